"""``k3rocm selftest model``: a small Kimi-K3-shaped checkpoint cut from the operator's own one.

Reads only config.json, the safetensors index and the headers of the shards it keeps tensors
from; writes the real names, dtypes, shapes and quantization layout with random values valid
for each dtype (integer tensors up to 1 MB copied). Keeps the decoder layers in order (default:
the shortest prefix with an MLA, a KDA and a MoE layer), the MTP layer(s) unless --no-mtp, the
first --experts routed experts (router rows cut to match; a fused-expert layout it cannot cut
consistently is refused), everything outside the layers and every other top-level file. The new
config.json records the cut under ``k3rocm_slice``. Layer kinds as vLLM 0.27.1 reads them
(vllm@0.27.1:vllm/transformers_utils/configs/kimi_linear.py ``is_kda_layer``; MoE when
i >= first_k_dense_replace and i % moe_layer_freq == 0). OUT is written atomically and never
overwritten. Exit codes: 0 written, 2 bad input (nothing written), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm import __version__
from k3rocm.errors import UsageError, tagged_log
from k3rocm.hashing import sha256_file as _sha256
from k3rocm.options import DeploymentFlags

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
SLICE_KEY = "k3rocm_slice"
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit for the JSON header
COPY_LIMIT = 1024 * 1024  # integer tensors up to this size are copied, not invented
CHUNK = 1 << 24  # elements generated per step (bounded memory for 2 GB embeddings)

# bits per element (safetensors/src/tensor.rs `Dtype`; F4/F6 packed, shapes count elements)
DTYPES = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
          "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
          "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
          "I64": 64, "U64": 64, "F64": 64}
# OCP MX element formats: every bit pattern is a finite number (no inf/NaN encodings)
PACKED = {"F4", "F6_E2M3", "F6_E3M2"}
INTEGER = {"BOOL", "I8", "I16", "U16", "I32", "U32", "I64", "U64"}
FLOAT_CODES = {"BF16": "<u2", "F16": "<f2", "F64": "<f8"}  # numpy codes; others: F32

# <prefix>layers.<i>.<rest>: multimodal (language_model.[model.]) or text-only (model.) prefix
LAYER_RE = re.compile(r"^(language_model\.(?:model\.)?|model\.)layers\.(\d+)\.(.+)$")
EXPERT_RE = re.compile(r"(?:^|\.)experts\.(\d+)\.(.+)$")  # not shared_experts.
ROUTER_RE = re.compile(r"(?:^|\.)gate\.(?:weight|e_score_correction_bias)$")
SHARED = "shared_experts."
MOE_BLOCKS = ("block_sparse_moe.", "mlp.")  # a MoE layer's block (Kimi-K3: block_sparse_moe)

_log = tagged_log("selftest-model")


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str = ""
    start: int = 0  # absolute byte offset of the data in the source shard

    @property
    def nbytes(self) -> int:
        return (math.prod(self.shape) * DTYPES[self.dtype] + 7) // 8


def read_layout(path: Path) -> tuple[dict[str, Tensor], int]:
    """The tensors a safetensors file declares and where its data starts (8 + N): from its
    header only. Bad headers raise UsageError naming the file."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise UsageError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(raw, "little")
            if not 2 <= n <= MAX_HEADER:
                raise UsageError(f"{path}: not a safetensors file (header length {n})")
            text = fh.read(n)
    except OSError as exc:
        raise UsageError(f"cannot read shard {path}: {exc.strerror or exc}") from None
    if len(text) != n:
        raise UsageError(f"{path}: truncated safetensors header ({8 + len(text)} bytes, the "
                         f"header alone needs {8 + n})")
    try:
        header = json.loads(text)
    except ValueError:
        raise UsageError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise UsageError(f"{path}: safetensors header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path}: bad header entry for {name!r}") from None
        if dtype not in DTYPES:
            raise UsageError(f"{path}: tensor {name!r} has dtype {dtype}, which this slicer does "
                             f"not know (known: {', '.join(DTYPES)})")
        t = Tensor(name, dtype, shape, path.name, 8 + n + begin)
        if end - begin != t.nbytes:
            raise UsageError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape "
                             f"{list(shape)} x {dtype} needs {t.nbytes}")
        out[name] = t
    return out, 8 + n


