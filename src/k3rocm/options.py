"""A command's options, each declared once: a typed pydantic field carries its flag, default,
range, choices (a ``Literal``) and help; a value that does not fit is one UsageError line naming
the flag, the value and what to use (exit 2), e.g. ``--concurrency 0 is out of range; use 1..1024``.
"""

from __future__ import annotations

import argparse
import copy
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from k3rocm.errors import UsageError, one_line

T = TypeVar("T", bound="Options")


def option(default: Any = None, help: str = "", *, flag: str | None = None,
           aliases: tuple[str, ...] = (), group: str | None = None, metavar: str | None = None,
           unit: str = "", **constraints: Any) -> Any:
    """A field that is also a flag (``--field-name`` unless ``flag``; ``aliases`` such as
    ``-w``); ``constraints`` are pydantic's (``ge``, ``le``, ``default_factory``, ...). ``help``
    may use ``%(default)s``; ``unit`` follows the range in the out-of-range message."""
    extra = {"option": True, "flag": flag, "aliases": aliases, "group": group,
             "metavar": metavar, "unit": unit}
    if "default_factory" not in constraints:
        constraints["default"] = default
    return Field(description=help,
                 json_schema_extra={k: v for k, v in extra.items() if v}, **constraints)


def like(model: type[BaseModel], name: str, help: str | None = None, **extra: str) -> Any:
    """``model``'s field ``name`` (its default and range) for another command, with its own
    help or ``extra`` (``flag``, ``group``, ``metavar``)."""
    f = copy.copy(model.model_fields[name])
    f.json_schema_extra = {**_extra(f), **extra}
    f.description = help or f.description
    return f


def _extra(f: FieldInfo) -> dict[str, Any]:
    return f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}


def _flag(name: str, f: FieldInfo) -> str:
    return _extra(f).get("flag") or "--" + name.replace("_", "-")


def _base_type(ann: Any) -> Any:
    """``int`` for ``int | None``, the annotation otherwise."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return ann


class Options(BaseModel):
    """Base of a command's options; building one from bad values raises a one-line
    :class:`UsageError`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, /, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise UsageError(_message(type(self), exc)) from None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                      groups: dict[str, argparse._ArgumentGroup] | None = None,
                      skip: tuple[str, ...] = ()) -> None:
        """Add every field's flag but ``skip``'s (field names: another declaration's flag) to
        ``parser``; with ``groups``, a field with a ``group`` goes into that argument group,
        created once per title in ``groups``."""
        for name, f in cls.flags().items():
            if name in skip:
                continue
            title = _extra(f).get("group")
            target = parser
            if title and groups is not None:
                target = groups.get(title) or groups.setdefault(
                    title, parser.add_argument_group(title))
            target.add_argument(_flag(name, f), *_extra(f).get("aliases", ()), dest=name,
                                **_argparse_kw(f))

    @classmethod
    def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
        """The model from the parsed flags, ``values`` overriding them."""
        return cls(**{**{n: getattr(args, n) for n in cls.flags() if hasattr(args, n)},
                      **values})

    @classmethod
    def flags(cls) -> dict[str, FieldInfo]:
        """The fields that are flags (declared with :func:`option`)."""
        return {n: f for n, f in cls.model_fields.items() if _extra(f).get("option")}


def _argparse_kw(f: FieldInfo) -> dict[str, Any]:
    ann = _base_type(f.annotation)
    default = f.get_default(call_default_factory=True)  # a factory: read when the parser is made
    kw: dict[str, Any] = {"default": default, "help": f.description or ""}
    kw.update({k: _extra(f)[k] for k in ("metavar",) if k in _extra(f)})
    if ann is bool:
        kw["action"] = "store_true" if not default else argparse.BooleanOptionalAction
        return kw
    if typing.get_origin(ann) is list:  # repeatable
        return {**kw, "action": "append", "type": typing.get_args(ann)[0]}
    if typing.get_origin(ann) is Literal:
        kw["choices"] = typing.get_args(ann)
    elif ann in (int, float, Path):
        kw["type"] = ann
    if default is not None and "%(default)" not in kw["help"]:
        kw["help"] += " (default %(default)s)"
    return kw


def _bounds(f: FieldInfo) -> str:
    """``1..1024``, ``0 < x <= 1``, ``x >= 1``: what the field's range allows."""
    b = {attr: getattr(m, attr) for m in f.metadata for attr in ("ge", "gt", "le", "lt")
         if getattr(m, attr, None) is not None}
    if "ge" in b and "le" in b:
        return f"{b['ge']}..{b['le']}"
    lo = next(((f"{b[k]} {sym} ", k) for k, sym in (("ge", "<="), ("gt", "<")) if k in b), None)
    hi = next((f" {sym} {b[k]}" for k, sym in (("le", "<="), ("lt", "<")) if k in b), "")
    if lo and not hi:  # x >= 1 reads better than 1 <= x
        return f"x {'>=' if lo[1] == 'ge' else '>'} {b[lo[1]]}"
    return f"{lo[0] if lo else ''}x{hi}"


def _message(cls: type[BaseModel], exc: ValidationError) -> str:
    def subject(loc: tuple[str, ...], value: Any) -> str:
        shown = value if isinstance(value, int | float) else repr(value)
        return f"{_flag(loc[0], cls.model_fields[loc[0]])} {shown}" if loc else ""

    def what(kind: str, err: dict[str, Any]) -> str | None:
        if not err["loc"]:  # a check across fields: its own message names the flags
            return err["msg"]
        f = cls.model_fields[err["loc"][0]]
        if kind == "range":
            return f"is out of range; use {_bounds(f)}{_extra(f).get('unit', '')}"
        if kind == "literal_error":
            return f"is not valid; use {' or '.join(typing.get_args(_base_type(f.annotation)))}"
        return err["msg"] if kind == "value_error" else None
    return one_line(exc, subject, what)


class ServerFlags(Options):
    """The flags every command that measures a running server shares; a command takes them with
    :func:`like` (its own help or flag spelling)."""

    url: str | None = option(None, "server root URL (default: from K3_BIND_ADDRESS and K3_PORT)")
    model: str | None = option(None, "served model name (default K3_SERVED_MODEL_NAME)")
    server_container: str | None = option(
        None, "server container for provenance (default: the one publishing the URL's port)",
        metavar="NAME")
    results: Path | None = option(None, "results root; each run gets its own directory under it "
                                  "(default K3_RESULTS_DIR, which compose mounts at /results)")
    dry_run: bool = option(False, "print the exact client command line and exit 0; contacts "
                           "nothing")


class DeploymentFlags(Options):
    """Which deployment a host command runs with (:mod:`k3rocm.cli` builds it once from them;
    ``--gpu``/``--no-gpu`` where a command has them: ``args.gpu``)."""

    env_file: str = option(".env", "settings file: shell > this file > profile > default")
