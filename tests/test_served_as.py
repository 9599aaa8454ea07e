"""Readers of a running server read what ``k3rocm serve`` rendered (its record in the server
container), not a reverse-engineered argv/env; without the record, the container's env only
(argv unknown), and the result says so.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, run_cli

from k3rocm.checks.bench.run import _server_line, server_prefix_caching
from k3rocm.checks.bench.summary import tokens_per_step
from k3rocm.checks.census import pipeline
from k3rocm.checks.census.fusions import from_cli
from k3rocm.deploy.provenance import served_as
from k3rocm.errors import UsageError
from k3rocm.serving.serve_cmd import RENDERED_FILE

DATA = REPO / "tests" / "data" / "census"
TINY = DATA / "models" / "tiny-deepseek-v3"

# The two disagree on every fact a reader takes: the rendered record must win.
RENDERED = {"env": {"K3_FUSE_QK_NORM": "0", "VLLM_ROCM_USE_AITER": "1"},
            "argv": ["vllm", "serve", "/models/Kimi-K3", "--tensor-parallel-size", "2",
                     "--no-enable-prefix-caching"],
            "sources": {}}
CONTAINER_ENV = {"K3_TP": "4", "K3_FUSE_QK_NORM": "1", "K3_MTP_K": "2", "PATH": "/usr/bin"}


def server_prov(rendered: dict | None) -> dict:
    return {"vllm_version": "0.27.1", "rendered": rendered,
            "container": {"image_ref": "k3rocm/server:latest", "image_id": "sha256:1",
                          "env": CONTAINER_ENV},
            "fusion_toggles": {}}


def test_rendered_record_wins_over_the_container_env():
    prov = server_prov(RENDERED)
    s = served_as(prov)
    assert s.rendered and RENDERED_FILE in s.source
    assert s.argv == RENDERED["argv"] and s.tp == 2
    assert s.env["K3_FUSE_QK_NORM"] == "0" and s.env["PATH"] == "/usr/bin"  # record on top
    # bench: summary.json's prefix caching, tokens per engine step, report line (tp: above)
    assert server_prefix_caching(prov) is False
    assert tokens_per_step(prov) == (1, "no speculative decoding seen")  # not K3_MTP_K=2
    assert RENDERED_FILE in _server_line(prov)
    # census: the world size a live census needs when the traces do not record it
    world, src = pipeline.resolve_world_size(None, None, s)
    assert world == 2 and RENDERED_FILE in src


def test_without_a_record_the_argv_is_unknown_and_the_result_says_so():
    prov = server_prov(None)
    s = served_as(prov)
    assert not s.rendered and "argv unknown" in s.source and "no rendered record" in s.source
    assert s.argv is None and s.tp is None
    assert server_prefix_caching(prov) is None
    assert tokens_per_step(prov)[0] == 3  # the container's K3_MTP_K=2
    assert "no rendered record" in _server_line(prov)
    with pytest.raises(UsageError, match="pass --world-size N"):
        pipeline.resolve_world_size(None, None, s)
    # nothing known at all
    assert served_as({}).tp is None and served_as(None).source.startswith("unknown")


SPEC2 = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']


@pytest.mark.parametrize("rendered, argv, env, k", [
    (True, ["vllm", "serve", "m", *SPEC2], {}, 2),
    (True, ["vllm", "serve", "m"], {"K3_MTP_K": "2"}, 0),  # the record's argv says it all
    (False, None, {"K3_MTP_K": " 2"}, 2),  # no record: the container's K3_MTP_K
    (False, None, {"K3_MTP_K": "0"}, 0),
    (True, ["vllm", "serve", "m", "--speculative-config", "{not json"], {}, 0),
    (True, ["vllm", "serve", "m", "--speculative-config", '{"num_speculative_tokens": 0}'],
     {}, 0),
])
def test_one_answer_to_does_this_server_decode_speculatively(rendered, argv, env, k):
    """``ServedAs.speculative``: the bench's tokens per step and the census's note agree."""
    prov = {"rendered": {"argv": argv, "env": env} if rendered else None,
            "container": {"env": env}}
    assert served_as(prov).speculative[0] == k
    assert tokens_per_step(prov)[0] == 1 + k
    assert (pipeline.speculative_note(served_as(prov)) is not None) == (k > 0)


@pytest.mark.parametrize("argv, n", [
    # what serving/config.py renders (K3_PROFILER_MAX_ITERATIONS=6, profiler style "config")
    (["--profiler-config", '{"profiler":"torch","torch_profiler_dir":"/results/traces",'
      '"delay_iterations":0,"max_iterations":6}'], 6),
    (["--profiler-config", '{"profiler":"torch","max_iterations":0}'], 0),  # unlimited
    (["--profiler-config", "{not json"], 0),
    (["--profiler-config", '["max_iterations", 6]'], 0),
    ([], 0),  # env-style profiler (older vLLM) or none
])
def test_the_census_waits_for_the_profiler_only_when_it_stops_itself(argv, n):
    prov = {"rendered": {"argv": ["vllm", "serve", "m", *argv], "env": {}}}
    assert served_as(prov).profiler_max_iterations == n


class Container:
    """docker-py's Container as the readers use it; only the record's file can be read."""

    name = id = "srv"

    def __init__(self, rendered: dict | None):
        self.rendered = rendered
        self.attrs = {"Config": {"Env": [f"{k}={v}" for k, v in CONTAINER_ENV.items()]}}
        self.reads: list[str] = []

    def get_archive(self, path):  # the engine's archive API: a tar stream of the file
        self.reads.append(path)
        if path != RENDERED_FILE or self.rendered is None:
            raise FileNotFoundError(path)  # docker.errors.NotFound in docker-py
        data, buf = json.dumps(self.rendered).encode(), io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(Path(path).name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return [buf.getvalue()], {}


def test_container_reader_reads_the_record_and_without_it_only_the_env():
    c = Container(RENDERED)
    s = served_as(container=c)
    assert s.rendered and s.tp == 2 and c.reads == [RENDERED_FILE]
    claim = pipeline.claim_from_container(c)
    assert claim.asked["qk_norm"] is False and "rendered settings" in claim.source
    old = Container(None)
    s = served_as(container=old)
    assert not s.rendered and s.argv is None and s.tp is None
    assert old.reads == [RENDERED_FILE]  # nothing else is read from the container
    legacy = pipeline.claim_from_container(old)
    assert legacy.asked["qk_norm"] is True  # K3_FUSE_QK_NORM=1 in its env
    assert legacy.asked["decode_qprep"] is True  # unset: on


def test_offline_claim_reads_the_recorded_rendering(tmp_path):
    """An offline census claims the recorded rendering's K3_FUSE_*, not the container env's."""
    run = tmp_path / "run"
    shutil.copytree(DATA / "rocm-on", run / "traces")
    (run / "provenance.json").write_text(json.dumps({"server": server_prov(RENDERED)}))
    def census(results: Path):
        p = run_cli("census", "--trace-dir", str(run / "traces"), "--model-dir", str(TINY),
                    "--results", str(results), "--skip-records")
        claim = json.loads(next(results.glob("*/census.json")).read_text())["claim"]
        return p, claim

    p, claim = census(tmp_path / "r")
    # the traces ran the fused q/kv norm: asked off, the census fails on it
    assert p.returncode == 1 and "(qk_norm asked off)" in p.stdout, p.stdout + p.stderr
    assert claim["source"].startswith("the server's rendered settings recorded in"), claim
    # without the record: the container's env (qk_norm asked on)
    (run / "provenance.json").write_text(json.dumps({"server": server_prov(None)}))
    q, claim = census(tmp_path / "r2")
    assert q.returncode == 0, q.stdout + q.stderr
    assert claim["source"].startswith("the server env recorded in"), claim


def _without_world_size(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in src.glob("*.pt.trace.json.gz"):
        doc = json.loads(gzip.decompress(f.read_bytes()))
        doc.pop("distributedInfo", None)
        (dest / f.name).write_bytes(gzip.compress(json.dumps(doc).encode()))
    return dest


def test_census_world_size_from_the_rendering(tmp_path):
    """No distributedInfo in the traces: the rendered TP is the world size; without the
    record it is unknown (pass --world-size).
    """
    d = _without_world_size(DATA / "rocm-on", tmp_path / "t")
    opts = pipeline.Analysis(model_dir=str(TINY), extra={}, skip_records=True)
    c = pipeline.analyse(d, opts, from_cli("all=on"), None,
                         served=served_as(server_prov(RENDERED)))
    assert c.traces.world_size is None
    ranks = next(x for x in c.checks if x.what == "worker traces, one per rank")
    assert (ranks.expected, ranks.ok) == (2, True), ranks
    assert RENDERED_FILE in ranks.rule, ranks.rule
    with pytest.raises(UsageError, match="--world-size"):
        pipeline.analyse(d, opts, from_cli("all=on"), None,
                         served=served_as(server_prov(None)))


def test_upstream_comparison_judges_the_rendered_env():
    """The base facts switched decode Q-prep off at start: the census is the stock side
    of vLLM PR #57640's counts, not the fused side a second rendering would claim.
    """
    from k3rocm.deploy.runrecord import upstream_comparison
    from k3rocm.serving.config import render

    container = {"K3_PROFILE": "fusion-evidence", "K3_MODEL": "/tmp"}
    rendered = render(environ=container, dotenv=None).to_json()
    rendered["env"]["K3_FUSE_DECODE_QPREP"] = "0"
    server = {"container": {"env": container}, "rendered": rendered}
    assert upstream_comparison("census", server=server)["text"].endswith("stock side")
    server["rendered"] = None  # an older image: the container's env, rendered again
    assert upstream_comparison("census", server=server)["text"].endswith("fused side")


# shaped as vLLM logs it (vllm@0.32.0:vllm/v1/engine/core.py:133); a live test reads real ones
ENGINE_LINE = ("(EngineCore pid=37) INFO 12-05 08:23:45 [core.py:133] Initializing a V1 LLM engine "
               "(v0.32.0) with config: model='/models/m', speculative_config={spec}, "
               "enforce_eager=False, enable_prefix_caching=True, enable_chunked_prefill=True, "
               "compilation_config={{'mode': <CompilationMode.VLLM_COMPILE: 3>, "
               "'cudagraph_mode': <CUDAGraphMode.PIECEWISE: 1>}}, kernel_config=None")
MTP2 = "SpeculativeConfig(method='mtp', model='/models/m', num_spec_tokens=2)"


def test_prefix_caching_speculation_and_graphs_come_from_the_servers_own_report():
    """Prefix caching as the server reports it: asked on, logged off, recorded off."""
    from k3rocm.deploy.provenance import served_config

    log = ENGINE_LINE.format(spec=MTP2) + "\nGraph capturing finished in 41 secs, took 1.2 GiB\n"
    sc = served_config(log)
    assert sc["prefix_caching"] == {"value": True, "from": "the engine's config line"}
    assert sc["speculative"] == {"method": "mtp", "num_spec_tokens": 2}
    assert sc["graphs"] == {"enforce_eager": False, "cudagraph_mode": "PIECEWISE",
                            "captured": True, "capture_seconds": 41}
    off = log + ("(EngineCore pid=37) INFO [core.py:288] Disabling prefix caching: model has "
                 "non-causal attention layers.\n")
    assert served_config(off)["prefix_caching"]["value"] is False
    assert "non-causal" in served_config(off)["prefix_caching"]["from"]
    metrics = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="False",engine="0"} 1\n'
    assert served_config("", metrics)["prefix_caching"] == {
        "value": False, "from": "/metrics vllm:cache_config_info"}
    assert served_config("")["prefix_caching"]["value"] is None
    # the bench takes the server's word over the argv, and says where it read it
    prov = {**server_prov(None), "served_config": served_config(off)}
    assert served_as(prov).argv is None
    assert server_prefix_caching(prov) is False
    assert tokens_per_step(prov) == (3, "the server's log: speculative mtp num_spec_tokens=2")
    plain = {**server_prov(None), "served_config": served_config(ENGINE_LINE.format(spec="None"))}
    assert tokens_per_step(plain) == (1, "the server's log: speculative_config=None")
    from k3rocm.checks.bench.run import graphs_line, served_prefix_caching

    assert served_prefix_caching(prov)[1].startswith("the server's own report (")
    value, said = served_prefix_caching(server_prov(RENDERED))
    assert value is False and "asked in the argv only" in said
    assert served_prefix_caching(server_prov(None)) == (None, "unknown")
    assert graphs_line(prov) == ("cudagraph_mode PIECEWISE, enforce_eager False, captured in "
                                 "41 s (the server's log)")


def test_exec_text_waits_for_the_engine_to_record_the_exit():
    """An exec inspected as its stream ends can be Running with no ExitCode
    (moby/moby#19607): exec_text waits for the engine's record.
    """
    from k3rocm.deploy.provenance import exec_text

    def run(*states, timeout=30.0):
        left = list(states)  # the engine's record of the exec, one per inspect; the last stays
        api = SimpleNamespace(
            exec_create=lambda container_id, cmd: {"Id": "e1"},
            exec_start=lambda exec_id, demux: (b"out\n", b"noise on stderr\n"),
            exec_inspect=lambda exec_id: left.pop(0) if len(left) > 1 else left[0])
        return exec_text(SimpleNamespace(id="c", client=SimpleNamespace(api=api)), ["x"],
                         timeout=timeout)

    running, done = {"Running": True, "ExitCode": None}, {"Running": False, "ExitCode": 0}
    assert run(running, running, done) == "out\n"
    assert run(running, {"Running": False, "ExitCode": 3}) is None
    assert run(running, timeout=0.1) is None  # never recorded: not a success
