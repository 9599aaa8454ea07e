"""`k3rocm ab` without servers: one flag set, the plan, refusals before any server starts, and
the compose rendering of an arm server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from k3rocm.cli import parse
from k3rocm.deploy.deployment import load_deployment


def test_bench_ab_census_ab_and_ab_share_one_flag_set(k3):
    def _options(cmd: str) -> set[str]:
        p = k3(cmd, "--help")
        assert p.returncode == 0, p.stderr
        return set(re.findall(r"(--[a-z][a-z0-9-]+)", p.stdout)) - {"--measure"}

    ab, bench, census = _options("ab"), _options("bench-ab"), _options("census-ab")
    assert ab == bench == census
    for flag in ("--aa", "--repeats", "--image", "--port", "--server-env", "--no-gpu",
                 "--stop-running", "--calibrate-delay-ms", "--pin-engine-core",
                 "--server-timeout", "--workload", "--on", "--steps", "--results"):
        assert flag in ab, flag


def test_flags_of_the_other_measure_are_refused_in_one_line(tmp_path, k3):
    p = run_cli("census-ab", "--runs-per-server", "2", "--model-dir", str(tmp_path))
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "k3rocm: error: --runs-per-server is not used by --measure census"]
    p = k3("bench-ab", "--steps", "3", "--dry-run")
    assert p.returncode == 2 and "--steps is not used by --measure bench" in p.stderr


STEP_DOUBLE = {"K3_TEST_PLUGINS_DIR": str(REPO / "tests" / "doubles" / "stepdelay")}


def test_calibration_plan_dry_run(k3):
    args = ("ab", "--measure", "bench", "--workload", "ci-tiny", "--repeats", "1",
            "--dry-run", "--no-gpu", "--calibrate-delay-ms", "12.5",
            "--server-env", "K3_PROFILE=cpu-smoke")
    p = k3(*args, env=STEP_DOUBLE)  # the caller gives the double's directory
    assert p.returncode == 0, p.stderr
    slots = [ln for ln in p.stdout.splitlines() if ln.startswith("# slot")]
    assert len(slots) == 2
    assert "K3_TEST_STEP_DELAY_MS" not in slots[0]
    assert "K3_TEST_STEP_DELAY_MS=12.5" in slots[1] and "PYTHONPATH=/opt/k3rocm-test" in slots[1]
    assert "calibration: both arms" in p.stdout


@pytest.mark.parametrize("args,msg", [
    # the product does not know where the tests keep the step-delay double: without it
    (["--calibrate-delay-ms", "5", "--no-gpu"], "set K3_TEST_PLUGINS_DIR to its directory"),
    (["--calibrate-delay-ms", "5", "--gpu"], "exists only for the CPU stand-in"),
    (["--calibrate-delay-ms", "5", "--aa", "--no-gpu"], "exclude each other"),
    (["--calibrate-delay-ms", "0", "--no-gpu"], "is out of range; use 0 < x <= 10000"),
    (["--repeats", "0"], "--repeats 0 is out of range; use x >= 1"),
    (["--port", "70000"], "--port 70000 is out of range; use 1..65535"),
    (["--runs-per-server", "0"], "--runs-per-server 0 is out of range; use x >= 1"),
    (["--on", "nope", "--no-gpu"], "--on 'nope' must name fusions from qk_norm, decode_qprep"),
    (["--server-env", "K3_FUSE_QK_NORM=0"], "set per arm"),
    (["--server-env", "novalue"], "expected KEY=VALUE"),
])
def test_bad_input_is_one_line_exit_2(k3, args, msg):
    p = k3("bench-ab", "--workload", "ci-tiny", "--dry-run", *args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], lines


def test_census_ab_dry_run_prints_the_plan_and_starts_nothing(tmp_path, k3):
    """The driver's dry run, for census-ab too (which used to start its servers on --dry-run):
    the cost, then each slot's compose line with the census's profiler directory."""
    p = k3("census-ab", "--dry-run", "--no-gpu", "--results", str(tmp_path / "r"),
           "--model-dir", str(REPO / "tests/data/census/models/tiny-deepseek-v3"))
    assert p.returncode == 0, p.stderr
    slots = [ln for ln in p.stdout.splitlines() if ln.startswith("# slot")]
    assert [ln.split()[4] for ln in slots] == ["A:", "B:"], p.stdout
    assert all("K3_PROFILER_DIR=/tmp/k3rocm-census-traces" in ln for ln in slots)
    assert "# cost: 2 cold server start(s) (1 server(s) per arm), 2 run(s)" in p.stdout
    assert not (tmp_path / "r").exists()


def test_a_server_on_the_port_asks_for_make_down_or_stop_running(tmp_path, fake_vllm):
    port = fake_vllm().port
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    p = run_cli("bench-ab", "--workload", "ci-tiny", "--no-gpu", "--tokenizer", str(tok),
                "--models-dir", str(tmp_path), "--port", str(port),
                "--results", str(tmp_path / "r"))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"k3rocm: error: a server already runs on port {port} "
        f"(http://127.0.0.1:{port}): the A/B starts its own fresh servers "
        "there; stop it with `make down` or pass --stop-running (or use another --port)"]
    assert not (tmp_path / "r").exists()


def test_estimate_uses_earlier_starts_else_states_the_assumption(tmp_path):
    from k3rocm.checks.ab.arms import Arms, estimate

    arms = Arms(mode="ab", repeats=2, arm_env={"A": {}, "B": {}}, port=8000, cpu=True)
    secs, how = estimate(arms, tmp_path)
    assert secs == 4 * 90 and "assumed 90s per start (CPU stand-in)" in how
    d = tmp_path / "20260101T000000Z-x-aa"
    d.mkdir()
    (d / "comparison.json").write_text(json.dumps({
        "slots": [{"server_ready_s": 40}, {"server_ready_s": 60}],
        "runs": [{"seconds": 10}, {"seconds": 30}]}))
    secs, how = estimate(arms, tmp_path)
    assert secs == 4 * 50 + 4 * 20 and "median of 2 earlier starts" in how


def test_arm_server_is_compose_yaml_with_the_arm_env(tmp_path, monkeypatch):
    """The arm server as real `docker compose config` renders it."""
    from k3rocm.checks.ab.arms import arms_from_args
    from k3rocm.deploy.lifecycle import ComposeServer

    monkeypatch.setenv(*next(iter(STEP_DOUBLE.items())))  # the caller's environment
    arms = arms_from_args(parse([
        "bench-ab", "--repeats", "1", "--port", "18555", "--server-timeout", "60", "--no-gpu",
        "--server-env", "K3_PROFILE=cpu-smoke", "--server-env", "VLLM_RPC_TIMEOUT=99",
        "--calibrate-delay-ms", "7", "--image", "k3rocm/server:cpu-0.32.0",
        "--models-dir", str(tmp_path)]))
    srv = ComposeServer(project="k3ab-test-01b", cpu=True, env=arms.compose_env("B"),
                        container_env={**arms.server_env, **arms.arm_container_env["B"]},
                        env_dir=tmp_path)
    p = srv.compose("config", "--format", "json", "server")
    if p.returncode != 0 and "unknown flag" in p.stderr:
        pytest.skip("docker compose too old for config --format json")
    assert p.returncode == 0, p.stderr
    svc = json.loads(p.stdout)["services"]["server"]
    assert svc["image"] == "k3rocm/server:cpu-0.32.0"
    assert svc["ports"][0]["published"] == "18555" and svc["ports"][0]["target"] == 18555
    env = svc["environment"]
    assert env["K3_FUSE_QK_NORM"] == "1" and env["K3_PROFILE"] == "cpu-smoke"
    assert env["K3_TEST_STEP_DELAY_MS"] == "7" and env["VLLM_RPC_TIMEOUT"] == "99"
    assert env["PYTHONPATH"] == "/opt/k3rocm-test"
    mounts = {v["target"]: v["source"] for v in svc["volumes"]}
    assert mounts["/models"] == str(tmp_path)
    assert mounts["/opt/k3rocm-test"] == STEP_DOUBLE["K3_TEST_PLUGINS_DIR"]
    assert "devices" not in svc or not svc["devices"]
    # arm A: no delay switch in its environment
    a = ComposeServer(project="k3ab-test-00a", cpu=True, env=arms.compose_env("A"),
                      container_env={**arms.server_env, **arms.arm_container_env["A"]},
                      env_dir=tmp_path)
    env_a = json.loads(a.compose("config", "--format", "json", "server").stdout)[
        "services"]["server"]["environment"]
    assert "K3_TEST_STEP_DELAY_MS" not in env_a and env_a["K3_FUSE_QK_NORM"] == "1"


def test_serving_image_never_carries_the_test_double():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "tests/" not in dockerfile and "stepdelay" not in dockerfile
    assert "K3_TEST_PLUGINS_DIR" not in (REPO / "compose.yaml").read_text()
    assert "K3_TEST_PLUGINS_DIR" in (REPO / "compose.cpu.yaml").read_text()


def test_replicas_plan_goes_through_the_router(k3):
    env = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "127.0.0.1:18601,127.0.0.1:18602",
           "K3_SCALE_ROUTER_PORT": "18680"}
    p = k3("bench-ab", "--workload", "ci-tiny", "--repeats", "1", "--dry-run", "--no-gpu",
           "--server-env", "K3_PROFILE=cpu-smoke", env=env)
    assert p.returncode == 0, p.stderr
    assert "# topology: mode=replicas" in p.stdout and "router=http://127.0.0.1:18680" in p.stdout
    reps = [ln for ln in p.stdout.splitlines() if ln.startswith("#   replicas on ports")]
    assert len(reps) == 2 and "[18601, 18602]" in reps[0]
    assert "vllm-router --host" in reps[0] and \
        "--worker-urls http://127.0.0.1:18601 http://127.0.0.1:18602" in reps[0]
    runs = [ln for ln in p.stdout.splitlines() if ln.startswith("aiperf profile")]
    assert len(runs) == 2 and all("--url http://127.0.0.1:18680 " in r for r in runs)


def test_replicas_on_other_hosts_are_refused(k3):
    env = {"K3_SCALE_MODE": "replicas", "K3_SCALE_NODES": "10.0.0.1:8000,10.0.0.2:8000"}
    p = k3("bench-ab", "--workload", "ci-tiny", "--dry-run", env=env)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "starts every replica itself" in p.stderr and "make bench-router" in p.stderr


def test_server_command_help_and_bad_input(k3):
    p = k3("server", "--help")
    assert p.returncode == 0
    for sub in ("up", "wait", "logs", "save-log", "provenance", "down"):
        assert sub in p.stdout
    p = run_cli("server")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "k3rocm: error: server needs a subcommand: up, wait, logs, save-log, provenance or down "
        "(see k3rocm server --help)"]
    p = k3("server", "wait", "--timeout", "0")
    assert p.returncode == 2 and "--timeout 0.0 is out of range; use x > 0" in p.stderr


# --- protocol identity from what each slot's server recorded ----------------------------------

def _slot(tmp_path, slot: int, arm: str, env: dict, argv: list[str] | None,
          image="sha256:aa") -> dict:
    """A run as the driver records it, with the run record's server part."""
    d = tmp_path / f"{slot:02d}-{arm}-0"
    d.mkdir()
    (d / "provenance.json").write_text(json.dumps({"server": {
        "container": {"image_id": image, "env": env},
        "rendered": None if argv is None else {"argv": argv, "env": {}}}}))
    return {"slot": slot, "arm": arm, "run": 0, "run_dir": str(d), "status": "ok"}


