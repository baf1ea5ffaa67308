"""`effkit train`: the one training loop, for single-process training, every parallel mode, and fine-tuning
between pruning rounds.

`Trainer` builds its parts once (data, model, parallel layout, optimizer, schedule, checkpointer) and
`train_step` reads top to bottom: micro-batches forward and backward, gradient sync, clip, step. `fit` runs
steps until a bound is reached; `finish` evaluates, saves the artifact and writes the report (built by
`build_report`, apart from the loop). Fine-tuning is the same Trainer with a hook after every optimizer step.

Around the loop: the training precision (`resolve_amp`: `--amp auto` measured), launching the processes of a
multi-process run and reading rank 0's report back (`train_in_processes`; `train_any` picks in-process or launched,
under the run's lock), what was decided before the run and is reported beside what it measured (`Planned`: the
memory plan, a time budget's decision), and the stage of `effkit run`
(`TrainStage`: the stage whose steps are the unit of the run's estimate, `measures_step_time`, and which a time
budget shortens: before training from `memplan.step_time`, the step `train --plan` predicts, and once more from
its own first steps while the learning rate still warms up, `Trainer.retarget`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, optim
from effkit.artifacts import RunLayout
from effkit.checkpoint import Checkpoint, Checkpointer
from effkit.config import OptimConfig, TrainConfig, build_config
from effkit.data import BlockSampler, make_loader, prepare
from effkit.data.blocks import check_batch
from effkit.errors import EffkitError, Interrupted
from effkit.measure import evaluation, hardware, memory, precision, roofline, timing
from effkit.measure.results import PairedRatio
from effkit.model import (
    activation_checkpointing_enabled,
    build_model,
    check_block_size,
    check_preset,
    config_of,
    count_params,
    enable_activation_checkpointing,
    flops_per_token,
    is_pretrained_source,
    load_model,
    save_model,
    shape_of,
)
from effkit.parallel import ParallelDims, Runtime, init_runtime
from effkit.parallel.launch import launch, nproc_per_node
from effkit.parallel.parallelize import parallelize_gpt2
from effkit.report import StageReport, plot_loss_curve, stamp, write_rows_csv, write_stage_report
from effkit.stage import FORWARD, Plan, RunContext, ShapeRun, Stage, Step, complete, costs, fingerprint


def resolve_amp(o: OptimConfig, device: torch.device, model: torch.nn.Module | None = None,
                block: int = 0) -> tuple[torch.dtype | None, str, dict[str, Any] | None]:
    """The autocast dtype actually used, a note on why, and (auto on a CPU) the measurement it was chosen by."""
    if o.amp is None:  # auto
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16, "auto: bf16 autocast (CUDA)", None
            return torch.float16, "auto: fp16 autocast with GradScaler (this GPU has no bf16)", None
        if model is None:
            raise EffkitError("--amp auto on a CPU needs the model to measure; pass --amp or --no-amp")
        probe = precision.cpu_choice(model, o.batch_size, block)
        if "not_run" in probe:  # ruled out by the CPU's flags, nothing timed
            return None, f"auto: fp32 ({probe['not_run']})", probe
        cmp = PairedRatio.of(probe["bf16_vs_fp32_time"])
        how = f"{cmp.fmt()} of fp32 on this CPU over {cmp.rounds} paired rounds, {cmp.verdict}"
        note = (f"auto: {probe['picked']} (bf16 autocast step time {how}, on {probe.get('probed', 'the shape')}; "
                f"{probe.get('measured', 'measured now')}, probe {probe.get('probe_seconds', 0):.1f} s)")
        return (torch.bfloat16 if probe["picked"] == "bf16" else None), note, probe
    if not o.amp:
        return None, "fp32 (AMP off)", None
    if o.amp_dtype == "fp16":
        if device.type != "cuda":
            raise EffkitError("fp16 autocast does nothing on CPU (PyTorch runs those ops in fp32); "
                              "use --amp-dtype bf16 on CPU")
        return torch.float16, "fp16 autocast with GradScaler", None
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise EffkitError("this GPU has no bf16 support; use --amp-dtype fp16")
    return torch.bfloat16, "bf16 autocast", None


def emulated_bf16_warning(device: torch.device, amp_dtype: torch.dtype | None) -> str | None:
    """What a forced bf16 autocast on a CPU without native bf16 is told before any work starts: the slowdown to
    expect, from the ratio of this machine's fp32 and bf16 GEMM peaks (measured once, cached per machine: cheap,
    unlike timing training steps), and the flags that avoid it. None where bf16 is native or not asked."""
    if amp_dtype != torch.bfloat16 or (reason := hardware.no_native_bf16(device)) is None:
        return None
    fp32, _ = roofline.cpu_peak_flops(torch.float32)
    bf16, _ = roofline.cpu_peak_flops(torch.bfloat16)
    ratio = fp32 / bf16
    expect = f"expect about {ratio:.1f}x slower than fp32" if ratio > 1 else "it is usually slower than fp32"
    return (f"warning: --amp forces bf16 autocast, but {reason}: PyTorch emulates bf16 here; {expect} (the "
            f"GEMM peak ratio: this machine's measured fp32 and bf16 GEMM peaks are {fp32 / 1e9:,.1f} and "
            f"{bf16 / 1e9:,.1f} GFLOP/s, cached per machine). Train with --no-amp (fp32), or leave --amp out "
            "(auto: fp32 on this CPU, nothing timed)")


def announce(msg: str) -> None:
    """A line on the console before the work it is about (rank 0 calls it; the progress bar is not up yet)."""
    from rich.console import Console

    Console(soft_wrap=True).print(msg, style="yellow", markup=False, highlight=False)


def make_scaler(device: torch.device, enabled: bool, distributed: bool):
    """fp16's loss scaler. Across processes it is FSDP's `ShardedGradScaler`, which all-reduces the found-inf
    flag over the world before stepping, so every rank skips the same steps (a plain GradScaler decides per rank,
    and ranks whose shards overflowed would skip a step the others take). CPU-offloaded gradients are checked on
    the CPU and their flag reduced on the device."""
    if distributed and enabled:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=True)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def lr_lambda(o: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to min_lr over total_steps (constant if unbounded)."""

    def f(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if total_steps <= 0:
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
        floor = o.min_lr / o.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def total_steps(o: OptimConfig, tokens_per_step: int) -> int:
    bounds = [s for s in (o.max_steps, math.ceil(o.max_tokens / tokens_per_step) if o.max_tokens else 0) if s > 0]
    return min(bounds) if bounds else 0  # 0: only the time budget bounds the run


class _Progress:
    """A rich progress bar (step, loss, tokens/s, ETA) on the main process; silent elsewhere."""

    def __init__(self, enabled: bool, total: int | None, start: int, desc: str):
        self.bar = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn(f"[bold]{desc}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                TimeElapsedColumn(), TimeRemainingColumn())
            self.task = self.bar.add_task(desc, total=total or None, completed=start, loss=float("nan"), tps=0.0)

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def update(self, step: int, loss: float, tps: float, total: int | None = None):
        if self.bar:
            self.bar.update(self.task, completed=step, loss=loss, tps=tps, **({"total": total} if total else {}))

    def log(self, msg: str):
        if self.bar:
            self.bar.console.print(msg)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)


@dataclass(frozen=True)
class TrainHooks:
    # after every step: (step, loss); what it returns, if anything, is the number of steps to train instead
    # (`Trainer.retarget`: a time budget re-fitted from this run's own steps)
    on_step: Callable[[int, float], int | None] | None = None
    after_optimizer_step: Callable[[torch.nn.Module], None] | None = None  # e.g. re-apply pruning masks
    # the training loss from (logits, batch); None = next-token cross-entropy (e.g. distillation adds a KL term)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Planned:
    """What was decided before training, reported beside what training measured: the memory plan
    (`effkit.memplan`'s, as a dict) and, under `effkit run` with a time budget, its decision (`schedule`: the
    pipeline's, re-fitted in place from training's first steps, so read when the report is built) with the result
    the recipe quotes for its full schedule."""
    memory: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    full_schedule_result: str = ""
    layout: dict[str, Any] | None = None  # `--parallel auto`'s ranking and pick

    def sections(self, m: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The report's `memory_plan` and `schedule` sections from the run's metrics `m`, and their protocol."""
        out, how = {}, {}
        if (plan := self.memory) is not None:
            measured = max(m["peak_memory_bytes_per_rank"])
            out["memory_plan"] = {
                "predicted_steps_bytes": plan["steps_bytes"], "predicted_total_bytes": plan["total_bytes"],
                "predicted_per_rank_bytes": plan["per_rank_bytes"], "measured_steps_bytes": measured,
                "measured_over_predicted": measured / plan["steps_bytes"] if plan["steps_bytes"] else None,
                "method": plan["method"], "notes": plan["notes"],
            }
            how["memory_plan"] = ("predicted before the run (" + plan["method"] + "); compared with the measured "
                                  "increase over the training steps of the largest rank")
        if self.schedule:
            out["schedule"] = self.schedule_section(m.get("bits_per_byte"))
            how["schedule"] = ("the training steps a time budget left: chosen before training from the step time "
                               "`train --plan` predicts, re-fitted once from training's own first steps while the "
                               "learning rate warms up (schedule.how_chosen, schedule.refit); the learning-rate "
                               "schedule is built for them; full_schedule_result is quoted from the recipe, not "
                               "measured here")
        if self.layout is not None:
            out["parallel_auto"] = self.layout
        return out, how

    def schedule_section(self, bpb: float | None) -> dict[str, Any]:
        """The time budget's decision (the steps chosen, the step time it was fitted with), the recipe's recorded
        full-schedule result and, where the steps were cut, what that cost and how to train them all."""
        reference = self.full_schedule_result
        s = {**{k: v for k, v in self.schedule.items() if k != "key"}, "full_schedule_result": reference}
        if s["steps"] < s["recipe_steps"]:
            s["what_it_costs"] = (
                f"{s['steps']:,} of the recipe's {s['recipe_steps']:,} training steps"
                + (f" reached {bpb:.3f} bits per byte on the held-out blocks" if bpb is not None else "")
                + f"; the full schedule: {reference or 'not recorded by the recipe (full_schedule_result)'}"
                + (f"; the stages after training ran on {s['share']:.0%} of their recipe's measuring budgets"
                   if s.get("share", 1) < 1 else "") + f"; `effkit run --full` trains all {s['recipe_steps']:,}")
        return s


class Trainer:
    """One training run: built once, then `fit()` and `finish()`."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, *, model: torch.nn.Module | None = None,
                 resumed: Checkpoint | None = None, hooks: TrainHooks | None = None, tag: str = "train",
                 progress: bool = True, dims: ParallelDims | None = None, planned: Planned | None = None):
        if not cfg.run.run_name:
            cfg = cfg.replace(run=cfg.run.replace(run_name=artifacts.new_run_name(cfg.model.name)))
        self.cfg, self.rt, self.tag, self.progress = cfg, rt, tag, progress
        self.planned = planned or Planned()  # what the report puts beside what the run measures
        self.hooks = hooks or TrainHooks()
        o, d = cfg.optim, cfg.data
        self.layout = RunLayout.for_run(cfg.run)
        self.checkpointer = Checkpointer(self.layout.checkpoint_dir)
        self._set_threads()
        self.tf32 = hardware.set_tf32(rt.device, o.tf32)
        self.amp_warning = None
        if o.amp is not None:  # forced: fail fast on a bad combination (auto is decided on the built model)
            forced = resolve_amp(o, rt.device)[0]
            self.amp_warning = emulated_bf16_warning(rt.device, forced) if rt.is_main else None
            if self.amp_warning:  # before the data and the first step, not only in the report after the run
                announce(self.amp_warning)
        pretrained = is_pretrained_source(cfg.model.name)
        if model is None and not pretrained:  # fail fast, before any data work
            check_block_size(d.block_size, check_preset(cfg.model.name)["n_positions"])

        torch.manual_seed(o.seed)
        self.data = prepare(d, tokenizer_from=cfg.model.name if pretrained else None)
        check_batch(len(self.data.blocks.train), o.batch_size * o.grad_accum)  # before any batch is allocated
        if model is None:
            model = (load_model(cfg.model.name, dropout=cfg.model.dropout) if pretrained else
                     build_model(cfg.model.name, vocab_size=len(self.data.tokenizer), dropout=cfg.model.dropout,
                                 eos_token_id=self.data.tokenizer.eos_token_id))
        check_block_size(d.block_size, model.config.n_positions)
        self.n_params = count_params(model)
        if resumed is not None:
            model.load_state_dict(resumed.model)
        if cfg.model.activation_checkpointing:
            enable_activation_checkpointing(model)
        model.to(rt.device)
        model.train()

        # the layout: given by the launcher (built once, before launching) or built here for a run in one process
        self.dims = (dims.check_world(rt.world_size) if dims is not None
                     else ParallelDims.build(cfg.parallel, rt.world_size)).check_model(model.config.n_head,
                                                                                      model.config.n_layer)
        self.amp_dtype, self.amp_note, self.amp_probe = resolve_amp(o, rt.device, model, d.block_size)
        if self.dims.pp_enabled and self.amp_dtype == torch.float16:
            raise EffkitError("--parallel pp does not combine with fp16's GradScaler; use --amp-dtype bf16 or --no-amp")
        p = cfg.parallel
        self.par = parallelize_gpt2(model, self.dims, p.sync, self.amp_dtype, p.reshard_after_forward, p.cpu_offload,
                                    rt, pp_schedule=p.pp_schedule, microbatches=p.microbatches,
                                    loss_scale=o.grad_accum)
        self._set_threads()  # launchers and Accelerate may have changed it
        self.optimizer, self.optim_library = optim.build_optimizer(self.par.model, o.optim, o.lr, o.weight_decay)
        self.tokens_per_step = o.batch_size * o.grad_accum * self.dims.dp * d.block_size
        self.horizon = total_steps(o, self.tokens_per_step)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o, self.horizon))
        self.scaler = make_scaler(rt.device, self.amp_dtype == torch.float16, rt.distributed)
        self.step, self.rows = 0, []
        self.resumed_from = resumed.step if resumed is not None else None
        if resumed is not None:
            self.par.load_optimizer_state(self.optimizer, resumed.optimizer)
            self.scheduler.load_state_dict(resumed.scheduler)
            if resumed.scaler and self.scaler.is_enabled():
                self.scaler.load_state_dict(resumed.scaler)
            self.step, self.rows = resumed.step, list(resumed.rows)
            Checkpointer.restore_rng(resumed, rt.device)
        sampler = BlockSampler(len(self.data.blocks.train), o.batch_size, o.grad_accum, self.dims.dp,
                               self.dims.dp_rank(rt.rank), o.seed, self.step)
        self.batches = iter(make_loader(self.data.blocks.train, sampler, d.workers))
        self.clock = timing.PhaseClock(rt.device, sync=cfg.run.profile)
        self.memory = memory.PeakMemory(rt.device)
        self.step_times: list[float] = []
        self.stop_reason = "max_steps" if self.horizon == o.max_steps else "max_tokens"
        self.train_wall = 0.0

    def _set_threads(self) -> None:
        if self.cfg.parallel.threads:
            torch.set_num_threads(self.cfg.parallel.threads)

    @property
    def model(self) -> torch.nn.Module:
        return self.par.base_model

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        o, par, clock = self.cfg.optim, self.par, self.clock
        clock.restart()
        loss_sum = torch.zeros((), device=self.rt.device)
        for micro in range(o.grad_accum):
            batch = next(self.batches).to(self.rt.device, non_blocking=True)
            clock.lap("data")
            if par.pipeline is not None:  # the schedule runs forward and backward of every micro-batch
                loss_sum += par.pipeline.step(batch)
                clock.lap("pipeline")
                continue
            with par.no_sync() if micro < o.grad_accum - 1 else nullcontext():
                with hardware.autocast_ctx(self.rt.device, self.amp_dtype):
                    logits = par.model(batch).logits
                    loss = (self.hooks.loss or evaluation.lm_loss)(logits, batch) / o.grad_accum
                clock.lap("forward")
                self.scaler.scale(loss).backward()
                clock.lap("backward")
            loss_sum += loss.detach()
        par.sync_gradients()
        self.scaler.unscale_(self.optimizer)
        grad_norm = par.clip_grad_norm(o.grad_clip) if o.grad_clip > 0 else torch.zeros(())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.hooks.after_optimizer_step is not None:
            self.hooks.after_optimizer_step(par.base_model)
        clock.lap("optimizer")
        lr = float(self.scheduler.get_last_lr()[0])  # a tensor for torchao's optimizers
        self.scheduler.step()
        return {"loss": par.mean_over_dp(loss_sum).item(), "lr": lr, "grad_norm": float(grad_norm)}

    def evaluate(self) -> dict[str, float]:
        pipe = self.par.pipeline
        return evaluation.evaluate(self.par.model, self.data.blocks.eval, self.cfg.optim.batch_size, self.amp_dtype,
                                block_losses=pipe.block_losses if pipe is not None else None,
                                eval_bytes=self.data.blocks.eval_bytes, docs=self.data.blocks.eval_docs)

    def checkpoint(self) -> None:
        self.checkpointer.save(self.step, self.par, self.optimizer, self.scheduler, self.cfg.to_dict(), self.rows,
                               scaler=self.scaler)

    def tokens_per_s(self) -> float | None:
        steady = self.steady_step_times
        return self.tokens_per_step * len(steady) / sum(steady) if steady else None

    @property
    def steady_step_times(self) -> list[float]:
        return self.step_times[self.cfg.run.warmup_steps_excluded:] or self.step_times

    def retarget(self, steps: int) -> None:
        """Train `steps` in all instead of `max_steps` (a time budget re-fitted from this run's own first steps),
        the cosine rebuilt for them: allowed only while the learning rate warms up, whose rates do not depend on the
        steps trained (`lr_lambda`), so the schedule is the one a run of `steps` from the start follows. Later
        checkpoints and the report carry the new count."""
        o = self.cfg.optim
        if self.step > o.warmup_steps or steps < self.step or not o.max_steps:
            raise EffkitError(f"the training steps can be re-fitted only during the warm-up (step {self.step}, "
                              f"warm-up {o.warmup_steps}), to no fewer than those trained, and with --max-steps")
        self.cfg = self.cfg.replace(optim=o.replace(max_steps=steps))
        self.horizon = total_steps(self.cfg.optim, self.tokens_per_step)
        self.scheduler.lr_lambdas = [lr_lambda(self.cfg.optim, self.horizon)] * len(self.optimizer.param_groups)
        self.stop_reason = "max_steps" if self.horizon == steps else "max_tokens"

    # ------------------------------------------------------------------------------------------ the loop
    @property
    def bounded(self) -> bool:
        o = self.cfg.optim
        return bool(o.max_steps or o.max_tokens or o.time_budget)

    def fit(self) -> None:
        """Train until the step, token or time bound (a fine-tune with no bound only evaluates and saves)."""
        r, o = self.cfg.run, self.cfg.optim
        t_start = time.perf_counter()
        with self.memory, _Progress(self.progress and self.rt.is_main, self.horizon, self.step, self.tag) as bar:
            try:
                while self.bounded and (self.horizon == 0 or self.step < self.horizon):
                    t0 = time.perf_counter()
                    out = self.train_step()
                    self.step += 1
                    if not math.isfinite(out["loss"]):  # every rank sees the same averaged loss
                        raise EffkitError(f"training diverged at step {self.step}: the loss is {out['loss']}; "
                                          f"lower --lr (now {o.lr:g}) or --weight-decay, or use more --warmup-steps")
                    dt = time.perf_counter() - t0
                    self.step_times.append(dt)
                    row = {"step": self.step, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                           "step_time_s": dt, "tokens": self.step * self.tokens_per_step, "eval_loss": None}
                    if r.eval_interval and self.step % r.eval_interval == 0 and self.step != self.horizon:
                        self.clock.restart()
                        row["eval_loss"] = self.evaluate()["eval_loss"]
                        self.clock.lap("eval")
                        bar.log(f"step {self.step}: held-out loss {row['eval_loss']:.4f}")
                    self.rows.append(row)
                    bar.update(self.step, out["loss"], self.tokens_per_s() or 0.0)
                    if self.hooks.on_step is not None and (steps := self.hooks.on_step(self.step, out["loss"])):
                        self.retarget(steps)
                        bar.update(self.step, out["loss"], self.tokens_per_s() or 0.0, total=self.horizon)
                    if r.checkpoint_interval and self.step % r.checkpoint_interval == 0:
                        self.checkpoint()
                    if o.time_budget and time.perf_counter() - t_start >= o.time_budget:
                        self.stop_reason = f"time_budget ({o.time_budget:g} s)"
                        break
            except KeyboardInterrupt:
                self.checkpoint()
                raise Interrupted(f"interrupted at step {self.step}; checkpoint saved, continue with "
                                  f"`effkit train --resume --run-name {r.run_name}`") from None
        self.train_wall = time.perf_counter() - t_start
        self.clock.phases["other"] = max(0.0, self.train_wall - sum(self.clock.phases.values()))

    # ------------------------------------------------------------------------------------------ the end
    def finish(self, stage: str = "train", parent: str | None = None,
               extra_metrics: Callable[[torch.nn.Module], dict[str, Any]] | None = None,
               mark_latest: bool = True) -> dict[str, Any]:
        """Final evaluation, the artifact `runs/<run>/<tag>/` and the report (rank 0 writes); `runs/latest`
        points at the run unless `mark_latest` is off."""
        final = self.evaluate()
        if not math.isfinite(final["eval_loss"]):
            raise EffkitError(f"training diverged: the held-out loss is {final['eval_loss']} after {self.step} steps; "
                              f"lower --lr (now {self.cfg.optim.lr:g}) or --weight-decay")
        if self.rows:
            self.rows[-1]["eval_loss"] = final["eval_loss"]
        peak_mem = self.par.gather_ints(self.memory.peak_bytes)
        peak_abs = self.par.gather_ints(self.memory.absolute_bytes)
        state = self.par.full_state_dict()
        stage_metrics = extra_metrics(self.model) if extra_metrics is not None else {}
        report = None
        if self.rt.is_main:
            artifact = self.layout.artifact(self.tag)
            with artifacts.atomic_dir(artifact) as tmp:
                save_model(self.par.save_as or self.model, tmp, self.data.tokenizer, state_dict=state)
                ran, m, verdicts, protocol = measurements(self, final, peak_mem, peak_abs, {
                    **stage_metrics, "size_bytes": artifacts.dir_size(tmp)})
                meta = artifacts.write_meta(tmp, stage, self.cfg.to_dict(), m, data=self.cfg.data.to_dict(),
                                            parent=parent, extra={"what_ran": ran})
            if mark_latest:
                artifacts.set_latest(self.layout.runs_dir, self.layout.run_dir)
            beside, how = self.planned.sections(m)
            report = StageReport(stage=stage, tag=self.tag, parent=parent, run=self.cfg.run.run_name,
                                 artifact=str(artifact), config=meta["config"], metrics=m, verdicts=verdicts,
                                 what_ran=ran, protocol={**protocol, **how}, **stamp(meta), extras=beside)
            out = self.layout.report_dir
            write_stage_report(out, report)
            write_rows_csv(out / f"{self.tag}_steps.csv", self.rows)
            if self.rows:
                plot_loss_curve(self.rows, out / f"{self.tag}_loss.png",
                                f"{self.tag}: {os.path.basename(self.cfg.model.name)} on {self.data.corpus.name}")
        self.rt.barrier()
        return report.as_dict() if report else {"stage": stage, "metrics": {"eval_loss": final["eval_loss"]},
                                                "run": self.cfg.run.run_name, "rows": self.rows}