# --- the config: which layers are what ---------------------------------------------------------

def text_config(cfg: dict) -> dict:
    """The kimi_linear part of a config: ``text_config`` of a kimi_k3 config, else the config."""
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def is_kda(tc: dict, i: int) -> bool:
    lac = tc.get("linear_attn_config") or {}
    return (i + 1) in (lac.get("kda_layers") or [])


def is_moe(tc: dict, i: int) -> bool:
    return (tc.get("num_experts") is not None and i >= int(tc.get("first_k_dense_replace", 0))
            and i % int(tc.get("moe_layer_freq", 1)) == 0)


def kind(tc: dict, i: int) -> str:
    return ("KDA" if is_kda(tc, i) else "MLA") + ("+MoE" if is_moe(tc, i) else "+dense")


def parse_layers(spec: str | None, tc: dict) -> list[int]:
    """``--layers``; by default the shortest prefix of layers with an MLA layer, a KDA layer
    and (MoE models) a MoE one."""
    n = int(tc["num_hidden_layers"])
    if spec is None:
        for j in range(n):
            kept = range(j + 1)
            if (any(is_kda(tc, i) for i in kept) and any(not is_kda(tc, i) for i in kept)
                    and (tc.get("num_experts") is None or any(is_moe(tc, i) for i in kept))):
                return list(kept)
        raise UsageError("the source config has no layer mix to keep (it needs at least one MLA "
                         "and one KDA layer: text_config.linear_attn_config.kda_layers)")
    try:
        layers = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--layers: {spec!r} is not a comma-separated list of layer "
                         "numbers (0-based)") from None
    bad = [i for i in layers if not 0 <= i < n]
    if not layers or bad:
        raise UsageError(f"--layers: {bad or spec!r} not in 0..{n - 1}")
    return layers


@dataclass
class Plan:
    layer_map: dict[int, int]  # old decoder/MTP layer index -> new
    experts: int | None  # routed experts kept per MoE layer (None: no MoE)
    config: dict  # the new config.json; what was cut is its SLICE_KEY
    source_experts: int | None = None  # the source's num_experts


