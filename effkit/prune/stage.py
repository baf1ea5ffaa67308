"""`effkit prune`: iterative pruning to a target, fine-tuning between rounds with the one training loop,
one artifact per round, and a report with the whole curve (loss, sparsity, FLOPs, measured latency).

Every round is judged against two baselines: the dense parent (latency, measured paired and interleaved with
the pruned model) and the dense control (the parent fine-tuned with the same steps, data order and learning
rate as the pruned model, so that "pruning cost nothing" cannot be an artefact of the extra training). The
control is one chain of fine-tuning per distinct fine-tuning budget, kept under `runs/<run>/controls/` and
reused by every mode and every later prune run of that budget.

Also here: the counts every round reports (`stage_metrics`: parameters, sparsity, FLOPs per token), the fine-tuning
learning rate taken from the parent's schedule (`finetune_lr`), the report and its curves (`write_prune_report`),
and the stage of `effkit run` (`PruneStage`: one step per pruning mode of the recipe)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, stageplan, workloads
from effkit.artifacts import RunLayout, prune_tag
from effkit.artifacts.loader import engine_of, is_quantized, trainable
from effkit.config import DataConfig, ModelConfig, ParallelConfig, PruneConfig, TrainConfig, build_config
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import evaluation, hardware, memory, results, stats, stopping, timing
from effkit.model import check_model_folder, count_params, load_model
from effkit.parallel import Runtime, init_runtime
from effkit.prune import methods
from effkit.prune.distill import Distiller
from effkit.prune.structure import prunable_linears, sparsity
from effkit.report import atomic_write_text, plot_prune_curves, write_rows_csv
from effkit.stage import FORWARD, Plan, RunContext, ShapeRun, Stage, Step, complete, costs, fingerprint
from effkit.train import finetune, lr_lambda


def forward_flops_per_token(model, seq_len: int, nonzero_only: bool = False) -> float:
    """2 x (matmul weights in the blocks + LM head) + the attention term, per token, forward only.
    With `nonzero_only`, zero weights are not counted (what sparse kernels could skip)."""
    count = (lambda w: int((w != 0).sum())) if nonzero_only else (lambda w: w.numel())
    weights = sum(count(lin.weight) for lin in prunable_linears(model).values()) + model.lm_head.weight.numel()
    attn = 4 * model.config.n_layer * model.config.n_embd * seq_len
    return 2 * weights + attn


def mlp_weights(model) -> int:
    return sum(b.mlp.c_fc.weight.numel() + b.mlp.c_proj.weight.numel() for b in model.transformer.h)


def block_params(model) -> int:
    """Parameters of the transformer blocks (what structured modes remove; embeddings and final norm excluded)."""
    return sum(p.numel() for p in model.transformer.h.parameters())


def stage_metrics(model, block: int, dense: dict[str, Any] | None,
                  counts_block_params: bool = False) -> dict[str, Any]:
    """Size, sparsity and FLOPs of `model`; the FLOPs speed-up against `dense` when given.
    `achieved_sparsity`: the fraction of prunable weights removed. Weight mode counts zeros among the block
    Linear weights; row mode counts the MLP weights physically removed (the row-prunable ones); width and depth
    count the block parameters removed. `block_params_removed` is that last fraction for every mode."""
    zeros, total = sparsity(model)
    removed = dense["mlp_weights"] - mlp_weights(model) if dense else 0
    achieved = removed / dense["mlp_weights"] if removed else zeros / total
    blocks = block_params(model)
    if dense and counts_block_params:
        achieved = 1 - blocks / dense["block_params"]
    m: dict[str, Any] = {
        "prunable_weights": total, "zero_weights": zeros, "mlp_weights": mlp_weights(model),
        "achieved_sparsity": achieved, "block_params": blocks,
        "block_params_removed": 1 - blocks / dense["block_params"] if dense else 0.0,
        "n_embd": model.config.n_embd, "n_layer": model.config.n_layer,
        "params": count_params(model), "nonzero_params": sum(int((p != 0).sum()) for p in model.parameters()),
        "n_inner": model.config.n_inner or 4 * model.config.n_embd,
        "flops_per_token_dense": forward_flops_per_token(model, block),
        "flops_per_token_nonzero": forward_flops_per_token(model, block, nonzero_only=True),
    }
    if dense is not None:
        key = "flops_per_token_dense" if model.config.n_inner else "flops_per_token_nonzero"
        m["speedup_projected_from_flops"] = dense["flops_per_token_dense"] / m[key]
    return m


def paired_latency(dense_model, model, block: int, cfg: PruneConfig) -> dict[str, Any]:
    """Forward latency of `model` against the dense parent at every prefill workload (`effkit.workloads`),
    interleaved: the p50 of each and the paired ratio with its interval and verdict (rounds until decided, see
    `stopping`), under the workload's keys (`latency_b12`, `dense_latency_b12`, `latency_ratio_b12`, ...)."""
    out: dict[str, Any] = {}
    was_training = model.training
    model.eval()
    for w in workloads.of_kind("prefill"):
        b, t = w.batch, w.tokens or block
        samples = stopping.measure({"dense": timing.forward_timer(dense_model, b, t),
                                    "pruned": timing.forward_timer(model, b, t)},
                                   stopping.Stopping.of(cfg.measure, "latency_rounds"),
                                   cfg.measure.latency_repeats, warmup=2)
        out[w.measure] = timing.latency_stats(samples["pruned"])
        out[f"dense_{w.measure}"] = timing.latency_stats(samples["dense"])
        out[w.ratio] = samples.ratio("dense", "pruned")
        out[f"latency_stopping_{w.tail}"] = samples.record
    model.train(was_training)
    return out