ARGV = ["vllm", "serve", "/models/k3-smoke", "--port", "8000", "--max-num-seqs", "8"]


def test_slots_differing_in_a_server_setting_are_refused(tmp_path):
    from k3rocm.checks.bench import ab
    from k3rocm.checks.bench.workloads import resolve

    w = resolve("ci-tiny", {})
    base = {"K3_PROFILE": "cpu-smoke", "K3_PREFIX_CACHING": "0", "K3_PORT": "8000"}
    runs = [_slot(tmp_path, 0, "A", {**base, "K3_FUSE_QK_NORM": "0"}, ARGV),
            _slot(tmp_path, 1, "B", {**base, "K3_FUSE_QK_NORM": "1", "K3_PORT": "8001"},
                  [*ARGV[:4], "8001", *ARGV[5:]]),
            _slot(tmp_path, 2, "B", {**base, "K3_FUSE_QK_NORM": "1", "K3_PREFIX_CACHING": "1",
                                     "K3_API_KEY": "<redacted>"},
                  [*ARGV, "--enable-prefix-caching"]),
            _slot(tmp_path, 3, "A", {**base, "K3_FUSE_QK_NORM": "0"}, ARGV)]
    key, diffs = ab.recorded_protocol(w, runs, "ab", 1)
    # the fusion switches and the port may differ; slot 2's prefix caching may not
    assert diffs == ["slot 2 (arm B) differs from slot 0 (arm A): env K3_API_KEY=(unset) vs "
                     "<redacted>; env K3_PREFIX_CACHING=0 vs 1; argv - vs "
                     "--enable-prefix-caching"]
    key2, diffs2 = ab.recorded_protocol(w, [runs[0], runs[1], runs[3]], "ab", 1)
    assert key2 == key and diffs2 == []
    # a different image, or more runs per server, is another protocol
    assert ab.recorded_protocol(w, [_slot(tmp_path, 4, "A", base, ARGV, "sha256:bb")], "ab",
                                1)[0] != key
    assert ab.recorded_protocol(w, [runs[0]], "ab", 2)[0] != key


