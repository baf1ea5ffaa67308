"""Paired comparisons a stage makes between a model and its PyTorch parent (`compare_with_parent`: latency,
generation, held-out loss, with their verdicts and protocol; `side_by_side`: interleaved prefill latency at every
prefill workload of `effkit.workloads`; `bf16_not_run`: where the bf16 parent is left out), and the generation
sample every artifact report carries (`generate_sample`). Quantize and export call these; neither imports the other."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effkit import workloads
from effkit.measure import evaluation, generation, hardware, results, stats, stopping, timing
from effkit.measure.engine_model import model_attr
from effkit.measure.results import LossDelta

PROMPT = generation.GENERATION_PROMPT


def generate_sample(model: nn.Module, tokenizer, max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation with the KV cache from a fixed prompt (capped at the model's context), and a seeded
    top-k / temperature sample beside it: the texts, and how much of the greedy text repeats itself. Speed is
    measured apart, interleaved with the model it is compared with (`generation.generation_timer`)."""
    new, note = generation.generation_budget(model, tokenizer, max_new_tokens)
    ids, _ = generation.greedy_generate(model, tokenizer, new)
    sampled = generation.sampled_generate(model, tokenizer, new)
    s = generation.SAMPLING
    return {"prompt": PROMPT, "text": tokenizer.decode(ids), "new_tokens": len(ids),
            "greedy_repeated_fraction": generation.repeated_fraction(ids.tolist()),
            "sampled_text": tokenizer.decode(sampled),
            "sampling": f"top-k {s['top_k']}, temperature {s['temperature']}, seed {s['seed']}",
            **({"note": "; ".join(notes)} if (notes := [n for n in (note, model_attr(model, "generation_note"))
                                                         if n]) else {})}


def side_by_side(contenders: dict[str, Callable[[int, int], Callable[[], float]]], block: int,
                 stop: stopping.Stopping, repeats: int,
                 pairs: list[tuple[str, str]] | None = None) -> dict[str, stopping.Measured]:
    """Prefill latency of every contender (a function giving its timer at a batch and a token count) at every
    prefill workload (its batch, its tokens or `block`), interleaved, until `pairs` (default: every contender
    against the first) are decided (see `stopping`); keyed by the workload's tail (`b12`). Every timer is a
    prefill that builds the KV cache, each through its own engine (`Engine.prefill`), so engines are timed doing
    the same work."""
    return {w.tail: stopping.measure({name: timer(w.batch, w.tokens or block) for name, timer in contenders.items()},
                                     stop, repeats, warmup=2, pairs=pairs)
            for w in workloads.of_kind("prefill")}


def _pytorch_prefill(model: nn.Module, dtype: torch.dtype | None) -> Callable[[int, int], Callable[[], float]]:
    """A PyTorch model's prefill timer at a batch and a token count, under autocast `dtype`."""
    return lambda b, t: timing.forward_timer(model, b, t, dtype, use_cache=True)


def bf16_not_run(device: torch.device) -> str | None:
    """"not run: <reason>" where the parent under bf16 autocast is neither evaluated nor timed (a CPU whose flags
    show no native bf16: PyTorch emulates it, several times slower than fp32, and the figures would only say so),
    else None. Callers evaluate `parent_bf16` only where this is None."""
    reason = hardware.no_native_bf16(device)
    return f"not run: {reason}" if reason else None


def _prefill_contenders(measure, parent: nn.Module, model: nn.Module, own, block: int,
                        skipped: str | None) -> tuple[dict[str, Callable[[int, int], Callable[[], float]]], dict]:
    """The prefill timers of the comparison: the parent in fp32 (and under bf16 autocast unless `skipped`), `model`
    through its own engine `own`, and with `measure.compile` the torch.compile twins of both, which join the same
    rounds; returns them with the twins' compile status."""
    contenders = {"fp32": _pytorch_prefill(parent, None),
                  **({} if skipped else {"bf16": _pytorch_prefill(parent, torch.bfloat16)}),
                  "int8": lambda b, t: own.prefill(model, b, t)}
    compiled_status = {}
    if getattr(measure, "compile", False):  # the compiled twins join the same rounds
        for name, m in (("fp32", parent), ("int8", model)):
            twin, compiled_status[name] = timing.compile_for_inference(
                m, tuple(w.batch for w in workloads.of_kind("prefill")), block, use_cache=True)
            if twin is not None:
                contenders[f"{name} compiled"] = _pytorch_prefill(twin, None)
    return contenders, compiled_status


