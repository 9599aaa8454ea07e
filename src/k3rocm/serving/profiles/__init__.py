"""Serving profiles: one YAML file each in this directory, shaped like a vllm-project/recipes model
YAML (``meta``, ``model.base_args``/``base_env``, ``features``, ``hardware_overrides``) but
listing K3_* settings instead of raw flags (docs/profiles.md). Resolution, later wins:
``meta.extends``, the model block, each feature in file order, the hardware override. A file's
shape is the pydantic model :class:`Profile`; a problem is a one-line UsageError.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from k3rocm.errors import UsageError, one_line
from k3rocm.serving.settings import FIELD_BY_ENV, PREFIX, VENDOR_PREFIXES, Settings, invalid

SUFFIX = ".yaml"
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


# --- the file's shape: a pydantic model; a rule's text follows the key it names ---------------

def _must(ok: Callable[[Any], Any], problem: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(problem.format(value=value))
        return value
    return AfterValidator(check)


Args = dict[Annotated[str, _must(lambda k: FIELD_BY_ENV.get(k) not in (None, "profile"),
                                 "is not a setting a profile can set; valid names are listed "
                                 "by `k3rocm config --list`")],
            Annotated[Any, _must(lambda v: not isinstance(v, (dict, list)),
                                 "must be a single value")]]
Env = dict[Annotated[str, _must(_ENV_NAME.match, "is not an environment variable name"),
                     _must(lambda k: not k.startswith(PREFIX),
                           "is a K3_* setting: put it under args/extra_args"),
                     _must(lambda k: k.startswith(VENDOR_PREFIXES),
                           "is not a vendor variable the renderer passes (prefixes: "
                           f"{', '.join(VENDOR_PREFIXES)})")],
           Annotated[Any, _must(lambda v: isinstance(v, str),
                                "must be a quoted string (got {value!r})")]]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Meta(_Section):
    name: str
    description: Annotated[str, _must(str.strip, "is empty: give it text")]
    hardware: Literal["amd", "cpu"]
    extends: str | None = None
    source: Any = None


class ModelBlock(_Section):
    base_args: Args | None = None
    base_env: Env | None = None


class Feature(_Section):
    description: str
    args: Args | None = None
    env: Env | None = None
    source: Any = None


class Override(_Section):
    extra_args: Args | None = None
    extra_env: Env | None = None
    source: Any = None


class Profile(_Section):
    meta: Meta
    model: ModelBlock | None = None
    features: dict[str, Feature] | None = None
    hardware_overrides: dict[str, Override] | None = None


_SECTION = {"meta": Meta, "model": ModelBlock, "features": Feature, "hardware_overrides": Override}


def _problem(exc: ValidationError) -> str:
    """The first error as ``key what is wrong: what to do``."""
    def what(kind: str, err: dict[str, Any]) -> str | None:
        section = err["loc"][:-1] if kind == "extra_forbidden" else err["loc"]  # holds the key
        known = list((_SECTION[section[0]] if section else Profile).model_fields)
        path = "".join(f"{p}." for p in section)
        return {"extra_forbidden": "is not a known key: use " + ", ".join(path + k for k in known),
                "model_type": f"must be a mapping with {', '.join(known)}",
                "literal_error": f"{err['input']!r} is not known: use "
                                 f"{err.get('ctx', {}).get('expected')}",
                "missing": "is missing", "string_type": "must be text",
                "dict_type": "must be a mapping", "value_error": err["msg"]}.get(kind)
    return one_line(exc, lambda loc, _: ".".join(loc) or "the file", what)


# --- reading and resolving ---------------------------------------------------------------------

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
    where = str(d / f"{name}{SUFFIX}")
    try:
        prof = Profile.model_validate(_read(d / f"{name}{SUFFIX}"))
    except ValidationError as exc:
        raise UsageError(f"{where}: {_problem(exc)}") from None
    meta, hw, parent = prof.meta, prof.meta.hardware, prof.meta.extends
    if meta.name != name:
        raise UsageError(f"{where}: meta.name {meta.name!r} must equal the file name ({name!r})")
    settings, env = {}, {}
    if parent is not None:
        if parent not in names(d):
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
    for hname in prof.hardware_overrides or {}:
        if hname != hw:
            raise UsageError(f"{where}: hardware_overrides.{hname} does not apply to this "
                             f"profile (meta.hardware is {hw!r}): one profile per hardware, "
                             f"rename the block to {hw}")
    model = prof.model or ModelBlock()
    # in the order they apply: the model, each feature in file order, the hardware override
    for args, block_env in [(model.base_args, model.base_env),
                            *((f.args, f.env) for f in (prof.features or {}).values()),
                            *((o.extra_args, o.extra_env)
                              for o in (prof.hardware_overrides or {}).values())]:
        settings.update({FIELD_BY_ENV[k]: v for k, v in (args or {}).items()})
        env.update(block_env or {})
    try:  # each value as the Settings model would take it (other fields at their defaults)
        Settings(**settings)
    except ValidationError as exc:
        raise UsageError(f"{where}: {invalid(exc, settings)}") from None
    return {"settings": settings, "env": env,
            "meta": {"name": name, "description": meta.description, "hardware": hw,
                     "extends": parent, "path": where}}


def _read(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise UsageError(f"{path}:{line}: {problem}") from None


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