class ControlArm:
    """The dense parent fine-tuned round after round with exactly the pruned model's fine-tuning (steps, data
    order, learning rate, and loss: distilled from the same frozen teacher when the pruned rounds are), kept as
    artifacts under `runs/<run>/controls/<budget>-r<k>/` and reused."""

    def __init__(self, cfg: PruneConfig, source: Path, meta: dict[str, Any], data: DataConfig, layout: RunLayout,
                 rt: Runtime, progress: bool, loss: Distiller | None = None):
        self.cfg, self.source, self.meta, self.data, self.rt, self.progress = cfg, source, meta, data, rt, progress
        self.loss = loss
        self.layout = RunLayout.of(layout.run_dir, layout.report_dir, "controls")
        kd = f"-kd{loss.alpha:g}-T{loss.temperature:g}" if loss else ""
        ft = cfg.finetune
        self.budget = (f"control-ft{ft.finetune_steps}-lr{ft.lr:g}-b{ft.batch_size}-w{ft.warmup_steps}"
                       f"-s{ft.seed}{kd}")

    def artifact(self, round_: int) -> Path:
        return self.layout.artifact(f"{self.budget}-r{round_}") if round_ else self.source

    def after(self, round_: int):
        """The control model after `round_` rounds of fine-tuning (made, or loaded from its artifact)."""
        path = self.artifact(round_)
        if (path / artifacts.META).is_file():
            return load_model(str(path)).to(self.rt.device)
        model = self.after(round_ - 1)
        finetune(finetune_config(self.cfg, self.source, self.meta, self.data, round_, self.layout), model, self.rt,
                 stage="control", tag=path.name, parent=str(self.artifact(round_ - 1)), progress=self.progress,
                 mark_latest=False, loss=self.loss)
        return model


def check_source(path: Path) -> dict[str, Any]:
    meta = artifacts.read_meta(path)
    if meta["stage"] == "quantize" or not trainable(path):
        name = "a quantized" if trainable(path) or is_quantized(path) else engine_of(path).noun
        raise EffkitError(f"{path} is {name} artifact; prune the model it came from "
                          f"({meta.get('parent') or 'its parent'}) and quantize afterwards")
    return meta


def finetune_config(cfg: PruneConfig, source: Path, meta: dict[str, Any], data: DataConfig, round_: int,
                    layout: RunLayout) -> TrainConfig:
    """The fine-tuning of round `round_`: the parent's optimizer settings with the prune options on top,
    single process, no evaluations or checkpoints in between."""
    parent = TrainConfig.from_dict(meta["config"])
    lr = finetune_lr(cfg, meta)[0]
    trained_in = meta.get("what_ran", {}).get("amp_dtype")  # fine-tune in the precision the parent trained in
    # a model effkit did not train (no record of its precision) fine-tunes in fp32
    amp = {"fp32": (False, parent.optim.amp_dtype), "bfloat16": (True, "bf16"), "float16": (True, "fp16")}.get(
        trained_in, (parent.optim.amp if meta.get("config") else False, parent.optim.amp_dtype))
    return TrainConfig(
        data=data, model=ModelConfig(name=str(source)),
        optim=parent.optim.replace(amp=amp[0], amp_dtype=amp[1], optim=cfg.finetune.optim or parent.optim.optim,
                                   max_steps=cfg.finetune.finetune_steps, max_tokens=0, time_budget=0.0, lr=lr,
                                   min_lr=lr / 10, warmup_steps=cfg.finetune.warmup_steps,
                                   batch_size=cfg.finetune.batch_size,
                                   grad_accum=1, seed=cfg.finetune.seed + round_),
        parallel=ParallelConfig(threads=parent.parallel.threads),
        run=parent.run.replace(run_name=layout.name, runs_dir=str(layout.runs_dir),
                               reports_dir=str(layout.reports_dir), resume=False, eval_interval=0,
                               checkpoint_interval=0),
    )


IMPORTED_LR = 1e-4  # fine-tuning a model effkit did not train: its schedule is unknown


