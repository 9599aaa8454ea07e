"""The one serving configuration: K3_* settings -> the environment and argv of ``vllm serve``.

Precedence, highest first: the process environment, ``.env``, the profile (``K3_PROFILE``), the
field default; an empty value counts as unset (compose passes unset variables as "").
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3rocm.errors import UsageError
from k3rocm.serving import profiles
from k3rocm.serving.fusions import FUSIONS, switches
from k3rocm.serving.modelfacts import KIMI_K3_HEADS
from k3rocm.serving.settings import (
    ENV_NAME,
    FIELD_BY_ENV,
    FIELDS,
    PREFIX,
    VENDOR_PREFIXES,
    Settings,
    invalid,
)

# The one redaction rule: these names, and any name ending in one of SECRET_SUFFIXES.
SECRET_KEYS = ("K3_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY",
               "OPENAI_API_KEY", "TOKEN", "API_KEY")
SECRET_SUFFIXES = ("_TOKEN", "_API_KEY", "_SECRET", "_PASSWORD")
REDACTED = "***"
MTP_METHODS_WITH_DRAFT_MODEL = ("dspark", "eagle", "eagle3", "draft_model")

# K3_* variables that are not serving settings but are known (tests, tooling).
KNOWN_OTHER = {
    "K3_RENDERED_FILE": "where `k3rocm serve` writes what it rendered "
                        "(default /tmp/k3rocm-rendered.json)",
    "K3_SERVER_IMAGE": "tests: the serving image the stand-in fixture runs",
    "K3_TORCH_WHEELS": "stand-in build: directory with the torch 2.13.0+cpu wheel",
    "K3_VIDEO_GID": "deployment: the host's video group id for the server container",
    "K3_RENDER_GID": "deployment: the host's render group id for the server container",
    "K3_VENDOR_ENV_FILE": "deployment: env file with the shell's vendor variables for compose",
}
# The scale-out settings (k3rocm.deploy.scale.settings; a test keeps this list equal).
SCALE_SETTINGS = ("K3_SCALE_MODE", "K3_SCALE_NODES", "K3_SCALE_ROUTER_HOST", "K3_SCALE_ROUTER_PORT",
                  "K3_SCALE_ROUTER_METRICS_PORT", "K3_SCALE_ROUTER_POLICY",
                  "K3_SCALE_ROUTER_STARTUP_TIMEOUT", "K3_SCALE_HEALTH_INTERVAL",
                  "K3_SCALE_HEALTH_THRESHOLD", "K3_SCALE_ROUTER_IMAGE", "K3_SCALE_PROXY_IMAGE",
                  "K3_SCALE_ROUTER_REPLICAS", "K3_SCALE_NODE_SELECTOR", "K3_SCALE_POD_SECURITY",
                  "K3_SCALE_MODELS_CLAIM", "K3_SCALE_GPU_GROUPS", "K3_SCALE_RUN_AS_USER",
                  "K3_SCALE_METRICS_NAMESPACE", "K3_SCALE_DRAIN_TIMEOUT")
KNOWN_OTHER.update({k: "scale-out setting (k3rocm scale config)" for k in SCALE_SETTINGS})
# Families of K3_* variables owned by tests (K3_TEST_*) and the client container (K3_GSM8K_*).
KNOWN_PREFIXES = ("K3_TEST_", "K3_GSM8K_")

# Container paths the profile sets: a host shell's value is not carried in (.env's is).
CONTAINER_PATH_KEYS = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRITON_CACHE_DIR",
                       "VLLM_CACHE_ROOT", "TORCH_HOME", "AITER_JIT_DIR")


@dataclass
class Rendered:
    settings: Settings
    env: dict[str, str]
    argv: list[str]
    sources: dict[str, str] = field(default_factory=dict)
    base: dict[str, Any] | None = None  # what the base facts decided (render(base=...))
    # a VLLM_*/AITER_* name the user set that the base does not know (passed anyway)
    warnings: list[str] = field(default_factory=list)

    def to_json(self, redact: bool = True) -> dict[str, Any]:
        env = redact_env(self.env) if redact else dict(self.env)
        out = {"env": env, "argv": list(self.argv), "sources": dict(self.sources)}
        if self.base is not None:
            out["base"] = self.base
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


def is_secret(key: str) -> bool:
    k = key.upper()
    return k in SECRET_KEYS or k.endswith(SECRET_SUFFIXES)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every secret's value (see :func:`is_secret`) replaced by ``***``."""
    return {k: (REDACTED if v and is_secret(k) else v) for k, v in env.items()}


