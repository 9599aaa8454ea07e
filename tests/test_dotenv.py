""".env means to k3rocm exactly what it means to Docker Compose: every tricky line read by
``serving.config.read_dotenv`` and by the real ``docker compose config`` (Compose v2.40.3,
installed by .ci/setup.sh; no daemon needed) must give the same value."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import need

from k3rocm.errors import UsageError
from k3rocm.serving.config import read_dotenv

TRICKY = {  # key: the line as written in .env
    "A": 'A="/x"  # a comment after a quoted value',
    "B": "B='/y' # after single quotes",
    "C": "C=/z # an inline comment",
    "D": "D=/w#no-space-no-comment",
    "E": 'E="a\\nb"',
    "F": "F='a\\nb'",
    "G": "export G=exported",
    "H": "H=${C}/sub",
    "I": 'I="${C}/dq"',
    "J": "J='${C}/sq'",
    "K": "K=  spaced  ",
    "L": 'L="quoted # not a comment"',
    "M": "M=${K3_TEST_SURELY_UNSET:-fallback}",
    "N": "N=",
    "O": 'O=""',
    "P": 'P="multi\nline"',
    "Q": 'Q="say \\"hi\\""',
    "R": "R=a=b=c",
}


def _compose_reading(tmp_path) -> dict[str, str]:
    docker = shutil.which("docker")
    need(docker is not None, "no docker CLI (.ci/setup.sh installs it)")
    (tmp_path / ".env").write_text("# comment line\n\n" + "\n".join(TRICKY.values()) + "\n")
    (tmp_path / "compose.yaml").write_text(
        "services:\n  s:\n    image: busybox\n    environment:\n" +
        "".join(f"      {k}: ${{{k}}}\n" for k in TRICKY))
    p = subprocess.run([docker, "compose", "config", "--format", "json"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin:/usr/local/bin",
                            "HOME": str(Path.home())})
    assert p.returncode == 0, f"docker compose config: {p.stderr[-500:]}"
    env = json.loads(p.stdout)["services"]["s"]["environment"]
    return {k: v.replace("$$", "$") for k, v in env.items()}  # config escapes a literal $


def test_every_tricky_line_reads_as_compose_reads_it(tmp_path):
    compose = _compose_reading(tmp_path)
    ours = read_dotenv(tmp_path / ".env")
    rows = [(k, compose.get(k), ours.get(k)) for k in TRICKY]
    for k, c, o in rows:
        print(f"{TRICKY[k]!r:50} compose={c!r:28} k3rocm={o!r}")
    assert [r for r in rows if r[1] != r[2]] == []


def test_an_unclosed_quote_is_one_line(tmp_path):
    env = tmp_path / ".env"
    env.write_text('K3_MODEL="/tmp\nK3_TP=4\n')
    with pytest.raises(UsageError, match="never closed"):
        read_dotenv(env)
