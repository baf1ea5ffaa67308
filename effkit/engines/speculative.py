"""Speculative decoding: a draft proposes k tokens, the target checks them all in one forward, and the output is
exactly the target's greedy text (it is the target's argmax at every position; the draft only decides how many
positions one forward settles).

- `Draft`: what a draft is (`propose(context, k) -> tokens`); `NgramDraft` (prompt lookup) is the one built in: it
  finds the context's last n-gram earlier in the context and proposes what followed it there. A model draft plugs in
  as another `Draft`.
- `speculative_loop`: greedy decoding of one row with a `verify(tokens, cached)` of the engine's, which rolls its
  KV cache back to the first `cached` positions, runs `tokens` after them and returns their logits; rows of a batch
  run one after another, each with its own cache (their acceptances differ, so a batch would wait for its slowest
  row and pad the rest), so a batch's output is each row's own greedy text.
- `SpecStats`: acceptance rate, tokens per target forward and the draft's share of the time.
- `first_divergence` / `check_exact`: exactness checked, not assumed: a mismatch with the target alone is an error
  that says where it diverged. Exactness needs a target whose logits for a token do not depend on the other tokens
  of the same run: fp32 graphs hold to it up to rounding, and so do ONNX Runtime's weight-only MatMulNBits (4 or 8
  bits; at accuracy level 4 its activations are quantized per row and block); its dynamic int8 does not (one
  activation scale over every token of a run), and the check says so.
- `choose_k`: k (and whether to draft at all) chosen by measurement under `effkit.measure.choice.choose`, its
  samples kept, exactness checked on every contender's first call; `write_settings` records the pick in the
  artifact's folder (`SETTINGS`), where the ONNX Runtime engine's loader reads it (`read_settings`).

Transformers runs the same for the PyTorch engine (`prompt_lookup_num_tokens=`, `assistant_model=`), so these are
the `generate` keywords every engine here takes (`generate_kwargs`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from effkit.errors import EffkitError

DRAFT_KINDS = ("ngram", "model")
K_CANDIDATES = (2, 4, 6, 8)  # draft tokens per step that `choose_k` measures
NGRAM_MAX = 3  # the longest n-gram the lookup matches (longest first, down to one token)


class Draft(Protocol):
    kind: str  # one of DRAFT_KINDS

    def propose(self, context: np.ndarray, k: int) -> np.ndarray:
        """At most `k` tokens (int64, possibly none) the draft expects after `context` (1-d int64)."""


@dataclass(frozen=True)
class NgramDraft:
    """Prompt lookup: the context's last n tokens (n from `max_ngram` down to 1) found earlier in the context, most
    recent occurrence first; the tokens that followed it there are the proposal, repeated where they reach the end
    (the text repeats with the period the match found). No model, no cost but a search."""

    max_ngram: int = NGRAM_MAX
    kind: str = "ngram"

    def propose(self, context: np.ndarray, k: int) -> np.ndarray:
        ctx = np.asarray(context)
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), 0, -1):
            # windows that end before the last token, so that each has a token after it
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:n_ctx - 1], n)
            hits = np.flatnonzero((windows == ctx[n_ctx - n:]).all(axis=1))
            if len(hits):  # copied as LZ77 copies, overlapping: a loop of period p near the end goes on past it
                start = hits[-1] + n
                return np.resize(ctx[start:], k).astype(np.int64) if k > 0 else np.zeros(0, np.int64)
        return np.zeros(0, np.int64)


@dataclass
class SpecStats:
    """What a speculative decoding did: new tokens, target forwards (the prompt's included), draft tokens proposed
    and accepted, seconds in the draft and in all."""

    new_tokens: int = 0
    forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    total_s: float = 0.0

    def add(self, other: SpecStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        """Its figures; None for what the loop did not count (an engine's own loop reports its forwards and the
        tokens each gave, not what its draft proposed or took: `proposed` and `total_s` left at 0)."""
        return {"new_tokens": self.new_tokens, "target_forwards": self.forwards, "proposed": self.proposed,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
                "tokens_per_target_forward": self.new_tokens / self.forwards if self.forwards else 0.0,
                "draft_share_of_time": self.draft_s / self.total_s if self.total_s else None}


def _targets(logits: np.ndarray, first: int, min_new_tokens: int, eos: int | None) -> np.ndarray:
    """The target's greedy token at each of `logits`' positions (m, vocab), the first being new token number
    `first`: end-of-text masked while tokens are owed, as `decoder_step.never_end` does for the plain loop."""
    if eos is not None and 0 <= eos < logits.shape[-1] and first < min_new_tokens:
        logits = logits.copy()
        logits[:min_new_tokens - first, eos] = -np.inf
    return logits.argmax(-1).astype(np.int64)


def _tensor(tokens: Any) -> Any:
    """A streamer's input: transformers' streamers take torch tensors."""
    import torch

    return torch.as_tensor(np.asarray(tokens, np.int64))


def speculative_row(verify: Callable[[np.ndarray, int], np.ndarray], prompt: np.ndarray, max_new_tokens: int,
                    draft: Draft, k: int, eos: int | None, min_new_tokens: int = 0, streamer: Any = None,
                    stats: SpecStats | None = None) -> np.ndarray:
    """One row: `prompt` (1-d int64) and exactly `max_new_tokens` greedy tokens of the target. `verify(tokens,
    cached)`: the engine keeps its cache's first `cached` positions, runs `tokens` (1-d) after them and returns their
    logits (len(tokens), vocab). Each step feeds the last token (not yet in the cache) and the draft's proposal, and
    keeps the proposal's longest prefix equal to the target's own tokens, plus the target's token after it."""
    stats = stats if stats is not None else SpecStats()
    start = time.perf_counter()
    out = list(prompt)
    if max_new_tokens > 0:
        out.append(int(_targets(verify(np.asarray(prompt, np.int64), 0)[-1:], 0, min_new_tokens, eos)[0]))
        stats.forwards += 1
        if streamer is not None:
            streamer.put(_tensor(out[-1:]))
    while len(out) - len(prompt) < max_new_tokens:
        made = len(out) - len(prompt)
        t = time.perf_counter()
        proposal = draft.propose(np.asarray(out, np.int64), min(k, max_new_tokens - made - 1))
        stats.draft_s += time.perf_counter() - t
        feed = np.concatenate([np.asarray(out[-1:], np.int64), proposal])
        targets = _targets(verify(feed, len(out) - 1), made, min_new_tokens, eos)
        agree = proposal == targets[:len(proposal)]
        accepted = len(proposal) if agree.all() else int(agree.argmin())
        new = targets[:accepted + 1]  # the accepted drafts are the target's own tokens; then the target's next
        out += new.tolist()
        stats.forwards += 1
        stats.proposed += len(proposal)
        stats.accepted += accepted
        if streamer is not None:
            streamer.put(_tensor(new))
    stats.new_tokens += len(out) - len(prompt)
    stats.total_s += time.perf_counter() - start
    return np.asarray(out, np.int64)


def speculative_loop(new_verifier: Callable[[], Callable[[np.ndarray, int], np.ndarray]], ids: np.ndarray,
                     max_new_tokens: int, draft: Draft, k: int, eos: int | None, min_new_tokens: int = 0,
                     streamer: Any = None) -> tuple[np.ndarray, SpecStats]:
    """The prompts `ids` (batch, n) and exactly `max_new_tokens` greedy tokens each, row by row (`speculative_row`,
    each with a fresh cache from `new_verifier()`); with the batch's statistics. `streamer` (batch 1 only, as
    transformers') gets the prompt, then the tokens of each step."""
    if k < 1:
        raise EffkitError(f"speculative decoding needs at least 1 draft token per step (got k={k})")
    if streamer is not None and ids.shape[0] != 1:
        raise EffkitError("a streamer takes one row; stream speculative decoding at batch 1")
    stats = SpecStats()
    if streamer is not None:
        streamer.put(_tensor(ids))
    rows = [speculative_row(new_verifier(), row, max_new_tokens, draft, k, eos, min_new_tokens, streamer, stats)
            for row in ids]
    if streamer is not None:
        streamer.end()
    return np.stack(rows), stats


def draft_of(kwargs: dict[str, Any]) -> tuple[Draft, int] | None:
    """The draft and k a `generate` call asks for with transformers' keywords: `prompt_lookup_num_tokens=k` (an
    n-gram draft), or `assistant_model=` (a `Draft`) with `num_assistant_tokens=k`; None: plain decoding."""
    if kwargs.get("prompt_lookup_num_tokens"):
        return NgramDraft(), int(kwargs["prompt_lookup_num_tokens"])
    if (assistant := kwargs.get("assistant_model")) is not None:
        if not callable(getattr(assistant, "propose", None)):
            raise EffkitError(f"assistant_model must propose tokens (a speculative Draft), not "
                              f"{type(assistant).__name__}")
        return assistant, int(kwargs.get("num_assistant_tokens") or 4)
    return None


def generate_kwargs(kind: str, k: int) -> dict[str, Any]:
    """The `generate` keywords of an n-gram draft of `k` tokens, which the PyTorch engine (transformers) and effkit's
    own loops read alike."""
    if kind != "ngram":
        raise EffkitError(f"draft kind {kind!r} needs a draft model; the built-in draft is ngram")
    return {"prompt_lookup_num_tokens": k}


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where `other` differs from `reference` (or where one ends first); None: identical."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def check_exact(reference: Sequence[int], other: Sequence[int], what: str) -> None:
    """A one-line error where `other` (speculative) is not token for token `reference` (the target alone)."""
    if (i := first_divergence(list(reference), list(other))) is not None:
        near = lambda s: list(s[max(0, i - 3):i + 3])  # noqa: E731
        raise EffkitError(f"{what} diverged from the target's greedy tokens at new token {i}: target {near(reference)}"
                          f", speculative {near(other)} (tokens {max(0, i - 3)}..)")


@dataclass
class KChoice:
    """`choose_k`'s outcome: the draft kind and k picked (k 0: plain decoding measured faster or not beaten), the
    choice's record (its samples kept) and each k's speculative statistics over the prompts."""

    kind: str
    k: int
    choice: dict[str, Any]
    per_k: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"draft": self.kind, "k": self.k, "per_k": self.per_k, "choice": self.choice}