def measurements(tr: Trainer, final: dict[str, float], peak_mem: list[int], peak_abs: list[int],
                 stage_metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str], dict[str, str]]:
    """What a finished run reports: what ran (read back from the model), its metrics (the stage's own last), the
    verdicts and how each metric was measured."""
    cfg, rt = tr.cfg, tr.rt
    steady = tr.steady_step_times
    excluded = len(tr.step_times) - len(steady)
    tokens_per_s = tr.tokens_per_s()
    peak, peak_source = roofline.peak_flops(rt.device, tr.amp_dtype or torch.float32, tf32=tr.tf32)
    fpt = flops_per_token(tr.model.config, cfg.data.block_size, tr.n_params)
    mfu = (fpt * tokens_per_s / (peak * rt.world_size)) if (peak and tokens_per_s) else None
    mfu_invalid = None
    if mfu is not None and mfu > 1.0:  # achieved FLOP/s above the peak: the peak is wrong, not the run
        mfu_invalid = (f"MFU not reported: the achieved {fpt * tokens_per_s / 1e9:,.1f} GFLOP/s exceed the peak "
                       f"({peak * rt.world_size / 1e9:,.1f} GFLOP/s over {rt.world_size} processes), so that peak "
                       "measurement is wrong (a noisy or throttled GEMM timing); `effkit --remeasure` measures it "
                       "again")
        mfu = None
    applied = tr.par.describe()
    amp_name = str(tr.amp_dtype).removeprefix("torch.") if tr.amp_dtype else "fp32"
    what_ran = {
        "device": hardware.describe_device(rt.device), "world_size": rt.world_size,
        "parallel": applied["mode"], "parallel_detail": applied.get("detail"),
        "amp_dtype": amp_name, "amp_note": tr.amp_note, "amp_probe": tr.amp_probe,
        "fp32_matmuls": ("TF32 tensor cores" if tr.tf32 else "fp32" if rt.device.type == "cuda" else "fp32 (CPU)"),
        "optimizer": f"{cfg.optim.optim}: {tr.optim_library}",
        "loss_scaler": (type(tr.scaler).__name__ + (" (found-inf all-reduced over the world)" if rt.distributed
                                                    else "")) if tr.scaler.is_enabled() else None,
        "activation_checkpointing": activation_checkpointing_enabled(tr.model),
        "model": cfg.model.name, "data": tr.data.corpus.name, "tokenizer": tr.data.tokenizer_source,
        "resumed_from_step": tr.resumed_from, "stopped_by": tr.stop_reason,
    }
    m = {
        **evaluation.eval_summary(final),
        "final_train_loss": tr.rows[-1]["loss"] if tr.rows else None, "steps": tr.step,
        "train_tokens": tr.step * tr.tokens_per_step, "train_tokens_per_s": tokens_per_s,
        "train_wall_s": tr.train_wall, "flops_per_token": fpt, "mfu": mfu, "peak_flops": peak,
        **({"mfu_invalid": mfu_invalid} if mfu_invalid else {}),
        "peak_memory_bytes_per_rank": peak_mem, "peak_memory_absolute_bytes_per_rank": peak_abs,
        "params": tr.n_params, "time_breakdown_s": tr.clock.phases,
        "train_split_tokens": tr.data.blocks.train_tokens, "heldout_split_tokens": tr.data.blocks.heldout_tokens,
        **stage_metrics,
    }
    verdicts = [tr.amp_warning.removeprefix("warning: ")] if tr.amp_warning else []
    if mfu_invalid:
        verdicts.append(mfu_invalid)
    return what_ran, m, verdicts, {
        "eval_loss": evaluation.EVAL_PROTOCOL + f"; {final['eval_tokens']} predicted tokens; computed under "
                     f"{amp_name}",
        "train_tokens_per_s": f"global tokens per step ({tr.tokens_per_step}) x steady-state steps / their "
                              f"wall time ({len(steady)} steps; first {excluded} excluded as warm-up)",
        "mfu": f"(6N + 12*L*d*T) FLOPs/token x tokens/s / (peak x {rt.world_size} processes); peak: "
               f"{peak_source}",
        "peak_memory": tr.memory.method + ", per rank, over the training steps (the model is built, "
                       "sharded and placed before; optimizer state, gradients and activations count); "
                       "peak_memory_absolute_bytes_per_rank: the high-water mark itself",
        "time_breakdown_s": "wall time per phase of every step on rank 0 (time.perf_counter"
                            + (", CUDA synchronised" if cfg.run.profile else "") + "); other = training wall "
                            "time minus the phases (logging, progress, checkpoints)",
    }