def plan(cfg: dict, layers: list[int], experts: int | None, keep_mtp: bool) -> Plan:
    """Decide the slice and write its config. Refuses (exit 2) a cut vLLM would read as other
    layer kinds than the source's."""
    new_cfg = json.loads(json.dumps(cfg))
    tc, ntc = text_config(cfg), text_config(new_cfg)
    n_old = int(tc["num_hidden_layers"])
    if not any(is_kda(tc, i) for i in layers) or all(is_kda(tc, i) for i in layers):
        kinds = ", ".join(f"{i}:{kind(tc, i)}" for i in layers)
        raise UsageError(f"--layers must keep at least one MLA and one KDA layer; got {kinds}")
    n_mtp = int(tc.get("num_nextn_predict_layers") or 0) if keep_mtp else 0
    layer_map = {old: new for new, old in enumerate(layers)}
    layer_map.update({n_old + k: len(layers) + k for k in range(n_mtp)})

    ntc["num_hidden_layers"] = len(layers)
    ntc["num_nextn_predict_layers"] = n_mtp
    lac = ntc.get("linear_attn_config")
    if isinstance(lac, dict):
        lac["kda_layers"] = [layer_map[i] + 1 for i in layers if is_kda(tc, i)]
        lac["full_attn_layers"] = [layer_map[i] + 1 for i in layers if not is_kda(tc, i)]
    record: dict[str, Any] = {"layers": [{"source": i, "slice": layer_map[i],
                                          "kind": kind(tc, i)} for i in layers]}
    new_cfg[SLICE_KEY] = record
    if n_mtp:
        record["mtp_layers"] = [{"source": n_old + k, "slice": len(layers) + k}
                                for k in range(n_mtp)]
    record["source_num_hidden_layers"] = n_old
    record["source_num_nextn_predict_layers"] = int(tc.get("num_nextn_predict_layers") or 0)

    n_exp = tc.get("num_experts")
    if n_exp is not None:
        n_exp, top_k = int(n_exp), int(tc.get("num_experts_per_token") or 1)
        k = experts if experts is not None else min(n_exp, 2 * top_k)
        if not top_k <= k <= n_exp:
            raise UsageError(f"--experts {k}: must be between num_experts_per_token ({top_k}) "
                             f"and num_experts ({n_exp})")
        experts = k
        ntc["num_experts"] = k
        groups = int(tc.get("num_expert_group") or 1)
        if groups > 1 and k % groups:
            # grouped top-k needs num_experts divisible by the groups: route in one group
            ntc["num_expert_group"], ntc["topk_group"] = 1, 1
            record["source_num_expert_group"] = groups
            record["source_topk_group"] = tc.get("topk_group")
        dense = [i for i in layers if not is_moe(tc, i)]
        ntc["first_k_dense_replace"] = len(dense)
        record["experts"] = {"kept": list(range(k)), "source_num_experts": n_exp}
    else:
        experts = None
    for old, new in layer_map.items():
        if is_moe(tc, old) != is_moe(ntc, new):
            raise UsageError(f"layer {old} is {'MoE' if is_moe(tc, old) else 'dense'} in the "
                             f"source but would be {'MoE' if is_moe(ntc, new) else 'dense'} as "
                             f"layer {new} of the slice; keep the dense layers first "
                             f"(first_k_dense_replace={tc.get('first_k_dense_replace', 0)}, "
                             f"moe_layer_freq={tc.get('moe_layer_freq', 1)})")
    for c in (new_cfg, ntc):
        q = c.get("quantization_config")
        if isinstance(q, dict) and isinstance(q.get("ignore"), list):
            q["ignore"] = [m for m in (_rename_module(x, layer_map) for x in q["ignore"])
                           if m is not None]
    return Plan(layer_map, experts, new_cfg, None if n_exp is None else int(n_exp))


def _rename_module(name: str, layer_map: dict[int, int]) -> str | None:
    """A module name (quantization ``ignore`` entry) renumbered; None when its layer is cut."""
    m = re.search(r"(?:^|\.)layers\.(\d+)(?=\.|$)", name)
    if name.startswith("re:") or m is None:
        return name
    new = layer_map.get(int(m.group(1)))
    return None if new is None else name[:m.start(1)] + str(new) + name[m.end(1):]


def _routed(rest: str) -> bool:
    """A tensor of the routed-expert part of a MoE block (not a shared expert)."""
    return ("." + SHARED) not in "." + rest


def slice_tensor(t: Tensor, p: Plan, known_shape: bool = True) -> Tensor | None:
    """The slice's tensor for source tensor ``t`` (new name and shape), or None when cut.
    Refuses (exit 2) a tensor it cannot cut consistently with the config it writes (by name
    alone when not ``known_shape``: before the headers are read)."""
    m = LAYER_RE.match(t.name)
    if m is None:
        return t
    new_layer = p.layer_map.get(int(m.group(2)))
    if new_layer is None:
        return None
    rest, shape = m.group(3), t.shape
    if p.experts is not None and is_moe(text_config(p.config), new_layer) and _routed(rest):
        k, n = p.experts, p.source_experts
        e = EXPERT_RE.search(rest)
        if e is not None:
            if n is not None and int(e.group(1)) >= n:
                raise UsageError(f"{t.name}: expert {e.group(1)}, but the source config has "
                                 f"num_experts {n}: the checkpoint and its config disagree")
            if int(e.group(1)) >= k:
                return None
        elif ROUTER_RE.search(rest):
            if known_shape and shape[:1] != (n,):
                raise UsageError(f"router {t.name} has shape {list(shape)}, not {n} rows "
                                 f"(num_experts): cannot cut it to {k} experts")
            shape = (k, *shape[1:])  # router rows: one per expert
        elif k < (n or 0) and (".experts." in "." + rest or known_shape and shape[:1] == (n,)
                               and rest.startswith(MOE_BLOCKS)):
            raise UsageError(
                f"{t.name} {list(shape) if known_shape else ''} holds the experts fused (no "
                f"per-expert name experts.<e>.): the slicer cuts experts only by name, and this "
                f"tensor would keep all {n} while the config says {k}; use --experts {n} to "
                f"keep them all, or a checkpoint with per-expert tensors")
    return Tensor(f"{m.group(1)}layers.{new_layer}.{rest}", t.dtype, shape, t.shard, t.start)


