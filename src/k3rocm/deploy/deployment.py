"""The deployment as every command sees it: one view of the K3_* settings, derived once.

:func:`load_deployment` reads the settings the one way (:func:`k3rocm.serving.config.render` with
host paths: shell > ``.env`` > profile > default, one ``.env`` parser) and derives what the server,
the clients and the run records need: the server URL, the served model name, the API key, the model
directory (host and container view), the tokenizer, the results root, the serving image and the
compose files. ``k3rocm <command> --print-deployment`` prints what a command resolved.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3rocm.serving.config import Rendered, Settings, redact_env, render

# compose.yaml mounts these host directories at these container paths (server and clients).
MODELS_MOUNT = "/models"
RESULTS_MOUNT = "/results"
CACHE_MOUNT = "/cache"
COMPOSE_BASE = "compose.yaml"
COMPOSE_CPU = "compose.cpu.yaml"
# compose.cpu.yaml's image default (compose.yaml's is Settings.image's default).
CPU_IMAGE = "k3rocm/server:cpu"
CPU_PROFILE = "cpu-smoke"
# The settings a deployment view is derived from (their sources are part of the view).
VIEW_SETTINGS = ("K3_PROFILE", "K3_MODEL", "K3_SERVED_MODEL_NAME", "K3_PORT", "K3_BIND_ADDRESS",
                 "K3_API_KEY", "K3_MODELS_DIR", "K3_RESULTS_DIR", "K3_CACHE_DIR", "K3_IMAGE")


def _abs(path: str | os.PathLike) -> Path:
    """A host path as an absolute path (relative ones are relative to where compose runs: the
    working directory), without resolving symlinks."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path.cwd() / p


def _under(path: str, mount: str) -> str | None:
    """The part of container ``path`` below ``mount`` ('' for the mount itself), else None."""
    if path == mount:
        return ""
    if path.startswith(mount + "/"):
        return path[len(mount) + 1:]
    return None


def compose_files(environ: Mapping[str, str], profile: str | None) -> tuple[str, ...]:
    """The compose files a ``docker compose`` call uses: ``COMPOSE_FILE`` when set (the Makefile
    exports it), else compose.yaml, plus compose.cpu.yaml for the cpu-smoke profile."""
    given = environ.get("COMPOSE_FILE", "")
    if given:
        sep = environ.get("COMPOSE_PATH_SEPARATOR") or os.pathsep
        return tuple(f for f in given.split(sep) if f)
    return (COMPOSE_BASE, COMPOSE_CPU) if profile == CPU_PROFILE else (COMPOSE_BASE,)


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
    compose_files: tuple[str, ...]
    env_file: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def profile(self) -> str:
        return self.settings.profile

    @property
    def port(self) -> int:
        return self.settings.port

    def compose_command(self, project: str | None = None) -> list[str]:
        """``docker compose [-p project] -f compose.yaml [-f compose.cpu.yaml]``: the one way
        to reach this deployment's containers."""
        cmd = ["docker", "compose"] + (["-p", project] if project else [])
        for f in self.compose_files:
            cmd += ["-f", f]
        return cmd

    def container_path(self, host: str | os.PathLike) -> str | None:
        """Where a host path under the results root or models dir is seen in the server
        container (/results/..., /models/...), else None."""
        p = _abs(host)
        for root, mount in ((self.results_root, RESULTS_MOUNT), (self.models_dir, MODELS_MOUNT)):
            try:
                rel = p.relative_to(root)
            except ValueError:
                continue
            return mount + ("/" + str(rel) if str(rel) != "." else "")
        return None

    def host_path(self, container: str) -> Path | None:
        """Where a server container path under /results, /models or /cache lives on this
        host, else None."""
        for mount, root in ((RESULTS_MOUNT, self.results_root), (MODELS_MOUNT, self.models_dir),
                            (CACHE_MOUNT, self.cache_dir)):
            rel = _under(container, mount)
            if rel is not None:
                return root / rel if rel else root
        return None

    def to_json(self) -> dict[str, Any]:
        """The resolved view, secrets redacted (what ``--print-deployment`` prints)."""
        return {
            "url": self.url, "served_model_name": self.served_model_name,
            "api_key": redact_env({"K3_API_KEY": self.api_key or ""})["K3_API_KEY"] or None,
            "model": self.model, "models_dir": str(self.models_dir),
            "model_container_dir": self.model_container_dir,
            "model_host_dir": str(self.model_host_dir) if self.model_host_dir else None,
            "tokenizer": str(self.tokenizer) if self.tokenizer else None,
            "results_root": str(self.results_root), "cache_dir": str(self.cache_dir),
            "image": self.image, "compose_files": list(self.compose_files),
            "profile": self.profile, "env_file": self.env_file,
            "sources": {k: self.sources.get(k, "default") for k in VIEW_SETTINGS},
        }


def load_deployment(environ: Mapping[str, str] | None = None, env_file: str | None = ".env",
                    check_model: bool = False) -> Deployment:
    """The deployment from the settings (shell > ``env_file`` > profile > default).

    ``check_model``: also check that the checkpoint exists on this host (commands that start
    a server); clients leave it off. Raises UsageError (one line, exit 2) on bad settings.
    """
    environ = dict(os.environ if environ is None else environ)
    notes: list[str] = []
    # compose.cpu.yaml sets K3_PROFILE=cpu-smoke in the server unless it is set: so do we.
    files = compose_files(environ, None)
    from k3rocm.serving.config import read_dotenv

    dotenv_vals = read_dotenv(env_file) if env_file else {}
    profile_from_compose = (COMPOSE_CPU in {Path(f).name for f in files}
                            and not environ.get("K3_PROFILE") and not dotenv_vals.get("K3_PROFILE"))
    if profile_from_compose:
        environ["K3_PROFILE"] = CPU_PROFILE
    rendered = render(environ, env_file, host_paths=True, check_model=check_model)
    s = rendered.settings
    sources = dict(rendered.sources)
    if profile_from_compose:
        sources["K3_PROFILE"] = f"compose:{COMPOSE_CPU}"
    files = compose_files(environ, s.profile)

    models_dir = _abs(s.models_dir)
    model_container_dir = host_dir = None
    rel = _under(s.model, MODELS_MOUNT)
    if rel is not None:
        model_container_dir = s.model
        host_dir = models_dir / rel if rel else models_dir
    elif s.model.startswith(("/", "./", "../", "~")):
        host_dir = _abs(s.model)
        notes.append(f"K3_MODEL={s.model} is not under {MODELS_MOUNT}: the server container "
                     "sees it only if it is mounted there")
    tokenizer = host_dir if host_dir is not None else None

    image = s.image
    if sources.get("K3_IMAGE", "default") == "default" and \
            COMPOSE_CPU in {Path(f).name for f in files}:
        image = CPU_IMAGE
    return Deployment(
        settings=s, sources=sources, rendered=rendered,
        url=f"http://{url_host(s.bind_address)}:{s.port}",
        served_model_name=s.served_model_name, api_key=s.api_key or None, model=s.model,
        models_dir=models_dir, model_container_dir=model_container_dir, model_host_dir=host_dir,
        tokenizer=tokenizer, results_root=_abs(s.results_dir), cache_dir=_abs(s.cache_dir),
        image=image, compose_files=files, env_file=str(env_file) if env_file else None,
        notes=notes)
