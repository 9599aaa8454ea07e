"""What the base image can run, measured from the vLLM and AITER installed in it.

``k3rocm base facts [--json]`` (and the image build, which records them in the manifest) reads
the installed sources without importing them (no GPU, no 20 s vLLM import, works during
``docker build``) and reports each fact with how it was decided, or ``unknown``:

- vLLM version; whether vLLM's ``vllm/models/kimi_k3/amd/mla.py`` is upstream code and which of
  the two fusions it carries (vLLM >= 0.32 ships both);
- AITER version; whether its ``fused_qk_rope_concat_and_cache_mla`` stub has the
  ``compute_all_q_rope`` argument that came with the position clamp (ROCm/aiter #4342, first in
  v0.1.19.post1); the op's schema is defined from that stub (``compile_ops`` ->
  ``torch_compile_guard``), so the stub answers what the registered schema will say;
- the AITER MLA decode route: ``AiterMLAHelper.use_gluon_decode`` with or without a
  ``kv_cache_dtype`` argument (vLLM 0.27.1: ``(num_heads, max_qo_len)``, every decode with
  < 16 heads and query length 1 goes to Gluon; 0.32+: fp8 KV never does), whether
  ``AiterMLAImpl`` keeps vLLM's default ``supports_quant_query_input = True`` (then an fp8 KV
  cache gives the backend an fp8 query), whether the < 16-head multi-token verify path syncs the
  host (0.27.1: ``.item()`` in ``AiterMLAImpl.forward_mqa``), whether the backend's query
  padding is a view for a query cut from a padded buffer (0.33: ``as_strided``);
- the FP8/FP4 BMM defaults in ``vllm/envs.py``.

:func:`route` turns those facts into the decode route for a heads-per-rank and KV dtype, and
:func:`check` into the decisions and refusals ``k3rocm serve`` applies before vLLM starts.
Stdlib only: runs in the image before anything else is there.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

from k3rocm.errors import UsageError
from k3rocm.serving.fusions import BY_NAME, FUSIONS  # stdlib only too
from k3rocm.serving.modelfacts import KIMI_K3_HEADS  # stdlib only too
from k3rocm.serving.overlay import BACKUP_SUFFIX, _ours, _text, _vllm_version, package_root

GLUON_MAX_HEADS = 15  # AiterMLAHelper._AITER_MIN_MLA_HEADS = 16 (0.27.1 .. 0.33)
ROUTER = "vllm/v1/attention/backends/mla/rocm_aiter_mla.py"
AMD_MLA = "vllm/models/kimi_k3/amd/mla.py"
ENVS = "vllm/envs.py"
VLLM_CONFIG = "vllm/config/vllm.py"
AITER_STUB = "aiter/ops/cache.py"
QPREP_OP = BY_NAME["decode_qprep"].op  # AITER's fused_qk_rope_concat_and_cache_mla
CLAMP_ARG = "compute_all_q_rope"


def fact(value: Any, how: str) -> dict[str, Any]:
    return {"value": value, "how": how}


def unknown(why: str) -> dict[str, Any]:
    return {"value": None, "how": f"unknown: {why}"}


def dist_version(dists: tuple[str, ...]) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _def(node: ast.AST | None, name: str, kind: type = ast.FunctionDef) -> Any:
    """The class or function ``name`` defined directly in ``node``'s body, or None."""
    return next((n for n in getattr(node, "body", ()) if isinstance(n, kind) and n.name == name),
                None)


