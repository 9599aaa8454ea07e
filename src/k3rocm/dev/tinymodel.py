"""`k3rocm tinymodel --out DIR`: the tiny random-weight MLA smoke model, offline: DeepSeek-V3
architecture with Kimi-K3's MLA shapes, 2 dense layers, a byte-level BPE tokenizer trained on
``CORPUS``; fixed seed. A stamp file with the definition hash makes reruns no-ops. Needs torch +
transformers: run it inside the serving image (``make tinymodel``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

from k3rocm.errors import UsageError, tagged_log
from k3rocm.rundir import write_json_atomic

GENERATOR_VERSION = 3
STAMP_FILE = "k3rocm-tinymodel.json"

# The definition, the chat template and the tokenizer's corpus: data (tinymodel.json)
_DATA = json.loads(resources.files("k3rocm.dev").joinpath("tinymodel.json").read_text())
DEFINITION: dict = _DATA["definition"]
DEFINITION["tokenizer"]["chat_template"] = "".join(_DATA["chat_template"])
CORPUS = "".join(line + "\n" for line in _DATA["corpus"])
DEFAULT_NAME = DEFINITION["name"]


def definition_hash(defn: dict | None = None) -> str:
    payload = {"generator": GENERATOR_VERSION, "definition": defn or DEFINITION, "corpus": CORPUS}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


_log = tagged_log("tinymodel")


def is_current(out: Path) -> bool:
    try:
        data = json.loads((out / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return data.get("definition_sha256") == definition_hash() and all(
        (out / f).is_file() for f in data.get("files", []))


def build_tokenizer(tdef: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Only printable ASCII, tab, newline in GPT-2 byte-to-unicode symbols (tab, newline, space
    # are chr(256 + byte)): every token decodes to whole text, one stream delta per token.
    ascii_alphabet = [chr(256 + b) for b in (9, 10, 32)] + [chr(b) for b in range(33, 127)]
    trainer = trainers.BpeTrainer(
        vocab_size=tdef["vocab_size"], min_frequency=tdef["min_frequency"],
        special_tokens=list(tdef["special_tokens"]), initial_alphabet=ascii_alphabet,
        show_progress=False)
    lines = [ln for ln in CORPUS.splitlines() if ln.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def generate(out: Path, force: bool = False) -> Path:
    out = out.resolve()
    if not force and is_current(out):
        _log(f"{out} already holds definition {definition_hash()[:12]}; nothing to do")
        return out
    if out.exists() and any(out.iterdir()) and not (out / STAMP_FILE).exists():
        raise UsageError(f"--out {out} is a non-empty directory that was not made by "
                         "`k3rocm tinymodel`; choose an empty or new directory")
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, DeepseekV3Config, PreTrainedTokenizerFast
    except ImportError as exc:
        raise UsageError(f"tinymodel needs torch and transformers ({exc}); run it inside the "
                         "serving image (see docs/standin.md)", exit_code=1) from exc

    t0 = time.monotonic()
    defn = DEFINITION
    tdef = defn["tokenizer"]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok = build_tokenizer(tdef)
        vocab_size = tok.get_vocab_size()
        ids = {t: tok.token_to_id(t) for t in tdef["special_tokens"]}
        # Written by hand so transformers 4.x and 5.x both load them with AutoTokenizer.
        tok.save(str(tmp / "tokenizer.json"))
        specials = {k: tdef[k] for k in ("bos_token", "eos_token", "pad_token")}
        extra = [t for t in tdef["special_tokens"] if t not in specials.values()]
        added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False,
                               "rstrip": False, "single_word": False, "special": True}
                 for t in tdef["special_tokens"]}
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast", **specials,
            "additional_special_tokens": extra, "added_tokens_decoder": added,
            "model_max_length": tdef["model_max_length"], "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False,
            "chat_template": tdef["chat_template"]}
        write_json_atomic(tmp / "tokenizer_config.json", tok_cfg)
        write_json_atomic(tmp / "special_tokens_map.json",
                    {**specials, "additional_special_tokens": extra})
        (tmp / "chat_template.jinja").write_text(tdef["chat_template"])
        fast = PreTrainedTokenizerFast.from_pretrained(str(tmp))
        if (fast.eos_token_id != ids[tdef["eos_token"]]
                or fast.bos_token_id != ids[tdef["bos_token"]]):
            raise RuntimeError("tokenizer round trip lost the bos/eos tokens")
        fast.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                 add_generation_prompt=True)
        _log(f"tokenizer: byte-level BPE, {vocab_size} tokens")

        cfg = {k: v for k, v in defn["config"].items()
               if k not in ("architectures", "model_type", "rope_theta")}
        config = DeepseekV3Config(
            vocab_size=vocab_size, bos_token_id=ids[tdef["bos_token"]],
            eos_token_id=ids[tdef["eos_token"]], pad_token_id=ids[tdef["pad_token"]],
            rope_parameters={"rope_type": "default",
                             "rope_theta": defn["config"]["rope_theta"]}, **cfg)
        config.architectures = list(defn["config"]["architectures"])
        torch.manual_seed(defn["seed"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(getattr(torch, defn["dtype"]))
        model.eval()
        nparams = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, safe_serialization=True)
        model.generation_config.save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        stamp = {"definition_sha256": definition_hash(), "generator_version": GENERATOR_VERSION,
                 "name": defn["name"], "parameters": nparams, "vocab_size": vocab_size,
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "files": files}
        write_json_atomic(tmp / STAMP_FILE, stamp)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        os.chmod(out, 0o755)
        for f in out.iterdir():
            os.chmod(f, 0o644)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"wrote {out} ({nparams / 1e6:.1f} M parameters, vocab {vocab_size}) in "
         f"{time.monotonic() - t0:.1f} s")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Generate the tiny random-weight MLA smoke model (DeepSeek-V3 "
                          "architecture) and its tokenizer, offline and deterministically.")
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory (e.g. /models/k3-smoke); left alone when it "
                        "already holds the same definition")
    parser.add_argument("--force", action="store_true", help="regenerate even if up to date")
    parser.add_argument("--print-hash", action="store_true",
                        help="print the definition hash and exit (no torch needed)")


def run(args: argparse.Namespace) -> int:
    if args.print_hash:
        print(definition_hash())
        return 0
    generate(args.out, force=args.force)
    return 0
