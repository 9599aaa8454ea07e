"""``k3rocm config``: the resolved serving settings, where each came from, and the settings list."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3rocm.deploy.deployment import CPU_PROFILE
from k3rocm.errors import UsageError
from k3rocm.options import DeploymentFlags
from k3rocm.rundir import table
from k3rocm.serving import profiles
from k3rocm.serving.config import (
    KNOWN_OTHER,
    KNOWN_PREFIXES,
    is_secret,
    redact_env,
    render,
)
from k3rocm.serving.settings import ENV_NAME, FIELDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    DeploymentFlags.add_arguments(parser)
    parser.add_argument("--list", action="store_true", help="list every K3_* setting and exit")
    parser.add_argument("--markdown", action="store_true",
                        help="print the settings table in markdown (the README's table)")
    parser.add_argument("--json", action="store_true", help="print settings and sources as JSON")
    parser.add_argument("--vendor-env-file", metavar="PATH", default=None,
                        help="write the vendor variables set in this shell (VLLM_*, AITER_*, "
                        "NCCL_*, ...) to PATH for compose's env_file, so the server container "
                        "gets what this command prints (`make up` and `make build` do this; "
                        "`make config` writes nothing)")
    parser.add_argument("--make-dirs", action="store_true",
                        help="create K3_CACHE_DIR and K3_RESULTS_DIR as the invoking user (else "
                        "Docker creates the mount sources as root)")
    parser.add_argument("--base-facts", action="store_true",
                        help="also apply the base facts recorded in the serving image "
                        "(K3_IMAGE, if built) and show what the server will change or refuse "
                        "at start (`make config` does this)")
    parser.add_argument("--host-paths", action="store_true",
                        help="check /models/... paths against K3_MODELS_DIR on this host "
                        "(what `make config` does before compose mounts it)")


def deployment_view(args: argparse.Namespace) -> dict:
    """``--print-deployment``: with --host-paths the checkpoint is checked, as the command's own
    render checks it."""
    return args.deployment.with_env(True).to_json() if args.host_paths else {}


def write_vendor_env(path: Path, rendered) -> None:
    """The shell's vendor variables, one KEY=VALUE per line (compose env_file), atomically."""
    from k3rocm.rundir import write_text_atomic

    lines = [f"{k}={v}" for k, v in sorted(rendered.env.items())
             if rendered.sources.get(k) == "env" and not k.startswith("K3_")
             and not is_secret(k)]  # secrets: compose passes HF_TOKEN by name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "# written by `k3rocm config --vendor-env-file`: vendor variables "
                      "from the shell, for compose\n" + "".join(x + "\n" for x in lines))


def image_base_facts(image: str) -> tuple[dict | None, str]:
    """The base facts in a local image's manifest (one short container run), or None."""
    from k3rocm.deploy.engine import docker_client
    from k3rocm.serving.basefacts import MANIFEST

    client = docker_client(timeout=60, required=False)
    if client is None:
        return None, "unknown (no Docker engine)"
    try:
        img = client.images.get(image)
        out = client.containers.run(img.id, entrypoint=["cat", str(MANIFEST)], remove=True,
                                    stdout=True, stderr=False)
        facts = json.loads(out).get("base_facts")
    except Exception as exc:  # noqa: BLE001 - no image, an older image, no manifest
        return None, f"unknown ({image}: {exc.__class__.__name__}; `make build` first)"
    if not facts:
        return None, f"unknown ({image} was built without base facts: `make build`)"
    return facts, f"{image} ({img.id[:19]}) manifest"


