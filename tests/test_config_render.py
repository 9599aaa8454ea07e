"""Rendering of the serving configuration: golden env/argv, precedence, sources, redaction."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from k3rocm.serving.config import render
from k3rocm.serving.settings import ENV_NAME, FIELDS

GOLDEN = Path(__file__).parent / "golden"
# The MI355X profile serves /models/Kimi-K3, which must exist: /tmp stands in for it here.
MODEL = {"K3_MODEL": "/tmp"}
CASES = {
    # name: environment (nothing else is read: no .env)
    "default": {**MODEL},
    "tp4-mtp-off": {**MODEL, "K3_TP": "4", "K3_MTP_K": "0"},
    "user-overrides": {**MODEL, "VLLM_ROCM_USE_AITER_MLA": "0", "K3_KV_CACHE_DTYPE": "auto",
                       "K3_MAX_NUM_SEQS": "8", "K3_FUSE_DECODE_QPREP": "0"},
    "cpu-smoke": {"K3_PROFILE": "cpu-smoke", "K3_MODEL": "/tmp", "K3_MAX_MODEL_LEN": "1024"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    got = render(environ=CASES[case], dotenv=None).to_json()
    path = GOLDEN / f"render-{case}.json"
    text = json.dumps(got, indent=2) + "\n"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()  # bytes: key order too


def test_default_model_is_the_local_checkpoint_and_the_hub_needs_an_opt_in():
    from k3rocm.errors import UsageError

    with pytest.raises(UsageError, match=r"K3_MODEL='/models/Kimi-K3' does not exist"):
        render(environ={}, dotenv=None)
    with pytest.raises(UsageError, match=r"Hugging Face id: .*~1\.56 TB.*ALLOW_HUB_DOWNLOAD"):
        render(environ={"K3_MODEL": "moonshotai/Kimi-K3"}, dotenv=None)
    r = render(environ={"K3_MODEL": "moonshotai/Kimi-K3", "K3_ALLOW_HUB_DOWNLOAD": "1"},
               dotenv=None)
    assert r.argv[:3] == ["vllm", "serve", "moonshotai/Kimi-K3"]


def test_user_value_beats_profile_and_sources_say_so(tmp_path):
    dotenv = tmp_path / ".env"
    dotenv.write_text("K3_TP=4\nK3_MAX_NUM_SEQS=16  # comment\nVLLM_ROCM_USE_AITER_MOE=0\n")
    r = render(environ={**MODEL, "K3_TP": "2", "VLLM_ROCM_USE_AITER_MLA": "0"},
               dotenv=dotenv)
    assert r.settings.tp == 2 and r.sources["K3_TP"] == "env"
    assert r.settings.max_num_seqs == 16 and r.sources["K3_MAX_NUM_SEQS"] == ".env"
    assert r.env["VLLM_ROCM_USE_AITER_MLA"] == "0"
    assert r.sources["VLLM_ROCM_USE_AITER_MLA"] == "env"
    assert r.env["VLLM_ROCM_USE_AITER_MOE"] == "0"
    assert r.sources["VLLM_ROCM_USE_AITER_MOE"] == ".env"
    assert r.sources["VLLM_ROCM_USE_AITER"] == "profile:mi355x-tp8"
    assert r.sources["K3_KV_CACHE_DTYPE"] == "default"
    smoke = render(environ={"K3_PROFILE": "cpu-smoke", "K3_MODEL": "/tmp"}, dotenv=None)
    assert smoke.sources["K3_TP"] == "profile:cpu-smoke" and smoke.settings.tp == 1


def test_empty_values_count_as_unset():
    r = render(environ={**MODEL, "K3_TP": "", "K3_MAX_NUM_SEQS": ""}, dotenv=None)
    assert r.settings.tp == 8 and r.sources["K3_TP"] == "default"
    assert r.sources["K3_MAX_NUM_SEQS"] == "default"


def test_profiler_renders_config_and_rpc_timeout():
    r = render(environ={**MODEL, "K3_PROFILER_DIR": "/results/traces"}, dotenv=None)
    prof = json.loads(r.argv[r.argv.index("--profiler-config") + 1])
    assert prof["torch_profiler_dir"] == "/results/traces" and prof["torch_profiler_use_gzip"]
    assert prof["max_iterations"] == 6 and prof["torch_profiler_with_stack"] is False
    assert int(r.env["VLLM_RPC_TIMEOUT"]) >= 600000
    old = render(environ={**MODEL, "K3_PROFILER_DIR": "/t",
                              "K3_PROFILER_STYLE": "env"}, dotenv=None)
    assert "--profiler-config" not in old.argv and old.env["VLLM_TORCH_PROFILER_DIR"] == "/t"


def test_secrets_are_redacted_in_print_and_never_in_argv():
    env = {**MODEL, "K3_API_KEY": "sekrit-123", "HF_TOKEN": "hf_sekrit"}
    proc = run_cli("render", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "sekrit" not in proc.stdout
    out = json.loads(proc.stdout)
    assert out["env"]["VLLM_API_KEY"] == "***"
    assert not any("sekrit" in a for a in out["argv"])
    cfg = run_cli("config", env=env)
    assert cfg.returncode == 0 and "sekrit" not in cfg.stdout + cfg.stderr


def test_entrypoint_print_on_the_host():
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update({**MODEL, "K3_TP": "4", "PYTHONPATH": ""})
    import subprocess

    proc = subprocess.run([str(REPO / "entrypoint.sh"), "--print", "--seed", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"env", "argv"}
    assert out["argv"][out["argv"].index("--tensor-parallel-size") + 1] == "4"
    assert out["argv"][-2:] == ["--seed", "1"]


def test_readme_settings_table_is_in_sync():
    from k3rocm.deploy.config_cmd import settings_table

    readme = (REPO / "README.md").read_text()
    assert settings_table() in readme, "README settings table is stale: paste " \
        "`k3rocm config --markdown` between the settings markers"


def test_compose_passes_every_container_setting():
    text = (REPO / "compose.yaml").read_text()
    for name, f in FIELDS.items():
        listed = f"      - {ENV_NAME[name]}\n" in text
        assert listed == (f.json_schema_extra["group"] != "deployment"), ENV_NAME[name]


def test_config_says_what_the_base_decides_only_while_its_facts_are_unknown(tmp_path):
    """`k3rocm config` before the facts are applied marks the values the base check decides
    (basefacts.DECIDES) and the graph mode; not once they are applied, nor with AITER off."""
    from conftest import image_base_facts

    from k3rocm.deploy.config_cmd import base_pending

    env = {**MODEL, "K3_FUSE_QK_NORM": "1"}
    before = base_pending(render(environ=env, dotenv=None), "facts unknown until `make build`")
    assert before["K3_KV_CACHE_DTYPE"] == ("the base decides at start: facts unknown until "
                                          "`make build`")
    assert before["K3_FUSE_QK_NORM"].startswith("the base checks it at start")  # explicit
    assert "PIECEWISE" in before["argv"] and "K3_MAX_MODEL_LEN" not in before
    applied = render(environ=env, dotenv=None, base=image_base_facts("0.34.0"))
    assert base_pending(applied, "x") == {}
    off = render(environ={**env, "VLLM_ROCM_USE_AITER": "0"}, dotenv=None)
    assert base_pending(off, "x") == {}


@pytest.mark.parametrize("version", ["0.27.1", "0.34.0"])
def test_unknown_vendor_names_are_warned_against_the_base(version):
    """A typo of a vLLM variable (from the shell or .env) gets one warning line naming the
    closest name the base's vLLM reads (its vllm/envs.py environment_variables, the real
    release's); a real name, and the profile's own names, get none; it is still passed."""
    from conftest import image_base_facts

    facts = image_base_facts(version)
    env = {**MODEL, "VLLM_ROCM_USE_AITR": "1", "VLLM_LOGGING_LEVEL": "DEBUG",
           "AITER_LOG_MORE": "1"}
    r = render(environ=env, dotenv=None, base=facts)
    assert len(r.warnings) == 1, r.warnings
    w = r.warnings[0]
    assert w.startswith("VLLM_ROCM_USE_AITR (from env) is not in vLLM ")
    assert "did you mean VLLM_ROCM_USE_AITER?" in w and "passed as set" in w
    assert r.env["VLLM_ROCM_USE_AITR"] == "1"  # a warning, not a refusal
    known = facts["known_env"]["value"]
    assert "VLLM_ROCM_USE_AITER" in known["vllm"] and "VLLM_ROCM_USE_AITR" not in known["vllm"]
    # no AITER here: AITER_* names are not checked, and the fact says so
    assert known["aiter"] is None and "AITER_* names not checked" in facts["known_env"]["how"]
    assert render(environ=MODEL, dotenv=None, base=facts).warnings == []  # profile names


def test_unknown_vendor_warning_reaches_stderr(capsys):
    from conftest import image_base_facts

    from k3rocm.serving.serve_cmd import warn

    warn(render(environ={**MODEL, "VLLM_ROCM_USE_AITR": "1"}, dotenv=None,
                base=image_base_facts("0.34.0")))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("k3rocm: warning: VLLM_ROCM_USE_AITR"), err


def test_aiter_names_are_read_from_aiters_sources(tmp_path):
    """AITER keeps no list: its names are the AITER_* literals of its Python files (the
    scanner on a small package; no AITER is installed here)."""
    from conftest import upstream_tree

    from k3rocm.serving import basefacts

    pkg = tmp_path / "aiter" / "ops"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text('import os\nos.getenv("AITER_LOG_MORE", "0")\n'
                              "os.environ.get('AITER_JIT_DIR')\n")
    fact = basefacts._known_env(upstream_tree("0.34.0"), tmp_path)
    assert fact["value"]["aiter"] == ["AITER_JIT_DIR", "AITER_LOG_MORE"]
    out = basefacts.unknown_env({"known_env": fact}, {"AITER_LOG_MOR": ".env",
                                                       "AITER_LOG_MORE": "env"})
    assert len(out) == 1 and "did you mean AITER_LOG_MORE?" in out[0]


@pytest.mark.parametrize("version", ["0.27.1", "0.28.0", "0.34.0"])
def test_the_base_changes_only_what_config_says_it_decides(version):
    """basefacts.DECIDES (what `make config` marks before a build) holds every setting the
    base check changed on the real releases' facts; on the seed's 0.27.1 it does change one."""
    from conftest import image_base_facts

    from k3rocm.serving.basefacts import DECIDES

    plain = render(environ=MODEL, dotenv=None).settings
    based = render(environ=MODEL, dotenv=None, base=image_base_facts(version)).settings
    changed = {f for f in FIELDS if getattr(plain, f) != getattr(based, f)}
    assert changed <= set(DECIDES), changed - set(DECIDES)
    assert bool(changed) == (version == "0.27.1"), changed


def test_load_format_checked_against_the_bases_own_list():
    """Beyond the union over releases, the base facts' LoadFormats decide: bitsandbytes left
    vLLM after 0.27.1, ipc_cache came in 0.30.0 (the real sources)."""
    from conftest import image_base_facts, need

    from k3rocm.errors import UsageError

    new, old = image_base_facts("0.34.0"), image_base_facts("0.27.1")
    need(new["load_formats"]["value"] is not None, "model_loader not unpacked (make upstream-src)")
    with pytest.raises(UsageError, match=r"K3_LOAD_FORMAT=bitsandbytes is not a load format of "
                       r"this base's vLLM 0\.34\.0 .*use one of auto, dummy"):
        render(environ={**MODEL, "K3_LOAD_FORMAT": "bitsandbytes"}, dotenv=None, base=new)
    with pytest.raises(UsageError, match="K3_LOAD_FORMAT=ipc_cache .* vLLM 0.27.1"):
        render(environ={**MODEL, "K3_LOAD_FORMAT": "ipc_cache"}, dotenv=None, base=old)
    for facts in (new, old):
        render(environ={**MODEL, "K3_LOAD_FORMAT": "fastsafetensors"}, dotenv=None, base=facts)


@pytest.mark.parametrize("version", ["0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                                     "0.32.0", "0.33.0", "0.34.0"])
def test_default_profile_asks_every_release_for_the_a8w4_moe(version):
    """The recipe's A8W4 MoE (AITER_SITUV2_A8W4=1) reaches every release: the switch that
    release's own envs.py defines (read from the real source, not from the profile) is set to
    a value that selects a8w4."""
    import re

    from conftest import upstream_tree

    envs = (upstream_tree(version) / "vllm" / "envs.py").read_text()
    names = set(re.findall(r'^\s+"((?:VLLM|AITER)_\w*SITUV2\w*)":', envs, re.M))
    assert names, f"vLLM {version} defines no SiTUv2 switch"
    env = render(environ={**MODEL}, dotenv=None).env
    selects = {"AITER_SITUV2_A8W4": "1", "VLLM_ROCM_USE_AITER_MOE_SITUV2_A8W4": "1",
               "VLLM_ROCM_USE_AITER_MOE_SITUV2": "a8w4"}
    for name in names & set(selects) or names:
        assert env.get(name) == selects.get(name, "<a name this test does not know>"), \
            (version, name)
