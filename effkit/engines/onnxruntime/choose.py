"""The settings of ONNX Runtime's quantized artifacts chosen by measurement on this CPU, loss first, then speed:
every candidate is written and reloaded, its held-out loss paired with the parent's on the blocks the stage reads
(`within_loss`), and those whose loss delta's 95% interval ends within the budget are timed at the run's workload
under the decision rule (`time_settings`, `effkit.measure.choice`).

- `choose_form`: effkit's int8 form against ONNX Runtime's defaults (`int8.py`): which decodes faster depends on the
  CPU and the model's size, so both are written; a tie goes to the smaller file and an undecided leader leaves ONNX
  Runtime's own form in place. The record, with its raw samples, is `int8_form` in `onnx.json`.
- `choose_settings`: MatMulNBits' algorithm, block size and accuracy level (`int4.py`), within `INT4_LOSS_BUDGET`
  (stricter than the stage's: a setting is not worth any loss; measured here, not left to the stage, because level
  4 quantizes activations); a tie goes to the smaller file, then to fp32 compute; where no all-4-bit setting is
  within it, mixed graphs with `int4.AUTO_SHARES` of the weights in 4 bits are tried in turn. The record (every
  setting's loss and status, the choice's samples, the settings read back from the graph, GPTQ's calibration, the
  weight bytes a decoded token reads and the memory-bandwidth bound they imply) is `int4` in `onnx.json`."""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from effkit import engines, workloads
from effkit.engines.onnxruntime.export import write_artifact
from effkit.engines.onnxruntime.graph import ONNX_DESC, ONNX_FILE, matmulnbits_settings, weight_bytes_per_token
from effkit.engines.onnxruntime.int4 import (
    AUTO_SHARES,
    GPTQ_CALIBRATION_BLOCKS,
    SENSITIVITY_BLOCKS,
    calibration_feeds,
    candidates,
    eight_bit_layers,
    onnx_nodes,
    quantize_int4,
    sensitivity,
    variant_name,
    with_accuracy_level,
)
from effkit.engines.onnxruntime.runtime import OnnxCausalLM

SETTING_LOSS_BUDGET = 0.002  # a form is timed only if its paired loss delta's interval ends within this share
INT4_LOSS_BUDGET = 0.002  # a MatMulNBits setting is timed only if its loss delta's interval ends within this share
SETTING_BUDGET_S = 10.0  # head-to-head seconds per open contender: one setting of one folder, as openvino's
FORMS = ("effkit", "standard")  # the smaller file first: it wins a tie
VARIANTS = ".int4-variants"  # scratch inside the artifact folder, removed before the folder is complete


def load_variant(folder: Path, artifact: Path, parent: nn.Module):
    """An `OnnxCausalLM` of the graph written in `folder`, with the artifact's config (saved before the export)."""
    shutil.copyfile(artifact / "config.json", folder / "config.json")
    (folder / ONNX_DESC).write_text(json.dumps({"params": sum(p.numel() for p in parent.parameters())}))
    return OnnxCausalLM(folder)


def within_loss(models: dict[str, Any], table: dict[str, dict[str, Any]], parent: nn.Module, source: Path,
                cfg, budget: float = SETTING_LOSS_BUDGET) -> tuple[list[str], str]:
    """The variants whose held-out loss, paired by block with the parent's on the blocks the stage reads (its data
    section, its documents), stays within `budget` (the upper end of the delta's 95% interval)."""
    from effkit import artifacts
    from effkit.config import DataConfig
    from effkit.data import prepare
    from effkit.measure import evaluation, results, stats

    prepared = prepare(DataConfig.from_dict(artifacts.data_section(source, cfg.inputs.data)),
                       tokenizer_from=str(source))
    blocks, docs = prepared.blocks.eval, prepared.blocks.eval_docs
    reference = evaluation.evaluate(parent, blocks, cfg.measure.batch_size, docs=docs)["block_losses"]
    within = []
    for name, model in models.items():
        r = evaluation.evaluate(model, blocks, cfg.measure.batch_size, docs=docs)
        delta = results.LossDelta.of(stats.paired_delta(reference, r["block_losses"], docs))
        ok = delta.verdict != results.INVALID and delta.ci95[1] <= budget
        table[name].update(eval_loss=r["eval_loss"], loss_delta=delta.to_dict(), status="candidate" if ok else
                           f"left out: loss {delta.fmt()}, its interval reaches past +{budget:.1%}")
        if ok:
            within.append(name)
    return within, (f"held-out loss paired with the parent's by block ({len(blocks)} blocks, interval by "
                    f"document): the upper end of the delta's 95% interval within +{budget:.1%}")


