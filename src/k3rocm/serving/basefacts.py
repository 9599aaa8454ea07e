"""What the base image can run, read from its installed vLLM and AITER sources (no import, no GPU;
works during ``docker build``): each fact with how it was decided (``path:line``) or ``unknown``
(docs/overlay.md tabulates them per release). :func:`route` gives the decode route for a
heads-per-rank and KV dtype; :func:`check` the decisions and refusals ``k3rocm serve`` applies
before vLLM starts. Stdlib only.
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
from k3rocm.serving.overlay import _ours, _vllm_version, package_root
from k3rocm.serving.upstream_hook import MLA_FILE, _text, read_mla, upstream_file

GLUON_MAX_HEADS = 15  # AiterMLAHelper._AITER_MIN_MLA_HEADS = 16 (0.27.1 .. 0.34)
ROUTER = "vllm/v1/attention/backends/mla/rocm_aiter_mla.py"
AMD_MLA = str(MLA_FILE)
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


# The < 16-head verify path through ``AiterMLAImpl.(_)forward_mqa`` on one MI355X rank (gfx950,
# no ASM padding env, no DCP, 1 + k <= 4 tokens): each early-return branch's test is classified;
# an unknown one makes the route unknown (never guessed).
_HOST_SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "synchronize")
_NOT_TAKEN = (  # (text in the branch test, why the verify does not take it)
    ("use_gluon_decode", "single-token decode only"),
    ("dcp", "decode context parallelism only (DCP = 1)"),
    ("triton_verify", "CDNA3 (gfx942) verify past qlen 4 only"),
    ("varlen_q_rows", "the uniform verify batch goes straight to _forward_mqa"),
)


def _host_syncs(nodes: list[ast.AST]) -> list[int]:
    """Lines in ``nodes`` that copy a device value to the host: ``.item()``, ``.tolist()``,
    ``.cpu()``, ... and ``int()``/``float()``/``bool()`` of a method call's result."""
    out = set()
    for top in nodes:
        for n in ast.walk(top):
            if not isinstance(n, ast.Call):
                continue
            method = isinstance(n.func, ast.Attribute) and n.func.attr in _HOST_SYNC_METHODS
            cast = (isinstance(n.func, ast.Name) and n.func.id in ("int", "float", "bool")
                    and bool(n.args) and isinstance(n.args[0], ast.Call)
                    and isinstance(n.args[0].func, ast.Attribute))
            if method or cast:
                out.add(n.lineno)
    return sorted(out)


def _refuses_quantized(fn: ast.FunctionDef | None) -> bool:
    """``fn`` returns False for a quantized KV cache (``if is_quantized_kv_cache(...): return
    False`` at its top level)."""
    return fn is not None and any(
        isinstance(s, ast.If) and "is_quantized_kv_cache" in ast.unparse(s.test)
        and isinstance(s.body[-1], ast.Return) and ast.unparse(s.body[-1].value) == "False"
        for s in fn.body)


def _verify_path(fwd: ast.FunctionDef, helper: ast.ClassDef | None,
                 quantized: bool) -> dict[str, Any] | None:
    """The branch a < 16-head verify takes through the impl's forward ``fwd``, and its host
    syncs; None when a branch test is not understood."""
    verify_fn = _def(helper, "use_gluon_verify")
    path: list[ast.AST] = []
    skipped: list[str] = []
    for stmt in fwd.body:
        exits = isinstance(stmt, ast.If) and isinstance(stmt.body[-1], (ast.Return, ast.Raise))
        if not exits:
            path.append(stmt)
            continue
        test = ast.unparse(stmt.test)
        not_taken = next((why for key, why in _NOT_TAKEN if key in test), None)
        if not_taken is None and ("verify is not None" in test):
            not_taken = "decode context parallelism only (DCP = 1)"
        if not_taken is not None:
            skipped.append(f"{stmt.lineno} ({not_taken})")
            continue
        if "use_gluon_verify" in test:  # the helper decides; the builder records its answer
            taken = not (quantized and _refuses_quantized(verify_fn))
            why = (f"AiterMLAHelper.use_gluon_verify:{verify_fn.lineno} refuses a quantized "
                   "KV cache" if verify_fn is not None and not taken else
                   "use_gluon_verify: bf16 KV, < 16 heads, gfx950")
        elif "num_heads" in test and "max_qo_len" in test and "kv_cache" not in test:
            taken, why = True, "every < 16-head verify, whatever the KV dtype"
        else:
            return None
        if taken:
            return {"route": "gluon", "branch": stmt.lineno, "why": why,
                    "syncs": _host_syncs([*path, stmt.test, *stmt.body])}
        skipped.append(f"{stmt.lineno} ({why})")
    return {"route": "asm-padded", "branch": None, "skipped": skipped,
            "syncs": _host_syncs(path)}


