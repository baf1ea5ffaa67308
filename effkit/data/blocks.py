"""Tokenize documents once (cached), pack them into fixed blocks, and serve deterministic batches.

The sampler draws a fresh permutation of the training blocks per epoch from the seed. Each optimizer
step consumes one *global* batch (batch_size x data-parallel size x grad_accum blocks); data-parallel
rank r takes its own disjoint slice of every micro-step, so the global batch is the same whatever the
parallel mode, and position is just the step number (which makes resuming exact).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from effkit.data.corpus import Corpus
from effkit.data.tokenizer import cache_dir, checksum_ok, note_rebuilt, token_byte_lengths, write_checksum
from effkit.errors import EffkitError


def _tokenize(docs, tokenizer) -> np.ndarray:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    texts = [t for _, t in docs]
    for start in range(0, len(texts), 64):
        for seq in tokenizer(texts[start:start + 64], add_special_tokens=False)["input_ids"]:
            ids.extend(seq)
            ids.append(eos)
    dtype = np.uint16 if len(tokenizer) < 65535 else np.int32
    return np.asarray(ids, dtype=dtype)


def token_cache_path(corpus: Corpus, tokenizer, part: str) -> Path:
    tok_key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
    return cache_dir() / "tokens" / f"{corpus.fingerprint(part)}-{tok_key}-{part}.npy"


def token_stream(corpus: Corpus, tokenizer, part: str) -> np.ndarray:
    """Token ids of a split, documents joined by end-of-text, cached as .npy (no pickle)."""
    path = token_cache_path(corpus, tokenizer, part)
    if path.is_file():
        if checksum_ok(path):
            try:
                return np.load(path, allow_pickle=False)
            except (ValueError, OSError, EOFError):
                pass
        note_rebuilt("token", path)
    arr = _tokenize(corpus.train if part == "train" else corpus.heldout, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, arr, allow_pickle=False)
    write_checksum(tmp)
    Path(f"{tmp}.sha256").replace(f"{path}.sha256")
    tmp.replace(path)
    return arr


@dataclass
class BlockData:
    train: torch.Tensor  # (n_train_blocks, block_size) int64
    eval: torch.Tensor  # (n_eval_blocks, block_size) int64: the fixed held-out blocks
    train_tokens: int
    heldout_tokens: int
    eval_bytes: int = 0  # UTF-8 bytes of the text the held-out blocks predict (their tokens 1..T-1)
    eval_docs: tuple[int, ...] = ()  # the held-out document each eval block comes from (its middle token's)


def spread_blocks(stream: np.ndarray, block_size: int, n: int, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """`n` of the stream's aligned, non-overlapping blocks, evenly spaced over the whole held-out text (so every
    document long enough to hold one contributes, in proportion to its length), and the document of each: the
    number of end-of-text tokens before the block's middle token. (The first `n` blocks would be one or two
    documents, and an interval over them would speak for those only.)"""
    total = len(stream) // block_size
    picks = (np.arange(n, dtype=np.int64) * total) // n
    starts = picks * block_size
    eos_at = np.flatnonzero(stream == eos) if eos is not None else np.empty(0, dtype=np.int64)
    docs = np.searchsorted(eos_at, starts + block_size // 2, side="left")
    return starts, docs


def load_blocks(corpus: Corpus, tokenizer, block_size: int, eval_blocks: int) -> BlockData:
    train = token_stream(corpus, tokenizer, "train")
    held = token_stream(corpus, tokenizer, "heldout")
    n_train = len(train) // block_size
    n_eval = min(eval_blocks, len(held) // block_size)
    if n_train < 1:
        raise EffkitError(f"the training split has {len(train)} tokens, less than one block of {block_size}; "
                          "use more data or a smaller --block-size")
    if n_eval < 1:
        raise EffkitError(f"the held-out split has {len(held)} tokens, less than one block of {block_size}; "
                          "use more data, a larger --heldout-fraction or a smaller --block-size")
    to_blocks = lambda a, n: torch.from_numpy(a[: n * block_size].astype(np.int64)).view(n, block_size)  # noqa: E731
    starts, docs = spread_blocks(held, block_size, n_eval, tokenizer.eos_token_id)
    eval_blocks_t = torch.from_numpy(np.stack([held[s:s + block_size] for s in starts]).astype(np.int64))
    eval_bytes = int(token_byte_lengths(tokenizer)[eval_blocks_t[:, 1:].numpy()].sum())
    return BlockData(to_blocks(train, n_train), eval_blocks_t, len(train), len(held), eval_bytes,
                     tuple(int(d) for d in docs))


def check_batch(n_blocks: int, global_batch: int) -> None:
    """One global batch must fit in the training split (checked before anything allocates a batch)."""
    if n_blocks < global_batch:
        raise EffkitError(f"the training split has {n_blocks} blocks, fewer than one global batch of "
                          f"{global_batch}; lower --batch-size/--grad-accum or use more data")


class BlockSampler(torch.utils.data.Sampler):
    """Yields, for each micro-step from `start_step` on, the block indices of this rank's micro-batch."""

    def __init__(self, n_blocks: int, batch_size: int, grad_accum: int, dp_size: int = 1, dp_rank: int = 0,
                 seed: int = 0, start_step: int = 0):
        self.global_batch = batch_size * grad_accum * dp_size
        check_batch(n_blocks, self.global_batch)
        self.n_blocks, self.batch_size, self.grad_accum = n_blocks, batch_size, grad_accum
        self.dp_size, self.dp_rank, self.seed, self.start_step = dp_size, dp_rank, seed, start_step
        self.steps_per_epoch = n_blocks // self.global_batch

    def step_indices(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(self.n_blocks, generator=torch.Generator().manual_seed(self.seed + epoch))
        return perm[within * self.global_batch:(within + 1) * self.global_batch]

    def __iter__(self):
        step = self.start_step
        while True:
            idx = self.step_indices(step)
            for micro in range(self.grad_accum):
                start = (micro * self.dp_size + self.dp_rank) * self.batch_size
                yield idx[start:start + self.batch_size].tolist()
            step += 1


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return self.blocks[i]


def make_loader(blocks: torch.Tensor, sampler: BlockSampler, workers: int = 0):
    return torch.utils.data.DataLoader(_Blocks(blocks), batch_sampler=sampler, num_workers=workers,
                                       persistent_workers=workers > 0)