def check_experts(names: list[str], p: Plan) -> None:
    """Every kept MoE layer has exactly experts 0..k-1 (``k`` = the written num_experts), each
    with the same tensors; refuses (exit 2) otherwise. ``names``: the slice's tensor names."""
    if p.experts is None:
        return
    ntc = text_config(p.config)
    experts: dict[int, dict[int, set[str]]] = {}
    for name in names:
        m = LAYER_RE.match(name)
        e = EXPERT_RE.search(m.group(3)) if m and _routed(m.group(3)) else None
        if e is not None:
            experts.setdefault(int(m.group(2)), {}).setdefault(int(e.group(1)), set()).add(
                e.group(2))
    source = {new: old for old, new in p.layer_map.items()}
    for new in sorted(source):
        got = experts.get(new, {})
        if not is_moe(ntc, new) or (not got and p.experts == p.source_experts):
            continue  # a dense layer, or a fused layout kept whole
        if sorted(got) != list(range(p.experts)):
            have = f"{min(got)}..{max(got)} ({len(got)})" if got else "none"
            raise UsageError(f"source layer {source[new]}: the slice would have experts {have} "
                             f"named experts.<e>., the config says 0..{p.experts - 1}")
        kinds = {frozenset(v) for v in got.values()}
        if len(kinds) > 1:
            raise UsageError(f"source layer {source[new]}: its experts do not all have the same "
                             f"tensors ({' vs '.join(sorted(','.join(sorted(x)) for x in kinds))})")


# --- values ----------------------------------------------------------------------------------

def _values(t: Tensor, src: Tensor, src_dir: Path, seed: int) -> Any:
    """Yield the bytes of ``t`` in chunks: random values valid for its dtype and role."""
    import numpy as np

    numel = math.prod(t.shape)
    if t.dtype in INTEGER:
        if t.nbytes > COPY_LIMIT or t.shape != src.shape:
            yield bytes(t.nbytes)
            return
        with open(src_dir / src.shard, "rb") as fh:
            fh.seek(src.start)
            data = fh.read(t.nbytes)
        if len(data) != t.nbytes:
            raise UsageError(f"{src_dir / src.shard}: shorter than its header says "
                             f"(tensor {src.name})")
        yield data
        return
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    if t.dtype in PACKED:
        for start in range(0, t.nbytes, CHUNK):
            yield rng.bytes(min(CHUNK, t.nbytes - start))
        return
    is_scale = "scale" in t.name.rsplit(".", 1)[-1]
    is_norm = t.name.endswith(("norm.weight", "layernorm.weight"))
    for start in range(0, numel, CHUNK):
        n = min(CHUNK, numel - start)
        if t.dtype == "F8_E8M0" or (t.dtype == "U8" and is_scale):
            # E8M0: 2**(b - 127); 255 is NaN. 2**-4 .. 2**0
            yield rng.integers(123, 128, n, dtype=np.uint8).tobytes()
        elif t.dtype == "U8":
            yield rng.integers(0, 256, n, dtype=np.uint8).tobytes()  # 2 e2m1 nibbles
        elif t.dtype in ("F8_E4M3", "F8_E5M2"):
            # clear the exponent's top bit: no inf/NaN code (|x| < 2 in e4m3fn, < 2**16 in e5m2)
            yield (rng.integers(0, 256, n, dtype=np.uint8) & 0xBF).tobytes()
        elif t.dtype == "BF16" and not (is_norm or is_scale):
            # sign and 7 mantissa bits random, exponent 2**-7 .. 2**-4: |x| in [0.0078, 0.0625)
            r = np.frombuffer(rng.bytes(2 * n), "<u2")
            yield ((r & 0x807F) | ((0x78 + ((r >> 7) & 3)) << 7)).astype("<u2").tobytes()
        else:
            if is_norm:
                x = np.ones(n, np.float32)
            elif is_scale:
                x = rng.uniform(0.5, 1.0, n).astype(np.float32)
            else:
                x = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
            if t.dtype == "BF16":
                x = x.view(np.uint32) >> 16  # bf16: the top half of the f32 bits
            yield x.astype(FLOAT_CODES.get(t.dtype, "<f4")).tobytes()


