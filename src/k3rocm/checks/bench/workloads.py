"""Named aiperf workloads (workloads.toml) and the exact aiperf command line built from one.

Precedence for every field: ``--set key=value`` > ``BENCH_<KEY>`` environment > the workload's
table > ``[defaults]``. Everything is validated before any container or server is touched.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from k3rocm.errors import UsageError

WORKLOADS_FILE = Path(__file__).with_name("workloads.toml")
ENV_PREFIX = "BENCH_"


class Workload(BaseModel):
    """One fully resolved aiperf workload."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    model: str
    tokenizer: str
    tokenizer_trust_remote_code: bool = True
    url: str
    api_key: str = "EMPTY"
    endpoint_type: Literal["chat", "completions"] = "chat"
    streaming: bool = True
    use_server_token_count: bool = True
    isl: int
    isl_stddev: int = 0
    osl: int
    osl_stddev: int = 0
    shared_prefix_tokens: int = 0
    extra_inputs: tuple[str, ...] = ()
    warmup_request_count: int = 0
    sweep_type: Literal["zip", "grid"] = "zip"
    concurrency: tuple[int, ...]
    request_count: tuple[int, ...]
    random_seed: int = 42
    ui: Literal["simple", "none", "dashboard"] = "simple"
    extra_args: tuple[str, ...] = ()
    request_timeout_s: float = 0
    prefix_caching: bool | None = None

    @field_validator("isl", "osl", "isl_stddev", "osl_stddev", "shared_prefix_tokens",
                     "warmup_request_count")
    @classmethod
    def _at_least(cls, v: int, info) -> int:  # info: pydantic's ValidationInfo
        low = 1 if info.field_name in ("isl", "osl") else 0
        if v < low:
            raise ValueError(f"must be >= {low}")
        return v

    @field_validator("concurrency", "request_count")
    @classmethod
    def _positive_list(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(x < 1 for x in v):
            raise ValueError("must be a non-empty list of integers >= 1")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+(:\d+)?/?$", v):
            raise ValueError("must look like http://HOST:PORT (no path)")
        return v.rstrip("/")

    @field_validator("extra_inputs")
    @classmethod
    def _kv(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for item in v:
            if ":" not in item or item.startswith(":"):
                raise ValueError(f"entry {item!r} is not key:value")
        return v

    @model_validator(mode="after")
    def _sweep(self) -> Workload:
        nc, nr = len(self.concurrency), len(self.request_count)
        if self.sweep_type == "zip" and nr != nc:
            raise ValueError("a single concurrency takes a single request_count" if nc == 1 else
                             f"sweep_type zip needs one request_count per concurrency "
                             f"(concurrency has {nc}, request_count {nr})")
        return self

    def points(self) -> list[tuple[int, int]]:
        """(concurrency, request_count) of each sweep point, in the order aiperf runs them."""
        if self.sweep_type == "zip":
            return list(zip(self.concurrency, self.request_count, strict=True))
        return [(c, n) for c in self.concurrency for n in self.request_count]

    def protocol(self) -> dict[str, Any]:
        """The fields that define the measurement protocol (everything but where it points)."""
        return self.model_dump(mode="json", exclude={"name", "description", "url", "tokenizer",
                                                     "api_key", "ui"})


FIELD_NAMES = [f for f in Workload.model_fields if f != "name"]
_LIST_FIELDS = {"extra_inputs", "concurrency", "request_count", "extra_args"}


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise UsageError("reading workloads needs Python >= 3.11 (tomllib) or tomli") from None
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"workloads file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"workloads file {path} is not valid TOML: {exc}") from None


def load_table(path: Path | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    data = _load_toml(path or WORKLOADS_FILE)
    defaults = data.get("defaults", {})
    workloads = data.get("workloads", {})
    for name, table in [("defaults", defaults), *workloads.items()]:
        unknown = sorted(set(table) - set(FIELD_NAMES))
        if unknown:
            raise UsageError(f"workload {name!r}: unknown field(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(FIELD_NAMES)}")
    return defaults, workloads


def _parse_value(field: str, raw: str) -> Any:
    """A CLI/env string -> the field's type (lists are comma separated; extra_args shell-split)."""
    raw = raw.strip()
    if field == "extra_args":
        try:
            return shlex.split(raw)
        except ValueError as exc:
            raise UsageError(f"extra_args={raw!r} is not valid shell quoting ({exc})") from None
    if field in _LIST_FIELDS:
        return [x.strip() for x in raw.split(",") if x.strip()]
    if Workload.model_fields[field].annotation is bool:
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise UsageError(f"{field}={raw!r} is not a boolean; use true/false or 1/0")
        return raw.lower() in ("1", "true", "yes", "on")
    return raw


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in FIELD_NAMES:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(FIELD_NAMES)}")
        out[key] = _parse_value(key, value)
    return out


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in env.items():
        if key in _RENAMED and value:
            raise UsageError(f"{key} is no longer read: use {_RENAMED[key]}")
        if not key.startswith(ENV_PREFIX) or key in _NOT_FIELDS or key in _RENAMED:
            continue
        field = key[len(ENV_PREFIX):].lower()
        if field not in FIELD_NAMES:
            raise UsageError(f"unknown environment variable {key}; BENCH_* fields are "
                             f"{', '.join('BENCH_' + f.upper() for f in FIELD_NAMES)}")
        if value == "":
            continue
        out[field] = _parse_value(field, value)
    return out


# BENCH_* variables that are not workload fields (read elsewhere).
_NOT_FIELDS = {"BENCH_WORKLOAD", "BENCH_CLIENT_IMAGE", "BENCH_AB_REPEATS",
               "BENCH_ARGS", "BENCH_IMAGE"}  # the last two: make variables (mk/bench.mk)
# Gone: the results root has one name for every command.
_RENAMED = {"BENCH_RESULTS": "K3_RESULTS_DIR (or --results)"}


# Workload field -> the settings it is derived from.
_FROM_SETTINGS = {"url": ("K3_PORT", "K3_BIND_ADDRESS"), "model": ("K3_SERVED_MODEL_NAME",),
                  "api_key": ("K3_API_KEY",), "tokenizer": ("K3_MODEL", "K3_MODELS_DIR")}


def deployment_fields(deployment) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a workload takes from the deployment: the server URL, the served model name, the
    API key and the tokenizer (the checkpoint dir). Returns (set, default): the fields whose
    settings were set (shell, .env, make line, a chosen profile), which win over a workload's
    table, and the ones from built-in defaults, which a workload's table overrides."""
    values = {"url": deployment.url, "model": deployment.served_model_name,
              "api_key": deployment.api_key or "EMPTY",
              "tokenizer": str(deployment.tokenizer) if deployment.tokenizer else ""}
    chosen = {f for f, keys in _FROM_SETTINGS.items()
              if any(deployment.sources.get(k, "default") != "default" for k in keys)}
    return ({f: v for f, v in values.items() if f in chosen},
            {f: v for f, v in values.items() if f not in chosen})


def resolve(name: str, sets: Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None, path: Path | None = None,
            deployment=None) -> Workload:
    """Resolve workload ``name`` with overrides: ``sets`` > ``BENCH_*`` in ``env`` > the
    deployment's settings that were set > the workload > [defaults] > the deployment's
    defaults (the deployment is read from ``env`` and .env unless given).
    Raises UsageError (one line) on bad input."""
    defaults, workloads = load_table(path)
    if name not in workloads:
        raise UsageError(f"unknown workload {name!r}; valid: {', '.join(workloads)}")
    if deployment is None:
        from k3rocm.deploy.deployment import load_deployment

        deployment = load_deployment(env)
    chosen, fallback = deployment_fields(deployment)
    merged: dict[str, Any] = {**fallback, **defaults, **workloads[name], **chosen}
    merged.update(env_overrides(os.environ if env is None else env))
    merged.update(sets or {})
    merged["name"] = name
    try:
        return Workload(**merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            raise UsageError(f"workload {name!r}: {msg}") from None
        loc = ".".join(str(x) for x in err["loc"])
        bad = merged.get(err["loc"][0])
        raise UsageError(f"workload {name!r}: {loc}={bad!r}: {msg}") from None


# --- the aiperf command line


def aiperf_command(w: Workload, artifact_dir: str, tokenizer: str | None = None) -> list[str]:
    """The aiperf argv. For decode-8k1k this is exactly the upstream PRs' command plus
    --artifact-dir.

    ``tokenizer`` is the tokenizer path as the client sees it (default: the workload's path).
    """
    cmd = ["aiperf", "profile", "--model", w.model, "--tokenizer", tokenizer or w.tokenizer]
    if w.tokenizer_trust_remote_code:
        cmd.append("--tokenizer-trust-remote-code")
    cmd += ["--url", w.url, "--api-key", w.api_key, "--endpoint-type", w.endpoint_type]
    if w.streaming:
        cmd.append("--streaming")
    if w.use_server_token_count:
        cmd.append("--use-server-token-count")
    if w.shared_prefix_tokens:
        cmd += ["--shared-system-prompt-length", str(w.shared_prefix_tokens)]
    cmd += ["--synthetic-input-tokens-mean", str(w.isl),
            "--synthetic-input-tokens-stddev", str(w.isl_stddev),
            "--output-tokens-mean", str(w.osl),
            "--output-tokens-stddev", str(w.osl_stddev)]
    for item in w.extra_inputs:
        cmd += ["--extra-inputs", item]
    if w.warmup_request_count:
        cmd += ["--warmup-request-count", str(w.warmup_request_count)]
    if len(w.points()) > 1:
        cmd += ["--sweep-type", w.sweep_type]
    cmd += ["--concurrency", ",".join(map(str, w.concurrency)),
            "--request-count", ",".join(map(str, w.request_count)),
            "--random-seed", str(w.random_seed), "--ui", w.ui]
    if w.request_timeout_s:
        cmd += ["--request-timeout-seconds", f"{w.request_timeout_s:g}"]
    cmd += list(w.extra_args)
    cmd += ["--artifact-dir", artifact_dir]
    return cmd


def shell_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