# ---------------------------------------------------------------------------------------------- entry points

def train(cfg: TrainConfig, rt: Runtime | None = None, *, on_step: Callable[[int, float], None] | None = None,
          progress: bool = True, dims: ParallelDims | None = None, planned: Planned | None = None) -> dict[str, Any]:
    """Train per `cfg` in this process (or as one rank of a launched run, with the layout `dims` built before
    launching); returns the report dict (with `planned` beside what was measured). `on_step(step, loss)` is called
    after every step. `cfg.run.resume` continues from the last checkpoint with the config saved there."""
    cfg = cfg.validate()
    rt = rt or init_runtime()
    resumed = None
    if cfg.run.resume:
        layout = RunLayout.for_run(cfg.run)
        resumed = Checkpointer(layout.checkpoint_dir).load()
        saved = TrainConfig.from_dict(resumed.config)
        if 0 < saved.optim.max_steps <= resumed.step:
            raise EffkitError(f"nothing to resume: run {saved.run.run_name!r} finished its {saved.optim.max_steps} "
                              f"steps (its last checkpoint is step {resumed.step}); train a new --run-name to train "
                              "more")
        cfg = saved.replace(run=saved.run.replace(resume=True),
                            optim=saved.optim.replace(time_budget=cfg.optim.time_budget))
        if dims is not None and _saved_degrees(cfg, dims.world_size) != dims.degrees():
            raise EffkitError(f"run {cfg.run.run_name!r} was trained with --parallel {cfg.parallel.mode}; resume it "
                              f"with --parallel {cfg.parallel.mode} (got {dims.mode}: {dims.describe_degrees()})")
    trainer = Trainer(cfg, rt, resumed=resumed, hooks=TrainHooks(on_step=on_step), progress=progress, dims=dims,
                      planned=planned)
    trainer.fit()
    return trainer.finish()


