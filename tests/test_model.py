"""`k3rocm model`: download at a pinned revision, verify, and checkpoint identity.

The download runs the real huggingface_hub against a local HTTP server answering the Hub
endpoints it reads (HF_ENDPOINT): tree listing, resolve with X-Repo-Commit / ETag /
X-Linked-Etag, and 404 X-Error-Code RevisionNotFound (huggingface_hub 2.x hf_api,
file_download, utils/_http).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from kimi_k3_layout import real_config, write_checkpoint
from safetensors.numpy import save

from k3rocm.deploy import checkpoint
from k3rocm.deploy.checkpoint import REVISION, identity, verify

REPO = "moonshotai/Kimi-K3"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _tiny_repo() -> dict[str, bytes]:
    """A tiny checkpoint laid out like Kimi-K3's: config, tokenizer config, index, 2 shards
    (written by the safetensors library)."""
    rng = np.random.default_rng(0)
    tensors = [{"model.embed_tokens.weight": rng.standard_normal((100, 100), np.float32)},
               {"model.layers.0.self_attn.kv_a_layernorm.weight": np.ones(512, np.float32),
                "lm_head.weight": rng.integers(0, 255, (100, 100), np.uint8)}]
    shard = [save(t) for t in tensors]
    index = {"metadata": {"total_size": sum(a.nbytes for t in tensors for a in t.values())},
             "weight_map": {name: SHARDS[k] for k, t in enumerate(tensors) for name in t}}
    return {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "config.json": json.dumps({"architectures": ["KimiK3ForConditionalGeneration"],
                                   "model_type": "kimi_k3"}).encode(),
        "tokenizer_config.json": b'{"model_max_length": 1048576}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        SHARDS[0]: shard[0], SHARDS[1]: shard[1],
    }


def _blob_id(data: bytes) -> str:  # git's blob id, what the Hub reports as "oid"
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """The Hub endpoints huggingface_hub reads, for ``files`` at ``revision``; ``log`` records
    (method, file name or "tree", Range) of every file or listing answered."""

    def __init__(self, files: dict[str, bytes], revision: str = REVISION):
        self.files, self.revision, self.log = files, revision, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: bytes, headers: dict) -> None:
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                resolve, tree = f"/{REPO}/resolve/", f"/api/models/{REPO}/tree/"
                if path.startswith(resolve):
                    rev, _, name = path[len(resolve):].partition("/")
                    if rev == hub.revision and name in hub.files:
                        return self._file(name)
                    kind = "EntryNotFound"
                elif path.startswith(tree) and self.command == "GET":
                    if path[len(tree):] == hub.revision:
                        return self._tree()
                    kind = "RevisionNotFound"
                else:
                    kind = "RepoNotFound"
                self._send(404, json.dumps({"error": kind}).encode(),
                           {"X-Error-Code": kind, "Content-Type": "application/json"})

            do_HEAD = do_GET

            def _file(self, name: str) -> None:
                data, rng = hub.files[name], self.headers.get("Range")
                hub.log.append((self.command, name, rng))
                start = int(rng.split("=")[1].split("-")[0]) if rng and self.command == "GET" \
                    else 0
                tag = ({"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"',
                        "X-Linked-Size": str(len(data))} if name.endswith(".safetensors")
                       else {"ETag": f'"{_blob_id(data)}"'})
                self._send(206 if start else 200, data[start:],
                           {"X-Repo-Commit": hub.revision, **tag})

            def _tree(self) -> None:
                hub.log.append(("GET", "tree", None))
                entries = [{"type": "file", "path": name, "size": len(data), "oid": _blob_id(data),
                            **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                        "pointerSize": 134}} if name.endswith(".safetensors")
                               else {})} for name, data in hub.files.items()]
                self._send(200, json.dumps(entries).encode(),
                           {"Content-Type": "application/json"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fetched(self) -> list[str]:
        return sorted(name for method, name, _ in self.log if method == "GET" and name != "tree")


@pytest.fixture
def hub():
    h = FakeHub(_tiny_repo())
    yield h
    h.server.shutdown()
    h.server.server_close()


def _env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "",
            "K3_MODELS_DIR": str(tmp_path / "models")}


def _copy(tmp_path: Path, files: dict[str, bytes], name: str = "ckpt") -> Path:
    d = tmp_path / name
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    return d


def test_identity_of_a_copy_hashes_config_and_index_only(tmp_path):
    files = _tiny_repo()
    d = _copy(tmp_path, files)
    ident = identity(d)
    assert ident == {
        "path": str(d.resolve()), "repo_id": None, "revision": None, "revision_source": None,
        "config_sha256": hashlib.sha256(files["config.json"]).hexdigest(),
        "index_sha256": hashlib.sha256(files["model.safetensors.index.json"]).hexdigest(),
        "index_total_size": 100 * 100 * 4 + 512 * 4 + 100 * 100,
        "files": len(files), "total_bytes": sum(len(v) for v in files.values())}
    json.dumps(ident)
    assert identity(tmp_path / "nothing-here") is None
    (tmp_path / "empty").mkdir()
    assert identity(tmp_path / "empty") is None
    # a huggingface_hub local_dir download without our record: its commit is the revision
    meta = d / ".cache" / "huggingface" / "download" / "config.json.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{REVISION}\n\"etag\"\n1764000000.0\n")
    got = identity(d)
    assert (got["revision"], got["revision_source"]) == (REVISION,
                                                          "huggingface_hub download metadata")
    assert got["files"] == len(files)  # bookkeeping under .cache is not counted


def test_verify_names_what_is_missing_or_wrong(tmp_path):
    files = _tiny_repo()
    d = _copy(tmp_path, files)
    assert verify(d) == []  # a missing shard: test_verify_cli_exit_codes
    (d / "config.json").unlink()
    assert "config.json is missing" in verify(d)
    # sizes are checked when the record lists them
    d2 = _copy(tmp_path, files, "sized")
    (d2 / checkpoint.RECORD).write_text(json.dumps(
        {"repo_id": REPO, "revision": REVISION,
         "files": {n: len(v) for n, v in files.items()}}))
    assert verify(d2, REVISION) == []
    (d2 / SHARDS[0]).write_bytes(files[SHARDS[0]][:-10])
    (d2 / "tokenizer_config.json").unlink()
    n0 = len(files[SHARDS[0]])
    assert verify(d2, REVISION) == [
        f"shard {SHARDS[0]} has {n0 - 10} bytes, the Hub lists {n0}",
        f"shard {SHARDS[0]} is short: {n0 - 10} bytes, its header's data offsets end at {n0} "
        "(0.0 MB missing)", "tokenizer_config.json (revision listing) is missing"]
    assert verify(d2, "0" * 40)[-1] == f"this copy is revision {REVISION}, not {'0' * 40}"


def test_verify_cli_exit_codes(tmp_path, k3):
    """The entry point once (a subprocess), the rest in-process: one FAIL line per problem."""
    d = _copy(tmp_path, _tiny_repo())
    ok = run_cli("model", "--verify", "--dir", str(d))
    assert ok.returncode == 0 and f"ok: {d} is complete" in ok.stdout, ok
    assert json.loads(ok.stdout[:ok.stdout.rindex("}") + 1])["config_sha256"]
    assert "Traceback" not in ok.stderr
    (d / SHARDS[0]).unlink()
    (d / "model-00003-of-00003.safetensors").write_bytes(b"\0" * 16)
    r = k3("model", "--verify", "--dir", str(d))
    assert r.returncode == 1, r
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[0] == (f"FAIL shard {SHARDS[0]} (listed in "
                                            "model.safetensors.index.json) is missing"), lines
    assert lines[1].startswith("FAIL the 1 readable shard(s) of 2 declare ")
    assert lines[2].startswith("FAIL extra shard model-00003-of-00003.safetensors")
    assert lines[3].endswith("3 problem(s); `make model` fetches what is missing")
    for argv, fragment in (([str(tmp_path / "absent")], "does not exist"),
                           ([str(d), "--revision", "main"], "not a 40-hex commit")):
        r = k3("model", "--verify", "--dir", *argv)
        assert r.returncode == 2 and fragment in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_verify_checks_each_shards_bytes_against_its_header_and_the_index(tmp_path):
    files = _tiny_repo()
    n0, n1 = len(files[SHARDS[0]]), len(files[SHARDS[1]])
    d = _copy(tmp_path, files)
    (d / SHARDS[1]).write_bytes(files[SHARDS[1]][:-100])  # a partial rsync
    (d / "model-00003-of-00003.safetensors").write_bytes(files[SHARDS[0]])  # another revision's
    got = verify(d)
    assert got == [
        f"shard {SHARDS[1]} is short: {n1 - 100} bytes, its header's data offsets end at {n1} "
        "(0.0 MB missing)",
        f"extra shard model-00003-of-00003.safetensors ({n0} bytes): neither the index nor the "
        "revision listing names it"]

    # an index that declares far more than its shards hold (57 MB of shards, 913.7 GB indexed)
    d = _copy(tmp_path, files, "big")
    idx = json.loads(files["model.safetensors.index.json"])
    idx["metadata"]["total_size"] = 913_700_000_000
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    assert verify(d) == ["the 2 readable shard(s) of 2 declare 52048 bytes (0.1 MB) of tensors; "
                         "model.safetensors.index.json total_size is 913700000000 (913.7 GB)"]

    # trailing bytes, a tensor the index puts in a shard that lacks it, a header that is not one
    d = _copy(tmp_path, files, "odd")
    (d / SHARDS[0]).write_bytes(files[SHARDS[0]] + b"\0" * 8)
    idx = json.loads(files["model.safetensors.index.json"])
    idx["weight_map"]["model.norm.weight"] = SHARDS[1]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    got = verify(d)
    assert got == [f"shard {SHARDS[0]} has 8 bytes past its header's last tensor",
                   f"shard {SHARDS[1]} lacks 1 tensor(s) model.safetensors.index.json puts "
                   "there (e.g. model.norm.weight)"]
    (d / SHARDS[1]).write_bytes(b"\xff" * 64)
    got = verify(d)
    assert f"shard {SHARDS[1]}: not a safetensors file (header length 18446744073709551615)" in got
    assert any("declare 40000 bytes" in x for x in got), got
    (d / SHARDS[1]).write_bytes(files[SHARDS[1]][:50])  # cut inside its header
    assert (f"shard {SHARDS[1]}: truncated safetensors header (50 bytes, the header alone "
            "needs ") in verify(d)[1]


@pytest.fixture(scope="module")
def full_size_copy(tmp_path_factory) -> Path:
    """Kimi-K3's 96 shards at full size as sparse files (1.57 TB apparent, a few MB on disk)."""
    d = tmp_path_factory.mktemp("full") / "Kimi-K3"
    write_checkpoint(d, real_config(), shards=96, data=False)
    return d


