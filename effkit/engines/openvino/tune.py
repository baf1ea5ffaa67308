"""The settings of one OpenVINO artifact chosen by measurement on this CPU, under the decision rule
(`effkit.measure.choice`): its inference precision (`choose_precision`: bf16 or f32, a tie to f32, whose loss the
export gate checked) and LLMPipeline's attention backend (`choose_attention`: PA or SDPA, each named explicitly, a tie
to PA, LLMPipeline's default), both timed as its users run it (`pipeline_timer`: LLMPipeline's greedy decoding, its
tokens checked against effkit's loop on the first call)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from effkit.engines.openvino.runtime import LOOKUP, OpenVINOCausalLM, genai_version
from effkit.engines.openvino.settings import bf16_unavailable, read_description, record
from effkit.errors import EffkitError

ATTENTION = ("PA", "SDPA")  # LLMPipeline's ATTENTION_BACKEND values; the first is its default (and wins a tie)
# a setting of one artifact (its inference precision, its attention backend) is chosen under the decision rule with
# at most this many seconds of head-to-head looks per open contender: it is one knob of one folder, and the
# stage that writes it measures the folder against its parent afterwards anyway
SETTING_BUDGET_S = 10.0
# the default workload a setting is chosen for where the writer names none (`effkit export`): the project's default
# `optimize_for`
DEFAULT_WORKLOAD = "decode-b1"


def prompt() -> str:
    from effkit.measure import generation

    return generation.GENERATION_PROMPT


def pipeline_timer(model: OpenVINOCausalLM, prompts: list[np.ndarray], new_tokens: int, attention: str | None,
                   lookup: int = 0):
    """A no-argument timer of LLMPipeline's greedy decoding of `new_tokens` from the prompts of its round (`prompts`:
    one (batch, n) array of token ids per round, handed over as those ids, `generation.by_round`), returning new
    tokens per second (all rows); `lookup` = k > 0: with its prompt lookup of k tokens. Its first call (every
    caller's warm-up) also checks the tokens against effkit's loop over the same graph
    (`OpenVINOCausalLM.check_tokens`), outside the timed span."""
    from effkit.measure import generation

    checked: list[bool] = []

    def once(ids: np.ndarray) -> float:
        t = time.perf_counter()
        new = model.pipeline_generate(ids, new_tokens, attention, lookup=lookup)
        seconds = time.perf_counter() - t
        if not checked:
            model.check_tokens(ids, new, LOOKUP if lookup else attention)
            checked.append(True)
        return ids.shape[0] * new_tokens / seconds

    return generation.by_round(prompts, once, model.settle_s)


def decode_timer(model: OpenVINOCausalLM, tokenizer, batch: int, new_tokens: int,
                 generate_kwargs: dict[str, Any] | None = None, prompts: list[np.ndarray] | None = None):
    """Greedy decoding as OpenVINO's users run it: `openvino_genai.LLMPipeline` (its C++ loop) with the attention
    backend the artifact records (the peer: LLMPipeline's default), from the prompts of its round (`prompts`, as
    token ids; default: `batch` copies of the fixed prompt), its tokens checked on the first call (`pipeline_timer`).
    Where LLMPipeline cannot be built, effkit's Python loop over the infer request, said so in the generation note;
    the peer is refused instead."""
    from effkit.measure import generation

    key, _ = model.decoding()
    lookup = model.lookup_k(batch, False, generate_kwargs or {})  # the artifact's measured k at batch 1
    if lookup:  # never timed plainly under the speculative artifact's name
        if model.pipeline(LOOKUP) is None:
            raise EffkitError(f"{model.path}: openvino_genai.LLMPipeline with prompt lookup cannot be built here "
                              f"({model.why_no_pipeline(LOOKUP)})")
        return pipeline_timer(model, prompts or generation.prompt_batches(tokenizer, batch), new_tokens, key, lookup)
    if model.pipeline(key) is None:
        if model.description.get("peer"):
            raise EffkitError(f"the OpenVINO peer cannot decode as its users run it: openvino_genai.LLMPipeline "
                              f"({model.why_no_pipeline(key)})")
        return generation.generation_timer(model, tokenizer, new_tokens, generate_kwargs, batch=batch,
                                           prompts=prompts)
    return pipeline_timer(model, prompts or generation.prompt_batches(tokenizer, batch), new_tokens, key)


def decoders_of(models: dict[str, OpenVINOCausalLM]) -> dict[str, str]:
    """Which loop `decode_timer` decodes each model with: LLMPipeline, or effkit's where LLMPipeline cannot be
    built for it."""
    return {n: "LLMPipeline" if m.pipeline(m.decoding()[0]) is not None else "effkit's loop"
            for n, m in models.items()}


def mixed(decoders: dict[str, str]) -> str:
    """`; mixed decoders: f32 through LLMPipeline, bf16 through effkit's loop` where they differ (the ratio is then of
    two decoders as much as of two settings), else nothing."""
    if len(set(decoders.values())) < 2:
        return ""
    return "; mixed decoders: " + ", ".join(f"{n} through {how}" for n, how in decoders.items())


def _choice_line(decided: dict[str, Any], noun: str) -> str:
    """`Choice.line` of a recorded choice (its `to_dict()`)."""
    from dataclasses import fields

    from effkit.measure import choice

    return choice.Choice(**{f.name: decided[f.name] for f in fields(choice.Choice) if f.name in decided}).line(noun)


def choose_attention(model: OpenVINOCausalLM, tokenizer, workload: str = "decode-b1", rule=None) -> dict[str, Any]:
    """LLMPipeline's attention backend for the artifact `model`, decoding at the batch of `workload`: PA and SDPA,
    each built with an explicit ATTENTION_BACKEND (so neither falls back to the other unseen), timed under the
    decision rule (`effkit.measure.choice.choose`, `rule`: at most SETTING_BUDGET_S of head-to-head looks per open
    contender by default; a tie goes to PA, LLMPipeline's default) and cached per machine, OpenVINO version,
    weights, precision, model size and batch, with the date. A backend that cannot be built is "not run: <reason>"
    and the other is taken untimed. Returns {"attention", "how", "workload", and "decision": the choice's
    `to_dict()`, every call of every sample, where timed}."""
    import openvino

    from effkit import workloads
    from effkit.measure import choice, hardware, machine_cache

    w = workloads.get(workload)
    rule = rule or choice.Rule(budget_s=SETTING_BUDGET_S)
    missing = {a: model.why_no_pipeline(a) for a in ATTENTION if model.pipeline(a) is None}
    if len(missing) == len(ATTENTION):
        return {"attention": None, "workload": w.name,
                "how": "not chosen: " + "; ".join(f"{a}: not run: {why}" for a, why in missing.items())}
    if missing:
        (other, why), = missing.items()
        only = next(a for a in ATTENTION if a not in missing)
        return {"attention": only, "workload": w.name, "not_run": {other: why},
                "how": f"{only}, untimed: {other}: not run: {why}"}
    start = tokenizer(prompt(), return_tensors="np").input_ids
    # the workload's own new tokens, as `auto` and the bench judge it (within the model's context)
    new = max(1, min(w.tokens or workloads.DECODE_TOKENS, model.config.n_positions - start.shape[1]))
    ids = np.repeat(start, w.batch, axis=0)
    d = model.description
    key = (f"{hardware.describe_device(torch.device('cpu'))}|threads {torch.get_num_threads()}|openvino "
           f"{openvino.__version__}|genai {genai_version()}|weights {d.get('weights')}|{model.inference_precision}|"
           f"params {d.get('params', 0)}|batch {w.batch}|{new} tokens|{choice.RULE_VERSION}|precision "
           f"{rule.precision}|budget {rule.budget_s}")

    def measure() -> dict[str, Any]:
        timers = {a: pipeline_timer(model, [ids], new, a) for a in ATTENTION}
        return choice.choose(timers, True, rule, prefer=ATTENTION.index).to_dict()

    decided, cached = machine_cache.machine_cached("openvino_attention_choice", key, measure)
    when = (f"cached: {machine_cache.cache_note('openvino_attention_choice', key)}, for a model of "
            f"{d.get('params', 0)} parameters with {d.get('weights')} weights" if cached
            else "timed when the artifact was written")
    return {"attention": decided["picked"], "workload": w.name, "decision": decided, "cached": cached,
            "line": f"{_choice_line(decided, '')} at {w.name}, {when}",
            "how": f"{_choice_line(decided, '')} at {w.name} (greedy decoding of {new} new tokens from {w.batch} "
                   f"prompt(s) by LLMPipeline, new tokens/s; each backend named explicitly); a tie goes to PA, "
                   f"LLMPipeline's default; the rule: {rule.describe()}; "
                   f"{machine_cache.cache_note('openvino_attention_choice', key)}"}


def record_attention(folder: Path, tokenizer, workload: str = "decode-b1", rule=None) -> dict[str, Any]:
    """Choose the attention backend of the artifact in `folder` (`choose_attention`) and record it (`record`): its
    description, as written."""
    model = OpenVINOCausalLM(folder)
    chosen = choose_attention(model, tokenizer, workload, rule)
    del model
    desc = read_description(folder)
    desc.update(attention=chosen["attention"], attention_how=chosen.get("line", chosen["how"]), attention_choice=chosen)
    return record(folder, desc)


def choose_precision(folder: Path, tokenizer, workload: str, rule=None) -> tuple[str, dict[str, Any]]:
    """bf16 or f32 for the artifact in `folder`, timed at `workload` on this CPU as its users run it (decode:
    LLMPipeline; prefill: a forward) under the decision rule (`effkit.measure.choice.choose`; `rule`: at most
    `SETTING_BUDGET_S` of head-to-head looks per open contender by default). A tie within the precision goes to f32,
    the precision whose loss the export gate checked. Returns (the pick, {"choice", "workload", "how", and
    "decision": the choice's `to_dict()`, every call of every sample}). A CPU without native bf16: f32, bf16 not
    run, nothing timed."""
    from effkit import workloads
    from effkit.measure import choice, generation, timing

    if reason := bf16_unavailable():
        return "f32", {"choice": "f32", "how": f"bf16 not run: {reason}"}
    w = workloads.get(workload)
    rule = rule or choice.Rule(budget_s=SETTING_BUDGET_S)
    models = {p: OpenVINOCausalLM(folder, precision=p) for p in ("f32", "bf16")}
    decoders: dict[str, str] = {}
    if w.kind == "decode":  # the workload's own new tokens, as `auto` and the bench judge it
        new = generation.generation_budget(models["f32"], tokenizer, w.tokens or workloads.DECODE_TOKENS)[0]
        fns = {p: decode_timer(m, tokenizer, w.batch, new) for p, m in models.items()}
        decoders = decoders_of(models)
        what = f"greedy decoding of {new} new tokens from {w.batch} prompt(s), new tokens/s" + mixed(decoders)
    else:
        tokens = w.tokens or min(128, models["f32"].config.n_positions)
        fns = {p: timing.forward_timer(m, w.batch, tokens) for p, m in models.items()}
        what = f"forward of ({w.batch}, {tokens}) tokens, seconds"
    picked = choice.choose(fns, w.higher_is_better, rule, prefer=lambda p: p != "f32")
    return picked.picked, {"choice": picked.picked, "workload": w.name, "decision": picked.to_dict(),
                           **({"decoders": decoders} if decoders else {}),
                           "how": f"{picked.line('inference precision ')} at {w.name} ({what}); a tie goes to f32, "
                                  f"whose loss the export gate checked; the rule: {rule.describe()}"}