def _saved_degrees(cfg: TrainConfig, world_size: int) -> tuple | None:
    """The degrees the checkpoint's layout has on `world_size` processes (None: it cannot run on them)."""
    try:
        return ParallelDims.build(cfg.parallel, world_size).degrees()
    except EffkitError:
        return None


def train_from_dict(config: dict[str, Any]) -> dict[str, Any]:
    """`train` from a JSON config, without a progress bar: what `run_isolated` calls in a fresh process."""
    return train(TrainConfig.from_dict(config), progress=False)


def finetune(cfg: TrainConfig, model: torch.nn.Module, rt: Runtime, *, stage: str, tag: str, parent: str,
             after_step: Callable[[torch.nn.Module], None] | None = None,
             extra_metrics: Callable[[torch.nn.Module], dict[str, Any]] | None = None,
             loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             progress: bool = True, mark_latest: bool = True) -> dict[str, Any]:
    """Fine-tune an already built `model` (e.g. pruned) with the one loop and save it as `runs/<run>/<tag>/`.
    `cfg.model.name` is the artifact it came from (for its tokenizer); with no step bound it is only
    evaluated and saved. `loss` replaces the next-token cross-entropy (distillation)."""
    cfg = cfg.validate(allow_no_steps=True)
    trainer = Trainer(cfg, rt, model=model, hooks=TrainHooks(after_optimizer_step=after_step, loss=loss), tag=tag,
                      progress=progress)
    trainer.fit()
    return trainer.finish(stage=stage, parent=parent, extra_metrics=extra_metrics, mark_latest=mark_latest)


