"""`k3rocm preflight`: the table, the exit code, and each check on fixtures that make it fail."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import free_port, run_cli

from k3rocm.deploy import preflight
from k3rocm.deploy.scale import preflight as scale_preflight
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
                 "checkpoint", "Docker engine", "client image", "Docker Compose", "API port"):
        assert any(ln.startswith(name) for ln in lines), name
    for name in ("GPU arch (gfx950)", "free HBM"):  # no GPU here: said so, no crash
        line = next(ln for ln in lines if ln.startswith(name))
        assert has_gpu or line[len(name):].split() == ["skip", "skipped:", "no", "/dev/kfd"], line
    assert " fail" in lines[-1] and (has_gpu or lines[-1].endswith(" skipped"))


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
    none = preflight.check_checkpoint(load_settings(env, dotenv=None, host_paths=True,
                                                    check_model=False)[0])
    assert none.status == "fail" and "no config.json" in none.have and "`make model`" in none.fix
    (tmp_path / "k3").mkdir()
    s = load_settings(env, dotenv=None, host_paths=True)[0]
    assert preflight.check_checkpoint(s).status == "fail"


def test_checkpoint_bytes_are_verified(tmp_path):
    """checkpoint.verify's verdict on the bytes: cut shards fail; a complete small copy is ok on
    the CPU profile, a warn (not Kimi-K3's size) on the MI355X one."""
    from kimi_k3_layout import small_config, truncate_data, write_checkpoint

    from k3rocm.serving.config import load_settings

    write_checkpoint(tmp_path / "k3", small_config(), shards=4)
    env = {"K3_MODELS_DIR": str(tmp_path), "K3_MODEL": "/models/k3"}
    node = load_settings(env, dotenv=None, host_paths=True)[0]
    cpu = load_settings({**env, "K3_PROFILE": "cpu-smoke"}, dotenv=None, host_paths=True)[0]
    ok = preflight.check_checkpoint(cpu)
    assert ok.status == "ok" and ": complete, " in ok.have and "verified in " in ok.have, ok
    small = preflight.check_checkpoint(node)
    assert small.status == "warn" and "~1.56 TB" in small.fix, small
    (tmp_path / "k3" / "config.json").write_text("{}")  # verify checks the bytes, not this
    truncate_data(tmp_path / "k3")
    cut = preflight.check_checkpoint(cpu)
    assert cut.status == "fail" and "is short" in cut.have and "more)" in cut.have, cut
    assert "headers only" in cut.have and "`make model`" in cut.fix


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
    s = load_scale({"K3_SCALE_MODE": "replicas",
                    "K3_SCALE_NODES": f"127.0.0.1:{p1},127.0.0.1:{p2}",
                    "K3_SCALE_ROUTER_PORT": str(free_port())}, dotenv=None)
    checks = {c.name: c for c in scale_preflight.check_scale(s, settings, None,
                                                             {"HOME": str(tmp_path)}, None)}
    assert set(checks) == {f"node 127.0.0.1:{p1}", f"node 127.0.0.1:{p2}",
                           "same serving image on every node", "router port", "kubernetes nodes"}
    assert checks[f"node 127.0.0.1:{p1}"].status == "warn"  # nothing listens: not started
    assert checks["same serving image on every node"].status == "warn"  # no engine: unknown
    assert checks["router port"].status == "ok"


def test_single_node_preflight_ends_with_the_callers_tail(tmp_path):
    """Single-node preflight ends with its caller's tail (default: the API port) and loads
    nothing of scale-out."""
    code = (
        "import json, sys\n"
        "from k3rocm.deploy import preflight as p\n"
        "mine = p.run_checks(ENV, None, tail=lambda s, c: [p.Check('mine', 'ok', 'x')])\n"
        "plain = p.run_checks(ENV, None)\n"
        "scale = sorted(m for m in sys.modules if m.startswith('k3rocm.deploy.scale'))\n"
        "print(json.dumps([[c.name for c in mine][-2:], plain[-1].name, scale]))\n")
    env = {"K3_PORT": str(free_port()), "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    r = subprocess.run([sys.executable, "-c", code.replace("ENV", repr(env))], env={
        **{k: v for k, v in os.environ.items() if not k.startswith("K3_")},
        "PYTHONPATH": str(Path(preflight.__file__).parents[2])}, capture_output=True,
        text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [["base facts", "mine"], "API port", []], r.stdout


def test_table_one_line_per_check():
    checks = [preflight.Check("a", "ok", "x"), preflight.Check("b", "fail", "y", "do z")]
    lines = preflight.format_table(checks).splitlines()
    assert len(lines) == 2 + 2 + 1 and lines[3].split() == ["b", "fail", "y", "do", "z"]
    assert lines[-1] == "1 ok, 0 warn, 1 fail"
    skipped = preflight.format_table([*checks, preflight.Check("c", "skip", "skipped: why")])
    assert skipped.splitlines()[-1] == "1 ok, 0 warn, 1 fail, 1 skipped"


def test_the_base_image_and_its_digest(monkeypatch):
    """The base line names its registry digest (pulled) or says unknown (local); the serving
    image line says what it was built FROM. Fake engine objects shaped like docker-py's."""
    import docker
    from k3rocm.deploy.engine import CLIENT_IMAGE
    from k3rocm.serving.basefacts import DEFAULT_BASE_IMAGE
    from k3rocm.serving.config import load_settings

    digest = "vllm/vllm-openai-rocm@sha256:" + "ab" * 32

    def Img(digests=(), labels=None):  # noqa: N802 - a docker-py Image
        return SimpleNamespace(id="sha256:" + "1" * 64, attrs={"RepoDigests": list(digests)},
                               labels=labels)

    def Client(known):  # noqa: N802 - a docker-py DockerClient
        def get(ref):
            if ref not in known:
                raise docker.errors.ImageNotFound(ref)
            return known[ref]
        return SimpleNamespace(images=SimpleNamespace(get=get), version=lambda: {"Version": "27"})

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
    # not built: how to build it and FROM what; the client image: present, or how (a warn)
    got = {c.name: c for c in preflight.check_docker(Client({CLIENT_IMAGE: Img()}), s)}
    assert got["serving image"].status == "warn" and "not built" in got["serving image"].have
    assert f"`make build` (it builds FROM {DEFAULT_BASE_IMAGE}" in got["serving image"].fix
    assert got["client image"].status == "ok" and "present sha256:1111" in got["client image"].have
    got = {c.name: c for c in preflight.check_docker(Client({}), s)}
    assert got["client image"].status == "warn"
    assert got["client image"].fix.startswith("run `make clients-image` (only the bench")


def _node(sys_root: Path, n: int, gfx: int, simd: int = 1216) -> None:
    d = sys_root / "class/kfd/kfd/topology/nodes" / str(n)
    d.mkdir(parents=True)
    # a subset of kfd_topology.c node_show's lines
    (d / "properties").write_text(f"cpu_cores_count {0 if simd else 64}\nsimd_count {simd}\n"
                                  f"gfx_target_version {gfx}\nvendor_id 4098\n"
                                  f"drm_render_minor {128 + n}\n")


def _kfd(tmp_path: Path) -> tuple[Path, Path]:
    sys_root, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    (dev / "kfd").touch()
    return sys_root, dev


def test_gfx_name_decodes_kfd_gfx_target_version():
    assert [preflight.gfx_name(v) for v in (90500, 90402, 90010, 110001)] == [
        "gfx950", "gfx942", "gfx90a", "gfx1101"]


def test_gpu_arch(tmp_path):
    """Every GPU must be gfx950: read from the KFD topology (CPU node 0 left out), else
    rocminfo; a wrong arch fails with the fix; no /dev/kfd is a skip line."""
    none = preflight.check_gpu_arch(tmp_path / "sys", tmp_path / "nodev")
    assert (none.status, none.have) == ("skip", "skipped: no /dev/kfd")
    sys_root, dev = _kfd(tmp_path)
    _node(sys_root, 0, 0, simd=0)  # the CPU
    for n in range(1, 9):
        _node(sys_root, n, 90500)
    ok = preflight.check_gpu_arch(sys_root, dev, tool=lambda argv: pytest.fail("sysfs answers"))
    assert ok.status == "ok" and ok.have == "8 GPU(s), all gfx950 (KFD topology)", ok
    (sys_root / "class/kfd/kfd/topology/nodes/3/properties").write_text(
        "simd_count 1216\ngfx_target_version 90402\n")
    mixed = preflight.check_gpu_arch(sys_root, dev)
    assert mixed.status == "fail" and mixed.have.startswith("gfx942 on 1 of 8 GPU(s): node 3")
    assert "MXFP4 MoE needs gfx950" in mixed.fix and "HIP_VISIBLE_DEVICES" in mixed.fix
    for n in range(1, 9):
        (sys_root / f"class/kfd/kfd/topology/nodes/{n}/properties").write_text(
            "simd_count 1216\ngfx_target_version 90402\n")
    mi300 = preflight.check_gpu_arch(sys_root, dev)
    assert mi300.status == "fail" and "gfx942 on 8 of 8" in mi300.have
    assert "run on an MI355X node" in mi300.fix and "HIP_VISIBLE_DEVICES" not in mi300.fix


def test_gpu_arch_from_rocminfo_when_sysfs_has_no_topology(tmp_path):
    sys_root, dev = _kfd(tmp_path)
    agents = "".join(f"*******\nAgent {i + 2}\n*******\n  Name:                    gfx950\n"
                     "  Marketing Name:          AMD Instinct MI355X\n  ISA Info:\n    ISA 1\n"
                     "      Name:                    amdgcn-amd-amdhsa--gfx950:sramecc+:xnack-\n"
                     for i in range(8))
    text = "*******\nAgent 1\n*******\n  Name:                    AMD EPYC 9575F\n" + agents
    calls = []
    c = preflight.check_gpu_arch(sys_root, dev, tool=lambda argv: calls.append(argv) or text)
    assert calls == [["rocminfo"]] and c.status == "ok" and c.have == "8 GPU(s), all gfx950 " \
        "(rocminfo)"
    c = preflight.check_gpu_arch(sys_root, dev, tool=lambda argv: text.replace("gfx950\n",
                                                                              "gfx942\n", 1))
    assert c.status == "fail" and "gfx942 on 1 of 8 GPU(s): agent 0 (rocminfo)" in c.have
    unknown = preflight.check_gpu_arch(sys_root, dev, tool=lambda argv: "")
    assert unknown.status == "warn" and unknown.have.startswith("unknown: no GPU node")
    assert "rocminfo | grep gfx" in unknown.fix


GIB = 2**30
MI355X_HBM = 288 * GIB


def _cards(sys_root: Path, used: list[int]) -> None:
    drm = sys_root / "class/drm"
    for i, u in enumerate(used):
        d = drm / f"card{i + 1}" / "device"  # card0: the BMC's display, no VRAM counters
        d.mkdir(parents=True, exist_ok=True)
        (d / "mem_info_vram_total").write_text(f"{MI355X_HBM}\n")
        (d / "mem_info_vram_used").write_text(f"{u}\n")
    (drm / "card0" / "device").mkdir(parents=True, exist_ok=True)
    (drm / "card1-DP-1").mkdir(exist_ok=True)  # a connector, not a device


def _engine(name: str, port: int, ours: bool = True):
    """An engine with one running container as docker-py shows it (what provenance reads)."""
    ctr = SimpleNamespace(
        name=name, id="c" * 64, labels={"com.docker.compose.service": "server"},
        image=SimpleNamespace(tags=["k3rocm/server:latest" if ours else "rocm/pytorch"],
                              id="sha256:" + "2" * 64),
        attrs={"Config": {"Env": ["K3_PROFILE=mi355x-tp8", f"K3_PORT={port}"]
                          if ours else ["PATH=/usr/bin"]},
               "NetworkSettings": {"Ports": {f"{port}/tcp": [{"HostPort": str(port)}]}},
               "HostConfig": {"Devices": [{"PathOnHost": "/dev/kfd",
                                           "PathInContainer": "/dev/kfd"}]}})
    return SimpleNamespace(containers=SimpleNamespace(list=lambda: [ctr]))


def test_free_hbm(tmp_path):
    """Every GPU needs K3_GPU_MEMORY_UTILIZATION of its HBM free; the fix names the holder."""
    from k3rocm.serving.config import load_settings

    s = load_settings({"K3_PORT": "8000"}, dotenv=None, check_model=False)[0]  # 0.95, TP 8
    assert preflight.check_hbm(s, None, tmp_path / "sys", tmp_path / "nodev").status == "skip"
    sys_root, dev = _kfd(tmp_path)
    nothing = preflight.check_hbm(s, None, sys_root, dev)
    assert nothing.status == "warn" and nothing.have.startswith("unknown: no mem_info_vram_total")
    _cards(sys_root, [GIB // 2] * 8)
    ok = preflight.check_hbm(s, None, sys_root, dev)
    assert ok.status == "ok" and ok.have.startswith("8 GPU(s), at most 0.5 GiB used"), ok
    assert "K3_GPU_MEMORY_UTILIZATION 0.95 needs 273.6 GiB free on each" in ok.have
    _cards(sys_root, [GIB // 2] * 2 + [15 * GIB] * 6)  # 15 GiB used: 273 GiB free < 273.6
    short = preflight.check_hbm(s, None, sys_root, dev)
    assert short.status == "fail" and "6 of 8 GPU(s) short" in short.have
    assert "card3 15.0 GiB used" in short.have and "card1 " not in short.have
    assert "outside this bundle's containers: `amd-smi process`" in short.fix
    other = preflight.check_hbm(s, _engine("k3-selftest-server-1", 8123), sys_root, dev)
    assert other.status == "fail" and "k3-selftest-server-1 (k3rocm/server:latest, port 8123)" \
        in other.fix
    assert "`make down`" in other.fix
    theirs = preflight.check_hbm(s, _engine("torch", 9000, ours=False), sys_root, dev)
    assert theirs.status == "fail" and "torch (rocm/pytorch, not a k3rocm server)" in theirs.fix
    ours = preflight.check_hbm(s, _engine("k3rocm-server-1", 8000), sys_root, dev)
    assert ours.status == "warn" and "compose server k3rocm-server-1" in ours.fix
    assert "`make up` keeps or recreates it" in ours.fix
    tp2 = load_settings({"K3_TP": "2"}, dotenv=None, check_model=False)[0]
    few = preflight.check_hbm(tp2, None, sys_root, dev)
    assert few.status == "warn" and "2 GPU(s) are free and K3_TP is 2" in few.fix
    assert "HIP_VISIBLE_DEVICES" in few.fix
    lower = load_settings({"K3_GPU_MEMORY_UTILIZATION": "0.9"}, dotenv=None,
                          check_model=False)[0]
    assert preflight.check_hbm(lower, None, sys_root, dev).status == "ok"  # 259.2 GiB needed


def test_gpu_holders_read_from_real_containers(docker_client, tmp_path):
    """Holders read through the real engine: our compose server on K3_PORT alone is a warn
    (`make up` keeps it); any other is named in a fail."""
    from k3rocm.serving.config import load_settings

    sys_root, dev = _kfd(tmp_path)
    _cards(sys_root, [280 * GIB] * 8)
    port, other = free_port(), free_port()
    s = load_settings({"K3_PORT": str(port)}, dotenv=None, check_model=False)[0]
    tag = f"k3pf-{os.getpid()}"
    started = []
    try:
        def start(name, p, service):
            started.append(docker_client.containers.run(
                "k3rocm/debian:bookworm", ["sleep", "600"], name=f"{tag}-{name}", detach=True,
                environment={"K3_PROFILE": "mi355x-tp8", "K3_PORT": str(p)},
                ports={f"{p}/tcp": ("127.0.0.1", p)},
                labels={"com.docker.compose.service": service}))
        start("server", port, "server")
        names = preflight.gpu_holders(docker_client)
        assert f"{tag}-server (k3rocm/debian:bookworm, port {port})" in names
        only = len(names) == 1  # other project servers on this engine: not only ours
        if only:
            c = preflight.check_hbm(s, docker_client, sys_root, dev)
            assert c.status == "warn" and f"compose server {tag}-server" in c.fix
        start("selftest", other, "selftest")
        c = preflight.check_hbm(s, docker_client, sys_root, dev)
        assert c.status == "fail" and f"{tag}-selftest (k3rocm/debian:bookworm, " in c.fix
        assert f"{tag}-server (k3rocm/debian:bookworm, " in c.fix and "`make down`" in c.fix
    finally:
        for ctr in started:
            ctr.remove(force=True)