def _router_facts(path: Path) -> dict[str, dict[str, Any]]:
    rel = ROUTER
    needs = {"gluon_decode_dtype_aware": "AiterMLAHelper.use_gluon_decode",
             "quantizes_query": "AiterMLAImpl",
             "verify_route_bf16": "AiterMLAImpl.forward_mqa",
             "verify_route_fp8": "AiterMLAImpl.forward_mqa",
             "padded_query_view": "AiterMLAHelper.get_mla_padded_q",
             "decode_cudagraph_support": "AiterMLAMetadataBuilder._cudagraph_support"}
    if not path.is_file():
        return {k: unknown(f"{rel} not in this vLLM") for k in needs}
    out = {k: unknown(f"{rel}: no {what}") for k, what in needs.items()}  # until found
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    helper, impl, builder = (_def(tree, c, ast.ClassDef) for c in (
        "AiterMLAHelper", "AiterMLAImpl", "AiterMLAMetadataBuilder"))
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
    fwd = _def(impl, "_forward_mqa") or _def(impl, "forward_mqa")
    for key, quantized in ((("verify_route_bf16", False), ("verify_route_fp8", True))
                           if fwd else ()):
        vp = _verify_path(fwd, helper, quantized)
        if vp is None:
            out[key] = unknown(f"{rel}:{fwd.lineno} {fwd.name}: a branch this reader does "
                               "not know")
            continue
        syncs = vp["syncs"]
        where = (f"branch at line {vp['branch']}: {vp['why']}" if vp["branch"] else
                 "falls through to the padded asm decode (mla_decode_fwd)"
                 + (f"; branches not taken: {', '.join(vp['skipped'])}" if vp["skipped"]
                    else ""))
        out[key] = fact({"route": vp["route"], "host_sync": bool(syncs)}, (
            f"{rel}:{fwd.lineno} AiterMLAImpl.{fwd.name}, < 16 heads, 1 + k query tokens, "
            f"gfx950: {where}; " + (f"host sync at line {', '.join(map(str, syncs))}"
                                     if syncs else "no host sync on that path")))
    pad = _def(helper, "get_mla_padded_q")
    if pad is not None:
        view = any(isinstance(n, ast.Attribute) and n.attr == "as_strided" for n in ast.walk(pad))
        out["padded_query_view"] = fact(view, (
            f"{rel}:{pad.lineno} get_mla_padded_q " + (
                "views a query cut from a 16-head buffer (as_strided)" if view else
                "copies a < 16-head query (repeat/repeat_interleave, contiguous)")))
    cg = next((n for n in getattr(builder, "body", ()) if isinstance(n, ast.AnnAssign)
               and ast.unparse(n.target) == "_cudagraph_support" and n.value is not None), None)
    if cg is not None:
        out["decode_cudagraph_support"] = fact(ast.unparse(cg.value).split(".")[-1], (
            f"{rel}:{cg.lineno} AiterMLAMetadataBuilder._cudagraph_support = "
            f"{ast.unparse(cg.value)}"))
    return out


