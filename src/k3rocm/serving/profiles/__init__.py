"""Serving profiles as data: one YAML file per profile in this directory (package data).

A profile gives defaults for ``K3_*`` settings and the vendor environment rendered for vLLM.
The file shape follows the vLLM recipes' model YAML (vllm-project/recipes,
``models/moonshotai/Kimi-K3.yaml`` at commit 2c22f3fe14583810bfc6c3ccd281cdeff64e508e, whose
schema is documented in that repository's ``.claude/skills/add-recipe/SKILL.md``): ``meta``,
``model.base_args`` / ``model.base_env``, ``features`` (each with ``args``), and
``hardware_overrides.<hardware>.extra_args`` / ``extra_env``. One deliberate difference: where a
recipe lists raw ``vllm serve`` flags, a profile lists our settings (``K3_TP: 8``), because
:mod:`k3rocm.serving.config` is the one function that turns settings into flags (validated, with
sources). docs/profiles.md compares our MI355X profile with the recipe's AMD block.

Resolution order (later wins for a key; an env key keeps its first position):
``meta.extends`` (the parent profile, resolved the same way), ``model.base_args``/``base_env``,
every entry of ``features`` in file order, then ``hardware_overrides[meta.hardware]``.
Every feature listed is on in that profile.

:func:`get` returns ``{"settings": {field: value}, "env": {NAME: value}, "meta": {...}}``;
:func:`names` lists the profiles present (``K3_PROFILE`` accepts exactly these).
Any problem in a file is a :class:`~k3rocm.errors.UsageError` naming the file and the key.
``k3rocm profiles`` (:func:`add_arguments`, :func:`run`) lists them, shows one, checks files.
"""

from __future__ import annotations

import argparse
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3rocm.errors import UsageError
from k3rocm.serving.settings import FIELD_BY_ENV, PREFIX, VENDOR_PREFIXES, Settings, invalid

SUFFIX = ".yaml"
HARDWARE = ("amd", "cpu")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")

# Allowed keys, per section (anything else is an error naming the key).
TOP_KEYS = ("meta", "model", "features", "hardware_overrides")
META_KEYS = ("name", "description", "hardware", "extends", "source")
MODEL_KEYS = ("base_args", "base_env")
FEATURE_KEYS = ("description", "args", "env", "source")
OVERRIDE_KEYS = ("extra_args", "extra_env", "source")


def profile_dir() -> Path:
    """Where the shipped profiles are (inside the installed package)."""
    return Path(str(resources.files(__name__)))


def names(directory: Path | None = None) -> list[str]:
    """The profiles present (file stems), sorted."""
    d = directory or profile_dir()
    return sorted(p.name[: -len(SUFFIX)] for p in d.iterdir()
                  if p.name.endswith(SUFFIX) and not p.name.startswith("."))


def get(name: str, directory: Path | None = None) -> dict[str, Any]:
    """The resolved profile ``name`` (validated). Unknown name: UsageError listing the names.
    ``directory``: profiles elsewhere than the package (tests, a new profile being written)."""
    d = directory or profile_dir()
    if name not in names(d):
        raise UsageError(f"K3_PROFILE={name!r} is not a profile: use one of "
                         f"{', '.join(names(d))}")
    return _resolve(d, name, ())  # read each time (~2 ms): an edited file counts at once


