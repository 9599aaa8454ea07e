"""Where the GSM8K items come from, checked before anything expensive starts.

Three sources, tried in this order:

1. ``--data-dir DIR``: a local directory with ``train.jsonl`` and ``test.jsonl`` (one JSON object
   a line with ``question`` and ``answer``; the answer ends in ``#### <number>``), for air-gapped
   nodes. Run through a task file (``tasks/gsm8k.yaml`` in the run directory, passed with
   ``--include_path``) that keeps ``task: gsm8k`` and every setting of lm-eval's built-in task but
   reads ``dataset_path: json`` with ``dataset_kwargs.data_files``.
2. The Hugging Face hub cache (``<HF_HOME>/hub/datasets--openai--gsm8k/snapshots/<rev>/main/``,
   what ``huggingface-cli download openai/gsm8k --repo-type dataset`` or an online
   ``load_dataset`` leaves behind): the same task file with ``dataset_path: parquet`` on those
   files, so no network is needed.
3. The ``datasets`` arrow cache (``<HF_HOME>/datasets/openai___gsm8k/main``): lm-eval's built-in
   task as is, with ``HF_DATASETS_OFFLINE=1`` and ``HF_HUB_OFFLINE=1``.

None of them -> :class:`UsageError` (exit 2) with one line saying how to provide the data.
"""

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

HOW_TO = ("pass --data-dir DIR with train.jsonl and test.jsonl (fields question, answer ending "
          "in '#### N'), or put openai/gsm8k in the HF cache (--hf-home, default $HF_HOME or "
          "~/.cache/huggingface) with `huggingface-cli download openai/gsm8k --repo-type dataset`")

# Mount points inside the client container.
DATA_MOUNT = "/data/gsm8k"
HF_MOUNT = "/hf"


@dataclass
class DataSource:
    kind: str  # "local-jsonl" | "hf-hub-parquet" | "hf-datasets-cache"
    host_dir: Path  # mounted into the container
    mount: str
    files: dict[str, str] = field(default_factory=dict)  # split -> path inside the container
    host_files: dict[str, Path] = field(default_factory=dict)
    test_items: int | None = None
    builder: str | None = None  # "json" | "parquet" | None (built-in task)

    @property
    def needs_task_file(self) -> bool:
        return self.builder is not None

    def describe(self) -> str:
        return f"{self.kind} at {self.host_dir}"

    def provenance(self) -> dict:
        return {
            "kind": self.kind,
            "host_dir": str(self.host_dir),
            "container_dir": self.mount,
            "files": {split: {"host": str(p), "container": self.files.get(split),
                              "sha256": sha256_file(p), "bytes": p.stat().st_size}
                      for split, p in self.host_files.items()},
            "test_items": self.test_items,
            "builder": self.builder or "lm-eval built-in (openai/gsm8k from the datasets cache)",
        }



def check_jsonl(path: Path) -> int:
    """Every line is an object with a non-empty question and an answer ending in ``#### N``.

    Returns the item count; raises UsageError naming the file and line of the first bad item.
    """
    if not path.is_file():
        raise UsageError(f"GSM8K data: {path} is missing; {HOW_TO}")
    count = 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"GSM8K data: {path}:{lineno} is not JSON ({exc.msg}); "
                                 "each line must be an object with question and answer") from None
            if not isinstance(item, dict) or not isinstance(item.get("question"), str) \
                    or not item["question"].strip() or not isinstance(item.get("answer"), str):
                raise UsageError(f"GSM8K data: {path}:{lineno} needs string fields question and "
                                 "answer")
            if not ANSWER_RE.search(item["answer"]):
                raise UsageError(f"GSM8K data: {path}:{lineno} answer does not end in "
                                 f"'#### <number>': {item['answer'][-40:]!r}")
            count += 1
    if count == 0:
        raise UsageError(f"GSM8K data: {path} has no items; {HOW_TO}")
    return count