def write_shard(path: Path, tensors: list[tuple[Tensor, Tensor]], src_dir: Path,
                seed: int) -> int:
    """Write one safetensors file (header, then each tensor's bytes in chunks)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "k3rocm selftest"}}
    offset = 0
    for t, _ in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    with open(path, "wb") as fh:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for t, src in tensors:
            written = 0
            for chunk in _values(t, src, src_dir, seed):
                fh.write(chunk)
                written += len(chunk)
            assert written == t.nbytes, (t.name, written, t.nbytes)
        fh.flush()
        os.fsync(fh.fileno())
    return 8 + len(text) + offset


# --- the command -----------------------------------------------------------------------------

def _load_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: missing ({what})") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not readable JSON ({what}): {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a JSON object ({what})")
    return data


def make_slice(src: Path, out: Path, layers: str | None = None, experts: int | None = None,
               keep_mtp: bool = True, seed: int = 0, shard_gb: float = 5.0) -> None:
    """Write the slice of checkpoint ``src`` to ``out``; print what was written."""
    t0 = time.monotonic()
    src, out = src.expanduser().resolve(), out.expanduser().absolute()
    if not src.is_dir():
        raise UsageError(f"source checkpoint {src}: not a directory")
    if out.exists():
        raise UsageError(f"output {out} exists; choose a new directory (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UsageError(f"output's parent directory {out.parent} does not exist")
    cfg = _load_json(src / CONFIG, "the checkpoint's config")
    tc = text_config(cfg)
    for key in ("num_hidden_layers", "linear_attn_config"):
        if key not in tc:
            raise UsageError(f"{src / CONFIG}: no {key} (text_config); is this a Kimi-K3 "
                             "(kimi_k3 / kimi_linear) checkpoint?")
    index = _load_json(src / INDEX, "the safetensors index")
    wmap = index.get("weight_map")
    if not isinstance(wmap, dict) or not wmap:
        raise UsageError(f"{src / INDEX}: no weight_map")
    p = plan(cfg, parse_layers(layers, tc), experts, keep_mtp)

    kept = [n for n in sorted(wmap) if slice_tensor(Tensor(n, "U8", ()), p, False) is not None]
    shards = sorted({wmap[n] for n in kept})
    headers: dict[str, Tensor] = {}
    for s in shards:
        if not isinstance(s, str) or "/" in s or not (src / s).is_file():
            raise UsageError(f"{src / INDEX}: weight_map names shard {s!r}, which is not there")
        headers.update({k: v for k, v in read_layout(src / s)[0].items() if wmap.get(k) == s})
    for name in kept:
        if name not in headers:
            raise UsageError(f"{src / wmap[name]}: has no tensor {name!r} (the index says so)")
    pairs = [(slice_tensor(headers[name], p), headers[name]) for name in kept]
    check_experts([t.name for t, _ in pairs], p)
    have = {int(m.group(2)) for t, _ in pairs if (m := LAYER_RE.match(t.name))}
    for old, new in p.layer_map.items():  # in the order of the new layers
        if new not in have:
            raise UsageError(f"the index has no tensors for source layer {old}")
    total = sum(t.nbytes for t, _ in pairs)
    _log(f"{len(pairs)} of {len(wmap)} tensors kept ({len(shards)} shard headers read), "
         f"{total / 1e9:.2f} GB to write")
    free = shutil.disk_usage(out.parent).free
    if free < total * 1.02 + (1 << 20):
        raise UsageError(f"{out.parent}: {free / 1e9:.1f} GB free, the slice needs "
                         f"{total / 1e9:.1f} GB")

    # shards of at most shard_gb (a bigger tensor gets a shard of its own)
    limit, groups, size = int(shard_gb * 1e9), [[]], 0
    for pair in sorted(pairs, key=lambda q: _order(q[0].name)):
        if groups[-1] and size + pair[0].nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(pair)
        size += pair[0].nbytes

    record = p.config[SLICE_KEY]
    record.update({
        "source": str(src), "source_config_sha256": _sha256(src / CONFIG),
        "source_index_sha256": _sha256(src / INDEX), "tensors": len(pairs),
        "source_tensors": len(wmap), "bytes": total, "values": f"random (seed {seed})",
        "tool": f"k3rocm {__version__}"})
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    tmp.mkdir()
    try:
        new_map, written = {}, 0
        for k, group in enumerate(groups, 1):
            fname = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            written += write_shard(tmp / fname, group, src, seed)
            new_map.update({t.name: fname for t, _ in group})
            _log(f"shard {k}/{len(groups)}: {len(group)} tensors, "
                 f"{written / 1e9:.2f} of {total / 1e9:.2f} GB, {time.monotonic() - t0:.1f} s")
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": new_map}, indent=2) + "\n")
        (tmp / CONFIG).write_text(json.dumps(p.config, indent=2) + "\n")
        copied = []
        for f in sorted(src.iterdir()):
            if (f.is_file() and f.name not in (CONFIG, INDEX) and not f.name.startswith(".")
                    and not f.name.endswith(".safetensors")):
                shutil.copy2(f, tmp / f.name)
                copied.append(f.name)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    layers = ", ".join(f"{x['source']}->{x['slice']} {x['kind']}" for x in record["layers"])
    mtp = ", ".join(f"{x['source']}->{x['slice']}" for x in record.get("mtp_layers", []))
    print(f"wrote {out}: {len(pairs)} of {len(wmap)} tensors, {written / 1e9:.2f} GB in "
          f"{len(groups)} shard(s), {time.monotonic() - t0:.2f} s")
    print(f"  layers: {layers}; MTP: {mtp or 'none'}; experts per MoE layer: {p.experts}")
    print(f"  files copied: {', '.join(copied) or 'none'}")


def _order(name: str) -> tuple:
    """Natural order (layer 2 before layer 10), so a layer's tensors share shards."""
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name))