def _router_facts(path: Path) -> dict[str, dict[str, Any]]:
    rel = ROUTER
    needs = {"gluon_decode_dtype_aware": "AiterMLAHelper.use_gluon_decode",
             "quantizes_query": "AiterMLAImpl", "verify_route": "AiterMLAImpl.forward_mqa",
             "padded_query_view": "AiterMLAHelper.get_mla_padded_q"}
    if not path.is_file():
        return {k: unknown(f"{rel} not in this vLLM") for k in needs}
    out = {k: unknown(f"{rel}: no {what}") for k, what in needs.items()}  # until found
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    helper, impl = (_def(tree, c, ast.ClassDef) for c in ("AiterMLAHelper", "AiterMLAImpl"))
    use = _def(helper, "use_gluon_decode")
    if use is not None:
        params = [a.arg for a in use.args.args]
        out["gluon_decode_dtype_aware"] = fact("kv_cache_dtype" in params, (
            f"{rel}:{use.lineno} AiterMLAHelper.use_gluon_decode({', '.join(params)})"))
    # vLLM's MLACommonImpl sets supports_quant_query_input = True; AITER's impl keeps it
    # unless it assigns it itself.
    sets = [n for n in ast.walk(impl) if isinstance(n, (ast.Assign, ast.AnnAssign)) and
            "supports_quant_query_input" in ast.unparse(n)] if impl else []
    if impl is not None and not sets:
        out["quantizes_query"] = fact(True, (
            f"{rel}:{impl.lineno} AiterMLAImpl keeps MLACommonImpl's "
            "supports_quant_query_input = True (fp8 KV -> fp8 query)"))
    elif sets:
        val = ast.unparse(sets[-1]).split("=")[-1].strip()
        out["quantizes_query"] = fact(val == "True", f"{rel}:{sets[-1].lineno} "
                                      f"supports_quant_query_input = {val}")
    verify = _def(helper, "use_gluon_verify")
    fwd = _def(impl, "forward_mqa")
    if verify is not None:
        out["verify_route"] = fact("gluon-mtp-or-asm", (
            f"{rel}:{verify.lineno} AiterMLAHelper.use_gluon_verify (bf16: Gluon 4-D MTP entry; "
            "fp8: padded asm; no host sync)"))
    elif fwd is not None:
        syncs = sorted(n.lineno for n in ast.walk(fwd) if isinstance(n, ast.Call) and
                       isinstance(n.func, ast.Attribute) and n.func.attr == "item")
        out["verify_route"] = fact("gluon-flatten-host-sync" if syncs else "gluon-flatten", (
            f"{rel}:{fwd.lineno} AiterMLAImpl.forward_mqa flattens < 16-head verify onto "
            "Gluon" + (f"; .item() at line {', '.join(map(str, syncs))}" if syncs else "")))
    pad = _def(helper, "get_mla_padded_q")
    if pad is not None:
        view = any(isinstance(n, ast.Attribute) and n.attr == "as_strided" for n in ast.walk(pad))
        out["padded_query_view"] = fact(view, (
            f"{rel}:{pad.lineno} get_mla_padded_q " + (
                "views a query cut from a 16-head buffer (as_strided)" if view else
                "copies a < 16-head query (repeat/repeat_interleave, contiguous)")))
    return out


def _upstream_mla(root: Path) -> dict[str, Any]:
    path = root / AMD_MLA
    if _ours(path):  # upstream's file, if any, is the backup `overlay apply --mode force` kept
        path = path.with_name(path.name + BACKUP_SUFFIX)
    text, how = _text(path), str(path.relative_to(root))
    if not text:
        return fact([], f"{AMD_MLA}: no upstream file (none, or only the k3rocm overlay)")
    fus = [f.name for f in FUSIONS if f.op in text]
    return fact(fus, f"{how}: upstream code calling " + (", ".join(fus) or "neither op"))


def _aiter_facts(root: Path | None = None) -> dict[str, dict[str, Any]]:
    ver = dist_version(("amd-aiter", "aiter"))
    root = root or package_root("aiter")
    out = {"aiter_version": fact(ver, "installed distribution amd-aiter") if ver else
           unknown("no amd-aiter distribution installed")}
    stub = _text(root / AITER_STUB) if root else ""
    fn = _def(ast.parse(stub), QPREP_OP)
    args = [a.arg for a in fn.args.args + fn.args.kwonlyargs] if fn else []
    if not stub:
        out["aiter_qprep_clamp"] = unknown(f"{AITER_STUB} not installed")
    elif fn is None:
        out["aiter_qprep_clamp"] = unknown(f"{AITER_STUB}: no {QPREP_OP}")
    else:
        out["aiter_qprep_clamp"] = fact(CLAMP_ARG in args, (
            f"{AITER_STUB}:{fn.lineno} {QPREP_OP} stub "
            f"{'has' if CLAMP_ARG in args else 'lacks'} {CLAMP_ARG}"))
    return out


