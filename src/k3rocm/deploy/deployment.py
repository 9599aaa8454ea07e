"""The deployment as every command sees it: one view of the K3_* settings, derived once.

:func:`load_deployment` renders the settings (shell > ``.env`` > profile > default) and derives
the server URL, served model, API key, model directory (host and container), results root,
image, and CPU stand-in or AMD GPUs (:func:`decide_cpu`, the one place that decides).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3rocm.serving.config import Rendered, read_dotenv, redact_env, render
from k3rocm.serving.settings import Settings

# compose.yaml mounts these host directories at these container paths (server and clients).
MODELS_MOUNT = "/models"
RESULTS_MOUNT = "/results"
CACHE_MOUNT = "/cache"
COMPOSE_BASE = "compose.yaml"
COMPOSE_CPU = "compose.cpu.yaml"
# compose.cpu.yaml's image default (a test keeps it equal)
CPU_IMAGE = "k3rocm/server:cpu"
CPU_PROFILE = "cpu-smoke"
KFD = Path("/dev/kfd")
VIEW_SETTINGS = ("K3_PROFILE", "K3_MODEL", "K3_SERVED_MODEL_NAME", "K3_PORT", "K3_BIND_ADDRESS",
                 "K3_API_KEY", "K3_MODELS_DIR", "K3_RESULTS_DIR", "K3_CACHE_DIR", "K3_IMAGE")


def _abs(path: str | os.PathLike) -> Path:
    """A host path made absolute against the working directory (symlinks kept)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path.cwd() / p


def _under(path: str, mount: str) -> str | None:
    """The part of container ``path`` below ``mount`` ('' for the mount itself), else None."""
    if path == mount:
        return ""
    if path.startswith(mount + "/"):
        return path[len(mount) + 1:]
    return None


def compose_files(cpu: bool) -> tuple[str, ...]:
    return (COMPOSE_BASE, COMPOSE_CPU) if cpu else (COMPOSE_BASE,)


def decide_cpu(environ: Mapping[str, str], profile: str | None,
               gpu: bool | None = None) -> tuple[bool, str]:
    """CPU stand-in (True) or AMD GPUs, and why; first match wins: 1. ``--gpu``/``--no-gpu``;
    2. ``COMPOSE_FILE`` naming compose.cpu.yaml (make exports it: k3rocm and compose must agree);
    3. ``K3_PROFILE=cpu-smoke``; 4. no ``/dev/kfd`` on this host.
    """
    if gpu is not None:
        return not gpu, "--gpu" if gpu else "--no-gpu"
    given = environ.get("COMPOSE_FILE", "")
    if given:
        sep = environ.get("COMPOSE_PATH_SEPARATOR") or os.pathsep
        return COMPOSE_CPU in {Path(f).name for f in given.split(sep) if f}, "COMPOSE_FILE"
    if profile == CPU_PROFILE:
        return True, f"K3_PROFILE={CPU_PROFILE}"
    present = KFD.exists()
    return not present, f"{KFD} {'present' if present else 'absent'}"


def url_host(bind_address: str) -> str:
    """Where a client on this host reaches a port published on ``bind_address``."""
    if bind_address in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bind_address == "::":
        return "[::1]"
    return f"[{bind_address}]" if ":" in bind_address else bind_address