def _upstream_mla(root: Path) -> dict[str, dict[str, Any]]:
    """Which fusions upstream's own ``amd/mla.py`` ships (it calls the fusion's op), and for
    which of them its ``__init__`` sets the per-layer attribute the k3rocm upstream hook
    switches (``fusions.py`` ``attr``); read by ``upstream_hook.read_mla``."""
    path = upstream_file(root)
    text, how = (_text(path), str(path.relative_to(root))) if path else ("", "")
    if not text:
        none = f"{AMD_MLA}: no upstream file (none, or only the k3rocm overlay)"
        return {"upstream_mla_fusions": fact([], none), "upstream_mla_switchable": fact([], none)}
    mla = read_mla(text)
    calls = {f.name: mla.calls[f.op] for f in FUSIONS if f.op in mla.calls}
    lines = {n: (mla.init or {}).get(BY_NAME[n].attr) for n in calls if BY_NAME[n].attr}
    return {
        "upstream_mla_fusions": fact(list(calls), f"{how}: upstream code calling " + (
            ", ".join(f"{BY_NAME[n].op} ({n}) at line {ln}" for n, ln in calls.items())
            or "neither op")),
        "upstream_mla_switchable": fact([n for n, ln in lines.items() if ln], f"{how}: " + (
            ", ".join(f"self.{BY_NAME[n].attr} set at line {ln}" if ln else
                      f"no self.{BY_NAME[n].attr} for {n}" for n, ln in lines.items()) or
            "no upstream fusion to switch"))}


K3_ARCH = "KimiK3ForConditionalGeneration"


def _set_value(node: ast.AST, names: dict[str, ast.AST]) -> set[str] | None:
    """A literal set of architecture names: ``frozenset({...})``, a module-level name, ``-``
    and ``|`` of those; None for anything else."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("frozenset", "set") \
            and len(node.args) == 1:
        node = node.args[0]
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        vals = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        return set(vals) if len(vals) == len(node.elts) else None
    if isinstance(node, ast.Name) and node.id in names:
        return _set_value(names[node.id], names)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Sub, ast.BitOr)):
        a, b = _set_value(node.left, names), _set_value(node.right, names)
        if a is None or b is None:
            return None
        return a - b if isinstance(node.op, ast.Sub) else a | b
    return None


def _breakable_facts(text: str) -> dict[str, Any]:
    """Whether vLLM turns ``VLLM_USE_BREAKABLE_CUDAGRAPH`` on by itself for Kimi-K3, per
    platform (the bundle's profile sets it to 0 either way; the recipe calls that REQUIRED on
    ROCm)."""
    tree = ast.parse(text)
    names = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name)}
    fn = _def(tree, "default_breakable_cudagraph_architectures")
    if fn is not None:  # vLLM >= 0.29: a per-platform answer
        per: dict[str, bool] = {}
        how = []
        for stmt in fn.body:
            if isinstance(stmt, ast.If) and isinstance(stmt.body[-1], ast.Return):
                plat = next((p for p in ("rocm", "cuda") if f"is_{p}()" in ast.unparse(stmt.test)),
                            None)
                archs = _set_value(stmt.body[-1].value, names)
                if plat is None or archs is None:
                    return unknown(f"{VLLM_CONFIG}:{stmt.lineno}: a platform branch this "
                                   "reader does not know")
                per[plat] = K3_ARCH in archs
                how.append(f"{plat} returns at line {stmt.body[-1].lineno}")
            elif isinstance(stmt, ast.Return):
                archs = _set_value(stmt.value, names)
                if archs is None:
                    return unknown(f"{VLLM_CONFIG}:{stmt.lineno}: not a literal set")
                for plat in ("rocm", "cuda"):
                    per.setdefault(plat, K3_ARCH in archs)
                how.append(f"others return at line {stmt.lineno}")
        if set(per) != {"rocm", "cuda"}:
            return unknown(f"{VLLM_CONFIG}:{fn.lineno}: no answer for every platform")
        return fact(per, f"{VLLM_CONFIG}:{fn.lineno} default_breakable_cudagraph_architectures"
                    f"(): {K3_ARCH} " + ", ".join(
                        f"{'in' if per[p] else 'not in'} the {p} set" for p in ("rocm", "cuda"))
                    + f" ({'; '.join(how)})")
    # vLLM <= 0.28: one inline list in VllmConfig.__post_init__, whatever the platform
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "VLLM_USE_BREAKABLE_CUDAGRAPH" in ast.unparse(n.test) and \
                any("os.environ" in ast.unparse(b) for b in n.body):
            archs = {c.value for c in ast.walk(n.test) if isinstance(c, ast.Constant)
                     and isinstance(c.value, str)}
            on = K3_ARCH in archs
            plat = "platform" in ast.unparse(n.test)
            if plat:
                return unknown(f"{VLLM_CONFIG}:{n.lineno}: a platform test this reader does "
                               "not know")
            return fact({"rocm": on, "cuda": on}, (
                f"{VLLM_CONFIG}:{n.lineno} auto-enable list (every platform): {K3_ARCH} "
                f"{'in' if on else 'not in'} it"))
    return fact({"rocm": False, "cuda": False}, f"{VLLM_CONFIG}: no breakable auto-enable")


def _default_graph_mode(text: str) -> dict[str, Any]:
    """vLLM's default ``cudagraph_mode``: the one of the default optimization level."""
    lvl = re.search(r"optimization_level:\s*OptimizationLevel\s*=\s*OptimizationLevel\.(O\d)",
                    text)
    table = lvl and re.search(rf"OptimizationLevel\.{lvl.group(1)}:\s*(\w+)", text)
    block = table and re.search(rf"^{table.group(1)}\s*=\s*\{{", text, re.M)
    mode = block and re.compile(r'"cudagraph_mode":\s*CUDAGraphMode\.(\w+)').search(
        text, block.end())
    if not mode:
        return unknown(f"{VLLM_CONFIG}: no default optimization level's cudagraph_mode")
    return fact(mode.group(1), (
        f"{VLLM_CONFIG}:{text.count(chr(10), 0, lvl.start()) + 1} default optimization level "
        f"{lvl.group(1)} -> {table.group(1)}, cudagraph_mode {mode.group(1)} at line "
        f"{text.count(chr(10), 0, mode.start()) + 1}"))


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
    text = path.read_text(errors="replace")
    m = re.search(rf'os\.getenv\(\s*"{name}",\s*"([^"]*)"', text)
    if not m:
        return unknown(f"{ENVS}: no default for {name}")
    line = text.count("\n", 0, m.start()) + 1
    return fact(m.group(1).lower() in ("true", "1"),
                f"{ENVS}:{line} {name} defaults to {m.group(1)!r}")


