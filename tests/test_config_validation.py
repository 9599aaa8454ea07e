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
    # vLLM takes any --load-format string and fails only when it picks the loader
    ({"K3_LOAD_FORMAT": "fast"}, "K3_LOAD_FORMAT='fast'", "use one of auto, bitsandbytes"),
    # a flag the renderer sets from a K3_* setting, in every spelling vLLM's parser accepts
    ({"K3_EXTRA_ARGS": "--max-model-len 4096"}, "repeats --max-model-len",
     "set K3_MAX_MODEL_LEN=4096"),
    ({"K3_EXTRA_ARGS": "--seed 1 -tp 4"}, "repeats -tp (--tensor-parallel-size)", "K3_TP=4"),
    ({"K3_EXTRA_ARGS": "--tensor_parallel_size=4"}, "--tensor-parallel-size", "set K3_TP=4"),
    ({"K3_EXTRA_ARGS": "--kv-cache-dtype=auto"}, "K3_EXTRA_ARGS repeats --kv-cache-dtype",
     "set K3_KV_CACHE_DTYPE=auto"),
    ({"K3_EXTRA_ARGS": "--speculative-config.num_speculative_tokens 3"},
     "repeats --speculative-config", "K3_MTP_K, K3_MTP_METHOD"),
    ({"K3_EXTRA_ARGS": "-sc '{\"method\":\"ngram\"}'"}, "-sc (--speculative-config)", "K3_MTP_K"),
    ({"K3_EXTRA_ARGS": "--no-enable-prefix-caching"}, "--no-enable-prefix-caching",
     "set K3_PREFIX_CACHING=0"),
    ({"K3_EXTRA_ARGS": "--enable-auto-tool-choice"}, "--enable-auto-tool-choice",
     "K3_TOOL_CALL_PARSER"),
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


def test_argv_after_the_entrypoint_may_not_repeat_a_managed_flag():
    _assert_one_line_error(_entrypoint({}, "--print", "--seed", "1", "--max-model-len=4096"),
                           "an argument after the entrypoint repeats --max-model-len",
                           "K3_MAX_MODEL_LEN=4096")


def test_unmanaged_flags_still_pass():
    from k3rocm.serving.config import render

    r = render({"K3_MODEL": "/tmp", "K3_EXTRA_ARGS": "--seed 7 --compilation-config '{}'"},
               dotenv=None, passthrough=["--max-logprobs", "5", "-O3"])
    assert r.argv[-7:] == ["--max-logprobs", "5", "-O3", "--seed", "7", "--compilation-config",
                           "{}"]


def test_managed_flags_are_every_flag_the_renderer_writes():
    """The refusal's list is the renderer's own table: every option of a full argv (profiler,
    draft model, tool parser on) is one of its names, and each row names its settings."""
    from k3rocm.serving.config import ARGS, managed_flags, render
    from k3rocm.serving.settings import FIELDS

    r = render({"K3_MODEL": "/tmp", "K3_PROFILER_DIR": "/tmp/p", "K3_MTP_METHOD": "eagle",
                "K3_MTP_MODEL": "/tmp", "K3_MTP_ATTENTION_BACKEND": "TRITON_MLA",
                "K3_ENFORCE_EAGER": "1", "K3_PREFIX_CACHING": "0"}, dotenv=None)
    written = {a for a in r.argv[2:] if a.startswith("--")}
    assert written <= set(managed_flags()), written - set(managed_flags())
    assert {"-tp", "-sc", "--no-trust-remote-code", "--model"} <= set(managed_flags())
    assert all(f in FIELDS for row in ARGS for f in row.fields)


def test_load_formats_are_the_union_of_vllms():
    """K3_LOAD_FORMAT's values are the union of ``LoadFormats`` over the real vLLM 0.27.1 ...
    0.34.0 sources (vllm/model_executor/model_loader/__init__.py)."""
    import ast
    import typing

    from conftest import need, upstream_tree
    from upstream_src import RELEASES

    from k3rocm.serving.settings import FIELDS

    union: set[str] = set()
    for v in RELEASES:
        path = upstream_tree(v) / "vllm/model_executor/model_loader/__init__.py"
        need(path.is_file(), f"{path} not unpacked (make upstream-src)")
        tree = ast.parse(path.read_text())
        node = next(n for n in tree.body if isinstance(n, ast.Assign)
                    and ast.unparse(n.targets[0]) == "LoadFormats")
        union |= {e.value for e in node.value.slice.elts}
    assert set(typing.get_args(FIELDS["load_format"].annotation)) == union


def test_load_format_case_is_ignored_as_vllm_does():
    from k3rocm.serving.config import render

    argv = render({"K3_MODEL": "/tmp", "K3_LOAD_FORMAT": "SafeTensors"}, dotenv=None).argv
    assert argv[argv.index("--load-format") + 1] == "safetensors"


def test_serve_validates_before_starting_anything():
    # `serve` (the container's normal path) runs the same checks before exec'ing vLLM.
    _assert_one_line_error(_entrypoint({"K3_TP": "7"}), "K3_TP")


@pytest.mark.parametrize("text,needles", [("K3_TP=4\nthis is not an assignment\n", [".env:2"]),
                                          ("K3_MAX_NUM_SEQ=4\n", ["K3_MAX_NUM_SEQ", ".env"])])
def test_a_bad_dotenv_is_one_line(tmp_path, text, needles):
    (tmp_path / ".env").write_text(text)
    _assert_one_line_error(_entrypoint({}, "--print", cwd=tmp_path), *needles)