def test_verify_reads_headers_only_at_full_size(full_size_copy):
    """1.57 TB verifies in seconds (headers only); a partial copy: test_verify_cli_exit_codes.
    A subprocess: in pytest's heap the garbage collector slows the 500k-entry headers."""
    t0 = time.monotonic()
    ok = run_cli("model", "--verify", "--dir", str(full_size_copy), timeout=120)
    assert ok.returncode == 0 and "is complete" in ok.stdout, ok.stdout[-2000:] + ok.stderr
    assert time.monotonic() - t0 < 60
    assert "verify: 96/96 shard headers read, 1567.7 GB of tensor data declared" in ok.stderr
    assert json.loads(ok.stdout[:ok.stdout.rindex("}") + 1])["index_total_size"] == \
        1_567_665_185_408


def test_download_resume_and_dry_run_against_a_local_hub(hub, tmp_path):
    env = _env(hub, tmp_path)
    target = tmp_path / "models" / "Kimi-K3"  # K3_MODELS_DIR + the default K3_MODEL
    dry = run_cli("model", "--dry-run", env=env)
    assert dry.returncode == 0, dry
    assert "would fetch 6 of 6 files" in dry.stdout and f"fetch {SHARDS[0]}" in dry.stdout
    assert hub.fetched() == [] and not target.exists()

    first = run_cli("model", env=env, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    for name, data in hub.files.items():
        assert (target / name).read_bytes() == data, name
    assert hub.fetched() == sorted(hub.files)
    rec = json.loads((target / checkpoint.RECORD).read_text())
    assert (rec["repo_id"], rec["revision"]) == (REPO, REVISION)
    assert rec["lfs_sha256"][SHARDS[1]] == hashlib.sha256(hub.files[SHARDS[1]]).hexdigest()
    ident = identity(target)
    assert (ident["revision"], ident["revision_source"]) == (REVISION, "k3rocm model")
    assert ident["index_sha256"] == hashlib.sha256(
        hub.files["model.safetensors.index.json"]).hexdigest()

    # resumable: only the missing shard is fetched again; its partial file (named as
    # huggingface_hub's _local_folder names it) goes
    from huggingface_hub._local_folder import _short_hash

    hub.log.clear()
    (target / SHARDS[1]).unlink()
    etag = hashlib.sha256(hub.files[SHARDS[1]]).hexdigest()
    partial = (target / ".cache" / "huggingface" / "download" /
               f"{_short_hash(SHARDS[1] + '.metadata')}.{etag}.0123abcd.incomplete")
    partial.write_bytes(hub.files[SHARDS[1]][:1000])
    check = run_cli("model", "--verify", env=env)
    assert check.returncode == 1 and "note: 1 partial file(s)" in check.stdout, check
    again = run_cli("model", env=env, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert hub.fetched() == [SHARDS[1]]
    assert "5 already in" in again.stderr and not partial.exists()
    assert (target / SHARDS[1]).read_bytes() == hub.files[SHARDS[1]]


def test_download_refuses_bad_input_before_fetching(hub, tmp_path):
    env = _env(hub, tmp_path)
    unknown = run_cli("model", "--revision", "1" * 40, env=env)
    assert unknown.returncode == 2 and f"has no revision {'1' * 40}" in unknown.stderr, unknown
    offline = run_cli("model", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and "HF_HUB_OFFLINE" in offline.stderr
    other = tmp_path / "other"
    other.mkdir()
    (other / checkpoint.RECORD).write_text(json.dumps({"revision": "2" * 40}))
    clash = run_cli("model", "--dir", str(other), env=env)
    assert clash.returncode == 2 and "holds revision 2222" in clash.stderr
    for r in (unknown, offline, clash):
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert hub.fetched() == []