LOADERS = "vllm/model_executor/model_loader/__init__.py"


def _load_formats(root: Path) -> dict[str, Any]:
    """vLLM's ``LoadFormats`` (the ``--load-format`` values its loader registry serves)."""
    tree = ast.parse(_text(root / LOADERS) or "pass")
    node = next((n for n in tree.body if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "LoadFormats"), None)
    elts = getattr(getattr(node, "value", None), "slice", None)
    vals = [e.value for e in getattr(elts, "elts", ()) if isinstance(e, ast.Constant)]
    if not vals:
        return unknown(f"{LOADERS}: no LoadFormats literal")
    return fact(sorted(vals), f"{LOADERS}:{node.lineno} LoadFormats ({len(vals)} values)")


_AITER_NAME = re.compile(r"""["'](AITER_[A-Z0-9_]+)["']""")


def _known_env(root: Path, aiter_root: Path | None) -> dict[str, Any]:
    """The VLLM_* / AITER_* names this image's vLLM and AITER read: the keys of vLLM's
    ``environment_variables`` (the list vLLM's own ``validate_environ`` checks, late, when
    the engine starts) and the ``AITER_*`` string literals of AITER's Python sources (AITER
    keeps no list; a name it builds at run time is not seen)."""
    tree = ast.parse(_text(root / ENVS) or "pass")
    node = next((n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and
                 ast.unparse(getattr(n, "target", None) or n.targets[0]) ==
                 "environment_variables" and isinstance(n.value, ast.Dict)), None)
    vllm = sorted(k.value for k in node.value.keys if isinstance(k, ast.Constant)) \
        if node is not None else None
    aiter_pkg = aiter_root / "aiter" if aiter_root else None
    aiter = sorted({m for p in aiter_pkg.rglob("*.py") for m in _AITER_NAME.findall(_text(p))}) \
        if aiter_pkg and aiter_pkg.is_dir() else None
    how = (f"{ENVS}:{node.lineno} environment_variables ({len(vllm)} names)" if vllm else
           f"{ENVS}: no environment_variables") + "; " + (
        f"AITER_* literals in {len(list(aiter_pkg.rglob('*.py')))} files of aiter/ "
        f"({len(aiter)} names)" if aiter is not None else "no AITER installed: AITER_* names "
        "not checked")
    return fact({"vllm": vllm, "aiter": aiter}, how)


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
        **_upstream_mla(root),
        "overlay_in_tree": fact(ours, f"{AMD_MLA} is {'' if ours else 'not '}the k3rocm overlay"),
        **_router_facts(root / ROUTER)}
    cfg = _text(root / VLLM_CONFIG)
    if cfg:
        facts["breakable_cudagraph_auto_for_k3"] = _breakable_facts(cfg)
        facts["default_cudagraph_mode"] = _default_graph_mode(cfg)
    facts["fp8_bmm_default"] = _env_default(root, "VLLM_ROCM_USE_AITER_FP8BMM")
    facts["fp4_bmm_default"] = _env_default(root, "VLLM_ROCM_USE_AITER_FP4BMM")
    facts["load_formats"] = _load_formats(root)
    facts["known_env"] = _known_env(root, aiter_site or package_root("aiter"))
    facts.update(_aiter_facts(aiter_site))
    return facts