def choose_k(model: Any, prompts: Sequence[np.ndarray], new_tokens: int, ks: Sequence[int] = K_CANDIDATES,
             kind: str = "ngram", rule: Any = None) -> KChoice:
    """k for `model` (an engine's loaded model: `generate` with transformers' keywords) chosen by
    `choice.choose` among plain greedy decoding (the default, kept unless beaten) and the draft at each of `ks`,
    in tokens per second over `prompts` (1-d int64 each; every prompt, every call). Every contender's first call is
    checked token for token against plain decoding (`check_exact`): one that diverges fails, and the choice records
    it among the invalid, with where, never picked."""
    import torch

    from effkit.measure.choice import Rule, choose
    from effkit.measure.timing import settle_time

    def run(kw: dict[str, Any]) -> tuple[list[list[int]], float, SpecStats | None]:
        made, t, stats = [], time.perf_counter(), SpecStats()
        for p in prompts:
            ids = torch.as_tensor(np.asarray(p, np.int64))[None]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0, **kw)
            made.append(out[0, ids.shape[1]:].tolist())
            if kw and isinstance(s := getattr(model, "speculative_stats", None), SpecStats):
                stats.add(s)
        return made, time.perf_counter() - t, stats if stats.forwards else None

    plain = run({})[0]
    per_k: dict[str, dict[str, Any]] = {}

    def contender(name: str, kw: dict[str, Any]) -> Callable[[], float]:
        checked = False

        def once() -> float:
            nonlocal checked
            made, seconds, stats = run(kw)
            if not checked:
                for i, (a, b) in enumerate(zip(plain, made, strict=True)):
                    check_exact(a, b, f"{name} on prompt {i}")
                checked = True
                if stats is not None:  # the engine's own loop counts its forwards (transformers' does not say)
                    per_k[name] = stats.to_dict()
            return sum(map(len, made)) / seconds
        once.settle_s = settle_time(model)
        return once

    names = {"plain": {}, **{f"k{k}": generate_kwargs(kind, k) for k in ks}}
    c = choose({n: contender(n, kw) for n, kw in names.items()}, higher_is_better=True, rule=rule or Rule(),
               default="plain")
    return KChoice(kind, 0 if c.picked == "plain" else int(c.picked[1:]), c.to_dict(), per_k)