def test_slots_without_the_rendered_record_are_not_shown_equal(tmp_path):
    """Equal unknown argvs prove no identical setup."""
    from k3rocm.checks.bench import ab
    from k3rocm.checks.bench.workloads import resolve

    w = resolve("ci-tiny", {})
    env = {"K3_PROFILE": "cpu-smoke", "K3_FUSE_QK_NORM": "1"}
    runs = [_slot(tmp_path, 0, "A", env, None), _slot(tmp_path, 1, "B", env, None)]
    _, diffs = ab.recorded_protocol(w, runs, "ab", 1)
    assert len(diffs) == 1 and "argv unknown (no rendered record" in diffs[0]
    run = _slot(tmp_path, 2, "A", env, ARGV)
    prov = json.loads((Path(run["run_dir"]) / "provenance.json").read_text())
    prov["server"]["rendered"]["env"] = {"K3_MAX_NUM_SEQS": "8"}
    (Path(run["run_dir"]) / "provenance.json").write_text(json.dumps(prov))
    ident = ab.slot_identity(Path(run["run_dir"]), "ab")
    assert ident["env"]["K3_MAX_NUM_SEQS"] == "8" and ident["argv"] == ARGV[:3] + ARGV[5:]


def test_the_aa_variance_is_pooled_only_with_the_same_recorded_key(tmp_path):
    from k3rocm.checks.bench import ab

    aa_rows = ab.judge({(1, "ITL p50"): {"A": [10.0, 10.2], "B": [10.1, 9.9]}}, ("ITL p50", 1))
    comp = aa_rows[0]["aa_component"]
    assert comp["df"] == 3
    doc = {"rows": aa_rows, "same_protocol": True}
    assert ab._floor_for(doc, 1, "ITL p50") == comp
    assert ab._floor_for({**doc, "same_protocol": False}, 1, "ITL p50") is None
    rows = ab.judge({(1, "ITL p50"): {"A": [10.0], "B": [10.05]}}, ("ITL p50", 1), doc)
    assert rows[0]["df"] == 3 and rows[0]["floor_used"]


