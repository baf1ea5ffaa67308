"""Generation with the KV cache: the fixed prompt (`GENERATION_PROMPT`) and the new tokens that fit after it
(`generation_budget`), greedy decoding at any batch (`greedy_generate`, compiled with a static cache through
`compiled_generation`), its timer in tokens per second (`generation_timer`), seeded top-k sampling (`sampled_generate`,
`SAMPLING`), how much a text repeats itself (`repeated_fraction`) and the prompts drawn from held-out documents that
judge speculative decoding (`heldout_prompts`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from effkit.errors import EffkitError
from effkit.measure.engine_model import model_attr
from effkit.measure.hardware import model_device
from effkit.measure.timing import settle_time, synchronize

GENERATION_PROMPT = "The state of the Union"


def generation_budget(model, tokenizer, wanted: int, prompt: str = GENERATION_PROMPT) -> tuple[int, str | None]:
    """New tokens that fit in the model's context after the prompt, and a note when `wanted` was capped."""
    room = model.config.n_positions - len(tokenizer(prompt).input_ids)
    if room < 1:
        raise EffkitError(f"the prompt {prompt!r} fills the model's context ({model.config.n_positions} tokens)")
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
def greedy_generate(model, tokenizer, new_tokens: int, prompt: str = GENERATION_PROMPT,
                    generate_kwargs: dict[str, Any] | None = None, batch: int = 1) -> tuple[torch.Tensor, float]:
    """Greedy decoding of exactly `new_tokens` with the KV cache, from `batch` copies of the prompt: (the first
    row's new token ids, seconds). `generate_kwargs`: e.g. `compiled_generation`'s."""
    device = model_device(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device).expand(batch, -1).contiguous()
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


def generation_timer(model, tokenizer, new_tokens: int, generate_kwargs: dict[str, Any] | None = None,
                     batch: int = 1) -> Callable[[], float]:
    """A function returning the new tokens per second (all rows) of one greedy decoding of `new_tokens` from a
    batch of `batch` prompts (the caller caps `new_tokens` with `generation_budget`)."""

    def once() -> float:
        new, seconds = greedy_generate(model, tokenizer, new_tokens, generate_kwargs=generate_kwargs, batch=batch)
        return batch * len(new) / seconds

    once.settle_s = settle_time(model)
    return once
