"""Every validation rule: exit 2, one line naming the setting, no traceback (real entrypoint)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import REPO

CASES = [
    ({"K3_TP": "5"}, "K3_TP", "divisor of 96"),
    ({"K3_TP": "0"}, "K3_TP", "divisor of 96"),
    ({"K3_TP": "eight"}, "K3_TP", "integer"),
    ({"K3_PORT": "70000"}, "K3_PORT", "<= 65535"),
    ({"K3_GPU_MEMORY_UTILIZATION": "1.5"}, "K3_GPU_MEMORY_UTILIZATION", "<= 1"),
    ({"K3_GPU_MEMORY_UTILIZATION": "0"}, "K3_GPU_MEMORY_UTILIZATION", "> 0"),
    ({"K3_MAX_MODEL_LEN": "2000000"}, "K3_MAX_MODEL_LEN", "<= 1048576"),
    ({"K3_MTP_K": "-1"}, "K3_MTP_K", ">= 0"),
    ({"K3_MAX_NUM_SEQS": "1.5"}, "K3_MAX_NUM_SEQS", "integer"),
    ({"K3_PREFIX_CACHING": "maybe"}, "K3_PREFIX_CACHING", "1 or 0"),
    ({"K3_KV_CACHE_DTYPE": "int4"}, "K3_KV_CACHE_DTYPE", "one of auto"),
    ({"K3_PROFILE": "mi300x"}, "K3_PROFILE", "mi355x-tp8"),
    ({"K3_MTP_METHOD": "dspark"}, "K3_MTP_MODEL", "needs a draft model"),
    ({"K3_MTP_MODEL": "x/y"}, "K3_MTP_MODEL", "own MTP head"),
    ({"K3_MTP_METHOD": "dspark", "K3_MTP_MODEL": "x/y", "K3_MTP_K": "0"}, "K3_MTP_K=0",
     "turns speculative"),
    ({"K3_MODEL": "/models/not-there"}, "K3_MODEL", "does not exist"),
    ({"K3_MODEL": "moonshotai/Kimi-K3"}, "K3_MODEL", "K3_ALLOW_HUB_DOWNLOAD=1"),
    ({"K3_MODEL": "moonshotai/Kimi-K3", "K3_ALLOW_HUB_DOWNLOAD": "maybe"},
     "K3_ALLOW_HUB_DOWNLOAD", "1 or 0"),
    ({"K3_MTP_METHOD": "dspark", "K3_MTP_MODEL": "./nope"}, "K3_MTP_MODEL", "does not exist"),
    ({"K3_TPP": "8"}, "K3_TPP", "not a known setting"),
    ({"K3_EXTRA_ARGS": "--foo 'unclosed"}, "K3_EXTRA_ARGS", "shell quoting"),
]


def _entrypoint(env_extra: dict, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env["K3_MODEL"] = "/tmp"  # stands in for /models/Kimi-K3 (must exist)
    env.update(env_extra)
    return subprocess.run([str(REPO / "entrypoint.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60, cwd=cwd or REPO)


def _assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert lines[0].startswith("k3rocm: error: ")
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize(("env", "setting", "hint"), CASES, ids=[c[1] + "-" + c[2] for c in CASES])
def test_invalid_setting_fails_in_one_line(env, setting, hint):
    _assert_one_line_error(_entrypoint(env, "--print"), setting, hint)


def test_serve_validates_before_starting_anything():
    # `serve` (the container's normal path) runs the same checks before exec'ing vLLM.
    _assert_one_line_error(_entrypoint({"K3_TP": "7"}), "K3_TP")


def test_bad_dotenv_line(tmp_path):
    (tmp_path / ".env").write_text("K3_TP=4\nthis is not an assignment\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env["PYTHONPATH"] = str(REPO / "src")
    proc = subprocess.run([str(REPO / ".venv/bin/python") if (REPO / ".venv/bin/python").exists()
                           else "python3", "-m", "k3rocm", "render"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    _assert_one_line_error(proc, ".env:2")


def test_unknown_variable_in_dotenv(tmp_path):
    (tmp_path / ".env").write_text("K3_MAX_NUM_SEQ=4\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env["PYTHONPATH"] = str(REPO / "src")
    proc = subprocess.run(["python3", "-m", "k3rocm", "render"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    _assert_one_line_error(proc, "K3_MAX_NUM_SEQ", ".env")