def test_the_refusal_line_and_the_invalid_report(tmp_path):
    from k3rocm.checks.bench import ab

    diffs = ["slot 2 (arm B) differs from slot 0 (arm A): env K3_PREFIX_CACHING=0 vs 1"]
    comp = {"mode": "ab", "protocol_key": "k", "protocol": [], "workload": "ci-tiny",
            "rows": [], "runs": [], "headline": "x", "protocol_differences": diffs,
            "invalid": "slots ran different server setups (only the fusion switches may "
                       "differ): " + diffs[0]}
    line, code = ab.refusal(comp, tmp_path)
    assert line == ("k3rocm: error: bench-ab refused: slots ran different server setups (only "
                    "the fusion switches may differ): slot 2 (arm B) differs from slot 0 (arm "
                    f"A): env K3_PREFIX_CACHING=0 vs 1; no verdict (report in {tmp_path})")
    assert code == 1
    assert "**INVALID: slots ran different" in ab.comparison_markdown(comp)


def test_an_arm_whose_fusion_was_refused_makes_the_ab_invalid():
    from k3rocm.checks.ab import arms as ab

    rec = REPO / "tests" / "data" / "census" / "records"
    on = ab.fusion_states(rec / "server-on.log")
    off_at_load = ab.fusion_states(rec / "server-qprep-off-after-load.log")
    assert on == {"qk_norm": ["on"], "decode_qprep": ["on"]}
    assert off_at_load["decode_qprep"] != ["on"]
    arm_env = {"A": {"K3_FUSE_QK_NORM": "0", "K3_FUSE_DECODE_QPREP": "0"},
               "B": {"K3_FUSE_QK_NORM": "1", "K3_FUSE_DECODE_QPREP": "1"}}
    stock = {"qk_norm": ["off"], "decode_qprep": ["off"]}
    assert ab.fusion_check([{"slot": 0, "arm": "A", "fusions": stock},
                            {"slot": 1, "arm": "B", "fusions": on}], arm_env) == ([], [])
    problems, refused = ab.fusion_check([{"slot": 0, "arm": "A", "fusions": stock},
                                         {"slot": 1, "arm": "B", "fusions": off_at_load},
                                         {"slot": 2, "arm": "B", "fusions": None},
                                         {"slot": 3, "arm": "A", "fusions": on}], arm_env)
    assert [p[:14] for p in problems] == ["slot 1 (arm B)", "slot 2 (arm B)", "slot 3 (arm A)",
                                          "slot 3 (arm A)"]
    assert "unverified" in problems[1] and refused == [problems[0], *problems[2:]]
    assert "decode_qprep asked on, the overlay decided" in problems[0]