SETTINGS = "speculative.json"  # beside an artifact: the draft kind and k measured for it, with the choice's record


def write_settings(folder: Path, chosen: KChoice, how: str) -> dict[str, Any]:
    """Record `chosen` (`choose_k`'s) in the artifact `folder`, where its engine's loader reads it (`read_settings`):
    the draft kind, k (0: plain decoding was not beaten), `how` it was measured (prompts, tokens, batch) and the
    choice with its samples."""
    record = {**chosen.to_dict(), "measured": how, "applies": "greedy decoding at batch 1 (rows of a larger batch "
              "would each run alone, one after another; a batch runs plain batched decoding unless asked)"}
    (Path(folder) / SETTINGS).write_text(json.dumps(record, indent=2))
    return record


def read_settings(folder: Path) -> dict[str, Any] | None:
    """The draft kind and k recorded in `folder` (`write_settings`), None where none is (or k is 0); a record
    naming a draft this effkit has no built-in for is refused in one line."""
    path = Path(folder) / SETTINGS
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        kind, k = record["draft"], int(record["k"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EffkitError(f"{path} is unreadable ({type(e).__name__}); measure the draft again") from None
    if kind != "ngram":
        raise EffkitError(f"{path} names a {kind!r} draft; effkit loads only n-gram drafts from an artifact's folder")
    return {"draft": kind, "k": k} if k > 0 else None