def time_settings(within: list[str], models: dict[str, Any], table: dict[str, dict[str, Any]], tokenizer,
                  parent: nn.Module, source: Path, cfg, w, prefer, what: str,
                  default: str | None = None) -> tuple[str, dict[str, Any], str]:
    """The fastest of `within` at the workload `w` by the decision rule: the stage's own rule (its precision), its
    head-to-head budget capped at SETTING_BUDGET_S (one setting of one folder); `prefer` breaks a tie; `default`
    stays where the leader is still undecided against it. Decoding is timed on the prompts the bench times
    (`generation.reference_prompts` of the parent's folder `source`)."""
    from dataclasses import replace

    from effkit.measure import choice, generation, stats, timing

    rule = replace(choice.Rule.of(cfg.measure), budget_s=min(cfg.measure.budget_s, SETTING_BUDGET_S))
    if w.kind == "decode":
        # the workload's own new tokens, as `auto` and the bench judge it (within every model's context)
        cut, record = generation.reference_prompts(source, tokenizer, cfg.inputs.data)
        batches = generation.round_batches(tokenizer, w, cut)
        new = min(generation.generation_budget(models[n], tokenizer, w.tokens or workloads.DECODE_TOKENS,
                                               batches[0].shape[1] if batches else None)[0] for n in within)
        fns = {n: generation.generation_timer(models[n], tokenizer, new, None, batch=w.batch, prompts=batches)
               for n in within}
        timed = (f"greedy decoding of {new} new tokens from {w.batch} prompt(s) a round, new tokens/s; prompts: "
                 f"{generation.prompts_line(record)}")
    else:
        tokens = w.tokens or min(128, parent.config.n_positions)
        fns = {n: timing.forward_timer(models[n], w.batch, tokens) for n in within}
        timed = f"forward of ({w.batch}, {tokens}) tokens, seconds"
    c = choice.choose(fns, w.higher_is_better, rule, prefer=prefer, default=default if default in fns else None)
    for n in within:
        if n in c.samples:
            table[n]["median"] = stats.median_of_rounds(c.samples[n])
        if n in c.ratios:
            table[n]["ratio_to_picked"] = c.ratios[n]
        if n in c.invalid:
            table[n]["status"] = f"left out: {c.invalid[n]}"
    return c.picked, c.to_dict(), f"{c.line()} at {w.name} ({timed}) {what}; the rule: {rule.describe()}"