def finetune_lr(cfg: PruneConfig, meta: dict[str, Any]) -> tuple[float, str]:
    """The fine-tuning learning rate and where it came from: `--lr`, or where the parent's training ended (its
    schedule's learning rate at its last step), so that fine-tuning continues the training instead of restarting
    it at a higher rate (which costs the dense model loss: the control measures it)."""
    if cfg.finetune.lr > 0:
        return cfg.finetune.lr, "set by --lr"
    if not meta.get("config"):
        return IMPORTED_LR, f"{IMPORTED_LR:g}: the parent was not trained by effkit (no schedule on record); set --lr"
    o = TrainConfig.from_dict(meta["config"]).optim
    steps = int(meta.get("metrics", {}).get("steps") or o.max_steps or 0)
    horizon = o.max_steps or steps
    lr = o.lr * lr_lambda(o, horizon)(max(0, steps - 1)) if steps else o.min_lr
    return lr, (f"{lr:.3g}: the parent's learning rate at its last training step ({steps} of {horizon}; peak "
                f"{o.lr:g}, cosine to {o.min_lr:g})")


def run_prune(cfg: PruneConfig, progress: bool = True) -> dict[str, Any]:
    cfg = cfg.validate()
    rt = init_runtime(cfg.inputs.device)
    source = artifacts.resolve_artifact(cfg.inputs.source, cfg.folders.runs_dir)
    meta = check_source(source)
    lr, lr_how = finetune_lr(cfg, meta)
    cfg = cfg.replace(lr=lr)
    data_cfg = DataConfig.from_dict(artifacts.data_section(source, cfg.inputs.data))
    layout = RunLayout.of(cfg.folders.runs_dir, cfg.folders.reports_dir, artifacts.run_of(source))
    plan = prune_plan(cfg)  # before the models are loaded: one that does not fit stops here, unless --force
    stageplan.check(plan, cfg.inputs.force)
    with artifacts.run_lock(layout.run_dir), memory.PeakMemory(rt.device) as mem:
        return _prune(cfg, rt, source, meta, data_cfg, layout, progress, lr_how, memory_of=lambda: {
            "plan": plan.to_dict(), **mem.record()})


def prune_plan(cfg: PruneConfig, probe: bool = False, suggest: bool = True) -> stageplan.StagePlan:
    """The memory plan of `effkit prune` with `cfg` (a PruneConfig, validated), from the model's shapes alone: the
    dense parent, loaded as the frozen teacher and the reference; the student, its copy that the rounds cut; and one
    fine-tuning (`effkit.memplan.predict` of the round's own training configuration: the model being fine-tuned,
    its gradients, its optimizer's moments, the step's activations and temporaries, and on a CPU the process
    runtime measured once per machine and shape). With the control arm the largest moment is the control's
    fine-tuning (a third model, the student held beside it); with distillation the teacher's logits and the KL
    term's two softmaxes are added (batch x block x vocabulary, fp32). Two things a simulation does not see are
    counted from what a run showed (gpt2: docs/benchmarks.md): a loaded model keeps
    its safetensors file mapped (clean pages in the resident set: the file's size per load alive), and a real
    step's peak holds gradients beside activations (counted whole); the mapped pages are clean, so they count in
    the predicted peak but not in what must fit. `probe`: measure the runtime now where it is not cached (seconds
    to minutes), else leave it out and say so. `suggest`: where it does not fit, plan again with the memory tricks
    added one by one (`--no-control`, `--optim adamw8bit`, halving `--batch-size`) and name the first set that
    fits."""
    from effkit import memplan
    from effkit.parallel import resolve_device

    source = artifacts.resolve_artifact(cfg.inputs.source, cfg.folders.runs_dir)
    meta = check_source(source)
    check_model_folder(Path(source))  # what prune will refuse, the plan refuses too
    data = DataConfig.from_dict(artifacts.data_section(source, cfg.inputs.data))
    layout = RunLayout.of(cfg.folders.runs_dir, cfg.folders.reports_dir, artifacts.run_of(source))
    device = resolve_device(cfg.inputs.device)
    ft = finetune_config(cfg, Path(source), meta, data, 1, layout)
    tuning = memplan.predict(ft, device, probe=probe)
    f = cfg.finetune
    mc = memplan._model_config(ft)
    student_config = first_cut(cfg, mc)  # the student after round 1, the largest tuned
    cut_size = student_config.to_dict() != mc.to_dict()
    if f.finetune_steps and not f.control and cut_size:  # the student is the model fine-tuned: planned at its shape
        tuning = memplan.predict(ft, device, probe=probe, model_config=student_config)
    states = dict(tuning.parts)
    states["parameters"] += states.pop("buffers", 0)
    model_bytes = _fp32_bytes(mc)
    student_bytes = _fp32_bytes(student_config)
    student = ("student: its copy after round 1's cut" if cut_size else
               "student: its copy, which the rounds cut (at most the parent's size)")
    weights_file = sum(p.stat().st_size for p in Path(source).glob("*.safetensors")) or model_bytes
    loads = 2 if f.finetune_steps and f.control else 1  # the parent (teacher), and the control arm's own load
    mapped = f"the weights' file, mapped by each of the {loads} load(s) alive (clean pages)"
    parts = {"teacher: the dense parent (frozen, fp32)": model_bytes, student: student_bytes,
             mapped: loads * weights_file}
    notes = []
    if f.finetune_steps:
        who = "the control arm's" if f.control else "the student's"
        if not f.control:  # the student is the model being fine-tuned: counted there
            del parts[student]
        parts |= {f"fine-tuning ({who}): {k}": v for k, v in states.items()}
        # a real step's peak holds the gradients already computed beside the activations still alive, which the
        # simulation's peak (the end of the forward) does not: counted whole, an upper bound
        bumped = max(states.get("gradients", 0), states["parameters"])
        parts[f"fine-tuning ({who}): gradients"] = bumped
        kept = f"fine-tuning ({who}): {memplan.AUTOCAST_KEPT}"
        if kept in parts:  # memplan counted the optimizer step's whole gradients in it: not twice
            parts[kept] = max(0, parts[kept] - (bumped - states.get("gradients", 0)))
            if not parts[kept]:
                del parts[kept]
        if cfg.distilling:
            parts["distillation: the teacher's logits and the KL's two softmaxes"] = \
                3 * f.batch_size * data.block_size * mc.vocab_size * 4
        notes += [f"the largest moment: {who} fine-tuning, {f.batch_size} x {data.block_size} tokens, "
                  f"{ft.optim.optim}, {'bf16 autocast' if ft.optim.amp else 'fp32'}",
                  *[n for n in tuning.notes if n.startswith("runtime")]]
        if tuning.step_s is not None:  # priced as `train --plan` prices a step (at the shape planned)
            steps = finetune_work(cfg)
            notes.append(f"time of the fine-tuning: {steps:,.1f} steps' work x {tuning.step_s:.2f} s = "
                         f"{steps * tuning.step_s / 60:.1f} min predicted (the evaluations and the latency "
                         "comparisons not counted)")
    else:
        notes.append("no fine-tuning (--finetune-steps 0): the two models and an evaluation batch")
    if cut_size:
        notes.append(f"the student after round 1 ({cfg.method.target / cfg.method.rounds:.0%} removed): "
                     f"{student_bytes / model_bytes:.2f}x the parent's parameters")
    plan = stageplan.StagePlan("prune", parts, tuning.device, tuning.device_bytes, notes, reclaimable={mapped})
    if suggest and plan.fits is False:
        plan.tricks = _fitting_tricks(cfg, ft.optim.optim)
    return plan


