"""What the bench measures of each artifact alone, in a fresh process: its held-out loss per block (for paired
deltas), a greedy sample, its size and parameters, the digest of what its engine computes (`Engine.computation`:
an artifact that runs a peer's very computation is told apart from one that ties it by measurement), and the peak
memory of loading it and running every measured
workload once (on CPU the process' RSS high-water mark, which an earlier artifact's freed memory would hide);
for a pruned artifact or anything made from one, its loss against its dense control."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, workloads
from effkit.artifacts.loader import engine_of, is_quantized, load_any, trainable
from effkit.bench.timing import TRAIN_BATCHES
from effkit.child import run_isolated
from effkit.config import BenchConfig, DataConfig
from effkit.data import prepare
from effkit.measure import evaluation, memory, results, stats
from effkit.measure.compare import generate_sample
from effkit.measure.engine_model import model_attr
from effkit.measure.timing import train_step_timers
from effkit.parallel import resolve_device


def dense_control_of(path: Path) -> Path | None:
    """The dense control of a pruned artifact or of anything made from one (its int8 or ONNX forms): the dense
    parent fine-tuned exactly as the pruning round was, which the prune stage names in its metrics. None for
    artifacts with no pruning round in their ancestry, or whose control folder is gone."""
    seen: set[Path] = set()
    while path not in seen and (path / artifacts.META).is_file():
        seen.add(path)
        meta = artifacts.read_meta(path)
        control = meta.get("metrics", {}).get("control_artifact")
        if control:
            return Path(control) if (Path(control) / artifacts.META).is_file() else None
        if not meta.get("parent"):
            return None
        path = Path(meta["parent"])
    return None


def bench_one(path: Path, cfg: BenchConfig, tokenizer, eval_blocks: torch.Tensor, block: int,
              device: torch.device, eval_bytes: int = 0, docs: tuple[int, ...] = (),
              data: dict[str, Any] | None = None) -> dict[str, Any]:
    """One artifact alone: held-out loss (per block, for paired deltas), a greedy sample, size, parameters, and
    the peak memory of loading it and running every measured workload once. `data`: the data section the blocks
    come from (None: the artifact's own)."""
    meta = artifacts.read_meta(path)
    with memory.PeakMemory(device) as mem:
        model = load_any(path, device).eval()
        r: dict[str, Any] = {"artifact": str(path), "tag": path.name, "stage": meta["stage"],
                             "params": model_attr(model, "n_params") or sum(p.numel() for p in model.parameters()),
                             "size_bytes": artifacts.dir_size(path), "quantized": is_quantized(path)}
        r.update(evaluation.evaluate(model, eval_blocks, cfg.measure.batch_size, eval_bytes=eval_bytes, docs=docs))
        r["generation"] = generate_sample(model, tokenizer, cfg.measure.gen_tokens)
        engine = engine_of(path)
        r["computation"] = engine.computation(path)  # the same digest as a peer's: the same computation
        for w in workloads.of_kind("prefill"):
            engine.prefill(model, w.batch, w.tokens or block)()
        if trainable(path) and cfg.measure.train_steps:  # --train-steps 0: no training measure, nor its memory
            for once in train_step_timers(model, TRAIN_BATCHES, block).values():
                once()
    r["peak_memory_bytes"] = mem.peak_bytes
    r["peak_memory_absolute_bytes"] = mem.absolute_bytes  # the process' own high-water mark (the memory plan's)
    if (control := dense_control_of(path)) is not None:  # after the peak: the control is not part of the footprint
        same_blocks = data is None or data == artifacts.data_section(path)  # what the prune stage evaluated on
        if results.EVAL_LOSS_DELTA_VS_CONTROL in meta["metrics"] and same_blocks:  # the prune stage's, same blocks
            r[results.EVAL_LOSS_DELTA_VS_CONTROL] = meta["metrics"][results.EVAL_LOSS_DELTA_VS_CONTROL]
        else:  # a descendant (int8, ONNX) of a pruned round, or other blocks (--data): against the same control,
            # paired on these blocks
            ctrl = evaluation.evaluate(load_any(control, device).eval(), eval_blocks, cfg.measure.batch_size)
            r[results.EVAL_LOSS_DELTA_VS_CONTROL] = stats.paired_delta(ctrl["block_losses"], r["block_losses"],
                                                                       r["block_docs"])
        r["control_artifact"] = str(control)
    return r


def bench_in_this_process(path: str, cfg: dict[str, Any], data: dict[str, Any], tokenizer_from: str,
                          device: str) -> dict[str, Any]:
    """`bench_one` from JSON-able arguments: what `run_isolated` calls in a fresh process."""
    data_cfg = DataConfig.from_dict(data)
    prepared = prepare(data_cfg, tokenizer_from=tokenizer_from)
    return bench_one(Path(path), BenchConfig.from_dict(cfg), prepared.tokenizer, prepared.blocks.eval,
                     data_cfg.block_size, resolve_device(device), prepared.blocks.eval_bytes,
                     prepared.blocks.eval_docs, data)


def bench_isolated(path: Path, cfg: BenchConfig, data: dict[str, Any], tokenizer_from: Path) -> dict[str, Any]:
    """`bench_one` in a fresh Python process."""
    return run_isolated("effkit.bench.static:bench_in_this_process",
                        {"path": str(path), "cfg": cfg.to_dict(), "data": data, "tokenizer_from": str(tokenizer_from),
                         "device": cfg.what.device}, what=f"bench of {path}")


def side_by_side_processes(paths: list[Path], device: torch.device, process_bytes: list[int] | None = None) -> int:
    """How many of the fresh processes run at once: two on a CPU with two cores or more where two of the largest
    artifacts' processes (each as the memory plan predicts it, `process_bytes` in the order of `paths`, else about
    four copies of its folder: the load, its copy in the engine, the loss evaluation's activations) and 2 GiB fit
    in half the memory available now; else one. Nothing here is timed, and each process's peak is its own
    high-water mark, so running two at once changes no figure, only the wall time (most of a process is its start
    and imports, on one core). On a GPU: one (they would share its memory)."""
    import os

    from effkit.memplan import device_memory

    if device.type != "cpu" or (os.cpu_count() or 1) < 2 or len(paths) < 2:
        return 1
    _, available = device_memory(device)
    sizes = process_bytes if process_bytes is not None else [4 * artifacts.dir_size(p) for p in paths]
    largest = sorted(sizes, reverse=True)[:2]
    return 2 if available is not None and sum(largest) + 2 * 2**30 <= available / 2 else 1


def bench_all_isolated(paths: list[Path], cfg: BenchConfig, data: dict[str, Any], tokenizer_from: Path,
                       device: torch.device, done=lambda path: None,
                       process_bytes: list[int] | None = None) -> list[dict[str, Any]]:
    """`bench_isolated` of every path, up to `side_by_side_processes` at once (`process_bytes`: each process as the
    memory plan predicts it), in the order given; `done(path)` after each (a progress bar)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=side_by_side_processes(paths, device, process_bytes))
    try:
        futures = [pool.submit(bench_isolated, p, cfg, data, tokenizer_from) for p in paths]
        out = []
        for p, f in zip(paths, futures, strict=True):
            out.append(f.result())
            done(p)
        return out
    finally:  # on a failure (or Ctrl-C), the processes not yet started are not started
        pool.shutdown(wait=True, cancel_futures=True)
