"""Workloads: what the bench times, what the results are keyed by, what the deliverable is chosen for.

A workload is data (optimum-benchmark's way), not code: a name, a kind (`prefill`: one forward of (batch,
tokens); `decode`: greedy generation with the KV cache from `batch` prompts), a batch and, optionally, a token
count. Its name is its one spelling on the command line and in recipes (`--optimize-for decode-b12`); every key
derived from it (the bench's measure, a row's figure and its paired ratio, the peer table's column) comes from the
properties below, so the bench, the results, the reports, the deliverable's choice and the CLI agree by
construction. Adding a workload is one `register(Workload(...))` line: the bench measures it for every artifact
and peer, its ratios land in bench.json, and `optimize_for` accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from effkit.errors import EffkitError
from effkit.registry import load_plugins

KINDS = ("prefill", "decode")
DECODE_TOKENS = 128  # new tokens of a decode workload that names none: the bench's default, and what `auto` times


@dataclass(frozen=True)
class Workload:
    name: str  # decode-b12: the one spelling
    kind: str  # prefill | decode
    batch: int
    tokens: int | None = None  # prefill: tokens per row (None: the model's block); decode: new tokens (None: the
    # bench's --gen-tokens, DECODE_TOKENS by default)
    prompts: int = 0  # decode: 0, the one fixed prompt; n, n prompts drawn from the held-out documents, the same for
    # every artifact and peer of a bench (`measure.generation.heldout_prompts`), round r timing prompt r mod n

    def __post_init__(self):
        if self.kind not in KINDS or self.batch < 1 or (self.tokens is not None and self.tokens < 1) \
                or self.prompts < 0:
            raise EffkitError(f"workload {self.name!r}: kind must be one of {', '.join(KINDS)}, batch and tokens at "
                              f"least 1 (got {self.kind!r}, {self.batch}, {self.tokens})")

    @property
    def key(self) -> str:
        """`decode_b12`: the name as a JSON key (the peer table's column, `same_rounds`)."""
        return self.name.replace("-", "_")

    @property
    def tail(self) -> str:
        """The name past its kind (`b12` of decode-b12, `b12_long` of decode-b12-long, the whole name where it does
        not start with its kind). Every key below is `<what>_<tail>`, so two workloads' keys differ because their
        names do (register refuses the few names that would still meet, e.g. a decode named `foo` and `decode-foo`),
        and the built-ins, named `<kind>-b<batch>`, keep the keys their reports and readers already use."""
        return self.key.removeprefix(f"{self.kind}_")

    @property
    def measure(self) -> str:
        """The bench's measure (its rounds, its stopping record): `latency_b12` for prefill, `decode_b12`."""
        return f"{'latency' if self.kind == 'prefill' else 'decode'}_{self.tail}"

    @property
    def figure(self) -> str:
        """A bench row's own figure: `latency_b12` (p50/p90/p99 seconds) or `decode_tokens_per_s_b12`."""
        return self.measure if self.kind == "prefill" else f"decode_tokens_per_s_{self.tail}"

    @property
    def ratio(self) -> str:
        """A row's paired ratio to the reference: `latency_ratio_b12` or `decode_ratio_b12`."""
        return f"{'latency' if self.kind == 'prefill' else 'decode'}_ratio_{self.tail}"

    @property
    def keys(self) -> frozenset[str]:
        """Every key derived from this workload, in bench.json and the bench's plan."""
        return frozenset((self.key, self.measure, self.figure, self.ratio))

    @property
    def higher_is_better(self) -> bool:
        """Decode is tokens/s (higher is faster); prefill is seconds (lower is faster)."""
        return self.kind == "decode"

    @property
    def label(self) -> str:
        """`decode b12`, as tables print it."""
        return self.name.replace("-", " ", 1)


_TABLE: dict[str, Workload] = {}


def register(w: Workload) -> Workload:
    """Add (or replace, by name) a workload; the bench measures every registered one. A workload whose keys are
    another's would overwrite that one's figures and ratios in the bench's rows, so it is refused."""
    for other in _TABLE.values():
        if other.name != w.name and (shared := sorted(w.keys & other.keys)):
            raise EffkitError(f"workload {w.name!r} would write {', '.join(shared)}, which workload {other.name!r} "
                              f"already writes; rename it (its keys come from its name past its kind)")
    _TABLE[w.name] = w
    return w


def unregister(name: str) -> None:
    if name in BUILTIN:
        raise EffkitError(f"workload {name} is built in")
    _TABLE.pop(name, None)


def names() -> tuple[str, ...]:
    load_plugins()
    return tuple(_TABLE)


def all_() -> tuple[Workload, ...]:
    load_plugins()
    return tuple(_TABLE.values())


def of_kind(kind: str) -> tuple[Workload, ...]:
    return tuple(w for w in all_() if w.kind == kind)


def other_batch(w: Workload) -> Workload | None:
    """The built-in workload of `w`'s kind at the other batch (decode-b12 for decode-b1): where a choice made for
    `w` must not be slower."""
    return next((o for o in of_kind(w.kind) if o.name in BUILTIN and o.batch != w.batch), None)


def get(name: str, what: str = "--optimize-for") -> Workload:
    load_plugins()
    if name not in _TABLE:
        raise EffkitError(f"unknown {what} {name!r}; choose one of {', '.join(_TABLE)}")
    return _TABLE[name]


# the built-in decode workloads time HELDOUT_PROMPTS prompts of HELDOUT_PROMPT_TOKENS tokens each, cut from the
# reference's held-out documents (`Workload.prompts`): speculative decoding's speed follows how much the text repeats,
# which one prompt rewards or punishes by chance, and the same prompts judge every artifact, speculative or not
HELDOUT_PROMPTS = 8
HELDOUT_PROMPT_TOKENS = 32
PREFILL_B1, PREFILL_B12, DECODE_B1, DECODE_B12 = (register(_w) for _w in (
    Workload("prefill-b1", "prefill", 1), Workload("prefill-b12", "prefill", 12),
    Workload("decode-b1", "decode", 1, prompts=HELDOUT_PROMPTS),
    Workload("decode-b12", "decode", 12, prompts=HELDOUT_PROMPTS)))
BUILTIN = tuple(w.name for w in (PREFILL_B1, PREFILL_B12, DECODE_B1, DECODE_B12))
# the decode workload whose figures are also the generation's (a bench row's `generation.tokens_per_s` and
# `generation_ratio`, a parent comparison's generation) and what a deliverable is chosen for unless told
GENERATION = DECODE_B1.name
