"""What every engine that runs its own artifacts shares, written once (torch and numpy imported where used, so that
a backend's `available()` reads the CPU check without them):

- `check_length`: the prompt check of a model wrapper's forward and generate (not empty, within the context), in
  effkit's one line;
- `one_line`, `load_or_fail`: an engine library's own exception (a truncated or foreign file) as effkit's one line,
  with the artifact and the fix;
- `cpu_only`, `require_cpu`: the CPU-only check of an engine or backend (`available`) and of a load;
- `parity_probe`, `logit_gate`, `parity_gate`: the one parity gate a conversion passes before it is written: logits
  on a probe batch within a tolerance relative to the largest logit (each engine's, a parameter), then greedy tokens
  equal to PyTorch's with its cache;
- `decode_loop`: the numpy decoding loop of the engines that step their graph themselves; `stream_after`: the
  streaming of the engines that decode a whole request at once;
- `save_config_and_tokenizer`: the config and tokenizer files written beside an export.

The probe batches, the default tolerance and the token picking live in `effkit.engines.decoder_step`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError


def check_length(n: int, n_positions: int, new: int = 0) -> None:
    """Refuse, in one line, a prompt of `n` tokens that is empty, or that runs past the model's context
    (`n_positions`) with `new` tokens generated after it (the last one is not fed back): the runtimes' own errors
    are pages, and an empty prompt reaches their graphs as a shape they reject."""
    if n < 1:
        raise EffkitError("the prompt has no tokens; give some text (a prompt the tokenizer turns into no tokens "
                          "means the artifact's tokenizer files are missing or empty)")
    if (total := n + max(new - 1, 0)) > n_positions:
        raise EffkitError(f"{total} tokens exceed the model's context ({n_positions})")


def one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as `Type: message` on one line. OpenVINO's run over several: the source files it passed through
    ("Exception from src/inference/src/cpp/core.cpp:132:", left out: they tell a user nothing), the check, then why."""
    lines = [line for line in str(e).splitlines() if not re.fullmatch(r"\s*Exception from \S+:\d+:\s*", line)]
    return f"{type(e).__name__}: {' '.join(' '.join(lines).split())[:limit]}"


@contextmanager
def load_or_fail(what: str, fix: str = "") -> Iterator[None]:
    """Inside the block an engine library opens an artifact (or converts a model); any exception of its own (a
    truncated or foreign file, a plug-in that refuses it, a converter's many kinds) becomes effkit's one line:
    `what` ("ONNX Runtime cannot open PATH"), the library's message (`one_line`), then `fix` ("export the parent
    again") where there is one."""
    try:
        yield
    except EffkitError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the library raises, the user gets the artifact and the fix
        raise EffkitError(f"{what}: {one_line(e)}" + (f"; {fix}" if fix else "")) from None


def cpu_only(device: Any, what: str, note: str = "") -> str | None:
    """None where `device` is the CPU (or not given), else the reason an engine or backend whose `what` artifacts
    ("ONNX") run on the CPU only cannot run there; `note` says why, in parentheses."""
    if device is None or device.type == "cpu":
        return None
    return f"effkit runs {what} artifacts on the CPU only{f' ({note})' if note else ''}; use --device cpu"


def require_cpu(path: Path, device: Any, noun: str) -> None:
    """Refuse to load the artifact at `path` (`noun`: the engine's, "an ONNX") on a device other than the CPU."""
    if device.type != "cpu":
        raise EffkitError(f"{path} is {noun} artifact, which effkit runs on the CPU only; use --device cpu")


def logit_gate(ours: Any, reference: Any, what: str, rtol: float, verb: str = "exported") -> tuple[float, float]:
    """The largest |ours - reference| (torch tensors of logits) and the bound it must stay within, `rtol` x max(1,
    max |reference|): the rounding of fp32 kernels grows with the logits' scale, while a conversion error moves
    logits by a tenth or more. A one-line error naming `what` ("the exported ONNX graph") otherwise."""
    diff = float((ours - reference).abs().max())
    allowed = rtol * max(1.0, float(reference.abs().max()))
    if not diff <= allowed:
        raise EffkitError(f"{what} does not reproduce the model (max logit difference {diff:.2e} > {allowed:.2e}, "
                          f"{rtol} of the largest logit); this model cannot be {verb} faithfully")
    return diff, allowed


