"""Generation with the KV cache: the fixed prompt (`GENERATION_PROMPT`) and the new tokens that fit after a prompt
(`generation_budget`), greedy decoding at any batch (`greedy_generate`, compiled with a static cache through
`compiled_generation`), its timer in tokens per second (`generation_timer`), seeded top-k sampling (`sampled_generate`,
`SAMPLING`), how much a text repeats itself (`repeated_fraction`), the prompts drawn from held-out documents that
every choice and comparison that times decoding uses (`heldout_prompts`, cut from an artifact's held-out documents
by `reference_prompts`, the same for every contender), each round's batch of them (`prompt_batches`, `round_batches`)
and a timer that times the batch of its round (`by_round`)."""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from effkit.errors import EffkitError
from effkit.measure.engine_model import model_attr
from effkit.measure.hardware import model_device
from effkit.measure.timing import settle_time, synchronize

GENERATION_PROMPT = "The state of the Union"


def generation_budget(model, tokenizer, wanted: int, prompt_tokens: int | None = None) -> tuple[int, str | None]:
    """New tokens that fit in the model's context after a prompt of `prompt_tokens` (default: `GENERATION_PROMPT`'s),
    and a note when `wanted` was capped."""
    used = len(tokenizer(GENERATION_PROMPT).input_ids) if prompt_tokens is None else prompt_tokens
    room = model.config.n_positions - used
    if room < 1:
        raise EffkitError(f"a prompt of {used} tokens fills the model's context ({model.config.n_positions} tokens)")
    if wanted <= room:
        return wanted, None
    return room, f"generation capped at {room} new tokens (asked {wanted}): the model's context is " \
                 f"{model.config.n_positions} tokens"


def compiled_generation(model) -> tuple[dict[str, Any] | None, str]:
    """`generate` keyword arguments that decode with a static KV cache and a `torch.compile`d forward (Inductor,
    static shapes: the cache no longer grows, so one graph serves every step; transformers compiles it on the
    first call, on any device), or (None, "not run: <reason>")."""
    if not model_attr(model, "compilable"):
        return None, "not run: an ONNX Runtime artifact (its graph is already optimized by ONNX Runtime)"
    if getattr(model, "hf_quantizer", None) is not None and not model.hf_quantizer.is_compileable:
        return None, "not run: transformers does not compile this quantization method"
    from transformers import CompileConfig

    config = CompileConfig(mode="default", dynamic=False, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles automatically on GPUs only unless told
    return {"cache_implementation": "static", "compile_config": config}, \
        "torch.compile of the decoding step (Inductor, static KV cache, fullgraph), compiled on the first call"


@torch.inference_mode()
def greedy_generate(model, tokenizer, new_tokens: int, prompt: str | np.ndarray = GENERATION_PROMPT,
                    generate_kwargs: dict[str, Any] | None = None, batch: int = 1) -> tuple[torch.Tensor, float]:
    """Greedy decoding of exactly `new_tokens` with the KV cache, from `batch` copies of the prompt (text), or from
    the prompts' token ids as they are ((batch, n) int64): (the first row's new token ids, seconds).
    `generate_kwargs`: e.g. `compiled_generation`'s."""
    device = model_device(model)
    ids = (torch.as_tensor(prompt).to(device) if isinstance(prompt, np.ndarray) else
           tokenizer(prompt, return_tensors="pt").input_ids.to(device).expand(batch, -1).contiguous())
    kwargs = generate_kwargs or {}
    synchronize(device)
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                         pad_token_id=tokenizer.eos_token_id, **kwargs)
    synchronize(device)
    return out[0, ids.shape[1]:], time.perf_counter() - t


SAMPLING = {"top_k": 40, "temperature": 0.8, "seed": 0}


def sampled_generate(model, tokenizer, new_tokens: int, prompt: str = GENERATION_PROMPT,
                     top_k: int = SAMPLING["top_k"], temperature: float = SAMPLING["temperature"],
                     seed: int = SAMPLING["seed"]) -> torch.Tensor:
    """Seeded top-k / temperature sampling of exactly `new_tokens` (the global RNG is left as it was)."""
    device = model_device(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True,
                             top_k=top_k, temperature=temperature, use_cache=True,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:]


def repeated_fraction(ids: list[int], n: int = 8) -> float:
    """The fraction of n-token windows that already occurred earlier in `ids` (greedy decoding loops: high)."""
    windows = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(windows)) / len(windows) if windows else 0.0