def _resolve(d: Path, name: str, chain: tuple[str, ...]) -> dict[str, Any]:
    path = d / f"{name}{SUFFIX}"
    doc = _read(path)
    where = str(path)
    _block(doc, where, "", TOP_KEYS)
    meta = _block(doc.get("meta"), where, "meta", META_KEYS, required=True)
    for key in ("name", "description", "hardware"):
        if not isinstance(meta.get(key), str) or not meta[key].strip():
            raise UsageError(f"{where}: meta.{key} is missing or not text")
    if meta["name"] != name:
        raise UsageError(f"{where}: meta.name {meta['name']!r} must equal the file name "
                         f"({name!r})")
    hw = meta["hardware"]
    if hw not in HARDWARE:
        raise UsageError(f"{where}: meta.hardware {hw!r} is not known: use one of "
                         f"{', '.join(HARDWARE)}")
    settings: dict[str, Any] = {}
    env: dict[str, str] = {}
    parent = meta.get("extends")
    if parent is not None:
        if not isinstance(parent, str) or parent not in names(d):
            raise UsageError(f"{where}: meta.extends {parent!r} is not a profile: use one of "
                             f"{', '.join(names(d))}")
        if parent in chain or parent == name:
            raise UsageError(f"{where}: meta.extends {parent!r} makes a cycle "
                             f"({' -> '.join((*chain, name, parent))})")
        base = _resolve(d, parent, (*chain, name))
        if base["meta"]["hardware"] != hw:
            raise UsageError(f"{where}: meta.hardware {hw!r} differs from the extended "
                             f"profile {parent!r} ({base['meta']['hardware']!r})")
        settings.update(base["settings"])
        env.update(base["env"])
    # (where in the file, the block, its settings key, its env key), in the order they apply
    blocks = [("model", _block(doc.get("model"), where, "model", MODEL_KEYS), "base_args",
               "base_env")]
    for fname, feat in _block(doc.get("features"), where, "features").items():
        key = f"features.{fname}"
        feat = _block(feat, where, key, FEATURE_KEYS, required=True)
        if not isinstance(feat.get("description"), str):
            raise UsageError(f"{where}: {key}.description is missing or not text")
        blocks.append((key, feat, "args", "env"))
    for hname, block in _block(doc.get("hardware_overrides"), where,
                               "hardware_overrides").items():
        key = f"hardware_overrides.{hname}"
        if hname != hw:
            raise UsageError(f"{where}: {key} does not apply to this profile (meta.hardware "
                             f"is {hw!r}): one profile per hardware, rename the block to {hw}")
        blocks.append((key, _block(block, where, key, OVERRIDE_KEYS, required=True),
                       "extra_args", "extra_env"))
    for key, block, args, env_key in blocks:
        settings.update(_args(block.get(args), where, f"{key}.{args}"))
        env.update(_env(block.get(env_key), where, f"{key}.{env_key}"))
    try:  # each value as the Settings model would take it (other fields at their defaults)
        Settings(**settings)
    except ValidationError as exc:
        raise UsageError(f"{where}: {invalid(exc, settings)}") from None
    return {"settings": settings, "env": env,
            "meta": {"name": name, "description": meta["description"], "hardware": hw,
                     "extends": parent, "path": where}}


def _read(path: Path) -> dict[str, Any]:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise UsageError(f"{path}:{line}: {problem}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: expected a mapping with {', '.join(TOP_KEYS)}")
    return doc


def _block(value: Any, where: str, key: str, allowed: tuple[str, ...] | None = None,
           required: bool = False) -> dict[str, Any]:
    """The mapping at ``key`` ({} when absent), holding only ``allowed`` keys (if given)."""
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        what = f" with {'/'.join(allowed)}" if allowed else ""
        raise UsageError(f"{where}: {key} is missing" if value is None else
                         f"{where}: {key} must be a mapping{what}")
    prefix = key + "." if key else ""
    for k in value if allowed else ():
        if k not in allowed:
            raise UsageError(f"{where}: {prefix}{k} is not a known key: use "
                             f"{', '.join(prefix + a for a in allowed)}")
    return value


def _args(block: Any, where: str, key: str) -> dict[str, Any]:
    """``K3_NAME: value`` -> ``{field: value}``; unknown settings are errors."""
    out: dict[str, Any] = {}
    for env_name, value in _block(block, where, key).items():
        field = FIELD_BY_ENV.get(env_name)
        if field is None or field == "profile":
            raise UsageError(f"{where}: {key}.{env_name} is not a setting a profile can set; "
                             "valid names are listed by `k3rocm config --list`")
        if isinstance(value, (dict, list)):
            raise UsageError(f"{where}: {key}.{env_name} must be a single value")
        out[field] = value
    return out


def _env(block: Any, where: str, key: str) -> dict[str, str]:
    for name, value in _block(block, where, key).items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise UsageError(f"{where}: {key}.{name} is not an environment variable name")
        if name.startswith(PREFIX):
            raise UsageError(f"{where}: {key}.{name}: K3_* settings go under args/extra_args")
        if not name.startswith(VENDOR_PREFIXES):
            raise UsageError(f"{where}: {key}.{name} is not a vendor variable the renderer "
                             f"passes (prefixes: {', '.join(VENDOR_PREFIXES)})")
        if not isinstance(value, str):
            raise UsageError(f"{where}: {key}.{name} must be a quoted string (got {value!r})")
    return dict(block or {})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="show this profile: the settings and environment it "
                   "gives (after `extends`), as JSON")
    p.add_argument("--dir", type=Path, default=None,
                   help="read profiles from DIR instead of the installed ones (e.g. to validate "
                   "a new profile file before adding it to src/k3rocm/serving/profiles/)")
    p.add_argument("--check", action="store_true",
                   help="validate every profile file; exit 2 with the file and key on a problem")


def run(args: argparse.Namespace) -> int:
    d = args.dir
    if d is not None and not d.is_dir():
        raise UsageError(f"--dir {d}: not a directory")
    if args.name:
        print(json.dumps(get(args.name, d), indent=2))
        return 0
    for name in names(d):
        meta = get(name, d)["meta"]  # validates
        if not args.check:
            print(f"{name:<18} {meta['hardware']:<4} {meta['description']}")
    if args.check:
        print(f"{len(names(d))} profiles valid: {', '.join(names(d))}")
    return 0