def first_cut(cfg: PruneConfig, config):
    """`config` (a GPT2Config) as round 1's cut leaves it, from shapes alone (`cut_config`); a method without
    `cut_config` is planned at the parent's shape, an upper bound."""
    cut = getattr(methods.get(cfg.method.mode), "cut_config", None)
    return cut(cfg, config, cfg.method.target / cfg.method.rounds) if cut else config


def _fp32_bytes(config) -> int:
    """The fp32 parameter bytes of a GPT-2 of `config` (tied head counted once), from its shape alone."""
    d, n_inner = config.n_embd, config.n_inner or 4 * config.n_embd
    block = 4 * d * d + 4 * d + 2 * d * n_inner + n_inner + d + 4 * d  # attention, MLP, two layer norms
    return 4 * (config.n_layer * block + (config.vocab_size + config.n_positions) * d + 2 * d)


def _fitting_tricks(cfg: PruneConfig, optim: str) -> list[str]:
    """The memory tricks, added one at a time in the order they cost the measurement least (no control arm: the
    loss deltas are then against the dense parent; 8-bit moments; smaller fine-tuning batches), until a plan fits
    (`stageplan.what_fits`): the first set that fits with its predicted peak, or the last set tried and what it
    still needs."""
    f = cfg.finetune
    steps: list[tuple[str, dict[str, Any]]] = []
    if f.finetune_steps and f.control:
        steps.append(("--no-control", {"control": False}))
    if f.finetune_steps and optim != "adamw8bit":
        steps.append(("--optim adamw8bit", {"optim": "adamw8bit"}))
    batch = f.batch_size
    while f.finetune_steps and batch > 1:
        batch //= 2
        steps.append((f"--batch-size {batch}", {"batch_size": batch}))
    flags: list[str] = []
    changes: dict[str, Any] = {}
    candidates = []
    for flag, change in steps:  # each set: the ones before it with this one added (a batch size replaces one)
        flags = [t for t in flags if not t.startswith("--batch-size")] + [flag]
        changes = changes | change
        candidates.append((" ".join(flags), cfg.replace(**changes)))
    tried = stageplan.what_fits(candidates, lambda c: prune_plan(c, suggest=False))
    if not tried:
        return []
    last = tried[-1]
    if last.fits:
        return [f"it would with {last.flags} ({last.plan.required_bytes / 2**30:.1f} GiB predicted)"]
    return [f"not even with {last.flags} ({last.plan.required_bytes / 2**30:.1f} GiB predicted); use a machine with "
            "more memory"]


