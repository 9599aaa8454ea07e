"""Profiles as data (src/k3rocm/serving/profiles/*.yaml) and the seed figures a result
compares with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli

from k3rocm.deploy.upstream_ref import FIGURES, MEASURES, comparable_with
from k3rocm.errors import UsageError
from k3rocm.serving import profiles
from k3rocm.serving.config import render
from k3rocm.serving.settings import FIELDS, Settings

SHIPPED = REPO / "src" / "k3rocm" / "serving" / "profiles"


def test_profile_names_are_the_files_present():
    files = sorted(p.stem for p in SHIPPED.glob("*.yaml"))
    assert profiles.names() == files
    assert {"mi355x-tp8", "cpu-smoke", "fusion-evidence", "seed-nightly"} <= set(files)
    assert Settings.model_fields["profile"].default == "mi355x-tp8"


def test_a_new_file_is_a_new_profile(tmp_path, monkeypatch):
    for p in SHIPPED.glob("*.yaml"):
        shutil.copy(p, tmp_path)
    (tmp_path / "mi355x-tp4.yaml").write_text(
        "meta: {name: mi355x-tp4, description: half a node, hardware: amd, extends: mi355x-tp8}"
        "\nmodel: {base_args: {K3_TP: 4}}\n")
    monkeypatch.setattr(profiles, "profile_dir", lambda: tmp_path)
    r = render(environ={"K3_PROFILE": "mi355x-tp4", "K3_MODEL": "/tmp"}, dotenv=None)
    assert r.settings.tp == 4 and r.sources["K3_TP"] == "profile:mi355x-tp4"
    assert r.env["VLLM_ROCM_USE_AITER"] == "1"  # inherited from mi355x-tp8
    assert r.sources["VLLM_ROCM_USE_AITER"] == "profile:mi355x-tp4"


def test_the_package_ships_the_profile_files():
    """pyproject's package data carries the YAML files; the Dockerfile installs src/ with it."""
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "*.yaml" in data["tool"]["setuptools"]["package-data"]["k3rocm.serving.profiles"]
    assert any(d.startswith("pyyaml") for d in data["project"]["dependencies"])
    assert "COPY src/ /opt/k3rocm/pkg/src/" in (REPO / "Dockerfile").read_text()


# --- validation: one line naming the file and the key, exit 2 --------------------------------

GOOD = {"meta": {"name": "p", "description": "d", "hardware": "amd"},
        "model": {"base_args": {"K3_TP": 4}, "base_env": {}},
        "features": {"f": {"description": "x", "args": {"K3_MTP_K": 0}}},
        "hardware_overrides": {"amd": {"extra_env": {"VLLM_ROCM_USE_AITER": "1"}}}}

BAD = [
    # (change to GOOD, the key the message must name, a phrase of the message)
    ({"colour": "blue"}, "colour", "not a known key"),
    ({"meta": {**GOOD["meta"], "owner": "me"}}, "meta.owner", "not a known key"),
    ({"meta": {**GOOD["meta"], "name": "q"}}, "meta.name", "must equal the file name"),
    ({"meta": {**GOOD["meta"], "hardware": "h100"}}, "meta.hardware", "not known"),
    ({"meta": {**GOOD["meta"], "extends": "nope"}}, "meta.extends", "not a profile"),
    ({"meta": {**GOOD["meta"], "extends": "p"}}, "meta.extends", "cycle"),
    ({"model": {"base_args": {"K3_NO_SUCH": 1}}}, "model.base_args.K3_NO_SUCH", "not a setting"),
    ({"model": {"base_args": {"K3_PROFILE": "x"}}}, "model.base_args.K3_PROFILE",
     "not a setting"),
    ({"model": {"base_args": {"K3_TP": 7}}}, "K3_TP", "divisor of 96"),
    ({"model": {"base_args": {"K3_KV_CACHE_DTYPE": "int3"}}}, "K3_KV_CACHE_DTYPE",
     "not valid"),
    ({"model": {"base_env": {"VLLM_ROCM_USE_AITER": 1}}}, "model.base_env.VLLM_ROCM_USE_AITER",
     "quoted string"),
    ({"model": {"base_env": {"K3_TP": "4"}}}, "model.base_env.K3_TP", "args/extra_args"),
    ({"model": {"base_env": {"MY_VAR": "1"}}}, "model.base_env.MY_VAR", "vendor variable"),
    ({"features": {"f": {"args": {"K3_MTP_K": 0}}}}, "features.f.description", "missing"),
    ({"features": {"f": {"description": "x", "flags": []}}}, "features.f.flags",
     "not a known key"),
    ({"model": 3}, "model", "must be a mapping with base_args, base_env"),
    ({"meta": {**GOOD["meta"], "description": " "}}, "meta.description", "empty"),
    ({"hardware_overrides": {"cpu": {"extra_env": {}}}}, "hardware_overrides.cpu",
     "does not apply"),
    ({"hardware_overrides": {"amd": {"extra_args": {"K3_MAX_NUM_SEQS": 0}}}},
     "K3_MAX_NUM_SEQS", "not valid"),
]


