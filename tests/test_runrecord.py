"""The one run record (deploy.runrecord), the one redaction rule and the one exit-code table.
Live runs' records are checked against real servers in test_bench_standin and test_gsm8k_e2e.
"""

from __future__ import annotations

import hashlib
import json

from conftest import REPO, run_cli

from k3rocm import errors
from k3rocm.deploy import runrecord
from k3rocm.deploy.deployment import load_deployment
from k3rocm.serving.config import REDACTED, redact_argv, redact_env

DATA = REPO / "tests" / "data" / "census"
SECRET = "rr-secret-1234"


def test_one_redaction_rule():
    secret = ["K3_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY",
              "OPENAI_API_KEY", "TOKEN", "API_KEY", "GITHUB_TOKEN", "AWS_SECRET",
              "DB_PASSWORD", "my_api_key"]
    plain = ["K3_PORT", "VLLM_ROCM_USE_AITER", "HF_HOME", "K3_FUSE_QK_NORM", "TOKENIZERS_X"]
    env = {k: "value" for k in secret + plain} | {"EMPTY_TOKEN": ""}
    out = redact_env(env)
    assert {k for k, v in out.items() if v == REDACTED} == set(secret)
    assert all(out[k] == "value" for k in plain) and out["EMPTY_TOKEN"] == ""


def test_the_same_rule_redacts_command_lines():
    argv = ["aiperf", "profile", "--api-key", "k1", "--url", "http://h:1", "--hf-token=t1",
            "--tokenizer", "/m", "--max-num-batched-tokens", "4096", "--extra", "k1"]
    assert redact_argv(argv, ["k1"]) == [
        "aiperf", "profile", "--api-key", REDACTED, "--url", "http://h:1",
        f"--hf-token={REDACTED}", "--tokenizer", "/m", "--max-num-batched-tokens", "4096",
        "--extra", REDACTED]
    assert redact_argv(["--api-key", "EMPTY"], ["EMPTY"]) == ["--api-key", "EMPTY"]  # no key