def local_source(data_dir: Path) -> DataSource:
    data_dir = data_dir.expanduser().resolve()
    if not data_dir.is_dir():
        raise UsageError(f"GSM8K data: --data-dir {data_dir} is not a directory; {HOW_TO}")
    train, test = data_dir / "train.jsonl", data_dir / "test.jsonl"
    n_train = check_jsonl(train)
    if n_train < 5:
        raise UsageError(f"GSM8K data: {train} has {n_train} items; 5-shot needs at least 5")
    n_test = check_jsonl(test)
    return DataSource(
        kind="local-jsonl", host_dir=data_dir, mount=DATA_MOUNT, builder="json",
        files={"train": f"{DATA_MOUNT}/train.jsonl", "test": f"{DATA_MOUNT}/test.jsonl"},
        host_files={"train": train, "test": test}, test_items=n_test)


def _hub_snapshot(hf_home: Path) -> DataSource | None:
    repo = hf_home / "hub" / HF_REPO_DIR
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return None
    revs = []
    ref = repo / "refs" / "main"
    if ref.is_file():
        revs.append(ref.read_text().strip())
    revs += sorted(p.name for p in snaps.iterdir() if p.is_dir())
    for rev in revs:
        split_files = {}
        for split in ("train", "test"):
            found = sorted((snaps / rev / "main").glob(f"{split}-*.parquet"))
            if found:
                split_files[split] = found
        if set(split_files) == {"train", "test"}:
            if any(len(v) != 1 for v in split_files.values()):
                continue  # sharded layout: leave it to the datasets cache path
            host_files = {s: v[0] for s, v in split_files.items()}
            if not all(p.exists() for p in host_files.values()):  # dangling blob links
                continue
            mount = f"{HF_MOUNT}/hub/{HF_REPO_DIR}"
            return DataSource(
                kind="hf-hub-parquet", host_dir=repo, mount=mount, builder="parquet",
                files={s: f"{mount}/{p.relative_to(repo)}" for s, p in host_files.items()},
                host_files=host_files, test_items=None)
    return None


def _arrow_cache(hf_home: Path) -> DataSource | None:
    base = Path(os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets")
    main = base / ARROW_DIR / "main"
    if main.is_dir() and any(main.rglob("*test*.arrow")):
        return DataSource(kind="hf-datasets-cache", host_dir=hf_home, mount=HF_MOUNT)
    return None


def hf_home_candidates(explicit: str | None) -> list[Path]:
    if explicit:
        return [Path(explicit).expanduser()]
    out = []
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]))
    out.append(Path(os.environ.get("K3_CACHE_DIR") or "./cache") / "huggingface")
    out.append(Path("~/.cache/huggingface").expanduser())
    return out


def resolve(data_dir: str | None, hf_home: str | None) -> DataSource:
    """Pick the data source (see the module doc) or fail with one line."""
    if data_dir:
        return local_source(Path(data_dir))
    candidates = hf_home_candidates(hf_home)
    for home in candidates:
        home = home.resolve()
        src = _hub_snapshot(home) or _arrow_cache(home)
        if src:
            return src
    looked = ", ".join(str(p) for p in candidates)
    raise UsageError(f"no GSM8K data found (looked in {looked}): {HOW_TO}")


# lm-eval 0.4.13's built-in tasks/gsm8k/gsm8k.yaml with only the data source replaced
# (tests/test_gsm8k_unit.py checks every other key against the installed lm-eval).
_TASK_TEMPLATE = r"""# Written by k3rocm gsm8k: lm-eval's built-in gsm8k task (lm-eval 0.4.13),
# data from {source}. Keeps `task: gsm8k` so results, metrics and filters are named as upstream
# (the built-in's `tag: math_word_problems` is left out: it would shadow the built-in tag).
task: gsm8k
dataset_path: {builder}
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{{{question}}}}\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore:
      - ","
      - "\\$"
      - "(?s).*#### "
      - "\\.$"
generation_kwargs:
  until:
    - "Question:"
    - "</s>"
    - "<|im_end|>"
  do_sample: false
  temperature: 0.0
repeats: 1
num_fewshot: 5
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\-?[0-9\\.\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 3.0
"""


def task_yaml(src: DataSource) -> str:
    if not src.needs_task_file:
        raise ValueError("the built-in task needs no task file")
    return _TASK_TEMPLATE.format(source=src.describe(), builder=src.builder,
                                 train=json.dumps(src.files["train"]),
                                 test=json.dumps(src.files["test"]))