def _env_default(root: Path, name: str) -> dict[str, Any]:
    path = root / ENVS
    if not path.is_file():
        return unknown(f"{ENVS} missing")
    m = re.search(rf'os\.getenv\(\s*"{name}",\s*"([^"]*)"', path.read_text(errors="replace"))
    if not m:
        return unknown(f"{ENVS}: no default for {name}")
    return fact(m.group(1).lower() in ("true", "1"), f"{ENVS}: {name} defaults to {m.group(1)!r}")


def measure(site: Path | None = None, aiter_site: Path | None = None) -> dict[str, Any]:
    """Facts about the vLLM under ``site`` (default: the importable one) and the AITER under
    ``aiter_site`` (default: the importable one)."""
    root = Path(site) if site else package_root("vllm")
    if root is None or not (root / "vllm" / "__init__.py").is_file():
        return {"schema": 1, "vllm_version": unknown("vLLM is not installed here"),
                **_aiter_facts(aiter_site)}
    ours = _ours(root / AMD_MLA)
    facts: dict[str, Any] = {
        "schema": 1, "vllm_version": fact(_vllm_version(root), "installed distribution"),
        "upstream_mla_fusions": _upstream_mla(root),
        "overlay_in_tree": fact(ours, f"{AMD_MLA} is {'' if ours else 'not '}the k3rocm overlay"),
        **_router_facts(root / ROUTER)}
    cfg = _text(root / VLLM_CONFIG)
    if cfg:
        auto = "KimiK3ForConditionalGeneration" in cfg and "VLLM_USE_BREAKABLE_CUDAGRAPH" in cfg
        facts["breakable_cudagraph_auto_for_k3"] = fact(auto, f"{VLLM_CONFIG}: Kimi-K3 "
                                                        f"{'in' if auto else 'not in'} the "
                                                        "auto-enable list")
    facts["fp8_bmm_default"] = _env_default(root, "VLLM_ROCM_USE_AITER_FP8BMM")
    facts["fp4_bmm_default"] = _env_default(root, "VLLM_ROCM_USE_AITER_FP4BMM")
    facts.update(_aiter_facts(aiter_site))
    return facts


def value(facts: dict[str, Any], key: str) -> Any:
    f = facts.get(key)
    return f.get("value") if isinstance(f, dict) else None


def route(facts: dict[str, Any], heads: int, kv_dtype: str, qlen: int = 1) -> dict[str, Any]:
    """The AITER MLA decode route vLLM takes for ``heads`` per rank, and the query it accepts.

    ``fp8_query_ok``: the route serves the fp8 query the stock layer (and the fused Q-prep)
    hands it with an fp8 KV cache; None when a fact it needs is unknown."""
    fp8 = kv_dtype.startswith("fp8")
    if heads > GLUON_MAX_HEADS:
        return {"route": "asm", "fp8_query_ok": True, "why": f"{heads} heads: asm decode"}
    aware = value(facts, "gluon_decode_dtype_aware")
    if qlen > 1:
        vr = value(facts, "verify_route")
        if vr is None:
            return {"route": "unknown", "fp8_query_ok": None, "why": "verify route unknown"}
        if vr.startswith("gluon-flatten"):
            return {"route": vr, "fp8_query_ok": False, "host_sync": vr.endswith("host-sync"),
                    "why": f"{heads}-head verify (query length {qlen}) flattened onto AITER's "
                           "Gluon kernel, which takes a bf16 query"}
        return {"route": "asm-padded" if fp8 else "gluon-mtp-or-asm", "fp8_query_ok": True,
                "host_sync": False, "why": "dtype-aware verify routing"}
    if aware is None:
        return {"route": "unknown", "fp8_query_ok": None, "why": "decode route unknown"}
    if not aware:
        return {"route": "gluon", "fp8_query_ok": False,
                "why": "decode goes to AITER's Gluon kernel for every KV dtype "
                       "(use_gluon_decode has no dtype argument), and Gluon asserts a bf16 "
                       "query (aiter/ops/triton/gluon/mla_gluon.py)"}
    if fp8:
        return {"route": "asm-padded", "fp8_query_ok": True,
                "why": "fp8 KV never takes Gluon here: padded asm decode (16 heads)"}
    return {"route": "gluon-or-asm", "fp8_query_ok": True,
            "why": "bf16 KV: Gluon on gfx950 for divisors of 16, else padded asm"}


