"""Byte-level BPE tokenizer trained with `tokenizers` on the training split, cached by corpus fingerprint."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from effkit.data.corpus import Corpus
from effkit.errors import EffkitError

EOS = "<|endoftext|>"


def cache_dir() -> Path:
    root = Path(os.environ.get("EFFKIT_CACHE", Path.home() / ".cache" / "effkit"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def write_checksum(path: Path) -> None:
    """Record the sha256 of a cache file beside it (`<name>.sha256`), so a later read can verify it."""
    Path(f"{path}.sha256").write_text(hashlib.sha256(Path(path).read_bytes()).hexdigest())


def checksum_ok(path: Path) -> bool:
    """Whether a cache file is intact: it exists and matches the checksum recorded when it was written."""
    sums = Path(f"{path}.sha256")
    if not (Path(path).is_file() and sums.is_file()):
        return False
    return sums.read_text().strip() == hashlib.sha256(Path(path).read_bytes()).hexdigest()


def note_rebuilt(what: str, path: Path) -> None:
    print(f"effkit: the {what} cache {path} was corrupt or incomplete; rebuilt it", file=sys.stderr)


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   pad_token=EOS, model_max_length=1_000_000)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes of the text each token id stands for (0 for special tokens such as end-of-text). A byte-level
    BPE token string spells one byte per character, so its length is exact; other tokenizers decode each id."""
    n = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    byte_level = type(getattr(tokenizer.backend_tokenizer, "decoder", None)).__name__ == "ByteLevel"
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    return np.array([0 if i in special else len(t) if byte_level else len(tokenizer.decode([i]).encode("utf-8"))
                     for i, t in enumerate(tokens)], dtype=np.int64)


def train_tokenizer(corpus: Corpus, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for _, text in corpus.train), trainer=trainer)
    return _wrap(tok)


def tokenizer_cache_path(corpus: Corpus, vocab_size: int) -> Path:
    return cache_dir() / "tokenizers" / f"bpe-{corpus.fingerprint('train')}-v{vocab_size}"


TOKENIZER_FILES = ("tokenizer.json", "vocab.json")  # a fast tokenizer's file, or a BPE's vocabulary (+ merges.txt)


def saved_tokenizer(folder: str | Path):
    """The tokenizer saved in the model folder (or hub id) `folder`, or one line naming what is missing: without its
    files transformers builds an empty tokenizer that turns every prompt into no tokens."""
    from transformers import AutoTokenizer

    if Path(folder).is_dir() and not any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        raise EffkitError(f"{folder} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt); copy them "
                          "from the artifact it was made from, or write it again")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - a missing or corrupt file: the user gets the folder
        raise EffkitError(f"could not load the tokenizer of {folder} ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]})") from None


def get_tokenizer(corpus: Corpus, vocab_size: int, pretrained: str | None = None):
    """Return (tokenizer, source). A pretrained model folder brings its own tokenizer; otherwise train
    (or reuse from the cache) a BPE tokenizer on the corpus' training split."""
    from transformers import AutoTokenizer

    if pretrained is not None:
        tok = saved_tokenizer(pretrained)
        if tok.eos_token is None:
            raise EffkitError(f"the tokenizer of {pretrained} has no end-of-text token")
        return tok, f"pretrained:{pretrained}"
    path = tokenizer_cache_path(corpus, vocab_size)
    if path.exists():
        if checksum_ok(path / "tokenizer.json"):
            try:
                return AutoTokenizer.from_pretrained(path), f"cache:{path}"
            except Exception:  # noqa: BLE001 - any failure to read the cache means: rebuild it
                pass
        shutil.rmtree(path, ignore_errors=True)
        note_rebuilt("tokenizer", path)
    tok = train_tokenizer(corpus, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    tok.save_pretrained(tmp)
    write_checksum(tmp / "tokenizer.json")
    try:
        tmp.rename(path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(path), f"trained:{path}"
