"""Held-out evaluation: the next-token loss (`lm_loss`, also the training loss), the held-out blocks in batches on
the model's device (`eval_batches`), `evaluate` (mean loss, its interval by document, per-block losses for paired
comparisons, perplexity, bits per byte), `bits_per_byte`, `eval_summary` (what reports keep) and the protocol
reports name (`EVAL_PROTOCOL`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from effkit.measure import stats
from effkit.measure.hardware import autocast_ctx, model_device

EVAL_PROTOCOL = ("token-level mean cross-entropy over the fixed held-out blocks (documents held out by a hash "
                 "of their id; eval_blocks non-overlapping blocks of block_size spread evenly over the whole "
                 "held-out text, so every held-out document contributes in proportion to its length); "
                 "perplexity = exp(loss); bits per byte = loss x predicted tokens / ln 2 / UTF-8 bytes of the "
                 "predicted text")


def lm_loss(logits: torch.Tensor, blocks: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a batch of blocks (each block predicts its own tokens 1..T-1)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), blocks[:, 1:].reshape(-1),
                           reduction=reduction)


def eval_batches(model, blocks: torch.Tensor, batch_size: int):
    """The held-out blocks in batches, on the model's device."""
    device = model_device(model)
    for start in range(0, len(blocks), batch_size):
        yield blocks[start:start + batch_size].to(device)


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int, amp_dtype: torch.dtype | None = None,
             block_losses: Callable[[torch.Tensor], torch.Tensor] | None = None,
             eval_bytes: int = 0, docs: Sequence[int] | None = None) -> dict[str, Any]:
    """Mean next-token cross-entropy over the held-out blocks, its 95% interval (by document with `docs`, each
    block's held-out document; see `stats.mean_ci`), and the per-block losses and documents (`block_losses`,
    `block_docs`: for paired comparisons between models on the same blocks; `eval_summary` drops them). With
    `eval_bytes` (the UTF-8 bytes of the predicted text), also bits per byte: the figure that compares across
    tokenizers. `block_losses(batch)` replaces the model's own forward where it cannot give logits alone (a
    pipeline stage)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    per_block: list[float] = []
    for batch in eval_batches(model, blocks, batch_size):
        if block_losses is not None:
            per_block += block_losses(batch).tolist()
            continue
        with autocast_ctx(device, amp_dtype):
            logits = model(batch).logits
        losses = lm_loss(logits, batch, reduction="none").view(batch.shape[0], -1).mean(1)
        per_block += losses.tolist()
    model.train(was_training)
    docs = list(docs) if docs else None
    loss, lo, hi = stats.mean_ci(per_block, docs)  # every block predicts the same number of tokens
    out = {"eval_loss": loss, "perplexity": math.exp(min(loss, 50)), "eval_tokens": blocks[:, 1:].numel(),
           "eval_loss_ci95": [lo, hi], "eval_interval": stats.interval_by(docs, len(per_block)),
           "block_losses": per_block, "block_docs": docs}
    if eval_bytes:
        out.update(bits_per_byte=bits_per_byte(loss, out["eval_tokens"], eval_bytes), eval_bytes=eval_bytes)
    return out


def bits_per_byte(loss_nats_per_token: float, tokens: int, n_bytes: int) -> float:
    """Held-out loss in bits per UTF-8 byte of the predicted text: nats/token x tokens / ln 2 / bytes."""
    return loss_nats_per_token * tokens / math.log(2) / n_bytes


def eval_summary(result: dict[str, Any]) -> dict[str, Any]:
    """An `evaluate` result without its per-block losses and documents (what reports keep)."""
    return {k: v for k, v in result.items() if k not in ("block_losses", "block_docs")}