def _write(d: Path, name: str, doc: dict) -> None:
    (d / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_a_good_file_resolves(tmp_path):
    _write(tmp_path, "p", GOOD)
    prof = profiles.get("p", tmp_path)
    assert prof["settings"] == {"tp": 4, "mtp_k": 0}
    assert prof["env"] == {"VLLM_ROCM_USE_AITER": "1"}


@pytest.mark.parametrize("change,key,phrase", BAD, ids=[b[1] for b in BAD])
def test_a_bad_file_is_one_line_naming_file_and_key(tmp_path, change, key, phrase):
    _write(tmp_path, "p", {**GOOD, **change})
    with pytest.raises(UsageError) as exc:
        profiles.get("p", tmp_path)
    msg = str(exc.value)
    assert msg.startswith(str(tmp_path / "p.yaml") + ":"), msg
    assert key in msg and phrase in msg and "\n" not in msg, msg


def test_broken_yaml_and_the_cli_exit_code(tmp_path):
    (tmp_path / "p.yaml").write_text("meta: {name: p\n  hardware: [\n")
    r = run_cli("profiles", "--dir", str(tmp_path), "--check")
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "p.yaml") in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    ok = run_cli("profiles", "--check")
    assert ok.returncode == 0 and "4 profiles valid" in ok.stdout, ok


# --- fusion-evidence: the seed's Q-prep setup --------------------------------------------------

def _render(profile: str, **extra: str):
    return render(environ={"K3_PROFILE": profile, "K3_MODEL": "/tmp", **extra}, dotenv=None)


def test_fusion_evidence_differs_from_the_default_only_where_it_says():
    default, fe = _render("mi355x-tp8"), _render("fusion-evidence")
    # the same AITER env; the profiler raises vLLM's RPC timeout so trace writing fits in it
    assert fe.env == {**default.env, "K3_PROFILE": "fusion-evidence",
                      "VLLM_RPC_TIMEOUT": "1800000"}
    differs = {f for f in FIELDS if getattr(fe.settings, f) != getattr(default.settings, f)}
    assert differs == {"profile", "mtp_k", "profiler_dir"}
    assert "--speculative-config" not in fe.argv and "--speculative-config" in default.argv
    assert not any(a.startswith("--compilation-config") or a == "--enforce-eager"
                   for a in fe.argv)
    prof = json.loads(fe.argv[fe.argv.index("--profiler-config") + 1])
    assert (prof["max_iterations"], prof["delay_iterations"]) == (6, 0)
    assert fe.settings.kv_cache_dtype == "fp8" and fe.settings.tp == 8


def test_every_fusion_evidence_feature_cites_its_source():
    doc = yaml.safe_load((SHIPPED / "fusion-evidence.yaml").read_text())
    for name, feat in doc["features"].items():
        assert feat.get("source", "").startswith("["), name


# --- upstream_ref ------------------------------------------------------------------------------

def test_fusion_evidence_census_is_comparable_with_the_qprep_launch_counts():
    fe = _render("fusion-evidence")
    got = comparable_with("census", fe.settings, fe.env, {"steps": 6})
    assert got["comparable"] and got["figure"] == "qprep-launches"
    assert "288 stock -> 144 fused over 6 decode steps" in got["text"]
    assert got["text"].endswith("this run is the fused side")
    assert all(c["ok"] for c in got["checked"])
    json.dumps(got)  # JSON-able
    stock = _render("fusion-evidence", K3_FUSE_DECODE_QPREP="0")
    assert comparable_with("census", stock.settings, stock.env)["text"].endswith("stock side")
    # the seed's trace load too: then the per-rank times are comparable as well
    load = {"isl": 131072, "osl": 1024, "concurrency": 8, "steps": 6}
    assert comparable_with("census-ab", fe.settings, fe.env, load)["also"] == ["qprep-time"]