def test_census_writes_the_run_record_from_deployment_settings(tmp_path):
    results = tmp_path / "results"
    env = {"K3_MODELS_DIR": str(DATA / "models"), "K3_MODEL": "/models/tiny-deepseek-v3",
           "K3_RESULTS_DIR": str(results), "K3_API_KEY": SECRET}
    p = run_cli("census", "--trace-dir", str(DATA / "rocm-on"), "--fusions", "all=on",
                env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    (run,) = results.iterdir()  # the results root is K3_RESULTS_DIR, no --results given
    rec = json.loads((run / "provenance.json").read_text())
    assert rec["schema"] == runrecord.SCHEMA
    assert set(rec) >= {"schema", "command", "deployment", "server", "checkpoint", "tools",
                        "topology", "source", "trace_files"}
    assert rec["command"]["argv"][1:3] == ["census", "--trace-dir"]
    assert rec["deployment"]["results_root"] == str(results)
    assert rec["deployment"]["model_host_dir"] == str(DATA / "models" / "tiny-deepseek-v3")
    assert rec["deployment"]["api_key"] == REDACTED
    assert rec["checkpoint"]["path"] == str(DATA / "models" / "tiny-deepseek-v3") \
        or "error" not in rec["checkpoint"]
    assert rec["server"] is None and rec["source"] == "trace-dir"  # offline: no server
    assert json.loads((run / "census.json").read_text())["provenance"] == rec
    for f in run.rglob("*"):
        if f.is_file():
            assert SECRET not in f.read_text(errors="replace"), f


def test_checkpoint_identity_is_recorded(tmp_path):
    ck = tmp_path / "models" / "ck"
    ck.mkdir(parents=True)
    cfg = b'{"model_type": "kimi_k3"}'
    (ck / "config.json").write_bytes(cfg)
    dep = load_deployment({"K3_MODELS_DIR": str(tmp_path / "models"), "K3_MODEL": "/models/ck"},
                          None)
    got = runrecord.build(deployment=dep)["checkpoint"]
    assert got["config_sha256"] == hashlib.sha256(cfg).hexdigest()  # the file's own bytes
    assert got["path"] == str(ck)
    hub = load_deployment({"K3_MODEL": "moonshotai/Kimi-K3", "K3_ALLOW_HUB_DOWNLOAD": "1"}, None)
    assert runrecord.checkpoint(hub) is None


def test_the_record_says_which_upstream_figure_from_the_servers_own_env():
    """Judged on what the server container was started with, not on this shell's settings."""
    client_side = load_deployment({"K3_PROFILE": "fusion-evidence"}, None)
    server_env = {"K3_PROFILE": "mi355x-tp8", "K3_MTP_K": "2"}  # the container's env
    rec = runrecord.build(deployment=client_side, measure="census",
                          server={"container": {"env": server_env}}, workload={"steps": 6})
    got = rec["upstream_comparison"]
    assert got["figure"] != "qprep-launches"
    assert "no speculative decoding" in got["not_comparable"]["qprep-launches"]
    server_env = {"K3_PROFILE": "fusion-evidence"}
    rec = runrecord.build(deployment=None, measure="census",
                          server={"container": {"env": server_env}}, workload={"steps": 6})
    got = rec["upstream_comparison"]
    assert got["figure"] == "qprep-launches", got["text"]
    # no server and no deployment: unknown, never comparable
    assert not runrecord.build(measure="bench")["upstream_comparison"]["comparable"]
    assert "upstream_comparison" not in runrecord.build()
    json.dumps(rec)


def test_the_exit_code_table_is_documented_once():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    for code in errors.EXIT_CODES:
        assert f"| {code} |" in section, code
    assert readme.count("## Exit codes") == 1


def test_top_level_help_lists_every_exit_code():
    p = run_cli("--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    for code, what in errors.EXIT_CODES.items():
        assert f"{code} {what}" in text, code


def test_host_state_records_governor_numa_and_the_gpu_tool_or_says_it_is_missing(tmp_path):
    import subprocess

    for cpu in (0, 1):
        d = tmp_path / f"sys/devices/system/cpu/cpu{cpu}/cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_governor").write_text("performance\n")
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/numa_balancing").write_text("0\n")
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"gpu": 0}\n', stderr="")

    st = runrecord.host_state(which=lambda t: f"/usr/bin/{t}", run=run, root=str(tmp_path))
    assert st["cpu_governor"] == ["performance"] and st["numa_balancing"] == "0"
    assert calls == runrecord.GPU_TOOLS["amd-smi"]  # amd-smi first; rocm-smi not asked
    assert st["gpu"]["amd-smi static --partition --json"] == '{"gpu": 0}'
    rocm = runrecord.host_state(which=lambda t: t == "rocm-smi" and "/opt/rocm/bin/rocm-smi",
                                run=run, root=str(tmp_path / "none"))
    assert list(rocm["gpu"]) == [" ".join(runrecord.GPU_TOOLS["rocm-smi"][0])]
    assert rocm["cpu_governor"].startswith("not available")
    bare = runrecord.host_state(which=lambda t: None, run=run, root=str(tmp_path / "none"))
    assert bare["gpu"].startswith("no amd-smi or rocm-smi on this host")
    assert runrecord.build()["host"]["gpu"]  # in every run record


def test_topology_is_the_callers_else_one_node():
    got = runrecord.build(url="http://127.0.0.1:8123")["topology"]
    assert got == {"mode": "single", "url": "http://127.0.0.1:8123", "via_router": False,
                   "nodes": ["127.0.0.1:8123"]}
    routed = {"mode": "replicas", "via_router": True}
    assert runrecord.build(url="http://127.0.0.1:8123", topology=routed)["topology"] == routed