def heldout_prompts(texts: list[str], tokenizer, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` token ids each, cut from the held-out documents `texts` (tokenized and joined in
    their order) at evenly spaced starts: the same for every artifact and peer that shares the tokenizer and the
    split. Fewer where the documents hold fewer; none is an error."""
    ids = [t for text in texts for t in tokenizer(text).input_ids]
    room = len(ids) - tokens
    if room < 0 or count < 1:
        raise EffkitError(f"the held-out documents hold {len(ids)} tokens: too few for a {tokens}-token prompt")
    starts = sorted({room * i // max(count - 1, 1) for i in range(count)} if count > 1 else {0})
    return [ids[s:s + tokens] for s in starts]


# the cuts made with each tokenizer (one stage asks for the same cut at each choice it times): by the data section
# and the count; gone with the tokenizer
_CUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def heldout_cut(data: dict[str, Any], tokenizer, count: int) -> list[list[int]]:
    """`heldout_prompts`' `count` prompts of the workloads' length from the held-out documents of the data split
    `data` (an artifact's data section)."""
    from effkit import workloads
    from effkit.config import DataConfig
    from effkit.data.corpus import load_corpus

    key = (json.dumps(data, sort_keys=True, default=str), count)
    made = _CUTS.setdefault(tokenizer, {})
    if key not in made:
        d = DataConfig.from_dict(data)
        texts = [t for _, t in load_corpus(d.source, d.heldout_fraction).heldout]
        made[key] = heldout_prompts(texts, tokenizer, count, workloads.HELDOUT_PROMPT_TOKENS)
    return [list(p) for p in made[key]]


def reference_prompts(reference: Path, tokenizer, data: str = "") -> tuple[dict[int, list[list[int]]], dict[str, Any]]:
    """The prompts of the decode workloads by their count (`Workload.prompts`), cut from the held-out documents of
    the data split of the artifact `reference` (`data`: a stage's --data in its place) with `tokenizer`: what every
    artifact, peer and candidate a decode timing compares decodes; and what they are (the reports' `prompts`).
    Where the reference has none to draw from (a plain Hugging Face folder, its data not found), none: every
    contender times the fixed prompt, and the record says why (`fallback`)."""
    from effkit import artifacts, workloads

    counts = sorted({w.prompts for w in workloads.of_kind("decode") if w.prompts})
    section = artifacts.data_section(reference, data)
    why = None if counts else "no decode workload asks for held-out prompts"
    if why is None and artifacts.read_meta(reference)["stage"] == "import" and not data:
        why = f"the reference {reference.name} is a plain Hugging Face folder: it has no held-out documents of its own"
    try:
        cut = {} if why else {n: heldout_cut(section, tokenizer, n) for n in counts}
    except (EffkitError, OSError) as e:
        cut, why = {}, f"no held-out prompts from {section.get('source')} ({e})"
    if why:
        return {}, {"count": 0, "tokens": len(tokenizer(GENERATION_PROMPT).input_ids), "prompt": GENERATION_PROMPT,
                    "fallback": why}
    return cut, {"count": len(cut[counts[-1]]), "tokens": workloads.HELDOUT_PROMPT_TOKENS,
                 "from": f"the held-out documents of {reference.name} ({section.get('source')})",
                 "workloads": [w.name for w in workloads.of_kind("decode") if w.prompts],
                 "order": "round r times prompt r mod count (batch b: prompts r..r+b-1 mod count), for every "
                          "contender alike"}


def round_batches(tokenizer, w, cut: dict[int, list[list[int]]]) -> list[np.ndarray] | None:
    """The batches of the decode workload `w`'s rounds from `reference_prompts`' cut (`prompt_batches`); None where
    `w` times the fixed prompt (no held-out prompts, or it asks for none)."""
    return prompt_batches(tokenizer, w.batch, cut[w.prompts]) if w.prompts and cut.get(w.prompts) else None


def prompts_line(record: dict[str, Any]) -> str:
    """`reference_prompts`' record in a few words, for a choice's `how`."""
    if record.get("fallback"):
        return f"the fixed prompt ({record['fallback']})"
    return f"{record['count']} prompts of {record['tokens']} tokens cut from {record['from']}, round r prompt r mod " \
           f"{record['count']}, the same for every contender"


def prompt_batches(tokenizer, batch: int, prompts: list[list[int]] | None = None) -> list[np.ndarray]:
    """What a decode timer times, one (batch, n) int64 array of token ids per round (round r: the array r mod their
    count): from `prompts` (the held-out ones, all of one length), rows r..r+batch-1 mod their count, so that the
    rounds cover every prompt and each is in as many rows; without them, `batch` copies of `GENERATION_PROMPT`."""
    if not prompts:
        return [np.repeat(np.asarray([tokenizer(GENERATION_PROMPT).input_ids], np.int64), batch, axis=0)]
    n = len(prompts)
    return [np.asarray([prompts[(r + i) % n] for i in range(batch)], np.int64) for r in range(n)]


def by_round(batches: list[np.ndarray], once: Callable[[np.ndarray], float], settle_s: float) -> Callable[[], float]:
    """A no-argument timer of `once` on the batch of its round (`batches[r mod count]`): a measurement tells it
    each round before its sample (`timing.start_round`), so that every contender times the same prompts in the same
    round, whatever its calls per sample or warm-up, and the paired ratio cancels each prompt's own speed."""
    at = [0]

    def timer() -> float:
        return once(batches[at[0] % len(batches)])

    timer.at_round = lambda r: at.__setitem__(0, r)  # type: ignore[attr-defined]
    timer.settle_s = settle_s  # type: ignore[attr-defined]
    return timer


def generation_timer(model, tokenizer, new_tokens: int, generate_kwargs: dict[str, Any] | None = None,
                     batch: int = 1, prompts: list[np.ndarray] | None = None) -> Callable[[], float]:
    """A function returning the new tokens per second (all rows) of one greedy decoding of `new_tokens` from the
    prompts of its round (`prompts`: `prompt_batches`'; default: `batch` copies of the fixed prompt); the caller caps
    `new_tokens` with `generation_budget`."""

    def once(ids: np.ndarray) -> float:
        new, seconds = greedy_generate(model, tokenizer, new_tokens, ids, generate_kwargs)
        return ids.shape[0] * len(new) / seconds

    return by_round(prompts or prompt_batches(tokenizer, batch), once, settle_time(model))