def _timing_ratios(timed: dict[str, stopping.Measured], gen: stopping.Measured, skipped: str | None,
                   compiled_status: dict) -> dict[str, Any]:
    """The paired ratios of the timings (latency at every prefill workload, generation tokens/s; the bf16 parent's
    unless `skipped`; the compiled twins'), with the stopping record of each measurement and every timing of every
    round; each key is the workload's (`latency_ratio_b12`, `bf16_latency_ratio_b12`, ..., samples by its tail)."""
    prefill = workloads.of_kind("prefill")
    comparisons = {
        **{w.ratio: timed[w.tail].ratio("fp32", "int8") for w in prefill},
        **({} if skipped else {
            **{f"{w.ratio}_vs_bf16": timed[w.tail].ratio("bf16", "int8") for w in prefill},
            **{f"bf16_{w.ratio}": timed[w.tail].ratio("fp32", "bf16") for w in prefill}}),
        results.GENERATION_RATIO: gen.ratio("fp32", "int8", higher_is_better=True),
        "stopping": {**{w.measure: timed[w.tail].record for w in prefill}, "generation": gen.record},
        # every timing of every round: each ratio above can be recomputed from these
        "samples": {**{w.tail: dict(timed[w.tail]) for w in prefill}, "generation": dict(gen)},
    }
    if compiled_status:
        comparisons["compiled"] = {"status": compiled_status, **{
            f"{name}_compiled_vs_{ref}_{w.tail}": timed[w.tail].ratio(ref, f"{name} compiled")
            for name, ref in (("fp32", "fp32"), ("int8", "int8"), ("int8", "fp32")) for w in prefill
            if f"{name} compiled" in timed[w.tail]}}
    return comparisons


def _add_loss_deltas(comparisons: dict[str, Any], parent_fp32: dict, parent_bf16: dict | None, q: dict,
                     skipped: str | None) -> None:
    """The paired held-out loss deltas against the fp32 parent (the model's; the bf16 parent's unless `skipped`),
    into `comparisons`; the per-block losses leave the results they came in."""
    fp32_blocks, docs = parent_fp32.pop("block_losses"), parent_fp32.pop("block_docs", None)
    q.pop("block_docs", None)
    comparisons[results.EVAL_LOSS_DELTA] = stats.paired_delta(fp32_blocks, q.pop("block_losses"), docs)
    if not skipped:
        parent_bf16.pop("block_docs", None)
        comparisons["bf16_eval_loss_delta"] = stats.paired_delta(fp32_blocks, parent_bf16.pop("block_losses"), docs)


def _verdicts(comparisons: dict[str, Any], label: str, skipped: str | None) -> list[str]:
    """The comparison's verdict lines, as the report prints them."""
    b12 = workloads.PREFILL_B12.tail  # the headline workload (`results.LATENCY_RATIO_B12`)
    verdicts = [stats.summary_of(comparisons[results.LATENCY_RATIO_B12], f"{label} latency {b12} vs fp32"),
                stats.summary_of(comparisons[results.EVAL_LOSS_DELTA], f"{label} loss vs fp32")]
    if LossDelta.of(comparisons[results.EVAL_LOSS_DELTA]).ci95[0] > 0.01:
        verdicts.append(f"{label} loss is worse than the parent's by more than 1% (the whole 95% interval is above)")
    for key, what in ((f"int8_compiled_vs_fp32_{b12}", f"{label} compiled latency {b12} vs fp32 eager"),
                      (f"int8_compiled_vs_int8_{b12}", f"{label} compiled vs eager, {b12}")):
        if key in comparisons.get("compiled", {}):
            verdicts.append(stats.summary_of(comparisons["compiled"][key], what))
    if skipped:
        verdicts.append(f"bf16 autocast: {skipped}")
    else:
        verdicts.append(stats.summary_of(comparisons[results.BF16_LATENCY_RATIO_B12],
                                         f"bf16 autocast latency {b12} vs fp32"))
    return verdicts


def _protocol(measure, model: nn.Module, own, label: str, block: int, stop: stopping.Stopping, new_tokens: int,
              skipped: str | None, compiled: bool, prompts: dict[str, Any] | None = None) -> dict[str, str]:
    """How each figure of the comparison was measured, in words (the report's protocol); `prompts`: the record of
    the held-out prompts decoded (`generation.reference_prompts`), None: the fixed prompt."""
    source = generation.prompts_line(prompts) if prompts else repr(PROMPT)
    generation_how = (f"greedy decoding of {new_tokens} new tokens from {source}, fp32 parent and {label} "
                      f"interleaved (rounds: {stop.describe()}); new tokens / wall time; each model decodes with its "
                      f"own KV cache, through the decoder of the engine that owns it (the parent: PyTorch; {label}: "
                      f"{own.label or own.name}), as the bench times it"
                      + (f"; {note}" if (note := model_attr(model, "generation_note")) else ""))
    bf16_how = f"parent under bf16 autocast ({skipped})" if skipped else "parent under bf16 autocast"
    return {"eval_loss": evaluation.EVAL_PROTOCOL + "; " + stats.LOSS_METHOD,
            "latency": f"forward of (batch, {block}) random tokens: fp32 parent, {bf16_how} and "
                       f"{label} (reloaded from its folder, through its own engine's prefill) "
                       + timing.INTERLEAVED_PROTOCOL.format(warmup=2, rounds=stop.describe(),
                                                             repeats=measure.latency_repeats)
                       + f"; {stats.RATIO_METHOD}"
                       + ("; with --compile, torch.compile twins (Inductor, freezing, static shapes) of the fp32 "
                          "parent and of the int8 model in the same rounds" if compiled else ""),
            "generation": generation_how, "size": "bytes of all files in the artifact folder",
            "int8_layers": "counted in the model reloaded from the artifact folder (int8 modules, or int8 "
                           "operators of the ONNX graph)"}


