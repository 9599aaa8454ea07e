"""`k3rocm preflight`: the table, the exit code, and each check on fixtures that make it fail."""

from __future__ import annotations

import socket
from pathlib import Path

from conftest import free_port, run_cli

from k3rocm.deploy import preflight
from k3rocm.deploy.scale.settings import load_scale


def test_runs_on_this_machine_and_reports_rocm_truthfully():
    # With CI=true too; on this CPU machine the ROCm lines fail and the exit code is 1.
    r = run_cli("preflight", env={"CI": "true", "K3_PORT": str(free_port())}, timeout=120)
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["check", "stat", "found"], r.stdout
    kfd = next(ln for ln in lines if ln.startswith("ROCm /dev/kfd"))
    has_gpu = Path("/dev/kfd").exists()
    assert kfd.split()[2] == ("ok" if has_gpu else "fail"), kfd
    assert r.returncode == (1 if " fail " in r.stdout else 0), r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    for name in ("ROCm /dev/dri render nodes", "group video", "group render",
                 "kernel.numa_balancing", "free disk: cache", "free disk: results",
                 "checkpoint", "Docker engine", "Docker Compose", "API port"):
        assert any(ln.startswith(name) for ln in lines), name
    assert lines[-1].endswith(" fail")


def test_bad_setting_exit_2_before_checks():
    r = run_cli("preflight", env={"K3_SCALE_MODE": "many"})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1


def test_rocm_devices(tmp_path):
    assert [c.status for c in preflight.check_rocm_devices(tmp_path)] == ["fail", "fail"]
    (tmp_path / "kfd").touch()
    (tmp_path / "dri").mkdir()
    for i in range(8):
        (tmp_path / "dri" / f"renderD{128 + i}").touch()
    assert [c.status for c in preflight.check_rocm_devices(tmp_path)] == ["ok", "ok"]


def test_numa_balancing(tmp_path):
    f = tmp_path / "numa_balancing"
    f.write_text("1\n")
    c = preflight.check_numa(f)
    assert c.status == "warn" and "numa_balancing=0" in c.fix
    f.write_text("0\n")
    assert preflight.check_numa(f).status == "ok"


def test_checkpoint(tmp_path):
    from k3rocm.serving.config import load_settings

    env = {"K3_MODELS_DIR": str(tmp_path), "K3_MODEL": "/models/k3"}
    hub = {"K3_MODEL": "moonshotai/Kimi-K3"}
    s = load_settings(hub, dotenv=None, check_model=False)[0]
    assert preflight.check_checkpoint(s).status == "fail"  # no opt-in: a 1.5 TB download
    s = load_settings({**hub, "K3_ALLOW_HUB_DOWNLOAD": "1"}, dotenv=None)[0]
    assert preflight.check_checkpoint(s).status == "warn"
    r = run_cli("preflight", env={**env, "K3_PORT": str(free_port())}, timeout=120)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint"))
    assert line.split()[1] == "fail" and "no config.json" in line and r.returncode == 1
    (tmp_path / "k3").mkdir()
    s = load_settings(env, dotenv=None, host_paths=True)[0]
    assert preflight.check_checkpoint(s).status == "fail"
    (tmp_path / "k3" / "config.json").write_text("{}")
    c = preflight.check_checkpoint(s)
    assert c.status == "warn" and "config.json" in c.have  # 2 bytes is not 1.5 TB


def test_port_in_use_fails():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert preflight.check_port("API port", "127.0.0.1", port, "x").status == "fail"
    assert preflight.check_port("API port", "127.0.0.1", port, "x").status == "ok"


def test_scale_checks(tmp_path):
    from k3rocm.serving.config import load_settings

    settings = load_settings({}, dotenv=None, check_model=False)[0]
    p1, p2 = free_port(), free_port()
    s = load_scale({"K3_SCALE_MODE": "dp-ep", "K3_SCALE_IFNAME": "ib9",
                    "K3_SCALE_NODES": f"127.0.0.1:{p1},127.0.0.1:{p2}",
                    "K3_SCALE_ROUTER_PORT": str(free_port())}, dotenv=None)
    (tmp_path / "net").mkdir()
    (tmp_path / "dev").mkdir()
    checks = {c.name: c for c in preflight.check_scale(s, settings, None, tmp_path / "net",
                                                       tmp_path / "dev")}
    assert checks[f"node 127.0.0.1:{p1}"].status == "warn"  # nothing listens: not started
    assert checks["/dev/infiniband"].status == "fail"
    assert checks["interface ib9"].status == "fail"
    assert checks["same serving image on every node"].status == "warn"  # no engine: unknown
    assert checks["router port"].status == "ok"
    (tmp_path / "net" / "ib9").mkdir()
    (tmp_path / "dev" / "infiniband").mkdir()
    checks = {c.name: c for c in preflight.check_scale(s, settings, None, tmp_path / "net",
                                                       tmp_path / "dev")}
    assert checks["/dev/infiniband"].status == checks["interface ib9"].status == "ok"


def test_table_one_line_per_check():
    checks = [preflight.Check("a", "ok", "x"), preflight.Check("b", "fail", "y", "do z")]
    lines = preflight.format_table(checks).splitlines()
    assert len(lines) == 2 + 2 + 1 and lines[3].split() == ["b", "fail", "y", "do", "z"]
    assert lines[-1] == "1 ok, 0 warn, 1 fail"


def test_the_base_image_and_its_digest(monkeypatch):
    """The base line names the base and its registry digest (a pulled image) or says it is
    unknown (a locally built or retagged one); the serving-image line says what it was built
    FROM and the digest as the build recorded it. Fake engine objects shaped like docker-py's."""
    import docker
    from k3rocm.serving.basefacts import DEFAULT_BASE_IMAGE
    from k3rocm.serving.config import load_settings

    digest = "vllm/vllm-openai-rocm@sha256:" + "ab" * 32

    class Img:
        def __init__(self, digests=(), labels=None):
            self.id, self.attrs, self.labels = "sha256:" + "1" * 64, {"RepoDigests":
                                                                       list(digests)}, labels

    class Images:
        def __init__(self, known):
            self.known = known

        def get(self, ref):
            if ref not in self.known:
                raise docker.errors.ImageNotFound(ref)
            return self.known[ref]

    class Client:
        def __init__(self, known):
            self.images = Images(known)

        def version(self):
            return {"Version": "27"}

    monkeypatch.delenv("BASE_IMAGE", raising=False)
    s, _ = load_settings({}, dotenv=None, check_model=False)
    pulled = Client({DEFAULT_BASE_IMAGE: Img([digest]), s.image: Img(labels={
        "org.opencontainers.image.base.name": DEFAULT_BASE_IMAGE,
        "org.opencontainers.image.base.digest": digest})})
    base, srv = preflight.check_docker(pulled, s)[1:3]
    assert base.status == "ok" and f"{DEFAULT_BASE_IMAGE}: present" in base.have
    assert f"digest {digest}" in base.have
    assert f"built FROM {DEFAULT_BASE_IMAGE} (digest {digest})" in srv.have
    local = Client({DEFAULT_BASE_IMAGE: Img(), s.image: Img(labels={
        "org.opencontainers.image.base.name": DEFAULT_BASE_IMAGE,
        "org.opencontainers.image.base.digest": ""})})
    base, srv = preflight.check_docker(local, s)[1:3]
    assert "digest unknown (built from a local tag)" in base.have
    assert "(digest unknown (built from a local tag))" in srv.have
    missing = preflight.check_docker(Client({}), s)[1]
    assert missing.status == "fail" and "BASE_IMAGE=<repo>@sha256:" in missing.fix