def _calibration(cfg: PruneConfig, pruner, train_blocks: torch.Tensor) -> list[torch.Tensor] | None:
    """The calibration batches of a method that ranks by activations (seeded from the fine-tuning seed), or None."""
    if not pruner.needs_calibration(cfg):
        return None
    g = torch.Generator().manual_seed(cfg.finetune.seed)
    idx = torch.randperm(len(train_blocks), generator=g)[: cfg.method.calib_batches * cfg.finetune.batch_size]
    return list(train_blocks[idx].split(cfg.finetune.batch_size))


def _round_metrics(mdl, *, cfg: PruneConfig, pruner, structure, distiller: Distiller | None, block: int,
                   dense: dict[str, Any], dense_model, dense_eval: dict[str, Any], blocks, control, source: Path,
                   r: int, fraction: float, control_eval: dict[str, Any] | None, done) -> dict[str, Any]:
    """What a pruned round's report adds to its fine-tuning's metrics: how it was pruned (`done`: this round's
    cut), its size and FLOPs against the dense parent, its latency paired with the parent's, and its held-out loss
    paired by block with the parent's and, with a control, with the control's (and the control's with the
    parent's)."""
    docs = blocks.eval_docs
    m = {"prune": {"mode": cfg.method.mode, "round": r, "target": fraction, "final_target": cfg.method.target,
                   "importance": pruner.ranks_by(cfg), "scope": None if pruner.structured else cfg.method.scope,
                   "structure": structure, "this_round": done,
                   "distill": distiller.describe() if distiller else None},
         **stage_metrics(mdl, block, dense, pruner.counts_block_params),
         **paired_latency(dense_model, mdl, block, cfg)}
    if judge := getattr(pruner, "round_metrics", None):  # what a method judges its rounds by besides (a draft's)
        m.update(judge(cfg, mdl, dense_model, blocks, source))
    own = evaluation.evaluate(mdl, blocks.eval, cfg.finetune.batch_size, docs=docs)
    m[results.EVAL_LOSS_DELTA_VS_DENSE] = stats.paired_delta(dense_eval["block_losses"], own["block_losses"], docs)
    if control_eval is not None:
        m["control_eval_loss"] = control_eval["eval_loss"]
        m["control_eval_loss_ci95"] = control_eval["eval_loss_ci95"]
        m["control_artifact"] = str(control.artifact(r) if control else source)
        m[results.EVAL_LOSS_DELTA_VS_CONTROL] = stats.paired_delta(control_eval["block_losses"],
                                                                   own["block_losses"], docs)
        # what the fine-tuning alone did to the dense model (the control against its own parent)
        m[results.CONTROL_DELTA_VS_DENSE] = stats.paired_delta(dense_eval["block_losses"],
                                                               control_eval["block_losses"], docs)
    return m


@dataclass(frozen=True)
class CurvePoint:
    """A point of the prune curve: the dense parent (round 0) or a pruned round, made once from what was measured
    of it; `to_dict()` is the point as the report's `curve` and prune-<label>.csv have it. Round 0 has none of a
    round's own figures (its shape, paired deltas, latency, projected speed-up)."""
    round: int
    target: float
    achieved_sparsity: float
    block_params_removed: float
    eval_loss: float
    eval_loss_ci95: list[float]
    control_eval_loss: float | None
    params: int
    flops_per_token: float
    artifact: str
    shape: dict[str, int] = field(default_factory=dict)  # n_embd, n_layer, n_inner
    delta_vs_control: dict[str, Any] | None = None  # paired by block, as `stats.paired_delta` gives them
    control_delta_vs_dense: dict[str, Any] | None = None
    delta_vs_dense: dict[str, Any] | None = None
    latency: dict[str, Any] = field(default_factory=dict)  # per prefill workload: p50 seconds, paired ratio
    speedup_projected: float | None = None

    @classmethod
    def dense(cls, dense: dict[str, Any], source: Path) -> CurvePoint:
        """Round 0 of the curve: the dense parent."""
        return cls(0, 0.0, dense["achieved_sparsity"], 0.0, dense["eval_loss"], dense["eval_loss_ci95"],
                   dense["eval_loss"], dense["params"], dense["flops_per_token_dense"], str(source))

    @classmethod
    def of_round(cls, r: int, fraction: float, report: dict[str, Any], structured: bool) -> CurvePoint:
        """Round `r` of the curve, from its fine-tuning report."""
        m = report["metrics"]
        prefill = workloads.of_kind("prefill")
        return cls(r, fraction, m["achieved_sparsity"], m["block_params_removed"], m["eval_loss"],
                   m["eval_loss_ci95"], m.get("control_eval_loss"), m["params"],
                   m["flops_per_token_dense" if structured else "flops_per_token_nonzero"], report["artifact"],
                   {k: m[k] for k in ("n_embd", "n_layer", "n_inner")}, m.get(results.EVAL_LOSS_DELTA_VS_CONTROL),
                   m.get(results.CONTROL_DELTA_VS_DENSE), m[results.EVAL_LOSS_DELTA_VS_DENSE],
                   {**{f"{w.measure}_s": m[w.measure]["p50_s"] for w in prefill},
                    **{w.ratio: m[w.ratio] for w in prefill}},
                   m["speedup_projected_from_flops"])

    def to_dict(self) -> dict[str, Any]:
        head = {"round": self.round, "target": self.target, "achieved_sparsity": self.achieved_sparsity,
                "block_params_removed": self.block_params_removed, **self.shape, "eval_loss": self.eval_loss,
                "eval_loss_ci95": self.eval_loss_ci95, "control_eval_loss": self.control_eval_loss}
        size = {"params": self.params, "flops_per_token": self.flops_per_token}
        if not self.round:
            return {**head, **size, "artifact": self.artifact}
        return {**head, results.EVAL_LOSS_DELTA_VS_CONTROL: self.delta_vs_control,
                results.CONTROL_DELTA_VS_DENSE: self.control_delta_vs_dense,
                results.EVAL_LOSS_DELTA_VS_DENSE: self.delta_vs_dense, **size, **self.latency,
                "speedup_projected": self.speedup_projected, "artifact": self.artifact}


