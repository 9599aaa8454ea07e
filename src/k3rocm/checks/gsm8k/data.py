"""Where the GSM8K items come from, checked before anything expensive: ``--data-dir`` (jsonl),
else the HF hub cache's parquet snapshot, else the ``datasets`` arrow cache (offline); the run's
task file is the shipped one (vLLM PR #52494's) with only its dataset lines adapted."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from k3rocm.errors import UsageError
from k3rocm.hashing import sha256_file

GSM8K_TEST_ITEMS = 1319
HF_REPO_DIR = "datasets--openai--gsm8k"
ARROW_DIR = "openai___gsm8k"
ANSWER_RE = re.compile(r"####\s*(-?[0-9][0-9,.]*)\s*$")
HOW_TO = ("run `make gsm8k-data` once on a node with HF hub access (or `huggingface-cli download "
          "openai/gsm8k --repo-type dataset`; --hf-home, default $HF_HOME, "
          "K3_CACHE_DIR/huggingface, ~/.cache/huggingface), or pass --data-dir DIR with "
          "train.jsonl and test.jsonl (fields question, answer ending in '#### N')")
TASK_FILE = Path(__file__).with_name("gsm8k.yaml")
SHIPPED_DATASET = ("dataset_path: openai/gsm8k", "dataset_name: main")
DATA_MOUNT, HF_MOUNT = "/data/gsm8k", "/hf"  # in the client container


class NoDataError(UsageError):
    """No GSM8K items anywhere (as opposed to items that are there but bad)."""


@dataclass
class DataSource:
    kind: str  # "local-jsonl" | "hf-hub-parquet" | "hf-datasets-cache"
    host_dir: Path  # mounted at ``mount`` in the container
    mount: str
    host_files: dict[str, Path] = field(default_factory=dict)  # split -> file under host_dir
    test_items: int | None = None
    builder: str | None = None  # "json" | "parquet" | None (the shipped task as is)

    @property
    def files(self) -> dict[str, str]:
        """split -> its path in the container"""
        return {s: f"{self.mount}/{p.relative_to(self.host_dir)}"
                for s, p in self.host_files.items()}

    def describe(self) -> str:
        return f"{self.kind} at {self.host_dir}"

    def provenance(self) -> dict:
        return {"kind": self.kind, "host_dir": str(self.host_dir), "container_dir": self.mount,
                "files": {split: {"host": str(p), "container": self.files.get(split),
                                  "sha256": sha256_file(p), "bytes": p.stat().st_size}
                          for split, p in self.host_files.items()},
                "test_items": self.test_items,
                "builder": self.builder or "openai/gsm8k main from the datasets arrow cache"}


def check_jsonl(path: Path) -> int:
    """The item count; UsageError naming the file and line of the first bad item."""
    if not path.is_file():
        raise UsageError(f"GSM8K data: {path} is missing; {HOW_TO}")
    count = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"GSM8K data: {path}:{lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where} is not JSON ({exc.msg}); each line must be an object "
                                 "with question and answer") from None
            if not isinstance(item, dict) or not isinstance(item.get("question"), str) \
                    or not item["question"].strip() or not isinstance(item.get("answer"), str):
                raise UsageError(f"{where} needs string fields question and answer")
            if not ANSWER_RE.search(item["answer"]):
                raise UsageError(f"{where} answer does not end in '#### <number>': "
                                 f"{item['answer'][-40:]!r}")
            count += 1
    if count == 0:
        raise UsageError(f"GSM8K data: {path} has no items; {HOW_TO}")
    return count


def local_source(data_dir: Path) -> DataSource:
    data_dir = data_dir.expanduser().resolve()
    if not data_dir.is_dir():
        raise UsageError(f"GSM8K data: --data-dir {data_dir} is not a directory; {HOW_TO}")
    train, test = data_dir / "train.jsonl", data_dir / "test.jsonl"
    if (n_train := check_jsonl(train)) < 5:
        raise UsageError(f"GSM8K data: {train} has {n_train} items; 5-shot needs at least 5")
    return DataSource(kind="local-jsonl", host_dir=data_dir, mount=DATA_MOUNT, builder="json",
                      host_files={"train": train, "test": test}, test_items=check_jsonl(test))


def _hub_snapshot(hf_home: Path) -> DataSource | None:
    repo = hf_home / "hub" / HF_REPO_DIR
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo / "refs" / "main"
    revs = [ref.read_text().strip()] if ref.is_file() else []
    for rev in revs + sorted(p.name for p in snaps.iterdir() if p.is_dir()):
        found = {split: sorted((snaps / rev / "main").glob(f"{split}-*.parquet"))
                 for split in ("train", "test")}
        # one file per split (sharded: left to the datasets cache), no dangling blob links
        if all(len(v) == 1 and v[0].exists() for v in found.values()):
            return DataSource(kind="hf-hub-parquet", host_dir=repo, builder="parquet",
                              mount=f"{HF_MOUNT}/hub/{HF_REPO_DIR}",
                              host_files={s: v[0] for s, v in found.items()})
    return None


def _arrow_cache(hf_home: Path) -> DataSource | None:
    main = Path(os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets") / ARROW_DIR / "main"
    if main.is_dir() and any(main.rglob("*test*.arrow")):
        return DataSource(kind="hf-datasets-cache", host_dir=hf_home, mount=HF_MOUNT)
    return None


def hf_home_candidates(explicit: str | None, cache_dir: Path | None = None) -> list[Path]:
    """--hf-home, else $HF_HOME, <K3_CACHE_DIR>/huggingface, ~/.cache/huggingface."""
    homes = (explicit,) if explicit else (
        os.environ.get("HF_HOME"), cache_dir and Path(cache_dir) / "huggingface",
        "~/.cache/huggingface")
    return [Path(h).expanduser() for h in homes if h]


def resolve(data_dir: str | None, hf_home: str | None,
            cache_dir: Path | None = None) -> DataSource:
    """The first data source found (module doc), else one line saying how to provide it."""
    if data_dir:
        return local_source(Path(data_dir))
    candidates = hf_home_candidates(hf_home, cache_dir)
    for home in candidates:
        if src := _hub_snapshot(home.resolve()) or _arrow_cache(home.resolve()):
            return src
    looked = ", ".join(str(p) for p in candidates)
    raise NoDataError(f"no GSM8K data found (looked in {looked}): {HOW_TO}")


def task_yaml(src: DataSource | None) -> str:
    """The run's task file: the shipped one, its two dataset lines replaced for local or parquet
    items."""
    text = TASK_FILE.read_text(encoding="utf-8")
    if src is None or src.builder is None:
        return text
    lines = text.splitlines()
    if [ln for ln in lines if ln.startswith("dataset_")] != list(SHIPPED_DATASET):
        raise ValueError(f"{TASK_FILE} must name the data set with exactly {SHIPPED_DATASET}")
    data_lines = [f"# data: {src.describe()}", f"dataset_path: {src.builder}", "dataset_kwargs:",
                  "  data_files:", f"    train: {json.dumps(src.files['train'])}",
                  f"    test: {json.dumps(src.files['test'])}"]
    out = []
    for ln in lines:
        if ln == SHIPPED_DATASET[0]:
            out += data_lines
        elif ln != SHIPPED_DATASET[1]:
            out.append(ln)
    return "\n".join(out) + "\n"