def base_pending(rendered, why: str) -> dict[str, str]:
    """Before the base facts are applied (none known, or not asked): what the server's base
    check will decide at start, per K3_* name (``basefacts.DECIDES``: a default it may change,
    an explicit value it may refuse), and the graph mode under MTP. {} when the facts were
    applied, or when AITER is off (the server checks nothing then)."""
    from k3rocm.serving.basefacts import DECIDES, sets_graph_mode

    s = rendered.settings
    if rendered.base is not None or rendered.env.get("VLLM_ROCM_USE_AITER") != "1":
        return {}
    out = {ENV_NAME[f]: ("the base decides at start" if rendered.sources.get(ENV_NAME[f],
                                                                           "default") == "default"
                         else "the base checks it at start") + f": {why}" for f in DECIDES}
    if s.mtp_k > 0 and not s.enforce_eager and not sets_graph_mode(s):
        out["argv"] = (f"graph mode: vLLM's default unless the base's MTP verify path syncs the "
                       f"host (then --compilation-config PIECEWISE); the base decides at start: "
                       f"{why}")
    return out


def settings_table() -> str:
    smoke = profiles.get(CPU_PROFILE)["settings"]

    def cell(v) -> str:  # as .env spells it: a bool as 0/1
        return "" if v is None else str(int(v) if isinstance(v, bool) else v)

    return "\n".join(table(["Setting", "Default", f"Profile `{CPU_PROFILE}`", "Description"], "", (
        [f"`{ENV_NAME[name]}`", f"`{cell(f.default)}`",
         "`(unset)`" if name in smoke and smoke[name] is None else
         f"`{cell(smoke[name])}`" if cell(smoke.get(name)) else "", f.description]
        for name, f in FIELDS.items()))) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(settings_table())
        return 0
    if args.list:
        for name, f in FIELDS.items():
            print(f"{ENV_NAME[name]:<30} {f.description}")
        for key, text in KNOWN_OTHER.items():
            print(f"{key:<30} {text}")
        for prefix in KNOWN_PREFIXES:
            print(f"{prefix + '*':<30} reserved (tests and the client container)")
        return 0
    base_line, why = None, "run with --base-facts to apply the image's"
    rendered = render(dotenv=args.env_file, host_paths=args.host_paths)
    if args.base_facts:
        facts, where = image_base_facts(rendered.settings.image)
        if facts is None:
            base_line = f"base facts: {where}; the server checks them at start"
            why = ("facts unknown until `make build`" if "make build" in where else
                   f"facts {where}")
        else:
            try:
                rendered = render(dotenv=args.env_file, host_paths=args.host_paths, base=facts)
            except UsageError as exc:
                raise UsageError(f"{exc} [base facts from {where}]") from None
            rendered.base["facts_from"] = where
            from k3rocm.serving.serve_cmd import warn

            warn(rendered)
    if args.vendor_env_file:
        write_vendor_env(Path(args.vendor_env_file), rendered)
    if args.make_dirs:
        for d in (rendered.settings.cache_dir, rendered.settings.results_dir):
            Path(d).expanduser().mkdir(parents=True, exist_ok=True)
    s = rendered.settings.model_dump()
    pending = base_pending(rendered, why)
    if args.json:
        json.dump({"settings": s, "sources": rendered.sources, **rendered.to_json(),
                   **({"base_decides": pending} if pending else {})},
                  sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    print(f"profile: {rendered.settings.profile}")
    for key, value in redact_env({ENV_NAME[name]: v for name, v in s.items()}).items():
        value = f"{value} ({pending[key]})" if key in pending else value
        print(f"  {key:<30} {value!s:<40} [{rendered.sources.get(key, 'default')}]")
    print("vLLM environment:")
    for key, value in redact_env(rendered.env).items():
        value = f"{value} ({pending[key]})" if key in pending else value
        print(f"  {key:<30} {value!s:<40} [{rendered.sources.get(key, '')}]")
    print("argv:")
    print("  " + " \\\n    ".join(rendered.argv))
    if "argv" in pending:
        print(f"  ({pending['argv']})")
    if base_line:
        print(base_line)
    elif rendered.base is not None:
        from k3rocm.serving.basefacts import describe

        head, *notes = describe(rendered.base)
        print(head)
        for note in notes:
            print(f"  {note}")
    return 0