def test_the_workload_sets_prefix_caching_on_the_arm_servers(k3):
    p = k3("bench-ab", "--workload", "decode-8k1k", "--tokenizer", str(REPO), "--dry-run",
                "--no-gpu", "--image", "k3rocm/server:cpu-0.32.0", "--repeats", "2")
    assert p.returncode == 0, p.stderr
    slots = [ln for ln in p.stdout.splitlines() if ln.startswith("# slot")]
    assert len(slots) == 4 and all("K3_PREFIX_CACHING=0" in ln for ln in slots)
    p = k3("bench-ab", "--workload", "decode-8k1k", "--dry-run", "--no-gpu",
           "--server-env", "K3_PREFIX_CACHING=1")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "k3rocm: error: --server-env K3_PREFIX_CACHING=1: workload decode-8k1k needs prefix "
        "caching off (K3_PREFIX_CACHING=0), which the A/B sets on its servers")


def test_an_aa_and_a_calibration_of_the_same_setup_share_the_key(tmp_path):
    """Arm B's step-delay variables do not change the recorded key."""
    from k3rocm.checks.bench import ab
    from k3rocm.checks.bench.workloads import resolve

    w = resolve("ci-tiny", {})
    env = {"K3_FUSE_QK_NORM": "1", "PYTHONPATH": "/opt/k3rocm-test"}
    aa = [_slot(tmp_path / "aa", i, arm, env, ARGV) for i, arm in enumerate("AB")
          if (tmp_path / "aa").mkdir(exist_ok=True) is None]
    cal = [_slot(tmp_path / "cal", i, arm,
                 {**env, "K3_TEST_STEP_DELAY_MS": "45"} if arm == "B" else env, ARGV)
           for i, arm in enumerate("AB") if (tmp_path / "cal").mkdir(exist_ok=True) is None]
    k_aa, d_aa = ab.recorded_protocol(w, aa, "aa", 1)
    k_cal, d_cal = ab.recorded_protocol(w, cal, "cal", 1)
    assert k_aa == k_cal and d_aa == d_cal == []
    # in an A/B the delay variable is a difference like any other
    assert ab.recorded_protocol(w, cal, "ab", 1)[1] == [
        "slot 1 (arm B) differs from slot 0 (arm A): env K3_TEST_STEP_DELAY_MS=(unset) vs 45"]


@pytest.mark.parametrize("cpu,dotenv,image,want", [
    (True, "K3_IMAGE=my/server:from-dotenv\n", None, "my/server:from-dotenv"),
    (False, "K3_IMAGE=my/server:from-dotenv\n", None, "my/server:from-dotenv"),
    (True, "", None, "k3rocm/server:cpu"),
    (False, "", None, "k3rocm/server:latest"),
    (True, "K3_IMAGE=my/server:from-dotenv\n", "my/server:flag", "my/server:flag"),
])
def test_the_arm_image_is_the_deployments(tmp_path, monkeypatch, cpu, dotenv, image, want):
    """--image, else K3_IMAGE from the shell or .env, else compose's default."""
    from k3rocm.checks.ab.arms import Arms, arm_deployment

    monkeypatch.delenv("K3_IMAGE", raising=False)
    monkeypatch.delenv("COMPOSE_FILE", raising=False)
    env_file = tmp_path / ".env"
    env_file.write_text(dotenv)
    dep = load_deployment(env_file=str(env_file), gpu=not cpu)
    arms = Arms(mode="ab", repeats=1, arm_env={"A": {}, "B": {}}, port=8000, cpu=cpu,
                image=image, env_file=str(env_file), deployment=dep)
    assert arm_deployment(arms).image == want  # what start() asks Docker for (never pulled)


