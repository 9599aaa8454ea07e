"""The client image's packages: a committed, hashed lock (resolved by the image's Python 3.11 on
x86_64), fetched the same by any host Python 3.10-3.12; the built image holds exactly that set.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, need

sys.path.insert(0, str(REPO / "docker" / "clients"))
import clientlock  # noqa: E402

LOCK = REPO / "docker" / "clients" / "requirements.lock"
SCRIPT = REPO / "docker" / "clients" / "clientlock.py"


@pytest.fixture(scope="module")
def pys() -> dict[str, str]:
    """{"3.10": path, ...}: this one plus any other CPython 3.10-3.13 on the machine (two at
    least, or nothing to compare)."""
    found = {f"{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    cands = sorted(glob.glob("/usr/bin/python3.1[0-3]")
                   + glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-3]*/bin/python3")))
    for path in cands:
        p = subprocess.run([path, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if p.returncode == 0:
            found.setdefault(p.stdout.strip(), path)
    need(len(found) >= 2, f"only one CPython here ({', '.join(found)}): nothing to compare")
    return found


def test_lock_pins_and_hashes_everything():
    pins = clientlock.read_lock(LOCK)
    assert pins["aiperf"][0] == "0.13.0" and pins["lm-eval"][0] == "0.4.13"
    header = re.search(r"^# Packages: (\d+)$", LOCK.read_text(), re.M)
    assert header and int(header.group(1)) == len(pins)
    assert re.search(r"^# Resolved by pip \S+ on Python 3\.11\.\d+ \(x86_64, linux\)",
                     LOCK.read_text(), re.M)
    # The inputs file and the lock agree on what the image is for.
    inputs = (REPO / "docker" / "clients" / "requirements.in").read_text()
    assert "aiperf==0.13.0" in inputs and "lm-eval[api]==0.4.13" in inputs


def _report(python: str, machine: str = "x86_64") -> dict:
    return {"pip_version": "23.0.1",
            "environment": {"python_full_version": python, "platform_machine": machine,
                            "sys_platform": "linux"},
            "install": [{"metadata": {"name": "Six", "version": "1.17.0"},
                         "download_info": {"url": "https://x/six-1.17.0-py2.py3-none-any.whl",
                                           "archive_info": {"hashes": {"sha256": "a" * 64}}}}]}


def test_lock_refuses_a_report_from_another_python(tmp_path):
    text = clientlock.lock_text(_report("3.11.2"), ["six"], "k3rocm/debian:bookworm")
    assert "six==1.17.0 --hash=sha256:" + "a" * 64 in text
    for bad, fragment in ((_report("3.12.1"), "not 3.11"), (_report("3.11.2", "aarch64"),
                                                             "not x86_64")):
        (tmp_path / "r.json").write_text(json.dumps(bad))
        p = subprocess.run([sys.executable, str(SCRIPT), "lock", "--report",
                            str(tmp_path / "r.json"), "--base-image", "b",
                            "--out", str(tmp_path / "out.lock")],
                           capture_output=True, text=True, cwd=REPO)
        assert p.returncode == 2 and fragment in p.stderr and p.stderr.count("\n") == 1, p.stderr
        assert not (tmp_path / "out.lock").exists()


def test_fetch_command_does_not_depend_on_the_host_python(pys):
    argvs = {}
    for ver, path in pys.items():
        p = subprocess.run([path, str(SCRIPT), "download", "--print-argv", "--dest", "/tmp/x"],
                           capture_output=True, text=True, cwd=REPO)
        assert p.returncode == 0, p.stderr
        argv = json.loads(p.stdout)
        assert argv[0] == path
        argvs[ver] = argv[1:]
    first = next(iter(argvs.values()))
    assert all(a == first for a in argvs.values()), argvs
    assert first[first.index("--python-version") + 1] == "3.11" and "--require-hashes" in first
    assert "--no-deps" in first


def test_fetch_gets_the_same_cp311_files_with_any_host_python(tmp_path, pys):
    """Real pip, real index: a slice of the lock fetched by each interpreter."""
    keep = ("pyyaml", "six", "sqlitedict")  # a cp311 wheel, a pure wheel, an sdist
    lines = [ln for ln in LOCK.read_text().splitlines()
             if re.match(rf"^({'|'.join(keep)})==", ln)]
    assert len(lines) == len(keep)
    sub = tmp_path / "slice.lock"
    sub.write_text("\n".join(lines) + "\n")
    got = {}
    for ver, path in pys.items():
        dest = tmp_path / f"wheels-{ver}"
        p = subprocess.run([path, str(SCRIPT), "download", "--lock", str(sub), "--dest", str(dest)],
                           capture_output=True, text=True, cwd=REPO, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        got[ver] = sorted(f.name for f in dest.iterdir() if not f.name.startswith("."))
    first = next(iter(got.values()))
    assert all(g == first for g in got.values()), got
    assert any(re.match(r"PyYAML-.*-cp311-cp311-manylinux.*x86_64.*\.whl$", n, re.I)
               for n in first), first
    assert "requirements.lock" in first and any(n.endswith(".tar.gz") for n in first)


@pytest.mark.docker
def test_image_holds_exactly_the_locked_set(docker_client):
    image = os.environ.get("CLIENTS_TEST_IMAGE") or "k3rocm/clients:0.1.0"
    try:
        img = docker_client.images.get(image)
    except Exception:  # noqa: BLE001
        need(False, f"client image {image} missing (make clients-image)")
    labels = img.attrs["Config"]["Labels"] or {}
    assert labels.get("k3rocm.clients.lock-sha256") == clientlock.sha256(LOCK)
    script = ("import json, importlib.metadata as m, re\n"
              "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
              "for d in m.distributions()}))")
    out = docker_client.containers.run(image, ["/opt/clients/bin/python", "-c", script],
                                       remove=True, network_disabled=True)
    installed = json.loads(out)
    locked = {name: ver for name, (ver, _) in clientlock.read_lock(LOCK).items()}
    # pip/setuptools of the venv itself aside, the venv is the lock, version for version.
    extra = {k: v for k, v in installed.items() if k not in locked and k not in ("pip",)}
    assert extra == {}
    assert {k: installed.get(k) for k in locked} == locked
    copy = docker_client.containers.run(image, ["cat", "/opt/clients/requirements.lock"],
                                        remove=True, network_disabled=True).decode()
    assert copy == LOCK.read_text()
    for tool in (["aiperf", "--version"], ["lm_eval", "--help"]):
        docker_client.containers.run(image, tool, remove=True, network_disabled=True)