def parity_probe(model: Any) -> tuple[Any, Any, Any, int, Any]:
    """What every gate compares a conversion of the PyTorch `model` on (call under no_grad): a (3, 24) probe batch
    (a shape no export traced) and PyTorch's logits of it, a (1, 8) prompt, the greedy tokens compared (`new`,
    PARITY_TOKENS capped by the context) and PyTorch's prompt and `new` greedy tokens with its cache."""
    from effkit.engines.decoder_step import PARITY_TOKENS, probe_ids

    c = model.config
    probe = probe_ids(c.vocab_size, (3, min(24, c.n_positions)))
    prompt = probe_ids(c.vocab_size, (1, min(8, c.n_positions // 2)))
    new = min(PARITY_TOKENS, c.n_positions - prompt.shape[1])
    return probe, model(probe).logits, prompt, new, pytorch_greedy(model, prompt, new)


def pytorch_greedy(model: Any, prompt: Any, new: int, use_cache: bool = True) -> Any:
    """PyTorch's prompt and exactly `new` greedy tokens (end-of-text never picked)."""
    return model.generate(prompt, use_cache=use_cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0)


def parity_gate(model: Any, logits_of: Callable[[Any], Any], greedy_of: Callable[[Any, int], Any], what: str,
                tokens_how: str, rtol: float | None = None, verb: str = "exported", recompute: bool = False,
                how_prefix: str = "") -> dict[str, Any]:
    """The gate of a conversion of the PyTorch `model` (`parity_probe`): `logits_of(probe)` (the converted model's
    logits of the probe batch; torch or numpy) within `logit_gate`'s bound (`rtol`, default
    `decoder_step.EXPORT_RTOL`), and `greedy_of(prompt, new)` (numpy prompt (1, n) -> the prompt and `new` greedy
    tokens, end-of-text never picked) equal to PyTorch's with its cache (and, with `recompute`, PyTorch's with its
    cache equal to its full recompute). A one-line error otherwise; the record of the check (`tokens_how` and
    `how_prefix` word it) where it passes."""
    import torch

    from effkit.engines.decoder_step import EXPORT_RTOL

    rtol = EXPORT_RTOL if rtol is None else rtol
    with torch.no_grad():
        probe, reference, prompt, new, cached = parity_probe(model)
        diff, allowed = logit_gate(torch.as_tensor(logits_of(probe)), reference, what, rtol, verb)
        same = torch.equal(torch.as_tensor(greedy_of(prompt.numpy(), new)), cached)
        stable = torch.equal(cached, pytorch_greedy(model, prompt, new, use_cache=False)) if recompute else True
    if not (same and stable):
        vs = f", PyTorch cached vs recomputed: {stable}" if recompute else ""
        raise EffkitError(f"{what}'s greedy tokens with its KV cache differ from PyTorch's (with its cache: {same}"
                          f"{vs}); this model cannot be {verb} faithfully")
    return {"max_abs_logit_diff": diff, "greedy_tokens_equal": new, "max_abs_logit_diff_allowed": allowed,
            "how": f"{how_prefix}logits of a (3, {probe.shape[1]}) probe batch within {allowed:.2e} of PyTorch's "
                   f"({rtol} of the largest logit's magnitude); {new} greedy tokens {tokens_how}"}


def decode_loop(step: Callable[[Any, int], Any], ids: Any, max_new_tokens: int, eos: int | None,
                min_new_tokens: int = 0, do_sample: bool = False, top_k: int | None = None, temperature: float = 1.0,
                streamer: Any = None) -> Any:
    """The prompts `ids` (numpy int64 (batch, n)) and exactly `max_new_tokens` new tokens: `step(ids, done)` runs
    the engine over `ids[:, done:]`, the tokens not yet in its cache (the whole prompt first), and returns the last
    position's logits (batch, vocab). End-of-text is never picked among the first `min_new_tokens`, as
    transformers' `min_new_tokens` does for PyTorch; tokens are picked in numpy (`decoder_step.next_tokens`),
    sampled from torch's global generator; `streamer` gets the prompts, then each token."""
    import numpy as np
    import torch

    from effkit.engines.decoder_step import never_end, next_tokens

    if streamer is not None:
        streamer.put(torch.from_numpy(ids))
    done = 0
    for k in range(max_new_tokens):
        logits = step(ids, done)
        done = ids.shape[1]
        nxt = next_tokens(never_end(logits, eos) if k < min_new_tokens else logits, do_sample, top_k, temperature)
        ids = np.concatenate([ids, nxt], axis=1)
        if streamer is not None:
            streamer.put(torch.from_numpy(nxt))
    if streamer is not None:
        streamer.end()
    return ids


def stream_after(streamer: Any, ids: Any, new: Any) -> None:
    """Hand `streamer` (if any) a decoding its engine did at once: the prompts `ids`, then the `new` tokens a column
    at a time (torch (batch, n) each), as transformers' `generate` streams them step by step."""
    if streamer is not None:
        streamer.put(ids)
        for k in range(new.shape[1]):
            streamer.put(new[:, k:k + 1])
        streamer.end()


def save_config_and_tokenizer(folder: Path, model: Any, tokenizer: Any, generation_config: bool = False) -> None:
    """Beside an export: the model's config.json with `use_cache` on (how a Hugging Face folder is saved: its users'
    `generate` builds the cache), its generation_config.json where asked and it has one, and the tokenizer's
    files. The config is left with `use_cache` off, as the exporters trace the forward (`engines.as_exported`
    gives the caller's value back)."""
    model.config.use_cache = True
    model.config.save_pretrained(folder)
    model.config.use_cache = False
    if generation_config and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