def train_in_processes(cfg: TrainConfig, planned: Planned | None = None,
                       trial: list[TrainConfig] | None = None) -> Any:
    """Validate the process layout here (one line, exit 2), build the data caches once, then start the
    processes through Accelerate (rank 0 reports `planned` beside what it measured); returns rank 0's report.
    `trial` (`time_steps`): those runs, each like `cfg`'s, trained in turn in one launch (`time_rank`); returns
    their step times."""
    p = cfg.parallel
    if p.mode == "none":
        raise EffkitError("--nproc/--nnodes > 1 need a parallel mode: add --parallel ddp (or fsdp, tp, fsdp+tp, "
                          "pp, pp+fsdp)")
    if p.cpu_offload and not torch.cuda.is_available():
        raise EffkitError("--cpu-offload moves FSDP parameters from GPU to CPU; there is no GPU here, drop it")
    nproc = nproc_per_node(p)
    shape = shape_of(cfg.model.name)
    dims = ParallelDims.build(p.replace(nproc=nproc), nproc * p.nnodes, shape.get("n_head"), shape.get("n_layer"))
    threads = p.threads or (0 if torch.cuda.is_available() else max(1, (os.cpu_count() or 1) // nproc))
    cfg = cfg.replace(parallel=p.replace(nproc=nproc, threads=threads),
                      run=cfg.run.replace(run_name=cfg.run.run_name or artifacts.new_run_name(cfg.model.name)))
    pretrained = is_pretrained_source(cfg.model.name)
    data = prepare(cfg.data, tokenizer_from=cfg.model.name if pretrained else None)  # bad data fails here, caches
    check_batch(len(data.blocks.train), cfg.optim.batch_size * cfg.optim.grad_accum)
    if cfg.optim.amp is None and not torch.cuda.is_available():  # --amp auto measured once, here, on the shape
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # as each process will run (the choice is cached per thread count)
        try:
            precision.cpu_choice(config_of(cfg.model.name, len(data.tokenizer), data.tokenizer.eos_token_id),
                                 cfg.optim.batch_size, cfg.data.block_size)
        finally:
            torch.set_num_threads(before)
    layout = RunLayout.for_run(cfg.run)
    if trial:
        runs = [{"config": c.replace(parallel=c.parallel.replace(nproc=nproc, threads=threads)).to_dict(),
                 "dims": ParallelDims.build(c.parallel.replace(nproc=nproc), nproc * p.nnodes, shape.get("n_head"),
                                            shape.get("n_layer")).to_dict()} for c in trial]
        return launch({"runs": runs}, cfg.parallel, cfg.run.run_name, target="effkit.train:time_rank")
    launch({"config": cfg.to_dict(), "dims": dims.to_dict(), "planned": asdict(planned or Planned())}, cfg.parallel,
           cfg.run.run_name)
    if p.node_rank != 0:  # only global rank 0 (on node 0) saves the artifact and writes the report
        return {"stage": "train", "run": cfg.run.run_name, "node_rank": p.node_rank,
                "report_on_node0": str(layout.report("train")), "artifact_on_node0": str(layout.artifact("train"))}
    return json.loads(layout.report("train").read_text())


def train_any(cfg: TrainConfig, on_step: Callable[[int, float], None] | None = None,
              planned: Planned | None = None) -> dict[str, Any]:
    """`effkit train`: in this process, or in launched processes when a parallel mode or several are asked;
    the run is locked against a second effkit process meanwhile. `on_step(step, loss)` is called after every step
    of an in-process run (launched processes report only at the end). `planned` (the memory plan made before, a
    time budget's decision) goes into the report beside what was measured."""
    if not cfg.run.run_name:
        cfg = cfg.replace(run=cfg.run.replace(run_name=artifacts.new_run_name(cfg.model.name)))
    run = (partial(train_in_processes, planned=planned) if cfg.parallel.launched
           else partial(train, on_step=on_step, planned=planned))
    if cfg.parallel.node_rank != 0:  # other nodes write nothing (global rank 0 saves): no lock to take
        return run(cfg)
    with artifacts.run_lock(RunLayout.for_run(cfg.run).run_dir):
        return run(cfg)


def time_steps(cfgs: list[TrainConfig]) -> list[list[float]]:
    """The step times of short runs of `cfgs` (no evaluation between steps, no checkpoint) in a scratch folder:
    `--parallel auto`'s trial of layouts. Launched runs go in one launch (`time_rank`: the processes and their
    imports started once, each run's model and layout built anew)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="effkit-auto-") as tmp:
        runs = [c.replace(run=c.run.replace(run_name=f"trial{i}", runs_dir=f"{tmp}/runs", reports_dir=f"{tmp}/reports",
                                            resume=False, eval_interval=0, checkpoint_interval=0))
                for i, c in enumerate(cfgs)]
        if runs and runs[0].parallel.launched:
            return train_in_processes(runs[0], trial=runs)
        return [timed_steps(c) for c in runs]


def timed_steps(cfg: TrainConfig, dims: ParallelDims | None = None) -> list[float]:
    """The seconds of each step of a run of `cfg`, trained and nothing more: a trial's timings are all it keeps,
    so its model is neither evaluated, saved nor reported."""
    trainer = Trainer(cfg.validate(), init_runtime(), progress=False, dims=dims)
    trainer.fit()
    return trainer.step_times


def time_rank(runs: list[dict[str, Any]]) -> list[list[float]]:
    """One launched rank of `time_steps`: its runs timed in turn in one process group, left after the last (as
    `effkit.worker.train_rank` leaves it); their step times."""
    import torch.distributed as dist

    times = [timed_steps(TrainConfig.from_dict(run["config"]), ParallelDims.from_dict(run["dims"])) for run in runs]
    if dist.is_initialized():
        dist.destroy_process_group()
    return times


# ------------------------------------------------------------------------------------- the stage in `effkit run`

class TrainStep(Step):
    key = "train"
    record_before_run = True  # a resumed run continues only a checkpoint of the same recipe
    known_early = False
    measures = False  # its work is its training steps, counted exactly

    def fingerprint(self, plan: Plan, before: dict[str, str]) -> str:
        t = plan.train.to_dict()
        t["run"].pop("resume", None)  # how training is continued, not what it makes
        return fingerprint("train", t)

    def outputs(self, ctx: RunContext) -> list[Path]:
        p = ctx.plan
        return [p.run_dir / "train", p.run_dir / "checkpoints", p.layout.report("train")]

    def complete(self, ctx: RunContext) -> bool:
        return complete(ctx.plan.run_dir / "train")

    def run(self, ctx: RunContext) -> None:
        from effkit.memplan import predict_quietly

        plan = ctx.plan
        resume = Checkpointer(plan.layout.checkpoint_dir).exists()
        if resume:
            ctx.console.print("resuming training from its last checkpoint")
        planned = Planned(predict_quietly(plan.train), plan.schedule, plan.run.pipeline.full_schedule_result)
        report = train_any(plan.train.replace(run=plan.train.run.replace(resume=resume)),
                           on_step=ctx.eta.on_train_step, planned=planned)
        ctx.eta.step_time_from_report(report)  # a launched run, or one too short for the in-run estimate
        self.say_schedule(ctx, report)

    def reuse(self, ctx: RunContext) -> None:
        path = ctx.plan.layout.report("train")
        if path.is_file():
            self.say_schedule(ctx, json.loads(path.read_text()))

    @staticmethod
    def say_schedule(ctx: RunContext, report: dict[str, Any]) -> None:
        """The steps a time budget left and the bits per byte they reached, for the run's last lines."""
        from effkit.report import schedule_line

        if line := schedule_line(report):
            ctx.results["schedule"] = line

    def work(self, plan: Plan) -> float:
        t = plan.train
        evals = (t.optim.max_steps // t.run.eval_interval if t.run.eval_interval else 0) + 1
        eval_batches = -(-t.data.eval_blocks // t.optim.batch_size)
        return t.optim.max_steps + evals * eval_batches * FORWARD + costs()["train_setup"]

    def describe(self, plan: Plan) -> dict[str, Any]:
        import shlex

        from effkit.child import Job
        from effkit.memplan import predict_quietly
        from effkit.parallel.launch import launch_command

        t = plan.train
        budget = plan.run.pipeline.time_budget_min
        steps = (f"{t.optim.max_steps} steps" + (f" (fewer if a step time measured at the start predicts the run over "
                                                 f"its time budget of {budget:g} min)" if budget else ""))
        what = (f"{t.model.name} on {t.data.source}, {steps}, batch {t.optim.batch_size} x "
                f"{t.data.block_size}, parallel {t.parallel.mode}, "
                f"amp {'auto (measured)' if t.optim.amp is None else t.optim.amp_dtype if t.optim.amp else 'off'}")
        mem = predict_quietly(t)
        if mem is not None:
            fits = {True: "fits", False: "does NOT fit", None: "fit unknown"}[mem["fits"]]
            what += (f"; memory plan: {mem['total_bytes'] / 2**20:,.0f} MiB per rank at the peak, {fits} in "
                     f"{mem['device']}" + (f" ({mem['device_bytes'] / 2**20:,.0f} MiB)" if mem["device_bytes"] else ""))
        entry = {"stage": "train", "what": what, "leaves": str(plan.layout.artifact("train"))}
        if t.parallel.launched:
            p = t.parallel.replace(nproc=nproc_per_node(t.parallel))  # as resolved on this machine
            cmd, env = launch_command(p, Job(Path("<tmp>/job")))
            cpu = " ACCELERATE_USE_CPU=1" if env.get("ACCELERATE_USE_CPU") else ""
            entry["launch"] = (f"{p.nproc} processes per node, forked from a server that imported torch once "
                               f"(effkit.child); by hand: {cpu.strip()} {shlex.join(cmd)}")
        return entry



class TrainStage(Stage):
    name = "train"
    measures_step_time = True  # its steps are the unit of `effkit run`'s estimate

    def untimed_steps(self, plan: Plan) -> int:
        return plan.train.run.warmup_steps_excluded

    def step_time(self, plan: Plan, report: dict[str, Any] | None = None) -> tuple[float, str] | None:
        """From the report's steady tokens/s (this run's folders hold it once training finished, here or before)."""
        if report is None:
            path = plan.layout.report("train")
            if not path.is_file():
                return None
            report = json.loads(path.read_text())
        tps = report.get("metrics", report).get("train_tokens_per_s")
        if not tps:
            return None
        o = plan.train
        return (o.optim.batch_size * o.optim.grad_accum * o.data.block_size / tps,
                "from the training report's steady tokens/s")

    def training_steps(self, plan: Plan) -> int:
        return plan.train.optim.max_steps  # 0: bounded by tokens or time, which a time budget leaves alone

    def fewest_training_steps(self, plan: Plan) -> int:
        return plan.train.optim.warmup_steps + 1  # the learning rate warms up and then decays

    def with_training_steps(self, plan: Plan, steps: int) -> None:
        plan.configs["train"] = plan.train.with_flat(max_steps=steps)  # the cosine is built for `steps`

    def probe_step_time(self, plan: Plan) -> tuple[float | None, str]:
        from effkit.memplan import step_time

        return step_time(plan.train)

    def schedule_free_steps(self, plan: Plan) -> int:
        return plan.train.optim.warmup_steps  # `lr_lambda`: the warm-up's rates do not depend on the steps trained

    def configure(self, plan: Plan) -> None:
        f = plan.run.folders
        plan.configs["train"] = build_config(TrainConfig, plan.recipe, {"run_name": plan.run.pipeline.run_name,
                                                                        "runs_dir": f.runs_dir,
                                                                        "reports_dir": f.reports_dir})

    def steps(self, plan: Plan) -> list[Step]:
        return [TrainStep()]

    def memory_plans(self, plan: Plan, shapes: ShapeRun) -> list[tuple[str, str, Any]]:
        """Training's plan (`effkit train --plan`), and the dense model it leaves, as shapes, for the stages after
        it (the same shape whether or not this recipe trains it)."""
        from effkit import memplan

        t = plan.train
        shapes.artifacts["train"] = artifacts.shape_only(shapes.run_dir / "train", memplan._model_config(t),
                                                         t.data.to_dict(), config=t.to_dict())
        if self.name not in plan.stages:
            return []
        return [("train", f"{t.model.name}, batch {t.optim.batch_size} x {t.data.block_size}, {t.optim.optim}",
                 memplan.predict(t, probe=True))]

    def fingerprints(self, plan: Plan, before: dict[str, str]) -> dict[str, str]:
        return {"train": TrainStep().fingerprint(plan, before)}  # every later stage depends on it


STAGE = TrainStage()