def choose_form(folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, fuse: bool) -> dict[str, Any]:
    """Both int8 forms written beside the artifact, the faster of those within +0.2% of the parent's loss moved
    into `folder` (see the module's text); its description with the record of the decision (`int8_form`)."""

    w = workloads.get(cfg.method.optimize_for)
    scratch = folder / ".int8-forms"
    scratch.mkdir(exist_ok=True)
    try:
        descs, models, table = {}, {}, {}
        with engines.exports_kept(scratch):  # one export of the parent for both forms
            for form in FORMS:
                (scratch / form).mkdir()
                descs[form] = write_artifact(scratch / form, parent, tokenizer, int8=True, fused=fuse,
                                             standard_int8=form == "standard")
                models[form] = OnnxCausalLM(scratch / form)
                table[form] = {"size_bytes": (scratch / form / ONNX_FILE).stat().st_size}
        within, loss_rule = within_loss(models, table, parent, source, cfg)
        decision = None
        if len(within) > 1:
            picked, decision, how = time_settings(
                within, models, table, tokenizer, parent, source, cfg, w, prefer=lambda n: table[n]["size_bytes"],
                what="between the int8 forms within +0.2% of the parent's loss; a tie goes to the smaller file, "
                     "an undecided leader leaves the standard form (ONNX Runtime's own) in place",
                default="standard")
        elif within:
            picked, how = within[0], "the only form within +0.2% of the parent's loss"
        else:
            picked = min(models, key=lambda n: table[n]["eval_loss"])
            how = "no form within +0.2% of the parent's loss: the lowest held-out loss, not timed"
        table[picked]["status"] = "picked"
        del models
        for f in (scratch / picked).iterdir():
            shutil.move(str(f), folder / f.name)
        desc = {**descs[picked], "int8_form": {"picked": picked, "how_chosen": how, "loss_rule": loss_rule,
                                               "table": table, "decision": decision}}
        (folder / ONNX_DESC).write_text(json.dumps(desc, indent=2))
        return desc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def training_blocks(source: Path, cfg, n: int) -> tuple[Any, dict[str, Any]]:
    """`n` blocks of the TRAINING split of the data the stage reads (its data section, its tokenizer), evenly
    spaced over it, never the held-out blocks; and the record of them."""
    from effkit import artifacts
    from effkit.config import DataConfig
    from effkit.data import prepare

    section = artifacts.data_section(source, cfg.inputs.data)
    train = prepare(DataConfig.from_dict(section), tokenizer_from=str(source)).blocks.train
    n = min(n, len(train))
    picks = [(i * len(train)) // n for i in range(n)]
    return train[picks], {"split": "train", "data": section.get("source"), "blocks": n,
                          "tokens_per_block": int(train.shape[1]), "of_train_blocks": int(len(train)),
                          "block_indices": picks}


def calibration(source: Path, cfg, config) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """GPTQ's calibration feeds: GPTQ_CALIBRATION_BLOCKS blocks of the TRAINING split of the data the stage reads
    (its data section, its tokenizer), evenly spaced over it, never the held-out blocks; and the record of them."""
    blocks, record = training_blocks(source, cfg, GPTQ_CALIBRATION_BLOCKS)
    feeds = calibration_feeds(blocks, config)
    tokens = int(feeds[0]["input_ids"].shape[1])
    n = record["blocks"]
    return feeds, {**record, "tokens_per_block": tokens, "tokens": n * tokens,
                   "how": f"{n} of the training split's {record['of_train_blocks']} blocks, evenly spaced over it "
                          "(never the held-out blocks the loss is measured on), each one feed of batch 1 with an "
                          "empty past"}


@dataclass
class _Variants:
    """The candidate MatMulNBits graphs of the fp32 graph `src`, written under `dst`'s folder (`VARIANTS`) and
    reloaded: their descriptions, models and table rows; the layers' 4-bit sensitivities (`mixing`), measured once
    a mixed graph is wanted; GPTQ's calibration feeds and their record, where GPTQ is a candidate."""

    src: Path
    dst: Path
    parent: nn.Module
    source: Path
    cfg: Any
    table: dict[str, dict[str, Any]]
    feeds: list[dict[str, Any]] | None = None
    calib: dict[str, Any] | None = None
    descs: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)
    written: dict[tuple, str] = field(default_factory=dict)
    mixing: dict[str, Any] = field(default_factory=dict)

    @property
    def scratch(self) -> Path:
        return self.dst.parent / VARIANTS

    def eight_bit(self, block: int, share: float) -> tuple[list[str], float]:
        """The layers left in 8 bits at this block size for a 4-bit `share`, and the share reached."""
        m = self.mixing
        if not m:
            blocks, record = training_blocks(self.source, self.cfg, SENSITIVITY_BLOCKS)
            m.update(blocks=blocks, record=record, nodes=onnx_nodes(self.src, self.parent), by_block={},
                     sizes={n: x.weight.numel() for n, x in self.parent.named_modules() if isinstance(x, nn.Linear)})
        if block not in m["by_block"]:
            m["by_block"][block] = sensitivity(self.parent, m["blocks"], block, self.cfg.measure.batch_size)
        return eight_bit_layers(m["by_block"][block], m["sizes"], share)

    def write(self, a: str, bits: int, b: int, lv: int, share: float = 1.0) -> str:
        """Write and reload one setting; its name. A setting that differs from one written only by its accuracy level
        is that graph re-stamped (the same weights)."""
        name = variant_name(a, bits, b, lv, share)
        (self.scratch / name).mkdir()
        path = self.scratch / name / ONNX_FILE
        if (a, bits, b, share) in self.written:
            first = self.written[(a, bits, b, share)]
            self.descs[name] = with_accuracy_level(self.scratch / first / ONNX_FILE, path, self.descs[first], lv)
            eight, four = self.table[first]["eight_bit_layers"], self.table[first]["int4_share"]
        else:
            eight, four = self.eight_bit(b, share) if share < 1 else ([], 1.0)
            self.descs[name] = quantize_int4(self.src, path, b, lv, a, bits, self.feeds if a == "gptq" else None,
                                             eight_bit=[self.mixing["nodes"][n] for n in eight])
            if a == "gptq":
                self.descs[name]["calibration"] = self.calib
            self.written[(a, bits, b, share)] = name
        self.models[name] = load_variant(self.scratch / name, self.dst.parent, self.parent)
        self.table[name] = {"algorithm": a, "bits": bits, "block_size": b, "accuracy_level": lv,
                            "size_bytes": path.stat().st_size, "int4_share": four, "eight_bit_layers": eight}
        return name