@dataclass(frozen=True)
class Deployment:
    """What one deployment is, from the host's side. Paths are absolute host paths."""

    settings: Settings
    sources: dict[str, str]
    rendered: Rendered
    url: str
    served_model_name: str
    api_key: str | None
    model: str  # K3_MODEL as the server sees it (a container path or a Hub id)
    models_dir: Path  # host directory compose mounts at /models
    model_container_dir: str | None  # /models/... when K3_MODEL lies under the mount
    model_host_dir: Path | None  # the checkpoint on this host (None for a Hub id)
    tokenizer: Path | None  # host path of the checkpoint directory, when it is one
    results_root: Path  # host directory compose mounts at /results
    cache_dir: Path
    image: str
    cpu: bool  # the CPU stand-in (compose.cpu.yaml), else the AMD GPUs
    cpu_from: str  # which rule of decide_cpu decided
    env_file: str | None = None
    environ: Mapping[str, str] | None = None  # what it was rendered from (with .env): with_env

    @property
    def profile(self) -> str:
        return self.settings.profile

    @property
    def port(self) -> int:
        return self.settings.port

    @property
    def compose_files(self) -> tuple[str, ...]:
        return compose_files(self.cpu)

    def _mounts(self) -> tuple[tuple[Path, str], ...]:
        return ((self.results_root, RESULTS_MOUNT), (self.models_dir, MODELS_MOUNT),
                (self.cache_dir, CACHE_MOUNT))

    def container_path(self, host: str | os.PathLike) -> str | None:
        """Where a host path under the results, models or cache dir is seen
        in the server container, else None.
        """
        p = _abs(host)
        for root, mount in self._mounts():
            if p.is_relative_to(root):
                rel = p.relative_to(root)
                return mount + ("/" + str(rel) if str(rel) != "." else "")
        return None

    def host_path(self, container: str) -> Path | None:
        """Where a container path under /results, /models or /cache lives here."""
        for root, mount in self._mounts():
            rel = _under(container, mount)
            if rel is not None:
                return root / rel if rel else root
        return None

    def to_json(self) -> dict[str, Any]:
        """The resolved view, secrets redacted (what ``--print-deployment`` prints)."""
        out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()
               if k not in ("settings", "rendered", "sources", "environ")}
        return {**out, "compose_files": list(self.compose_files), "profile": self.profile,
                "api_key": redact_env({"K3_API_KEY": self.api_key or ""})["K3_API_KEY"] or None,
                "sources": {k: self.sources.get(k, "default") for k in VIEW_SETTINGS}}

    def with_env(self, check_model: bool = False, **overrides: str) -> Deployment:
        """This deployment re-rendered with ``overrides`` on top of its environment and .env
        (a selftest or demo server's), the CPU/GPU decision kept."""
        cpu_profile = self.sources.get("K3_PROFILE") == f"compose:{COMPOSE_CPU}"
        return _derive({**(self.environ or {}), **overrides}, self.env_file, check_model,
                       self.cpu, self.cpu_from, cpu_profile and "K3_PROFILE" not in overrides)


def load_deployment(environ: Mapping[str, str] | None = None, env_file: str | None = ".env",
                    check_model: bool = False, gpu: bool | None = None) -> Deployment:
    """The deployment from the settings. ``check_model``: the checkpoint must exist here
    (commands that start a server). UsageError (exit 2) on bad settings.
    """
    environ = dict(os.environ if environ is None else environ)
    dotenv_vals = read_dotenv(env_file) if env_file else {}
    profile = environ.get("K3_PROFILE") or dotenv_vals.get("K3_PROFILE") or None
    cpu, cpu_from = decide_cpu(environ, profile, gpu)
    return _derive(environ, env_file, check_model, cpu, cpu_from, cpu and not profile)


def _derive(environ: Mapping[str, str], env_file: str | None, check_model: bool, cpu: bool,
            cpu_from: str, cpu_profile: bool) -> Deployment:
    # compose.cpu.yaml sets K3_PROFILE=cpu-smoke in the server unless it is set: so do we.
    rendered = render({**environ, **({"K3_PROFILE": CPU_PROFILE} if cpu_profile else {})},
                      env_file, host_paths=True, check_model=check_model)
    s = rendered.settings
    sources = dict(rendered.sources)
    if cpu_profile:
        sources["K3_PROFILE"] = f"compose:{COMPOSE_CPU}"
    models_dir = _abs(s.models_dir)
    model_container_dir = host_dir = None
    rel = _under(s.model, MODELS_MOUNT)
    if rel is not None:
        model_container_dir = s.model
        host_dir = models_dir / rel if rel else models_dir
    elif s.model.startswith(("/", "./", "../", "~")):  # seen by the server only if mounted
        host_dir = _abs(s.model)

    image = CPU_IMAGE if cpu and sources.get("K3_IMAGE", "default") == "default" else s.image
    return Deployment(
        settings=s, sources=sources, rendered=rendered,
        url=f"http://{url_host(s.bind_address)}:{s.port}",
        served_model_name=s.served_model_name, api_key=s.api_key or None, model=s.model,
        models_dir=models_dir, model_container_dir=model_container_dir, model_host_dir=host_dir,
        tokenizer=host_dir, results_root=_abs(s.results_dir), cache_dir=_abs(s.cache_dir),
        image=image, cpu=cpu, cpu_from=cpu_from, env_file=str(env_file) if env_file else None,
        environ=environ)