def unknown_env(facts: dict[str, Any], names: dict[str, str]) -> list[str]:
    """One warning line per name in ``names`` (name -> where it was set) that starts with VLLM_
    or AITER_ and is not one the base's vLLM or AITER reads (``known_env``), with the closest
    known name."""
    import difflib

    known = value(facts, "known_env") or {}
    ver = value(facts, "vllm_version") or "?"
    out = []
    for name, where in sorted(names.items()):
        part = "vllm" if name.startswith("VLLM_") else "aiter" if name.startswith("AITER_") \
            else None
        pool = known.get(part) if part else None
        if not pool or name in pool:
            continue
        close = difflib.get_close_matches(name, pool, n=1, cutoff=0.8)
        what = (f"is not in vLLM {ver}'s environment_variables (vllm/envs.py)" if part == "vllm"
                else "is named nowhere in this image's AITER sources")
        out.append(f"{name} (from {where}) {what}: "
                   + (f"did you mean {close[0]}? " if close else "check the spelling; ")
                   + "passed as set")
    return out


def value(facts: dict[str, Any], key: str) -> Any:
    f = facts.get(key)
    return f.get("value") if isinstance(f, dict) else None


def route(facts: dict[str, Any], heads: int, kv_dtype: str, qlen: int = 1) -> dict[str, Any]:
    """The AITER MLA decode route vLLM takes for ``heads`` per rank, and the query it accepts."""
    fp8 = kv_dtype.startswith("fp8")
    if heads > GLUON_MAX_HEADS:
        return {"route": "asm", "fp8_query_ok": True, "why": f"{heads} heads: asm decode"}
    aware = value(facts, "gluon_decode_dtype_aware")
    if qlen > 1:
        key = "verify_route_fp8" if fp8 else "verify_route_bf16"
        vr = value(facts, key)
        if not isinstance(vr, dict):
            return {"route": "unknown", "fp8_query_ok": None, "host_sync": None,
                    "why": f"{heads}-head verify route unknown ({key})"}
        sync = "; syncs the host" if vr.get("host_sync") else "; no host sync"
        if vr.get("route") == "gluon":
            return {"route": "gluon", "fp8_query_ok": not fp8, "host_sync": vr.get("host_sync"),
                    "why": f"{heads}-head verify (query length {qlen}) on AITER's Gluon "
                           "kernel, which takes a bf16 query" + sync}
        return {"route": vr.get("route", "unknown"), "fp8_query_ok": True,
                "host_sync": vr.get("host_sync"),
                "why": f"{heads}-head verify (query length {qlen}): padded asm decode" + sync}
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
# The serving image's default base (Dockerfile, compose.yaml; a test keeps them equal); the
# seed nightly (the 0.27.1 code state) is K3_PROFILE=seed-nightly.
DEFAULT_BASE_IMAGE = "vllm/vllm-openai-rocm:v0.34.0"
SEED_BASE_IMAGE = "vllm/vllm-openai-rocm:nightly-cb8104839c141609d99f1254459ef3a4f1bd4263"


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