def compare_with_parent(measure, device: torch.device, parent: nn.Module, model: nn.Module, tokenizer, block: int,
                        parent_fp32: dict, parent_bf16: dict | None, q: dict, label: str,
                        artifact: Path | None = None, prompts: tuple[dict, dict] | None = None
                        ) -> tuple[dict, list[str], dict]:
    """A quantized or exported model (`label`) against its PyTorch parent (fp32 and under bf16 autocast), paired and
    interleaved: latency at every prefill workload (`effkit.workloads`), generation tokens/s, held-out loss per block
    (the `evaluate` results `parent_fp32`, `parent_bf16`, `q`, which are completed in place). `parent_bf16` is None
    where `bf16_not_run(device)` says why: the bf16 parent is then neither timed nor evaluated, and the report says
    "bf16 autocast: not run: <reason>" in place of its ratios and losses. `measure` (the stage config's measure section)
    gives latency_rounds, latency_repeats and, for quantize, compile. Each model decodes with the decoder of the engine
    that owns it (the parent: PyTorch's; `model`: the engine of its folder `artifact`), as the bench times it, so that
    both report the same tokens/s for the same artifact. Returns metrics, verdicts and the protocol. (The contender is
    named "int8" in the metrics.)"""
    from effkit.artifacts.loader import engine_of  # engines are reached through the registry, from below
    from effkit.registry import ENGINES

    skipped = bf16_not_run(device) or (None if parent_bf16 is not None else "not run: not evaluated")
    pytorch = ENGINES.get("pytorch")
    own = engine_of(artifact) if artifact is not None else pytorch
    contenders, compiled_status = _prefill_contenders(measure, parent, model, own, block, skipped)
    stop = stopping.Stopping.of(measure, "latency_rounds")
    pairs = [("fp32", "int8"), *([] if skipped else [("bf16", "int8"), ("fp32", "bf16")]),
             *[(ref, f"{name} compiled") for name, ref in (("fp32", "fp32"), ("int8", "int8"), ("int8", "fp32"))]]
    timed = side_by_side(contenders, block, stop, measure.latency_repeats, pairs)
    gen_w = workloads.get(workloads.GENERATION)
    batches = generation.round_batches(tokenizer, gen_w, prompts[0]) if prompts else None
    new_tokens = min(q["generation"]["new_tokens"], generation.generation_budget(
        parent, tokenizer, q["generation"]["new_tokens"], batches[0].shape[1] if batches else None)[0])
    gen = stopping.measure({"fp32": pytorch.decode(parent, tokenizer, gen_w.batch, new_tokens, prompts=batches),
                            "int8": own.decode(model, tokenizer, gen_w.batch, new_tokens, prompts=batches)}, stop, 1,
                           warmup=1)
    for name, r in (("fp32", parent_fp32), ("bf16", parent_bf16), ("int8", q)):
        if name in contenders:
            for w in workloads.of_kind("prefill"):
                r[w.measure] = timing.latency_stats(timed[w.tail][name])
    for name, r in (("fp32", parent_fp32), ("int8", q)):
        r["generation"]["tokens_per_s"] = stats.median_of_rounds(gen[name])
    comparisons = _timing_ratios(timed, gen, skipped, compiled_status)
    _add_loss_deltas(comparisons, parent_fp32, parent_bf16, q, skipped)
    verdicts = _verdicts(comparisons, label, skipped)
    m = {**q, **comparisons, "parent_fp32": parent_fp32,
         **({"bf16_autocast": skipped} if skipped else {"parent_bf16": parent_bf16}),
         "eval_loss_delta_vs_parent": LossDelta.of(comparisons[results.EVAL_LOSS_DELTA]).delta,
         "size_ratio_vs_parent": q["size_bytes"] / parent_fp32["size_bytes"]}
    return m, verdicts, _protocol(measure, model, own, label, block, stop, new_tokens, skipped,
                                  bool(compiled_status), prompts[1] if prompts else None)
