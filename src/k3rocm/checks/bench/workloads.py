"""Named aiperf workloads (workloads.toml) and the aiperf command line built from one.

Precedence: ``--set key=value`` > ``BENCH_<KEY>`` > the deployment's settings that were set >
the workload's table > ``[defaults]`` > the deployment's defaults. Validated before anything runs.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from k3rocm.errors import UsageError

WORKLOADS_FILE = Path(__file__).with_name("workloads.toml")
ENV_PREFIX = "BENCH_"
Pos = Annotated[int, Field(ge=1)]
NonNeg = Annotated[int, Field(ge=0)]


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
    isl: Pos
    isl_stddev: NonNeg = 0
    osl: Pos
    osl_stddev: NonNeg = 0
    shared_prefix_tokens: NonNeg = 0
    extra_inputs: tuple[str, ...] = ()
    warmup_request_count: NonNeg = 0
    sweep_type: Literal["zip", "grid"] = "zip"
    concurrency: Annotated[tuple[Pos, ...], Field(min_length=1)]
    request_count: Annotated[tuple[Pos, ...], Field(min_length=1)]
    random_seed: int = 42
    ui: Literal["simple", "none", "dashboard"] = "simple"
    extra_args: tuple[str, ...] = ()
    request_timeout_s: float = 0
    prefix_caching: bool | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+(:\d+)?/?$", v):
            raise ValueError("must look like http://HOST:PORT (no path)")
        return v.rstrip("/")

    @field_validator("extra_inputs", "concurrency", "request_count", "extra_args", mode="before")
    @classmethod
    def _split(cls, v: Any, info: Any) -> Any:  # info: pydantic's ValidationInfo
        """A ``--set``/``BENCH_*`` string: extra_args shell-split, the lists comma separated."""
        if not isinstance(v, str):
            return v
        if info.field_name != "extra_args":
            return [x.strip() for x in v.split(",") if x.strip()]
        try:
            return shlex.split(v)
        except ValueError as exc:
            raise ValueError(f"is not valid shell quoting ({exc})") from None

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
        """The fields that define the measurement (everything but where it points)."""
        return self.model_dump(mode="json", exclude={"name", "description", "url", "tokenizer",
                                                     "api_key", "ui"})


FIELD_NAMES = [f for f in Workload.model_fields if f != "name"]
# BENCH_* variables that are not workload fields (read elsewhere; the last two by mk/bench.mk).
_NOT_FIELDS = {"BENCH_WORKLOAD", "BENCH_CLIENT_IMAGE", "BENCH_AB_REPEATS", "BENCH_ARGS",
               "BENCH_IMAGE"}
# Workload field -> the settings it is derived from.
_FROM_SETTINGS = {"url": ("K3_PORT", "K3_BIND_ADDRESS"), "model": ("K3_SERVED_MODEL_NAME",),
                  "api_key": ("K3_API_KEY",), "tokenizer": ("K3_MODEL", "K3_MODELS_DIR")}


def load_table(path: Path | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """([defaults], {name: table}) of a workloads file."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = path or WORKLOADS_FILE
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"workloads file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"workloads file {path} is not valid TOML: {exc}") from None
    defaults, workloads = data.get("defaults", {}), data.get("workloads", {})
    for name, table in [("defaults", defaults), *workloads.items()]:
        if unknown := sorted(set(table) - set(FIELD_NAMES)):
            raise UsageError(f"workload {name!r}: unknown field(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(FIELD_NAMES)}")
    return defaults, workloads


def parse_sets(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in FIELD_NAMES:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(FIELD_NAMES)}")
        out[key] = value.strip()
    return out


def env_overrides(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        field = key.removeprefix(ENV_PREFIX).lower()
        if key.startswith(ENV_PREFIX) and key not in _NOT_FIELDS:
            if field not in FIELD_NAMES:
                raise UsageError(f"unknown environment variable {key}; BENCH_* fields are "
                                 f"{', '.join('BENCH_' + f.upper() for f in FIELD_NAMES)}")
            if value != "":
                out[field] = value.strip()
    return out


def deployment_fields(deployment) -> tuple[dict[str, Any], dict[str, Any]]:
    """(set, default): URL, served model, API key and tokenizer from the deployment; the ones
    whose settings were set win over a workload's table, the others are overridden by it."""
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
    """Workload ``name`` with its overrides (the deployment is read from ``env`` and .env
    unless given); UsageError (one line) on bad input."""
    defaults, workloads = load_table(path)
    if name not in workloads:
        raise UsageError(f"unknown workload {name!r}; valid: {', '.join(workloads)}")
    if deployment is None:
        from k3rocm.deploy.deployment import load_deployment

        deployment = load_deployment(env)
    chosen, fallback = deployment_fields(deployment)
    merged: dict[str, Any] = {**fallback, **defaults, **workloads[name], **chosen,
                              **env_overrides(os.environ if env is None else env),
                              **(sets or {}), "name": name}
    try:
        return Workload.model_validate(merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:
            raise UsageError(f"workload {name!r}: {msg}") from None
        loc = ".".join(str(x) for x in err["loc"])
        raise UsageError(f"workload {name!r}: {loc}={merged.get(err['loc'][0])!r}: {msg}"
                         ) from None


def aiperf_command(w: Workload, artifact_dir: str, tokenizer: str | None = None) -> list[str]:
    """The aiperf argv (decode-8k1k: the upstream PRs' command plus --artifact-dir);
    ``tokenizer``: its path as the client sees it (default: the workload's)."""
    flag = lambda on, *args: list(args) if on else []  # noqa: E731
    return ["aiperf", "profile", "--model", w.model, "--tokenizer", tokenizer or w.tokenizer,
            *flag(w.tokenizer_trust_remote_code, "--tokenizer-trust-remote-code"),
            "--url", w.url, "--api-key", w.api_key, "--endpoint-type", w.endpoint_type,
            *flag(w.streaming, "--streaming"),
            *flag(w.use_server_token_count, "--use-server-token-count"),
            *flag(w.shared_prefix_tokens, "--shared-system-prompt-length",
                  str(w.shared_prefix_tokens)),
            "--synthetic-input-tokens-mean", str(w.isl),
            "--synthetic-input-tokens-stddev", str(w.isl_stddev),
            "--output-tokens-mean", str(w.osl), "--output-tokens-stddev", str(w.osl_stddev),
            *[a for item in w.extra_inputs for a in ("--extra-inputs", item)],
            *flag(w.warmup_request_count, "--warmup-request-count", str(w.warmup_request_count)),
            *flag(len(w.points()) > 1, "--sweep-type", w.sweep_type),
            "--concurrency", ",".join(map(str, w.concurrency)),
            "--request-count", ",".join(map(str, w.request_count)),
            "--random-seed", str(w.random_seed), "--ui", w.ui,
            *flag(w.request_timeout_s, "--request-timeout-seconds", f"{w.request_timeout_s:g}"),
            *w.extra_args, "--artifact-dir", artifact_dir]


def shell_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