# The settings :func:`check` may change or refuse (besides adding --compilation-config).
DECIDES = ("kv_cache_dtype", *(f.field for f in FUSIONS))


def sets_graph_mode(s: Any) -> bool:
    """K3_EXTRA_ARGS gives vLLM a compilation config (the user's graph mode wins)."""
    return any(a.split("=")[0] in CC_FLAGS for a in s.extra_args.split())


class BaseRefusal(ValueError):
    """A setting this base cannot run (one line)."""


def check(s: Any, sources: dict[str, str], facts: dict[str, Any] | None,
          aiter_on: bool) -> tuple[dict[str, Any], list[str], list[str]]:
    """Decide what the base allows for settings ``s`` before anything loads."""
    updates: dict[str, Any] = {}
    argv: list[str] = []
    notes: list[str] = []
    formats = value(facts or {}, "load_formats")
    if formats and s.load_format not in formats:
        raise BaseRefusal(
            f"K3_LOAD_FORMAT={s.load_format} is not a load format of this base's vLLM "
            f"{value(facts, 'vllm_version') or '?'} ({facts['load_formats']['how']}): use one "
            f"of {', '.join(formats)}; K3_BASE_CHECK=warn overrides")
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
            if sources.get("K3_KV_CACHE_DTYPE", "default") != "default":
                raise BaseRefusal(
                    f"K3_KV_CACHE_DTYPE={kv} cannot serve on this base ({what}); use "
                    "K3_KV_CACHE_DTYPE=auto, or a base with dtype-aware small-head routing "
                    f"(vLLM >= 0.28.0, e.g. the default {DEFAULT_BASE_IMAGE}); "
                    "K3_BASE_CHECK=warn overrides")
            updates["kv_cache_dtype"] = kv = "auto"
            notes.append(f"K3_KV_CACHE_DTYPE=auto (default fp8 cannot serve: {what})")
        elif any(r["fp8_query_ok"] is None for r in routes.values()):
            notes.append(f"WARNING: decode route for fp8 KV at {heads} heads/rank unknown on "
                         f"vLLM {ver}; not checked")
    notes += _fusion_checks(s, sources, facts, kv, ver, heads, updates)
    if s.mtp_k > 0 and not s.enforce_eager:
        r = route(facts, heads, kv, 1 + s.mtp_k)
        user_cc = sets_graph_mode(s)
        how = (facts.get("verify_route_fp8" if kv.startswith("fp8") else "verify_route_bf16")
               or {}).get("how", "?")
        if r.get("host_sync") and not user_cc:
            argv += ["--compilation-config", '{"cudagraph_mode":"PIECEWISE"}']
            notes.append(
                f"graphs: cudagraph_mode PIECEWISE (no full-graph capture): vLLM {ver}'s "
                f"{heads}-head MTP verify path syncs the host ({how})"
                ", which full-graph capture of a uniform verify batch cannot do; set "
                "--compilation-config in K3_EXTRA_ARGS to override")
        elif r.get("host_sync") is None and not user_cc:
            notes.append(f"WARNING: whether vLLM {ver}'s {heads}-head MTP verify path syncs the "
                         "host is unknown; vLLM's default graph mode kept")
    return updates, argv, notes