def settings_of(parent: nn.Module, o: Any) -> tuple[list[tuple[str, int, int, int]], dict[str, str]]:
    """`int4.candidates` for `parent`'s shape: the settings to write and those ruled out, or the one-line refusal of
    a setting asked by hand that this model cannot take."""
    widths = tuple(sorted({m.in_features for m in parent.modules() if isinstance(m, nn.Linear)}))
    return candidates(o, parent.config.n_embd, widths)


def choose_settings(src: Path, dst: Path, parent: nn.Module, source: Path, tokenizer, o: Any,
                    cfg) -> dict[str, Any]:
    """Write every candidate setting of the fp32 graph `src` for the backend's options `o` (`int4.candidates`),
    keep those within INT4_LOSS_BUDGET of the parent, time them (see the module's text) and copy the pick to `dst`.
    Returns `quantize_int4`'s description of the pick with `int4`: the record of the decision, and the settings
    read back from `dst`. One setting asked by hand is written as asked, its loss left to the stage, which
    measures every artifact's."""

    todo, skipped = settings_of(parent, o)
    v = _Variants(src, dst, parent, source, cfg, {n: {"status": why} for n, why in skipped.items()})
    w = workloads.get(cfg.method.optimize_for)
    if any(a == "gptq" for a, *_ in todo):
        v.feeds, v.calib = calibration(source, cfg, parent.config)
    v.scratch.mkdir(exist_ok=True)
    try:
        for a, bits, b, lv in todo:
            v.write(a, bits, b, lv, 1.0 if o.int4_share in ("auto", "1") else float(o.int4_share))
        picked, chosen, how, loss_rule, decision = _pick(v, len(todo), o.int4_share, w, tokenizer)
        v.table[picked]["status"] = "picked"
        shutil.copyfile(v.scratch / picked / ONNX_FILE, dst)
        m = v.mixing
        record = {"picked": picked, "chosen": chosen, "how_chosen": how, "loss_rule": loss_rule,
                  "algorithm": v.table[picked]["algorithm"],
                  "settings": matmulnbits_settings(dst),  # what travels: read back from the graph written
                  "calibration": v.descs[picked].get("calibration"),  # GPTQ's (None for the others)
                  "int4_share": v.table[picked]["int4_share"],
                  "sensitivity": m and {
                      **m["record"], "by_block_size": m["by_block"],
                      "how": "each Linear's weight alone rounded to 4 bits (symmetric round-to-nearest, as "
                             "MatMulNBits stores it), the mean loss on these training blocks less the "
                             "parent's; the layers that lose least per weight go to 4 bits first"} or None,
                  "table": v.table, "decision": decision}
        record.update(_bandwidth(dst, v.models[picked], tokenizer, decision and decision["samples"], picked, w))
        return {**v.descs[picked], "int4": record}
    finally:
        shutil.rmtree(v.scratch, ignore_errors=True)