DEFAULT_OUT = "Kimi-K3-selftest"  # beside the checkpoint, under K3_MODELS_DIR


def add_arguments(m: argparse.ArgumentParser) -> None:
    """``k3rocm selftest model``'s flags."""
    m.add_argument("source", type=Path, nargs="?", default=None,
                   help="the Kimi-K3 checkpoint directory (default: the deployment's K3_MODEL "
                   "on this host)")
    m.add_argument("out", type=Path, nargs="?", default=None,
                   help=f"new directory for the slice, must not exist (default: "
                   f"<K3_MODELS_DIR>/{DEFAULT_OUT})")
    m.add_argument("--layers", default=None,
                   help="source decoder layers to keep, 0-based, comma-separated (default: the "
                   "shortest prefix with an MLA, a KDA and a MoE layer)")
    m.add_argument("--experts", type=int, default=None,
                   help="routed experts kept per MoE layer (default: 2 x num_experts_per_token)")
    m.add_argument("--no-mtp", action="store_true", help="drop the MTP layer(s)")
    m.add_argument("--seed", type=int, default=0, help="seed of the random values (default 0)")
    m.add_argument("--shard-gb", type=float, default=5.0,
                   help="largest output shard in GB (default 5)")
    DeploymentFlags.add_arguments(m)


def run(args: argparse.Namespace) -> int:
    if args.shard_gb <= 0:
        raise UsageError("--shard-gb must be > 0")
    src, out = args.source, args.out
    if src is None or out is None:
        dep = args.deployment
        if src is None and dep.model_host_dir is None:
            raise UsageError(f"K3_MODEL={dep.model} is not a directory on this host: name the "
                             "checkpoint directory (k3rocm selftest model SRC OUT)")
        src = src or dep.model_host_dir
        out = out or dep.models_dir / DEFAULT_OUT
    make_slice(src, out, args.layers, args.experts, not args.no_mtp, args.seed, args.shard_gb)
    return 0