MANIFEST = Path("/opt/k3rocm/manifest.json")
CC_FLAGS = ("--compilation-config", "-cc", "-O")


def load(manifest: Path = MANIFEST) -> tuple[dict[str, Any] | None, str]:
    """The base facts: recorded in the image's manifest at build time, else measured here
    (a Python with vLLM), else None (a host without vLLM)."""
    if manifest.is_file():
        try:
            facts = json.loads(manifest.read_text()).get("base_facts")
        except (OSError, ValueError):
            facts = None
        if facts:
            return facts, f"{manifest} (measured at image build)"
    if package_root("vllm") is not None:
        return measure(), "measured in this Python"
    return None, "unknown (no vLLM here: run inside the image)"


class BaseRefusal(ValueError):
    """A setting this base cannot run (one line)."""


def _explicit(sources: dict[str, str], env_name: str) -> bool:
    return sources.get(env_name, "default") != "default"


def check(s: Any, sources: dict[str, str], facts: dict[str, Any] | None,
          aiter_on: bool) -> tuple[dict[str, Any], list[str], list[str]]:
    """Decide what the base allows for settings ``s`` before anything loads.

    Returns (setting updates, extra argv, notes for the startup log). A default that the base
    cannot run is changed (and noted); a value set explicitly (shell, .env or a profile) that
    it cannot run raises BaseRefusal. Unknown facts give a note, never a refusal."""
    updates: dict[str, Any] = {}
    argv: list[str] = []
    notes: list[str] = []
    if facts is None or not aiter_on:
        why = "AITER is off (VLLM_ROCM_USE_AITER != 1)" if facts else "facts unknown"
        return updates, argv, [f"base checks skipped: {why}"]
    heads = KIMI_K3_HEADS // s.tp
    ver = value(facts, "vllm_version") or "?"
    kv = s.kv_cache_dtype
    if kv.startswith("fp8"):  # the decode route, and MTP's verify route
        routes = {q: route(facts, heads, kv, q) for q in ([1, 1 + s.mtp_k] if s.mtp_k > 0 else [1])}
        bad = [(q, r) for q, r in routes.items() if r["fp8_query_ok"] is False]
        if bad:
            q, r = bad[0]
            what = (f"vLLM {ver}, {heads} heads/rank, query length {q}: {r['why']}; an fp8 KV "
                    "cache makes the MLA layer quantize the query to fp8")
            if _explicit(sources, "K3_KV_CACHE_DTYPE"):
                raise BaseRefusal(
                    f"K3_KV_CACHE_DTYPE={kv} cannot serve on this base ({what}); use "
                    "K3_KV_CACHE_DTYPE=auto, or a base with dtype-aware small-head routing "
                    "(vLLM >= 0.32); K3_BASE_CHECK=warn overrides")
            updates["kv_cache_dtype"] = kv = "auto"
            notes.append(f"K3_KV_CACHE_DTYPE=auto (default fp8 cannot serve: {what})")
        elif any(r["fp8_query_ok"] is None for r in routes.values()):
            notes.append(f"WARNING: decode route for fp8 KV at {heads} heads/rank unknown on "
                         f"vLLM {ver}; not checked")
    upstream = value(facts, "upstream_mla_fusions") or []
    if upstream and not value(facts, "overlay_in_tree"):
        for f in FUSIONS:
            if f.name in upstream and not getattr(s, f.field) and _explicit(sources, f.env):
                raise BaseRefusal(
                    f"{f.env}=0 has no effect on this base: vLLM {ver} ships "
                    f"vllm/models/kimi_k3/amd/mla.py with that fusion and the overlay was "
                    "skipped; rebuild with K3_OVERLAY=force to switch it, or unset it")
        notes.append(f"fusions: vLLM {ver}'s own amd/mla.py ({', '.join(upstream)}); the "
                     "K3_FUSE_* switches have no effect on this base")
    elif s.fuse_decode_qprep and not kv.startswith("fp8"):
        if _explicit(sources, "K3_FUSE_DECODE_QPREP"):
            raise BaseRefusal(
                f"K3_FUSE_DECODE_QPREP=1 needs an fp8 KV cache (K3_KV_CACHE_DTYPE={kv} on this "
                f"base, vLLM {ver}, {heads} heads/rank); set K3_FUSE_DECODE_QPREP=0, or "
                "K3_KV_CACHE_DTYPE=fp8 on a base that serves it")
        updates["fuse_decode_qprep"] = False
        notes.append(f"K3_FUSE_DECODE_QPREP=0 (the default 1 needs an fp8 KV cache; "
                     f"K3_KV_CACHE_DTYPE={kv})")
    if s.mtp_k > 0 and not s.enforce_eager:
        r = route(facts, heads, kv, 1 + s.mtp_k)
        user_cc = any(a.split("=")[0] in CC_FLAGS for a in s.extra_args.split())
        if r.get("host_sync") and not user_cc:
            argv += ["--compilation-config", '{"cudagraph_mode":"PIECEWISE"}']
            notes.append(
                f"graphs: cudagraph_mode PIECEWISE (no full-graph capture): vLLM {ver}'s "
                f"{heads}-head MTP verify path syncs the host ({facts['verify_route']['how']})"
                ", which full-graph capture of a uniform verify batch cannot do; set "
                "--compilation-config in K3_EXTRA_ARGS to override")
    return updates, argv, notes