def _pick(v: _Variants, n_todo: int, share: str, w, tokenizer) -> tuple[str, str, str, str, dict[str, Any] | None]:
    """The setting kept among those written: (name, chosen, how_chosen, loss_rule, the timed decision or None)."""
    if n_todo == 1:
        how = "as asked (--int4-algorithm, --int4-block-size, --accuracy-level, --int4-share)"
        return (next(iter(v.models)), how, how, "not measured here: one setting, as asked (the stage measures the "
                "artifact's)", None)
    table, models, budget = v.table, v.models, INT4_LOSS_BUDGET
    within, loss_rule = within_loss(models, table, v.parent, v.source, v.cfg, budget)
    rtn = [n for n in models if table[n]["algorithm"] == "rtn" and table[n]["bits"] == 4]
    if not within and share == "auto" and rtn:
        # fewer layers in 4 bits, the least sensitive kept, at the best all-4-bit setting's block and level
        best = table[min(rtn, key=lambda n: table[n]["eval_loss"])]
        for four in AUTO_SHARES:
            name = v.write("rtn", 4, best["block_size"], best["accuracy_level"], four)
            within, _ = within_loss({name: models[name]}, table, v.parent, v.source, v.cfg, budget)
            if within:
                break
    if len(within) > 1:
        # a tie within the precision: the smaller file (fewer bytes per token), then fp32 compute (level 1: no
        # rounding of the activations, the more accurate of two settings that run alike)
        picked, decision, how = time_settings(
            within, models, table, tokenizer, v.parent, v.source, v.cfg, w,
            prefer=lambda n: (table[n]["size_bytes"], table[n]["accuracy_level"]),
            what=f"among the settings within +{budget:.1%} of the parent's loss; a tie goes to the smaller file, "
                 "then to fp32 compute")
        return picked, f"chosen at {w.name} by measurement: {decision['label']}", how, loss_rule, decision
    if within:
        how = f"the only setting within +{budget:.1%} of the parent's loss"
        return within[0], how, how, loss_rule, None
    picked = min(models, key=lambda n: table[n]["eval_loss"])
    return (picked, f"the lowest loss; none within +{budget:.1%}",
            f"no setting within +{budget:.1%} of the parent's loss: the lowest held-out loss, not timed", loss_rule,
            None)


def _time_b1(model, tokenizer, samples: dict[str, list[list[float]]] | None, name: str, w) -> tuple[float, str]:
    """Batch-1 decoding tokens/s of `model`: from the choice's own samples when it was timed at batch-1 decoding,
    else timed here (the median of 5 calls after a warm-up)."""
    from effkit.measure import generation, stats

    if samples and name in samples and w.kind == "decode" and w.batch == 1:
        return stats.median_of_rounds(samples[name]), f"the choice's samples at {w.name} (median of its rounds)"
    new = generation.generation_budget(model, tokenizer, workloads.DECODE_TOKENS)[0]
    timer = generation.generation_timer(model, tokenizer, new, batch=1)
    timer()
    return statistics.median(timer() for _ in range(5)), f"greedy decoding of {new} tokens from 1 prompt, median of " \
                                                          "5 calls after a warm-up"


def _bandwidth(graph: Path, model, tokenizer, samples, name: str, w) -> dict[str, Any]:
    """Weight bytes per decoded token, the memory-bandwidth bound they set on batch-1 decoding (measured now, in
    this run) and the share of it the artifact reached."""
    from effkit.measure import roofline

    per_token = weight_bytes_per_token(graph)
    rate, rate_how = _time_b1(model, tokenizer, samples, name, w)
    bandwidth, bw_how = roofline.memory_bandwidth()
    bound = bandwidth / per_token["bytes_per_token"]
    out = {"weight_bytes_per_token": per_token, "memory_bandwidth_bytes_per_s": bandwidth,
           "memory_bandwidth_how": bw_how, "bandwidth_bound_tokens_per_s": bound,
           "decode_b1_tokens_per_s": rate, "decode_b1_how": rate_how, "share_of_bound": rate / bound}
    if rate > bound:  # tiny models: the weights stay in the caches and DRAM bandwidth does not bind
        out["bound_note"] = (f"above the DRAM bound: {per_token['bytes_per_token'] / 2**20:.2f} MiB of weights "
                             "per token fit in this CPU's caches, so memory bandwidth is not what limits it")
    return out