def test_arm_server_with_replicas_saves_every_log_and_removes_the_router(tmp_path, monkeypatch):
    """Replicas: one compose project per node, then the router; every log saved, all removed."""
    from types import SimpleNamespace

    from k3rocm.checks.ab import arms as armlib
    from k3rocm.deploy import server_api
    from k3rocm.deploy.scale import router as routermod

    seen: dict[str, list] = {"up": [], "down": [], "router": []}

    class FakeServer:
        def __init__(self, project, env, url, **kw):
            self.project, self.env, self.url, self.pinned = project, env, url, None

        def up(self, log_path=None):
            seen["up"].append((self.project, self.env["K3_PORT"]))

        def wait(self, timeout, every=10, log_path=None):
            seen.setdefault("wait", []).append((self.project, log_path.name))

        def down(self, log_path=None):
            seen["down"].append((self.project, log_path.name))

    class FakeRouter:
        name = "k3ab-s-00a-router"
        status = "running"
        attrs = {"State": {"ExitCode": 0}}

        def reload(self):
            pass

        def logs(self):
            return b"router says hi\n"

        def stop(self, timeout=None):
            seen["router"].append("stop")

        def remove(self, force=False):
            seen["router"].append("remove")

    router = FakeRouter()
    client = SimpleNamespace(containers=SimpleNamespace(get=lambda name: router))
    monkeypatch.setattr(armlib, "ComposeServer", FakeServer)
    monkeypatch.setattr(routermod, "start_router", lambda c, s, name, labels: router)
    monkeypatch.setattr(server_api, "wait_ready", lambda *a, **kw: 0.0)
    monkeypatch.setattr(armlib, "wait_ready", lambda *a, **kw: 0.0, raising=False)
    scale = SimpleNamespace(nodes=["127.0.0.1:18601", "127.0.0.1:18602"],
                            node_port=lambda i: 18601 + i, router_url="http://127.0.0.1:18680",
                            router_image="r:1", router_policy="round_robin")
    arms = armlib.Arms(mode="ab", repeats=1, arm_env={"A": {}, "B": {}}, port=8000, cpu=True,
                       scale=scale, deployment=load_deployment(env_file=None, gpu=False))
    run = armlib.Run(arms, client, "img", "sha256:0", "m", None, tmp_path / "S-x")
    with run.server(0, "A", tmp_path / "00-A-server.log") as (srv, info):
        assert srv.project == "k3ab-s-00a-r0" and info["replicas"] == [
            "k3ab-s-00a-r0", "k3ab-s-00a-r1"]
    assert seen["up"] == [("k3ab-s-00a-r0", "18601"), ("k3ab-s-00a-r1", "18602")]
    assert seen["down"] == [("k3ab-s-00a-r0", "00-A-server-r0.log"),
                            ("k3ab-s-00a-r1", "00-A-server-r1.log")]
    assert seen["wait"] == seen["down"]  # a replica that fails to start: its log, same place
    assert (tmp_path / "00-A-server-router.log").read_bytes() == b"router says hi\n"
    assert seen["router"] == ["stop", "remove"]


def test_every_measure_runs_in_the_one_slot_loop(tmp_path, monkeypatch):
    import contextlib
    from types import SimpleNamespace

    from k3rocm.checks.ab import arms as armlib
    from k3rocm.errors import UsageError

    rec = REPO / "tests" / "data" / "census" / "records" / "server-on.log"

    @contextlib.contextmanager
    def fake_server(self, slot, arm, log_path):  # Run.server's contract: (server, info)
        log_path.write_text(rec.read_text())
        yield SimpleNamespace(), {"server": f"k3ab-x-{slot:02d}{arm.lower()}",
                                  "server_ready_s": 1.5}

    monkeypatch.setattr(armlib.Run, "server", fake_server)
    arms = armlib.Arms(mode="ab", repeats=2, arm_env={"A": {}, "B": {}}, port=8000, cpu=True)
    run = armlib.Run(arms, None, "img", "sha256:0", "m", None, tmp_path / "20260101T000000Z-x")
    logs = lambda i, arm: tmp_path / f"{i:02d}-{arm}-server.log"  # noqa: E731
    seen = []
    slots = run.each_slot(logs, lambda i, arm, srv, info: seen.append((i, arm, info["server"])))
    assert seen == [(0, "A", "k3ab-x-00a"), (1, "B", "k3ab-x-01b"), (2, "B", "k3ab-x-02b"),
                    (3, "A", "k3ab-x-03a")]
    assert [(s["slot"], s["arm"], s["server_ready_s"], s["error"]) for s in slots] == [
        (0, "A", 1.5, None), (1, "B", 1.5, None), (2, "B", 1.5, None), (3, "A", 1.5, None)]
    assert slots[0]["fusions"] == {"qk_norm": ["on"], "decode_qprep": ["on"]}

    def fails_in_slot_1(i, arm, srv, info):
        if i == 1:
            raise UsageError("server gone", 3)

    with pytest.raises(UsageError, match="server gone"):
        run.each_slot(logs, fails_in_slot_1)
    slots = run.each_slot(logs, fails_in_slot_1, keep_going=True)
    assert [s["error"] for s in slots] == [None, "server gone"]
    assert len(run.each_slot(logs, lambda *a: False)) == 1  # False: stop after this slot