def fusion_provider(facts: dict[str, Any], name: str, overlay_mode: str) -> tuple[str | None, str]:
    """What implements fusion ``name`` here, and why: ``overlay`` (ours, wired unless
    K3_OVERLAY=off), ``upstream-hook`` (upstream ships it with the attribute the hook switches),
    ``upstream`` (shipped, not switchable here) or None."""
    f = BY_NAME[name]
    plugin_on = overlay_mode != "off"
    if value(facts, "overlay_in_tree"):
        return (("overlay", "the k3rocm overlay is vLLM's amd/mla.py") if plugin_on else
                (None, "the overlay is in the image but K3_OVERLAY=off leaves the stock MLA "
                       "wrapper (no fusion)"))
    ver = value(facts, "vllm_version") or "?"
    if name not in (value(facts, "upstream_mla_fusions") or []):
        return None, (f"vLLM {ver}'s own amd/mla.py does not ship it and the overlay is not "
                      "in this image")
    if name not in (value(facts, "upstream_mla_switchable") or []):
        return "upstream", (f"vLLM {ver}'s amd/mla.py ships it without the per-layer "
                            f"attribute {f.attr} the k3rocm hook switches")
    if not plugin_on:
        return "upstream", (f"vLLM {ver}'s amd/mla.py ships it, and K3_OVERLAY=off disables "
                            "the k3rocm plugin whose hook switches it")
    return "upstream-hook", (f"vLLM {ver}'s amd/mla.py ships it; the k3rocm hook switches "
                             f"{f.attr}")


def _fusion_checks(s: Any, sources: dict[str, str], facts: dict[str, Any], kv: str, ver: str,
                   heads: int, updates: dict[str, Any]) -> list[str]:
    """Each fusion asked on or off against what implements it here (:func:`fusion_provider`)
    and the KV cache it needs (its row's ``kv_cache``)."""
    notes: list[str] = []
    providers = {f.name: fusion_provider(facts, f.name, s.overlay) for f in FUSIONS}
    for f in FUSIONS:
        on = updates.get(f.field, getattr(s, f.field))
        provider, why = providers[f.name]
        explicit = sources.get(f.env, "default") != "default"
        if on and provider is None:
            if explicit:
                raise BaseRefusal(
                    f"{f.env}=1 cannot take effect on this base ({why}); unset it, or build "
                    "the image with K3_OVERLAY=auto (the overlay is applied where upstream "
                    "lacks a fusion) and leave K3_OVERLAY unset at run time")
            updates[f.field] = on = False
            notes.append(f"{f.env}=0 (the default 1 cannot take effect: {why})")
        elif not on and provider == "upstream" and explicit:
            raise BaseRefusal(
                f"{f.env}=0 cannot take effect on this base ({why}); unset it (upstream keeps "
                "the fusion on)" + (", or unset K3_OVERLAY so the hook can switch it"
                                    if s.overlay == "off" else
                                    ", or use a base whose amd/mla.py has that attribute "
                                    "(vLLM 0.30 ... 0.34)"))
        if f.kv_cache and on and not kv.startswith(f.kv_cache):
            if explicit:
                raise BaseRefusal(
                    f"{f.env}=1 needs an {f.kv_cache} KV cache (K3_KV_CACHE_DTYPE={kv} on "
                    f"this base, vLLM {ver}, {heads} heads/rank); set {f.env}=0, "
                    f"or K3_KV_CACHE_DTYPE={f.kv_cache} on a base that serves it")
            updates[f.field] = False
            notes.append(f"{f.env}=0 (the default 1 needs an {f.kv_cache} KV cache; "
                         f"K3_KV_CACHE_DTYPE={kv})")
    shipped = value(facts, "upstream_mla_fusions") or []
    if shipped and not value(facts, "overlay_in_tree"):
        hooked = [n for n in shipped if providers[n][0] == "upstream-hook"]
        notes.append(f"fusions: vLLM {ver}'s own amd/mla.py ({', '.join(shipped)}); "
                     + (f"the k3rocm hook switches {', '.join(hooked)} (K3_FUSE_*)" if hooked
                        else "nothing switches them here"))
    return notes


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
            if isinstance(f, dict):  # known_env's name lists: --json
                shown = "(lists: --json)" if key == "known_env" else repr(f["value"])
                print(f"{key}: {shown}  ({f['how']})")
        for k, r in routes.items():
            sync = f" host sync={r['host_sync']}" if "host_sync" in r else ""
            print(f"route {args.heads} heads {k}: {r['route']} fp8 query ok={r['fp8_query_ok']}"
                  f"{sync} ({r['why']})")
    return 0