def describe(base: dict[str, Any]) -> list[str]:
    """What a render's base decision (``Rendered.base``) says: a header line, then the notes."""
    r = base.get("decode_route") or {}
    return [f"base: vLLM {base.get('vllm_version', '?')}, {base.get('heads_per_rank', '?')} MLA "
            f"heads/rank, decode route {r.get('route', '?')} ({r.get('why', '?')}); facts from "
            f"{base.get('facts_from', '?')}", *(base.get("notes") or [])]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="base_cmd", metavar="{facts}")
    f = sub.add_parser("facts", help="measure what this image's vLLM and AITER can run",
                       description="Read the installed vLLM and AITER sources (no import, no "
                       "GPU) and print each fact with how it was decided, and the decode route "
                       "for a heads-per-rank count.")
    f.add_argument("--json", action="store_true", help="print JSON")
    f.add_argument("--site", type=Path, default=None,
                   help="directory holding the vllm package (default: the importable one)")
    f.add_argument("--heads", type=int, default=12,
                   help="MLA heads per rank for the route (default 12: Kimi-K3 at TP=8)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "base_cmd", None) != "facts":
        raise UsageError("base needs a subcommand: facts (see k3rocm base --help)")
    if args.heads < 1:
        raise UsageError(f"--heads {args.heads} is not valid: use a positive head count")
    facts = measure(args.site)
    routes = {f"{dt} q{q}": route(facts, args.heads, dt, q)
              for dt in ("fp8", "auto") for q in (1, 3)}
    if args.json:
        print(json.dumps({"facts": facts, "heads": args.heads, "routes": routes}, indent=2,
                         sort_keys=True))
    else:
        for key, f in facts.items():
            if isinstance(f, dict):
                print(f"{key}: {f['value']!r}  ({f['how']})")
        for k, r in routes.items():
            print(f"route {args.heads} heads {k}: {r['route']} fp8 query ok={r['fp8_query_ok']}"
                  f" ({r['why']})")
    return 0