def _prune(cfg: PruneConfig, rt: Runtime, source: Path, meta: dict[str, Any], data_cfg: DataConfig,
           layout: RunLayout, progress: bool, lr_how: str = "set by --lr",
           memory_of: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    block = data_cfg.block_size
    torch.manual_seed(cfg.finetune.seed)

    dense_model = load_model(str(source)).to(rt.device).eval()
    model = copy.deepcopy(dense_model).train()
    pruner = methods.get(cfg.method.mode)
    structure = pruner.plan(cfg, model)  # before anything is written: a target that removes all or nothing
    prepared = prepare(data_cfg, tokenizer_from=str(source))
    blocks = prepared.blocks
    dense = stage_metrics(model, block, None)
    docs = blocks.eval_docs
    dense_eval = evaluation.evaluate(dense_model, blocks.eval, cfg.finetune.batch_size, eval_bytes=blocks.eval_bytes,
                                  docs=docs)
    dense.update(evaluation.eval_summary(dense_eval))
    ft = cfg.finetune
    distiller = (Distiller(dense_model, ft.distill_alpha, ft.distill_temperature, teacher_name=str(source))
                 if cfg.distilling else None)
    # without fine-tuning there is no extra training to control for: the dense parent is the control
    control = ControlArm(cfg, source, meta, data_cfg, layout, rt, progress, loss=distiller) \
        if cfg.finetune.control and cfg.finetune.finetune_steps else None
    cut = pruner.start(cfg, model)
    calib = _calibration(cfg, pruner, blocks.train)

    rows = [CurvePoint.dense(dense, source)]
    parent = str(source)
    for r in range(1, cfg.method.rounds + 1):
        fraction = cfg.method.target * r / cfg.method.rounds
        control_eval = (evaluation.evaluate(control.after(r), blocks.eval, cfg.finetune.batch_size, docs=docs)
                        if control else dense_eval if cfg.finetune.control else None)
        model, done, after_step = cut(model, fraction, calib)
        model.train()
        extra = partial(_round_metrics, cfg=cfg, pruner=pruner, structure=structure, distiller=distiller,
                        block=block, dense=dense, dense_model=dense_model, dense_eval=dense_eval, blocks=blocks,
                        control=control, source=source, r=r, fraction=fraction, control_eval=control_eval,
                        done=done)
        report = finetune(finetune_config(cfg, source, meta, data_cfg, r, layout), model, rt, stage="prune",
                          tag=prune_tag(cfg.label, r), parent=parent, after_step=after_step, extra_metrics=extra,
                          loss=distiller, progress=progress)
        rows.append(CurvePoint.of_round(r, fraction, report, pruner.structured))
        parent = report["artifact"]

    source_info = {"model": str(source), "data": data_cfg.source, "tokenizer": prepared.tokenizer_source}
    return write_prune_report(cfg, layout, rows, dense, rt, block, source_info, lr_how,
                              memory_of() if memory_of else None)


def round_verdict(cfg: PruneConfig, row: CurvePoint, dense: dict[str, Any]) -> str:
    """`weight 50%: latency b12: same, ≈ 0.98x (0.91-1.05); params 1.00x; loss vs control: worse, +0.4% (...)`."""
    parts = [stats.summary_of(row.latency[results.LATENCY_RATIO_B12], f"latency {workloads.PREFILL_B12.tail}"),
             f"params {row.params / dense['params']:.2f}x"]
    if row.delta_vs_control:
        parts.append(stats.summary_of(row.delta_vs_control, "loss vs control"))
    else:
        parts.append(stats.summary_of(row.delta_vs_dense,
                                      "loss vs dense (confounded with the extra training: run with the control)"))
    return f"{cfg.method.mode} {row.achieved_sparsity:.0%} (round {row.round}): " + "; ".join(parts)


def write_prune_report(cfg: PruneConfig, layout: RunLayout, rows: list[CurvePoint], dense: dict[str, Any],
                       rt: Runtime, block: int, source: dict[str, str], lr_how: str = "set by --lr",
                       mem: dict[str, Any] | None = None) -> dict[str, Any]:
    out = layout.report_dir
    verdicts = [round_verdict(cfg, row, dense) for row in rows[1:]]
    last = rows[-1]
    last_b12 = results.PairedRatio.of(last.latency[results.LATENCY_RATIO_B12])
    if not methods.get(cfg.method.mode).structured and last_b12.verdict != "faster":
        verdicts.append("unstructured zeros reduced FLOPs (counting non-zeros) but not latency: dense kernels "
                        "still multiply the zeros; the gain is in compressibility, not speed")
    if last.control_delta_vs_dense:
        verdicts.append(stats.summary_of(last.control_delta_vs_dense, "the control (the dense parent "
                                         f"fine-tuned the same way, lr {cfg.finetune.lr:.3g}) vs the dense parent") +
                        ": what the fine-tuning alone did, apart from the pruning")
    if not cfg.finetune.control:
        verdicts.append("no control arm (--no-control): the loss deltas against the dense parent are confounded "
                        "with the extra fine-tuning steps")
    report = {
        "stage": "prune", "tag": f"prune-{cfg.label}", "mode": cfg.method.mode, "label": cfg.label, "run": layout.name,
        "artifact": last.artifact, "config": cfg.to_dict(), "source": source,
        "curve": [r.to_dict() for r in rows], "dense": dense, "verdicts": verdicts,
        "protocol": {"eval_loss": evaluation.EVAL_PROTOCOL + "; " + stats.LOSS_METHOD,
                     "control": ("the dense parent fine-tuned with the same steps, data order, learning rate "
                                 "and loss as each round (distilled from the same frozen teacher when the rounds "
                                 "are; cumulative, like the pruned model), one chain per fine-tuning budget, cached "
                                 "under runs/<run>/controls/") if cfg.finetune.control else "not run",
                     "latency": f"forward of (batch, {block}) random tokens, pruned model and dense parent "
                                + timing.INTERLEAVED_PROTOCOL.format(
                                    warmup=2, rounds=stopping.Stopping.of(cfg.measure, "latency_rounds").describe(),
                                    repeats=cfg.measure.latency_repeats)
                                + f"; {stats.RATIO_METHOD}; device {hardware.describe_device(rt.device)}",
                     "importance": methods.get(cfg.method.mode).ranks_by(cfg),
                     "finetune_lr": f"peak {lr_how}; warm-up {cfg.finetune.warmup_steps} steps, cosine to a tenth",
                     "distillation": (f"fine-tuning loss (1 - {cfg.finetune.distill_alpha}) x cross-entropy + "
                                      f"{cfg.finetune.distill_alpha} x T^2 x KL(teacher_T || student_T), T = "
                                      f"{cfg.finetune.distill_temperature}, teacher = the frozen dense parent "
                                      f"({cfg.inputs.source}); the control arm is distilled the same way")
                                     if cfg.distilling else "off",
                     "sparsity": "counted zeros over the Linear weights of the transformer blocks; width and depth: "
                                 "the fraction of transformer-block parameters removed",
                     "flops": "forward FLOPs/token = 2 x (block Linear weights + LM head) + 4*L*d*T; weight mode "
                              "counts non-zero weights (what sparse kernels could skip)"},
        "memory": mem,  # the plan made before the stage, beside the peak it measured
        "versions": artifacts.versions(), "git_commit": artifacts.git_commit(),
    }
    atomic_write_text(out / f"prune-{cfg.label}.json", json.dumps(report, indent=2, default=str))
    write_rows_csv(out / f"prune-{cfg.label}.csv", [flat_curve_row(r) for r in report["curve"]])
    plot_prune_curves(out)
    return report


def flat_curve_row(row: dict[str, Any]) -> dict[str, Any]:
    """A curve row for CSV: every interval as _lo / _hi columns."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dict):
            c = results.comparison(v)
            if isinstance(c, results.PairedRatio):
                value, (lo, hi), level = c.ratio, c.ci, {f"{k}_ci_level": c.ci_level}
            else:
                value, (lo, hi), level = c.delta, c.ci95, {}
            out.update({k: value, f"{k}_lo": lo, f"{k}_hi": hi, **level, f"{k}_verdict": c.verdict})
        elif isinstance(v, list):
            out.update({f"{k}_lo": v[0], f"{k}_hi": v[1]})
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------------------------- the stage in `effkit run`

def finetune_work(c: PruneConfig) -> float:
    """The fine-tuning of every round in training steps: the student's, the control arm's where there is one, and
    the teacher's forward per step where it distils."""
    ft = c.finetune
    return c.method.rounds * ft.finetune_steps * (1 + (FORWARD if c.distilling else 0)) * (2 if ft.control else 1)


class PruneStep(Step):
    """One pruning mode of the recipe (`prune row`): every round, its control, its report."""

    def __init__(self, mode: str):
        self.mode, self.key = mode, f"prune {mode}"

    def cfg(self, plan: Plan) -> PruneConfig:
        return plan.prune[self.mode]

    def fingerprint(self, plan: Plan, before: dict[str, str]) -> str:
        return fingerprint("prune", self.cfg(plan).to_dict(), before["train"])

    def outputs(self, ctx: RunContext) -> list[Path]:
        # (the control chains under controls/ are a cache keyed by their whole fine-tuning: never stale)
        c, layout = self.cfg(ctx.plan), ctx.plan.layout
        return [*(layout.artifact(prune_tag(c.label, r)) for r in range(1, c.method.rounds + 1)),
                ctx.plan.report_dir / f"prune-{c.label}.json"]

    def complete(self, ctx: RunContext) -> bool:
        c = self.cfg(ctx.plan)
        return (ctx.plan.report_dir / f"prune-{c.label}.json").is_file() and complete(
            ctx.plan.layout.artifact(prune_tag(c.label, c.method.rounds)))

    def run(self, ctx: RunContext) -> None:
        run_prune(self.cfg(ctx.plan))

    def work(self, plan: Plan) -> float:
        c = self.cfg(plan)
        return finetune_work(c) + c.method.rounds * costs()["prune_round"]  # calibration, latency, evaluations

    def budget(self, plan: Plan) -> float:
        c = self.cfg(plan)
        # one sequential latency measurement per prefill workload and round
        prefill = len(workloads.of_kind("prefill"))
        return 0.0 if c.measure.fixed_rounds else c.method.rounds * c.measure.budget_s * prefill

    def describe(self, plan: Plan) -> dict[str, Any]:
        c = self.cfg(plan)
        return {"stage": self.key, "what": f"to {c.method.target} in {c.method.rounds} rounds, "
                f"{c.finetune.finetune_steps} fine-tuning steps each"
                + (" (distilled from the dense model)" if c.distilling else ""),
                "leaves": ", ".join(str(plan.layout.artifact(prune_tag(c.label, r)))
                                    for r in range(1, c.method.rounds + 1))}


class PruneStage(Stage):
    name = "prune"

    def configure(self, plan: Plan) -> None:
        run, f = plan.run, plan.run.folders
        dense = str(plan.layout.artifact("train"))
        plan.configs["prune"] = {m: build_config(PruneConfig, plan.recipe, {"mode": m, "source": dense,
                                                                           "runs_dir": f.runs_dir,
                                                                           "reports_dir": f.reports_dir})
                                 for m in run.pipeline.prune_modes}
        if "prune" in run.pipeline.stages and not plan.prune:
            raise EffkitError(f"recipe {plan.recipe}: [run] lists the prune stage but prune_modes is empty")

    def steps(self, plan: Plan) -> list[Step]:
        return [PruneStep(m) for m in plan.prune]

    def memory_plans(self, plan: Plan, shapes: ShapeRun) -> list[tuple[str, str, Any]]:
        """Each mode's plan (`effkit prune --plan`) from the dense model's shapes, and its first round (the
        largest) at the shape its cut leaves, for the stages after it."""
        dense = shapes.artifacts.get("train")
        if self.name not in plan.stages or dense is None:
            return []
        out = []
        for mode, c in plan.prune.items():
            c = c.replace(source=str(dense), **shapes.folders.to_dict()).validate()
            out.append((PruneStep(mode).key, f"to {c.method.target:g} in {c.method.rounds} round(s)",
                        prune_plan(c, probe=True)))
            from transformers import GPT2Config

            tag = artifacts.prune_tag(c.label, 1)
            shapes.artifacts[tag] = artifacts.shape_only(shapes.run_dir / tag,
                                                         first_cut(c, GPT2Config.from_pretrained(dense)),
                                                         artifacts.data_section(dense), "prune", parent=str(dense))
        if any(c.method.rounds > 1 for c in plan.prune.values()):
            shapes.notes.append("each prune mode's later rounds (smaller than its first) are not planned for the "
                                "stages after it")
        return out

    def with_share(self, plan: Plan, share: float) -> dict[str, Any]:
        """Each mode's fine-tuning steps between rounds and its latency comparison's time budget, times `share`
        (at least one step where the recipe fine-tunes; a budget of 0 s still runs the first look)."""
        ft = {m: c.finetune.finetune_steps for m, c in plan.prune.items()}  # a recipe's 0 (no fine-tuning) stays 0
        plan.configs["prune"] = {m: c.replace(finetune_steps=ft[m] and max(1, round(ft[m] * share)),
                                              budget_s=c.measure.budget_s * share) for m, c in plan.prune.items()}
        return {m: {"finetune_steps": c.finetune.finetune_steps, "budget_s": c.measure.budget_s}
                for m, c in plan.prune.items()}

    def fingerprints(self, plan: Plan, before: dict[str, str]) -> dict[str, str]:
        return {s.key: s.fingerprint(plan, before) for s in self.steps(plan)}  # quantize's best-pruned reads them


STAGE = PruneStage()