def test_a_first_slot_that_never_ran_is_compared_not_a_traceback():
    from k3rocm.checks.bench import ab
    from k3rocm.checks.bench.workloads import resolve

    w = resolve("ci-tiny", {})
    runs = [{"slot": 0, "arm": "A", "run": 0, "server": None, "run_dir": None,
             "status": "failed", "message": "server not ready"}]
    comp = ab.compare(w, runs, "ab", "", None, ("ITL p50", w.points()[0][0]))
    assert comp["command"] is None and comp["headline"] == "no comparable runs"


def test_census_ab_reads_the_checkpoint_the_arm_servers_load(tmp_path, monkeypatch):
    import shutil

    from k3rocm.checks.ab import arms as armlib
    from k3rocm.checks.ab import cli as abcli
    from k3rocm.errors import UsageError

    models = tmp_path / "models"
    (models / "b").mkdir(parents=True)
    shutil.copy(REPO / "tests/data/census/models/tiny-deepseek-v3/config.json", models / "b")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("COMPOSE_FILE", raising=False)
    monkeypatch.setenv("K3_MODEL", "/models/a")
    monkeypatch.setenv("K3_MODELS_DIR", str(models))
    seen = []

    def fake_start(arms, results, label, runs_per_slot=1, client_image=None, dep=None):
        seen.append(dep.model_host_dir)
        raise UsageError("reached start", 3)

    monkeypatch.setattr(armlib, "start", fake_start)
    args = parse(["census-ab", "--no-gpu", "--results", str(tmp_path / "results"),
                  "--server-env", "K3_MODEL=/models/b"])
    with pytest.raises(UsageError, match="reached start"):
        abcli.run(args)
    assert seen == [models / "b"]


