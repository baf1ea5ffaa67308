"""The one training loop: single process and every parallel mode, also used to fine-tune between
pruning rounds. Read it top to bottom: setup, the step loop, final evaluation, artifact and report."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, metrics
from effkit.checkpoint import load_checkpoint, save_checkpoint
from effkit.config import TrainConfig
from effkit.data import BlockSampler, get_tokenizer, load_blocks, load_corpus, make_loader
from effkit.errors import EffkitError
from effkit.model import (
    activation_checkpointing_enabled,
    build_model,
    check_preset,
    count_params,
    enable_activation_checkpointing,
    flops_per_token,
    is_pretrained_source,
    load_model,
    save_model,
)
from effkit.parallel import Runtime, init_runtime
from effkit.report import plot_loss_curve, write_rows_csv, write_stage_report


class Interrupted(Exception):
    """Training was interrupted (Ctrl-C); a checkpoint was written and `--resume` continues."""


def resolve_amp(cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype | None, str]:
    """The autocast dtype actually used, and a note on why."""
    if not cfg.amp:
        return None, "fp32 (AMP off)"
    if cfg.amp_dtype == "fp16":
        if device.type != "cuda":
            raise EffkitError("fp16 autocast does nothing on CPU (PyTorch runs those ops in fp32); "
                              "use --amp-dtype bf16 on CPU")
        return torch.float16, "fp16 autocast with GradScaler"
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise EffkitError("this GPU has no bf16 support; use --amp-dtype fp16")
    return torch.bfloat16, "bf16 autocast"


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    is_dtensor = any(type(p).__name__ == "DTensor" for p in decay)
    fused = not is_dtensor  # fused AdamW exists for CPU and CUDA tensors, not for DTensors everywhere
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to min_lr over total_steps (constant if unbounded)."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if total_steps <= 0:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        floor = cfg.min_lr / cfg.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def total_steps(cfg: TrainConfig, tokens_per_step: int) -> int:
    bounds = [s for s in (cfg.max_steps, math.ceil(cfg.max_tokens / tokens_per_step) if cfg.max_tokens else 0)
              if s > 0]
    return min(bounds) if bounds else 0  # 0: only the time budget bounds the run


def prepare_data(cfg: TrainConfig):
    corpus = load_corpus(cfg.data, cfg.heldout_fraction)
    pretrained = cfg.model if is_pretrained_source(cfg.model) else None
    tokenizer, tok_source = get_tokenizer(corpus, cfg.vocab_size, pretrained=pretrained)
    data = load_blocks(corpus, tokenizer, cfg.block_size, cfg.eval_blocks)
    return corpus, tokenizer, tok_source, data


def prepare_model(cfg: TrainConfig, tokenizer) -> torch.nn.Module:
    if is_pretrained_source(cfg.model):
        model = load_model(cfg.model, dropout=cfg.dropout)
    else:
        model = build_model(cfg.model, vocab_size=len(tokenizer), dropout=cfg.dropout,
                            eos_token_id=tokenizer.eos_token_id)
    if cfg.block_size > model.config.n_positions:
        raise EffkitError(f"--block-size {cfg.block_size} is larger than the model's context "
                          f"({model.config.n_positions}); use --block-size {model.config.n_positions} or less")
    return model


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

    def update(self, step: int, loss: float, tps: float):
        if self.bar:
            self.bar.update(self.task, completed=step, loss=loss, tps=tps)

    def log(self, msg: str):
        if self.bar:
            self.bar.console.print(msg)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)


def train(cfg: TrainConfig, on_step: Callable[[int, float], None] | None = None, progress: bool = True,
          rt: Runtime | None = None, *, model: torch.nn.Module | None = None, stage: str = "train",
          tag: str = "train", parent: str | None = None, after_step: Callable[[torch.nn.Module], None] | None = None,
          extra_metrics: Callable[[torch.nn.Module], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train per `cfg`; returns the report dict. `on_step(step, loss)` is called after every step.

    Fine-tuning (used by `effkit prune`): pass `model` (already built, e.g. pruned), with `cfg.model` the
    parent artifact it came from (for its tokenizer); `after_step(model)` runs after every optimizer step (to
    re-apply pruning masks); `extra_metrics(model)` adds stage metrics before the artifact is saved under
    `runs/<run>/<tag>/`. With a given model, `max_steps = 0` means: evaluate and save without training.
    """
    finetune_only_eval = model is not None and cfg.max_steps == 0 and not cfg.max_tokens and not cfg.time_budget
    cfg.validate(allow_no_steps=model is not None)
    rt = rt or init_runtime()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_name = cfg.run_name or artifacts.new_run_name(cfg.model)
    runs_dir = Path(cfg.runs_dir)
    run_dir = runs_dir / run_name
    ckpt_dir = run_dir / "checkpoints" / "last"
    resumed = None
    if cfg.resume:
        if not ckpt_dir.is_dir():
            raise EffkitError(f"nothing to resume: {ckpt_dir} does not exist; start without --resume")
        resumed = load_checkpoint(ckpt_dir)
        saved = TrainConfig.from_dict(resumed["config"])
        saved.resume, saved.time_budget = True, cfg.time_budget
        cfg = saved
    cfg.run_name = run_name

    amp_dtype, amp_note = resolve_amp(cfg, rt.device)
    if not is_pretrained_source(cfg.model):  # fail fast, before any data work
        n_positions = check_preset(cfg.model)["n_positions"]
        if cfg.block_size > n_positions:
            raise EffkitError(f"--block-size {cfg.block_size} is larger than the model's context "
                              f"({n_positions}); use --block-size {n_positions} or less")
    torch.manual_seed(cfg.seed)
    corpus, tokenizer, tok_source, data = prepare_data(cfg)
    if model is None:
        model = prepare_model(cfg, tokenizer)
    n_params = count_params(model)
    if resumed is not None:
        model.load_state_dict(resumed["model"])
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    model.to(rt.device)
    model.train()
    from effkit.parallel.apply import parallelize

    par = parallelize(model, cfg, rt)
    model = par.model
    if cfg.threads:  # launchers and Accelerate may have changed it
        torch.set_num_threads(cfg.threads)

    optimizer = make_optimizer(model, cfg)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * rt.dp_size * cfg.block_size
    horizon = total_steps(cfg, tokens_per_step)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, horizon))
    scaler = torch.amp.GradScaler(rt.device.type, enabled=amp_dtype == torch.float16)
    start_step, rows = 0, []
    if resumed is not None:
        par.load_optimizer_state(optimizer, resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        start_step, rows = resumed["step"], resumed.get("rows", [])
        torch.set_rng_state(resumed["rng"]["__rng_cpu"])
        if "__rng_cuda" in resumed["rng"] and rt.device.type == "cuda":
            torch.cuda.set_rng_state(resumed["rng"]["__rng_cuda"])

    sampler = BlockSampler(len(data.train), cfg.batch_size, cfg.grad_accum, rt.dp_size, rt.dp_rank, cfg.seed,
                           start_step)
    batches = iter(make_loader(data.train, sampler, cfg.workers))

    def checkpoint(step: int):
        state = par.full_state_dict()
        optim_state = par.optimizer_state(optimizer)
        if rt.is_main:
            save_checkpoint(ckpt_dir, state, optim_state, scheduler.state_dict(), step,
                            {"config": asdict(cfg), "rows": rows})
        rt.barrier()

    step_times: list[float] = []
    phases: dict[str, float] = {}
    stop_reason = "max_steps" if horizon == cfg.max_steps else "max_tokens"
    t_start = time.perf_counter()
    step = start_step
    memory = metrics.PeakMemory(rt.device)
    with memory, _Progress(progress and rt.is_main, horizon, start_step, tag) as bar:
        try:
            while not finetune_only_eval and (horizon == 0 or step < horizon):
                t0 = clock = time.perf_counter()

                def lap(phase: str) -> None:  # per-phase wall time (CUDA synchronised when profiling)
                    nonlocal clock
                    if cfg.profile and rt.device.type == "cuda":
                        torch.cuda.synchronize(rt.device)
                    now = time.perf_counter()
                    phases[phase] = phases.get(phase, 0.0) + now - clock
                    clock = now

                loss_sum = torch.zeros((), device=rt.device)
                for micro in range(cfg.grad_accum):
                    batch = next(batches).to(rt.device, non_blocking=True)
                    lap("data")
                    with par.no_sync() if micro < cfg.grad_accum - 1 else nullcontext():
                        with metrics.autocast_ctx(rt.device, amp_dtype):
                            logits = model(batch).logits
                            loss = metrics.lm_loss(logits, batch) / cfg.grad_accum
                        lap("forward")
                        scaler.scale(loss).backward()
                        lap("backward")
                    loss_sum += loss.detach()
                par.sync_gradients()
                scaler.unscale_(optimizer)
                grad_norm = par.clip_grad_norm(cfg.grad_clip) if cfg.grad_clip > 0 else torch.zeros(())
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if after_step is not None:
                    after_step(par.base_model)
                lap("optimizer")
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                step_loss = par.mean_over_dp(loss_sum).item()
                step += 1
                dt = time.perf_counter() - t0
                step_times.append(dt)
                row = {"step": step, "loss": step_loss, "lr": lr, "grad_norm": float(grad_norm),
                       "step_time_s": dt, "tokens": step * tokens_per_step, "eval_loss": None}
                if cfg.eval_interval and step % cfg.eval_interval == 0 and step != horizon:
                    t_eval = time.perf_counter()
                    row["eval_loss"] = metrics.evaluate(model, data.eval, cfg.batch_size, rt.device,
                                                        amp_dtype)["eval_loss"]
                    phases["eval"] = phases.get("eval", 0.0) + time.perf_counter() - t_eval
                    bar.log(f"step {step}: held-out loss {row['eval_loss']:.4f}")
                rows.append(row)
                steady = step_times[cfg.warmup_steps_excluded:] or step_times
                bar.update(step, step_loss, tokens_per_step * len(steady) / sum(steady))
                if on_step is not None:
                    on_step(step, step_loss)
                if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0:
                    checkpoint(step)
                if cfg.time_budget and time.perf_counter() - t_start >= cfg.time_budget:
                    stop_reason = f"time_budget ({cfg.time_budget:g} s)"
                    break
        except KeyboardInterrupt:
            checkpoint(step)
            raise Interrupted(f"interrupted at step {step}; checkpoint saved, continue with "
                              f"`effkit train --resume --run-name {run_name}`") from None
    train_wall = time.perf_counter() - t_start
    phases["other"] = max(0.0, train_wall - sum(phases.values()))

    final = metrics.evaluate(model, data.eval, cfg.batch_size, rt.device, amp_dtype)
    if rows:
        rows[-1]["eval_loss"] = final["eval_loss"]
    steady = step_times[cfg.warmup_steps_excluded:] or step_times
    excluded = len(step_times) - len(steady)
    tokens_per_s = tokens_per_step * len(steady) / sum(steady) if steady else None
    peak_dtype = amp_dtype or torch.float32
    peak, peak_source = metrics.peak_flops(rt.device, peak_dtype)
    fpt = flops_per_token(par.base_model.config, cfg.block_size, n_params)
    mfu = (fpt * tokens_per_s / (peak * rt.world_size)) if (peak and tokens_per_s) else None
    peak_mem = par.gather_ints(memory.peak_bytes)
    state = par.full_state_dict()

    stage_metrics = extra_metrics(par.base_model) if extra_metrics is not None else {}
    artifact = run_dir / tag
    report = None
    if rt.is_main:
        applied = par.describe()
        what_ran = {
            "device": metrics.describe_device(rt.device), "world_size": rt.world_size,
            "parallel": applied["mode"], "parallel_detail": applied.get("detail"),
            "amp_dtype": str(amp_dtype).removeprefix("torch.") if amp_dtype else "fp32", "amp_note": amp_note,
            "activation_checkpointing": activation_checkpointing_enabled(par.base_model),
            "model": cfg.model, "data": corpus.name, "tokenizer": tok_source, "resumed_from_step":
                resumed["step"] if resumed else None, "stopped_by": stop_reason,
        }
        m = {
            "eval_loss": final["eval_loss"], "perplexity": final["perplexity"], "eval_tokens": final["eval_tokens"],
            "final_train_loss": rows[-1]["loss"] if rows else None, "steps": step,
            "train_tokens": step * tokens_per_step, "train_tokens_per_s": tokens_per_s,
            "train_wall_s": train_wall, "flops_per_token": fpt, "mfu": mfu, "peak_flops": peak,
            "peak_memory_bytes_per_rank": peak_mem, "params": n_params, "time_breakdown_s": phases,
            "train_split_tokens": data.train_tokens, "heldout_split_tokens": data.heldout_tokens,
            **stage_metrics,
        }
        with artifacts.atomic_dir(artifact) as tmp:
            save_model(par.base_model, tmp, tokenizer, state_dict=state)
            m["size_bytes"] = artifacts.dir_size(tmp)
            meta = artifacts.write_meta(tmp, stage, asdict(cfg), m, parent=parent, extra={"what_ran": what_ran})
        artifacts.set_latest(runs_dir, run_dir)
        report = {
            "stage": stage, "tag": tag, "parent": parent, "run": run_name, "artifact": str(artifact),
            "time": meta["time"],
            "what_ran": what_ran, "metrics": m, "config": asdict(cfg), "versions": meta["versions"],
            "git_commit": meta["git_commit"], "verdicts": [],
            "protocol": {
                "eval_loss": metrics.EVAL_PROTOCOL + f"; {final['eval_tokens']} predicted tokens; computed under "
                             f"{what_ran['amp_dtype']}",
                "train_tokens_per_s": f"global tokens per step ({tokens_per_step}) x steady-state steps / their "
                                      f"wall time ({len(steady)} steps; first {excluded} excluded as warm-up)",
                "mfu": f"(6N + 12*L*d*T) FLOPs/token x tokens/s / (peak x {rt.world_size} processes); peak: "
                       f"{peak_source}",
                "peak_memory": memory.method + ", per rank, over the training steps (the model is built, "
                               "sharded and placed before; optimizer state, gradients and activations count)",
                "time_breakdown_s": "wall time per phase of every step on rank 0 (time.perf_counter"
                                    + (", CUDA synchronised" if cfg.profile else "") + "); other = training wall "
                                    "time minus the phases (logging, progress, checkpoints)",
            },
        }
        if amp_dtype == torch.bfloat16 and rt.device.type == "cpu" and not metrics.cpu_has_native_bf16():
            report["verdicts"].append("this CPU has no native bf16 (no AVX512-BF16 / AMX): bf16 autocast is "
                                      "emulated and usually slower than fp32 here; compare with --no-amp")
        reports_dir = Path(cfg.reports_dir) / run_name
        write_stage_report(reports_dir, report)
        write_rows_csv(reports_dir / f"{tag}_steps.csv", rows)
        if rows:
            title = f"{tag}: {Path(cfg.model).name} on {corpus.name}"
            plot_loss_curve(rows, reports_dir / f"{tag}_loss.png", title)
    rt.barrier()
    return report or {"stage": "train", "metrics": {"eval_loss": final["eval_loss"]}, "run": run_name,
                      "rows": rows}