def redact_argv(argv: list[str] | None, secrets: list[str | None] = ()) -> list[str] | None:
    """``argv`` with secrets replaced by ``***``, by the same rule as :func:`redact_env`: the
    value of a flag whose name is a secret's (``--api-key X``, ``--hf-token=X``), and any
    argument equal to one of ``secrets``."""
    if argv is None:
        return None
    hide = {x for x in secrets if x and x != "EMPTY"}
    out: list[str] = []
    after_flag = False
    for a in argv:
        a = str(a)
        name, eq, _ = a.partition("=")
        flag_secret = a.startswith("--") and is_secret(name[2:].replace("-", "_"))
        if (after_flag and a != "EMPTY") or a in hide:  # EMPTY: OpenAI clients' "no key"
            out.append(REDACTED)
        elif flag_secret and eq:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(a)
        after_flag = flag_secret and not eq
    return out


_DOTENV_KEY = re.compile(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*=[ \t]*")
_DOTENV_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|"
                         r"([A-Za-z_][A-Za-z0-9_]*))")
_DQ_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}


def _interpolate(value: str, known: Mapping[str, str]) -> str:
    """``${VAR}``, ``$VAR``, ``${VAR:-default}``, ``${VAR-default}``, as Compose does in .env
    (earlier keys of the file, then the process environment; unset = empty)."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        val = known.get(name, os.environ.get(name))
        op, alt = m.group(2), m.group(3) or ""
        if op == ":-" and not val or op == "-" and val is None:
            return alt
        if op == ":+" and val or op == "+" and val is not None:
            return alt
        return val or ""
    return _DOTENV_VAR.sub(sub, value)


def read_dotenv(path: str | os.PathLike) -> dict[str, str]:
    """Read a ``.env`` file the way Docker Compose reads it (compose-go's dotenv): ``#``
    comments, ``export``, single quotes literal, double quotes with ``\\n``-style escapes and
    multi-line values, a comment after a closing quote, unquoted values cut at `` #`` and
    trimmed, ``${VAR}`` interpolation outside single quotes."""
    p = Path(path)
    if not p.is_file():
        return {}
    text, out, pos, n = p.read_text(), {}, 0, 0
    while pos < len(text):
        eol = text.find("\n", pos)
        eol = len(text) if eol < 0 else eol
        line = text[pos:eol]
        n += 1
        if not line.strip() or line.lstrip().startswith("#"):
            pos = eol + 1
            continue
        m = _DOTENV_KEY.match(line)
        if not m:
            raise UsageError(f"{p}:{n}: cannot parse {line.strip()!r}; expected KEY=VALUE")
        key, at = m.group(1), pos + m.end()
        quote = text[at:at + 1]
        if quote in ("'", '"'):
            close, i, buf = -1, at + 1, []
            while i < len(text):
                c = text[i]
                if c == "\\" and quote == '"' and i + 1 < len(text):
                    buf.append(_DQ_ESCAPES.get(text[i + 1], "\\" + text[i + 1]))
                    i += 2
                    continue
                if c == quote:
                    close = i
                    break
                buf.append(c)
                i += 1
            if close < 0:
                raise UsageError(f"{p}:{n}: {key}: the {quote} quote is never closed")
            value = "".join(buf)
            n += text.count("\n", at, close)
            eol = text.find("\n", close)
            eol = len(text) if eol < 0 else eol
            out[key] = value if quote == "'" else _interpolate(value, out)
        else:
            value = text[at:eol]
            cut = re.search(r"\s#", value)
            value = (value[:cut.start()] if cut else value).strip()
            out[key] = _interpolate(value, out)
        pos = eol + 1
    return out


def _is_pathlike(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def load_settings(environ: Mapping[str, str] | None = None,
                  dotenv: str | os.PathLike | None = ".env",
                  host_paths: bool = False,
                  check_model: bool = True) -> tuple[Settings, dict[str, str]]:
    """Build Settings from the environment, an optional .env and the profile."""
    environ = dict(os.environ if environ is None else environ)
    file_vals = read_dotenv(dotenv) if dotenv else {}
    layered: dict[str, tuple[str, str]] = {}  # env name -> (raw value, source)
    for src_name, vals in ((".env", file_vals), ("env", environ)):
        for key, raw in vals.items():
            if not key.startswith(PREFIX):
                continue
            if key not in FIELD_BY_ENV and key not in KNOWN_OTHER and \
                    not key.startswith(KNOWN_PREFIXES):
                raise UsageError(
                    f"{key} is not a known setting (from {src_name}); check the spelling: "
                    f"valid names are listed by `k3rocm config --list`")
            if key in FIELD_BY_ENV and raw != "":
                layered[key] = (raw, src_name)

    # The profile first: it decides the other defaults (an unknown name: profiles.get's error).
    profile = layered.get("K3_PROFILE", (FIELDS["profile"].default, "default"))[0]
    profile_settings = profiles.get(profile)["settings"]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, f in FIELDS.items():
        env_name = ENV_NAME[name]
        if env_name in layered:
            raw, sources[env_name] = layered[env_name]
            values[name] = raw.strip() if f.annotation is bool else raw  # pydantic: 1/0, true..
        elif name in profile_settings:
            values[name] = profile_settings[name]
            sources[env_name] = f"profile:{profile}"
        else:
            sources[env_name] = "default"
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        raise UsageError(invalid(exc, values)) from None
    _check_consistency(settings, host_paths, check_model)
    check_repeats(shlex.split(settings.extra_args), "K3_EXTRA_ARGS")
    return settings, sources


def _host_path(s: Settings, path: str) -> Path:
    """Where a container path under /models lives on the host (compose mounts K3_MODELS_DIR)."""
    if path == "/models" or path.startswith("/models/"):
        return Path(s.models_dir).expanduser() / path[len("/models"):].lstrip("/")
    return Path(path).expanduser()


def _check_consistency(s: Settings, host_paths: bool = False, check_model: bool = True) -> None:
    if s.mtp_k > 0 and s.mtp_method in MTP_METHODS_WITH_DRAFT_MODEL and not s.mtp_model:
        raise UsageError(f"K3_MTP_METHOD={s.mtp_method} needs a draft model: set K3_MTP_MODEL "
                         "(or use K3_MTP_METHOD=mtp, or K3_MTP_K=0 to turn speculation off)")
    if s.mtp_model and s.mtp_method == "mtp":
        raise UsageError(f"K3_MTP_MODEL={s.mtp_model!r} is set but K3_MTP_METHOD=mtp uses the "
                         "model's own MTP head: unset K3_MTP_MODEL or choose "
                         + "/".join(MTP_METHODS_WITH_DRAFT_MODEL))
    if s.mtp_model and s.mtp_k == 0:
        raise UsageError(f"K3_MTP_MODEL={s.mtp_model!r} is set but K3_MTP_K=0 turns speculative "
                         "decoding off: set K3_MTP_K >= 1 or unset K3_MTP_MODEL")
    if not check_model:
        return
    if not _is_pathlike(s.model) and not s.allow_hub_download:
        raise UsageError(f"K3_MODEL={s.model!r} is a Hugging Face id: serving it downloads the "
                         "checkpoint (Kimi-K3: ~1.56 TB) into K3_CACHE_DIR at start; put it "
                         "under K3_MODELS_DIR and set K3_MODEL=/models/<dir>, or set "
                         "K3_ALLOW_HUB_DOWNLOAD=1")
    for env_name, path in (("K3_MODEL", s.model), ("K3_MTP_MODEL", s.mtp_model)):
        if not (path and _is_pathlike(path)):
            continue
        where = _host_path(s, path) if host_paths else Path(path).expanduser()
        if not where.exists():
            shown = f" (on this host: {where})" if host_paths else ""
            raise UsageError(f"{env_name}={path!r} does not exist{shown}: put the model there "
                             "(compose mounts K3_MODELS_DIR at /models)")


@dataclass(frozen=True)
class Arg:
    """One row of the renderer's table: a ``vllm serve`` flag (then vLLM's own aliases for it),
    the settings it is rendered from, and how."""

    flags: tuple[str, ...]
    fields: tuple[str, ...]
    render: Callable[[Settings], list[str]]
    boolean: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        """Every spelling vLLM accepts for this row (``--no-`` forms of a boolean)."""
        return self.flags + tuple("--no-" + f[2:] for f in self.flags if self.boolean)


def _value(flag: str, name: str, *aliases: str) -> Arg:
    def render(s: Settings) -> list[str]:
        v = getattr(s, name)
        return [] if v is None or v == "" else [flag, str(v)]
    return Arg((flag, *aliases), (name,), render)


def _switch(flag: str, name: str, off: str | None = None) -> Arg:
    return Arg((flag,), (name,), lambda s: [flag] if getattr(s, name) else [off] if off else [],
               boolean=True)


def _speculative(s: Settings) -> list[str]:
    if s.mtp_k <= 0:
        return []
    spec: dict[str, Any] = {"method": s.mtp_method, "num_speculative_tokens": s.mtp_k}
    if s.mtp_model:
        spec["model"] = s.mtp_model
    if s.mtp_attention_backend:
        spec["attention_backend"] = s.mtp_attention_backend
    return ["--speculative-config", json.dumps(spec, separators=(",", ":"))]


def _profiler(s: Settings) -> list[str]:
    if not (s.profiler_dir and s.profiler_style == "config"):
        return []
    prof = {"profiler": "torch", "torch_profiler_dir": s.profiler_dir,
            "torch_profiler_use_gzip": True, "ignore_frontend": True,
            "delay_iterations": s.profiler_delay_iterations,
            "max_iterations": s.profiler_max_iterations, "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False}
    return ["--profiler-config", json.dumps(prof, separators=(",", ":"))]


# The renderer's table, in argv order: the argv (build_argv) and the flags K3_EXTRA_ARGS may not
# repeat (managed_flags). Aliases are vLLM's (vllm@0.34.0:vllm/engine/arg_utils.py:1224 -tp,
# :1897 -sc; vllm@0.27.1: :1043, :1578); --model: vllm@0.34.0:vllm/engine/arg_utils.py:976.
ARGS: tuple[Arg, ...] = (
    Arg(("--model",), ("model",), lambda s: [s.model]),  # positional after `vllm serve`
    _value("--served-model-name", "served_model_name"),
    _value("--host", "host"),
    _value("--port", "port"),
    _value("--tensor-parallel-size", "tp", "-tp"),
    _value("--kv-cache-dtype", "kv_cache_dtype"),
    _value("--max-model-len", "max_model_len"),
    _value("--max-num-seqs", "max_num_seqs"),
    _value("--max-num-batched-tokens", "max_num_batched_tokens"),
    _value("--gpu-memory-utilization", "gpu_memory_utilization"),
    _value("--load-format", "load_format"),
    _value("--moe-backend", "moe_backend"),
    _switch("--enable-prefix-caching", "prefix_caching", off="--no-enable-prefix-caching"),
    _switch("--trust-remote-code", "trust_remote_code"),
    _switch("--language-model-only", "language_model_only"),
    _switch("--enforce-eager", "enforce_eager"),
    _value("--reasoning-parser", "reasoning_parser"),
    Arg(("--tool-call-parser", "--enable-auto-tool-choice"), ("tool_call_parser",),
        lambda s: ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser]
        if s.tool_call_parser else []),
    Arg(("--speculative-config", "-sc"), ("mtp_k", "mtp_method", "mtp_model",
                                          "mtp_attention_backend"), _speculative),
    Arg(("--profiler-config",), ("profiler_dir", "profiler_max_iterations",
                                 "profiler_delay_iterations", "profiler_style"), _profiler),
)


def managed_flags() -> dict[str, Arg]:
    """Every spelling of a flag the renderer sets -> its row of :data:`ARGS`."""
    return {name: row for row in ARGS for name in row.names}


def _flag_name(arg: str) -> str:
    """How vLLM's parser reads an option's name: ``--a_b=1`` and ``--a-b.key`` are ``--a-b``
    (vllm@0.34.0:vllm/utils/argparse_utils.py:378-393: underscores -> dashes, ``.`` sets a
    key of a JSON option)."""
    name = arg.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def check_repeats(args: list[str], where: str) -> None:
    """Refuse (one line) ``args`` that repeat a flag the renderer sets from a K3_* setting:
    the argv would carry both, and which one vLLM takes is not what `make config` shows."""
    managed = managed_flags()
    for i, arg in enumerate(args):
        if not arg.startswith("-") or _flag_name(arg) not in managed:
            continue
        flag = _flag_name(arg)
        row = managed[flag]
        names = ", ".join(ENV_NAME[f] for f in row.fields)
        shown = flag if flag == row.flags[0] else f"{flag} ({row.flags[0]})"
        if row.boolean:
            use = f"{names}={0 if flag.startswith('--no-') else 1}"
        elif len(row.fields) == 1 and (flag == row.flags[0] or not flag.startswith("--")):
            value = arg.split("=", 1)[1] if "=" in arg else \
                args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else None
            use = names + (f"={shlex.quote(value)}" if value is not None else "")
        else:
            use = "those" if len(row.fields) > 1 else names
        raise UsageError(f"{where} repeats {shown}, a flag k3rocm renders from {names}: "
                         f"set {use} instead")


def build_argv(s: Settings, passthrough: list[str] | None = None,
               extra: list[str] = ()) -> list[str]:
    """``vllm serve`` argv: the settings' (:data:`ARGS`), then ``extra`` (the base facts'),
    ``passthrough`` and K3_EXTRA_ARGS last."""
    argv = ["vllm", "serve"] + [a for row in ARGS for a in row.render(s)]
    return argv + list(extra) + list(passthrough or []) + shlex.split(s.extra_args)


def build_env(s: Settings, environ: Mapping[str, str], file_vals: Mapping[str, str],
              sources: dict[str, str], host: bool = False) -> dict[str, str]:
    """The environment we manage for vLLM (profile env, toggles, secrets); user values win.
    ``host``: rendering on the host for compose (the shell's container paths stay out)."""
    env: dict[str, str] = {}
    user = {key: (value, src) for src, vals in ((".env", file_vals), ("env", environ))
            for key, value in vals.items() if key.startswith(VENDOR_PREFIXES) and value != ""
            and not (host and src == "env" and key in CONTAINER_PATH_KEYS)}
    for key, value in profiles.get(s.profile)["env"].items():
        env[key], sources[key] = user.pop(key, (value, f"profile:{s.profile}"))
    for key, (value, src) in sorted(user.items()):  # set by the user, passed as they are
        env[key], sources[key] = value, src
    ours = {**switches({f.name: getattr(s, f.field) for f in FUSIONS}),
            "K3_OVERLAY": s.overlay, "K3_PROFILE": s.profile}
    for key, value in ours.items():
        env[key] = value
        sources.setdefault(key, "default")
    if s.api_key:
        env["VLLM_API_KEY"] = s.api_key
        sources["VLLM_API_KEY"] = sources.get("K3_API_KEY", "env")
    if s.profiler_dir:
        env["VLLM_RPC_TIMEOUT"] = environ.get("VLLM_RPC_TIMEOUT") or "1800000"
        sources["VLLM_RPC_TIMEOUT"] = "env" if environ.get("VLLM_RPC_TIMEOUT") else "profiler"
        if s.profiler_style == "env":
            env["VLLM_TORCH_PROFILER_DIR"] = s.profiler_dir
            sources["VLLM_TORCH_PROFILER_DIR"] = sources["K3_PROFILER_DIR"]
    return env


def _apply_base(settings: Settings, sources: dict[str, str], base: bool | dict[str, Any],
                aiter_on: bool, user_env: dict[str, str] | None = None
                ) -> tuple[Settings, list[str], dict[str, Any] | None, list[str]]:
    """The base facts (``base``: a dict, or True for the manifest's / measured here) applied to
    ``settings``: (settings with the defaults the base cannot run changed, extra argv, what
    was decided, warnings about ``user_env``'s names: name -> where set)."""
    from k3rocm.serving import basefacts

    facts, where = (base, "given") if isinstance(base, dict) else basefacts.load()
    if facts is None:
        return settings, [], None, []
    try:
        updates, extra, notes = basefacts.check(settings, sources, facts, aiter_on)
    except basefacts.BaseRefusal as exc:
        if settings.base_check == "enforce":
            raise UsageError(str(exc)) from None
        updates, extra, notes = {}, [], [f"WARNING (K3_BASE_CHECK=warn): {exc}"]
    settings = settings.model_copy(update=updates)
    sources.update({ENV_NAME[name]: "base facts" for name in updates})
    heads = KIMI_K3_HEADS // settings.tp
    return settings, extra, {"facts_from": where, "heads_per_rank": heads,
                             "vllm_version": basefacts.value(facts, "vllm_version"),
                             "decode_route": basefacts.route(facts, heads,
                                                             settings.kv_cache_dtype),
                             "notes": notes}, basefacts.unknown_env(facts, user_env or {})


def render(environ: Mapping[str, str] | None = None, dotenv: str | os.PathLike | None = ".env",
           passthrough: list[str] | None = None, host_paths: bool = False,
           check_model: bool = True, base: bool | dict[str, Any] = False) -> Rendered:
    """Settings -> vLLM env and argv."""
    environ = dict(os.environ if environ is None else environ)
    file_vals = read_dotenv(dotenv) if dotenv else {}
    settings, sources = load_settings(environ, dotenv, host_paths, check_model)
    check_repeats(list(passthrough or []), "an argument after the entrypoint")
    env = build_env(settings, environ, file_vals, sources, host=host_paths)
    base_info, extra, warnings = None, [], []
    if base is not False:
        user = {k: sources[k] for k in env if k.startswith(("VLLM_", "AITER_"))
                and sources.get(k) in ("env", ".env")}
        settings, extra, base_info, warnings = _apply_base(
            settings, sources, base, env.get("VLLM_ROCM_USE_AITER") == "1", user)
        env = build_env(settings, environ, file_vals, sources, host=host_paths)  # as changed
    argv = build_argv(settings, passthrough, extra)
    if extra:
        sources["argv:base"] = " ".join(extra)
    if passthrough:
        sources["argv:passthrough"] = " ".join(passthrough)
    return Rendered(settings=settings, env=env, argv=argv, sources=sources, base=base_info,
                    warnings=warnings)