def test_bench_ab_client_uses_what_the_arm_servers_serve(tmp_path, k3):
    models = tmp_path / "models"
    for m in ("a", "b"):
        (models / m).mkdir(parents=True)
    p = k3("bench-ab", "--workload", "ci-tiny", "--dry-run", "--no-gpu", "--models-dir",
                str(models), "--server-env", "K3_MODEL=/models/b", "--server-env",
                "K3_API_KEY=sekrit", env={"K3_MODEL": "/models/a", "K3_MODELS_DIR": str(models)},
                cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    runs = [ln for ln in p.stdout.splitlines() if ln.startswith("aiperf profile")]
    assert runs and all(f"--tokenizer {models / 'b'} " in r and "--api-key sekrit " in r
                        for r in runs)


# --- the arms against the serving image's base facts (measured from the real vLLM sources)

SEED, UPSTREAM = "0.27.1", "0.34.0"


def _facts(version: str) -> dict:
    from conftest import image_base_facts

    return image_base_facts(version)


@pytest.fixture
def on_base(tmp_path, monkeypatch):
    """Serve ``version``'s facts as the image manifest; record every Docker/compose/port call."""
    from k3rocm.checks.ab import arms as armlib
    from k3rocm.deploy import config_cmd

    calls: list[str] = []
    seen_images: list[str] = []

    def use(version: str) -> list[str]:
        facts = _facts(version)

        def image_base_facts(image):
            seen_images.append(image)
            return facts, f"{image} (sha256:0123456789ab) manifest"

        monkeypatch.setattr(config_cmd, "image_base_facts", image_base_facts)
        return calls

    class NoServer:
        def __init__(self, *a, **kw):
            calls.append("ComposeServer")

    def no_docker(*a, **kw):
        calls.append("docker_client")
        raise AssertionError("Docker before the base check")

    def no_port(arms):
        calls.append("check_port")
        raise AssertionError("the port check (--stop-running stops a server) before the base "
                             "check")

    monkeypatch.setattr(armlib, "ComposeServer", NoServer)
    monkeypatch.setattr(armlib, "docker_client", no_docker)
    monkeypatch.setattr(armlib, "check_port", no_port)
    for k in ("K3_UPSTREAM_SRC", "COMPOSE_FILE", "K3_PROFILE", "K3_IMAGE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    use.images = seen_images
    return use


def _measure_args(tmp_path: Path, measure: str) -> list[str]:
    """Inputs each measure checks before its start(), all present (the A/B on the node)."""
    import shutil

    models = tmp_path / "models"
    (models / "Kimi-K3").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "tests/data/census/models/tiny-deepseek-v3/config.json",
                models / "Kimi-K3")
    (models / "Kimi-K3" / "tokenizer.json").write_text("{}")
    common = ["--gpu", "--models-dir", str(models), "--results", str(tmp_path / "results"),
              "--image", "k3rocm/server:seed"]
    if measure == "bench":
        return ["bench-ab", "--workload", "ci-tiny", "--tokenizer", str(models / "Kimi-K3"),
                *common]
    if measure == "census":
        return ["census-ab", "--model-dir", str(models / "Kimi-K3"), *common]
    data = tmp_path / "gsm8k"
    data.mkdir(exist_ok=True)
    item = json.dumps({"question": "1+1?", "answer": "2\n#### 2"})
    for name in ("train.jsonl", "test.jsonl"):
        (data / name).write_text((item + "\n") * 5)
    return ["ab", "--measure", "gsm8k", "--data-dir", str(data), *common]


@pytest.mark.parametrize("measure", ["bench", "census", "gsm8k"])
def test_an_ab_on_the_seed_base_is_refused_before_any_server(on_base, tmp_path, capsys,
                                                              measure):
    """vLLM 0.27.1 cannot serve arm B (no fp8 KV, so no decode Q-prep): refused before
    any server, in every measure, naming what it can switch."""
    from k3rocm.cli import main

    calls = on_base(SEED)
    code = main(_measure_args(tmp_path, measure))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert calls == [] and on_base.images == ["k3rocm/server:seed"]
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("k3rocm: error: arm B (K3_FUSE_DECODE_QPREP=1 K3_FUSE_QK_NORM=1) "
                           "cannot be served by this base (vLLM 0.27.1; facts from "
                           "k3rocm/server:seed"), line
    assert "K3_FUSE_DECODE_QPREP=1 needs an fp8 KV cache" in line
    assert "this base can switch: --on qk_norm;" in line and "no server was started" in line
    assert not (tmp_path / "results").exists()  # no run directory either


def _check_base(tmp_path: Path, measure: str, *extra: str) -> dict:
    from k3rocm.checks.ab import arms as armlib
    from k3rocm.checks.ab import cli as abcli

    args = parse([*_measure_args(tmp_path, measure), *extra])
    abcli.fill_repeats(args)
    single = ("census-ab", "test") if measure == "census" else None
    return armlib.check_base(armlib.arms_from_args(args, single=single))


@pytest.mark.parametrize("version,measure,extra", [
    (SEED, "bench", ("--on", "qk_norm")), (UPSTREAM, "census", ()), (UPSTREAM, "bench", ("--aa",))])
def test_the_arms_a_base_can_serve_pass(on_base, tmp_path, version, measure, extra):
    """The seed base serves the arms it offers (noting its KV cache and graph mode); an upstream
    base both arms, with no KV cache note."""
    on_base(version)
    got = _check_base(tmp_path, measure, *extra)
    assert {a: b["vllm_version"] for a, b in got["arms"].items()} == {"A": version, "B": version}
    notes = got["arms"]["B"]["notes"]
    if version == SEED:
        assert "K3_KV_CACHE_DTYPE=auto" in " ".join(notes) and "PIECEWISE" in " ".join(notes)
    else:
        assert not any(n.startswith("K3_KV_CACHE_DTYPE") for n in notes)


def test_a_server_setting_the_base_refuses_is_named_for_every_arm(on_base, tmp_path, capsys):
    from k3rocm.cli import main

    calls = on_base(SEED)
    code = main([*_measure_args(tmp_path, "bench"), "--server-env", "K3_KV_CACHE_DTYPE=fp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and calls == [], err
    assert err[0].startswith("k3rocm: error: every arm (the servers' own settings, not the "
                             "fusion switches) cannot be served by this base (vLLM 0.27.1")
    assert "K3_KV_CACHE_DTYPE=fp8 cannot serve on this base" in err[0]
    assert "--on" not in err[0]