@pytest.mark.parametrize("extra,reason", [
    ({"K3_MTP_K": "2"},
     "speculative decoding mtp k=2 (differs; upstream: no speculative decoding)"),
    ({"K3_TP": "4"}, "TP 4 (differs; upstream: TP 8)"),
    ({"K3_EXTRA_ARGS": "--compilation-config '{\"level\":0}'"}, "compilation override"),
    ({"K3_ENFORCE_EAGER": "1"}, "--enforce-eager"),
    ({"K3_KV_CACHE_DTYPE": "auto"}, "KV cache auto (differs"),
    ({"VLLM_ROCM_USE_AITER_MLA": "0"}, "VLLM_ROCM_USE_AITER_MLA=0"),
    ({"K3_PROFILER_MAX_ITERATIONS": "12"}, "12 profiled steps (differs"),
])
def test_one_difference_from_the_qprep_setup_is_named(extra, reason):
    r = _render("fusion-evidence", **extra)
    got = comparable_with("census", r.settings, r.env)
    assert reason in got["not_comparable"]["qprep-launches"], got
    if not got["comparable"]:
        assert got["text"].startswith("not comparable with any upstream figure: ")


def test_the_default_profile_compares_with_the_mtp_figures_not_the_qprep_one():
    d = _render("mi355x-tp8")
    census = comparable_with("census", d.settings, d.env)
    assert census["figure"] == "qknorm-launches"  # the seed's fusion-1 trace ran MTP k=2
    assert "no speculative decoding" in census["not_comparable"]["qprep-launches"]
    task = {"num_fewshot": 5, "limit": None, "reference_task_config": True}
    assert comparable_with("gsm8k", d.settings, d.env, task)["figure"] == "gsm8k"
    sub = comparable_with("gsm8k", d.settings, d.env, {**task, "limit": 100})
    assert not sub["comparable"] and "subset of 100" in sub["text"]
    assert comparable_with("bench-ab", d.settings, d.env, "decode-8k1k")["figure"] == \
        "latency-ab"
    assert not comparable_with("bench-ab", d.settings, d.env, "agentic-68k")["comparable"]
    bench = comparable_with("bench", d.settings, d.env, "decode-8k1k")
    assert not bench["comparable"] and "no absolute latency" in bench["text"]


def test_the_cpu_standin_and_unknown_facts_are_never_comparable():
    c = _render("cpu-smoke")
    for measure in MEASURES:
        assert not comparable_with(measure, c.settings, c.env, "decode-8k1k")["comparable"]
    d = _render("mi355x-tp8")
    no_env = comparable_with("census", d.settings, None)
    assert not no_env["comparable"] and "server environment unknown" in no_env["text"]
    partial = comparable_with("census", {"profile": "fusion-evidence", "tp": 8}, d.env)
    assert not partial["comparable"] and "unknown" in partial["text"]
    with pytest.raises(ValueError, match="measure"):
        comparable_with("latency", d.settings, d.env)


def test_a_server_containers_environment_is_resolved_like_the_entrypoint_does():
    """What the census reads from `docker inspect`: the K3_* the container got + vendor env."""
    fe = _render("fusion-evidence")
    container = {"K3_PROFILE": "fusion-evidence", "K3_MODEL": "/models/Kimi-K3", "K3_TP": "",
                 **{k: v for k, v in fe.env.items() if not k.startswith("K3_")},
                 "PATH": "/usr/bin"}
    got = comparable_with("census", container, None, {"steps": 6})
    assert got["figure"] == "qprep-launches", got["text"]
    container["K3_MTP_K"] = "2"
    assert comparable_with("census", container)["figure"] == "qknorm-launches"
    assert comparable_with("census", {"K3_TP": "7"})["comparable"] is False


def test_every_figure_says_where_it_comes_from():
    assert {f.key for f in FIGURES} == {"qprep-launches", "qprep-time", "qknorm-launches",
                                        "gsm8k", "latency-ab"}
    for f in FIGURES:
        assert f.source.startswith("[") and f.conditions and set(f.measures) <= set(MEASURES)


# --- docs/profiles.md's comparison table says what render gives --------------------------------

def _doc_rows() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "profiles.md").read_text()
    section = text.split("## `mi355x-tp8` against")[1].split("\n## ")[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_the_docs_comparison_shows_what_mi355x_tp8_renders():
    r = _render("mi355x-tp8")
    rows = _doc_rows()
    assert len(rows) >= 25
    argv = r.argv
    for name, ours in rows:
        value = ours.strip("`")
        if name.startswith("--"):
            if ours == "(unset)":
                assert name not in argv, name
            elif value == "on":
                assert name in argv, name
            else:
                assert name in argv and argv[argv.index(name) + 1] == value, (name, value)
        elif ours == "(unset)":
            assert name not in r.env, name
        else:
            assert r.env[name] == value, (name, value)
    # every vendor variable the profile renders is in the table
    assert {k for k in r.env if not k.startswith("K3_")} <= {n for n, _ in rows}
