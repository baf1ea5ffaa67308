"""`effkit bench --plan` and the plan every bench makes before it loads a model: the peak resident memory of
the bench's largest moment, predicted from the artifacts' shapes alone (safetensors headers, config.json, folder
sizes; no weight read), whether it fits, and what would make it fit (`bench_plan`).

A bench runs in several processes, and its largest process is one of these:
- the top process converting the peers (with --peers): it loads the dense reference and converts it with each peer
  engine, one after the other;
- the top process timing: it loads every artifact at once and times them in interleaved rounds, with one private
  copy of each trainable artifact, its AdamW moments and its gradients (`train_step_timers`);
- an artifact alone, in a fresh process (`effkit.bench.static`): two run side by side where
  `side_by_side_processes`, fed with these predictions, says two fit in half the memory available.
Each artifact counts as its alone process holds it (loaded in its engine, evaluated, its sample generated, every
workload run once) and, where it trains, as `effkit.memplan`'s simulation of its training step at the largest
training batch (FakeTensorMode: the private copy, the moments, the activations; its gradients counted whole beside
them). The per-engine lines were measured once (`Engine.memory_line`); the plan's parts are the largest process's, the
others' totals and what the machine holds at once while two alone processes run side by side in its notes, and the
report puts each process's prediction beside the peak it measured (`memory`: the top process's, and
`alone_processes`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, engines, memplan, stageplan, workloads
from effkit.artifacts.loader import cannot_run_on, engine_of, is_quantized, trainable
from effkit.bench.discover import find_artifacts, tags
from effkit.bench.static import side_by_side_processes
from effkit.bench.timing import TRAIN_BATCHES
from effkit.config import BenchConfig
from effkit.errors import EffkitError
from effkit.parallel import resolve_device
from effkit.registry import ENGINES
from effkit.stageplan import on_line, weights_of

MIB = 2**20
# What each part weighs is measured per engine (`Engine.memory_line`: an artifact alone, a peer's conversion) and
# for the bench itself (`figure`); effkit/engines/memory_calibration.json says how. A part that grows with the
# model is a line in the artifact's weights: fp32 bytes for a PyTorch one, its folder's bytes for another engine's.
ALONE_LINE, PEER_LINE = "bench_alone", "bench_peer_conversion"
LARGEST_TRAIN_BATCH = max(TRAIN_BATCHES)
MAPPED = "weights' file, mapped (clean pages)"  # in a part's name: pages the kernel can drop (not what must fit)
ACTIVATIONS = "activations, batch"  # how a training step's activations are named (one step at a time)


def figure(name: str) -> float:
    """The bench's own measured figure `name` (bytes, or a share)."""
    return engines.memory_figure("bench", name)


def prefill_bytes(path: Path, block: int) -> int:
    """The KV cache and logits (fp32) of the largest prefill workload the bench runs on the PyTorch artifact at
    `path`, from its config.json: per token, keys and values of every layer (2 x n_layer x n_embd) and a row of
    logits (the vocabulary)."""
    c = json.loads((Path(path) / "config.json").read_text())
    tokens = max(w.batch * (w.tokens or block) for w in workloads.of_kind("prefill"))
    return 4 * tokens * (2 * int(c["n_layer"]) * int(c["n_embd"]) + int(c["vocab_size"]))


def pytorch_workloads(path: Path, block: int) -> int:
    """What a PyTorch artifact's evaluation, sample and workloads hold beyond its model: what the allocator keeps
    of its largest prefill's KV cache and logits (`prefill_kept` times them), at least `pytorch_alone`."""
    return int(max(figure("pytorch_alone"), figure("prefill_kept") * prefill_bytes(path, block)))


def training_parts(path: Path, block: int) -> dict[str, int]:
    """A trainable artifact's training step as `train_step_timers` runs it (a private copy, AdamW's moments, one
    step at the largest training batch), simulated by `effkit.memplan` on fake tensors from its config.json: the
    copy, the moments, the activations and temporaries at the peak, its gradients counted whole beside them (a real
    step holds the gradients already computed beside the activations still alive), and what a real step held
    beyond the simulation (`train_runtime`)."""
    from transformers import GPT2Config

    mc = GPT2Config.from_pretrained(path)
    sim = memplan.simulate_layers(mc, LARGEST_TRAIN_BATCH, block, mc.n_layer, checkpointing=False, optim="adamw")
    copy = sim["parameters"] + sim["buffers"]
    return {"its private copy": copy, "AdamW's moments": sim["optimizer"],
            "its gradients": max(sim["gradients"], copy),
            f"{ACTIVATIONS} {LARGEST_TRAIN_BATCH} x {block} (memplan's simulation)":
            sim["activations"] + sim["temporaries"],
            "the step's runtime beyond the simulation": int(figure("train_runtime"))}


def benched(cfg: BenchConfig, device: torch.device,
            elsewhere: dict[str, str] | None = None) -> tuple[str, list[Path], dict[str, str]]:
    """(run name, the artifacts this bench measures, those it leaves out with why): the run's artifacts (or the
    paths given) but those `elsewhere` names and those that cannot run on `device`."""
    run_name, found = find_artifacts(cfg)
    found = [p for p in found if p.name not in (elsewhere or {})]
    not_run = {p.name: f"not run: {reason}" for p in found if (reason := cannot_run_on(p, device))}
    not_run |= {tag: f"not benched here: {where}" for tag, where in (elsewhere or {}).items()}
    paths = [p for p in found if p.name not in not_run]
    if not paths:
        raise EffkitError(f"no artifact of run {run_name} can run on {device}: "
                          + "; ".join(f"{t}: {r}" for t, r in not_run.items()))
    return run_name, paths, not_run


def _needs_control(path: Path, data: dict[str, Any]) -> Path | None:
    """The dense control an alone process loads to evaluate `path` against (as `bench_one` decides), or None."""
    from effkit.bench.static import dense_control_of
    from effkit.measure import results

    control = dense_control_of(path)
    if control is None:
        return None
    same_blocks = data == artifacts.data_section(path)
    copied = results.EVAL_LOSS_DELTA_VS_CONTROL in artifacts.read_meta(path)["metrics"] and same_blocks
    return None if copied else control


def alone_parts(path: Path, tag: str, block: int, data: dict[str, Any], train: bool = True) -> dict[str, int]:
    """What the artifact at `path` holds in its alone process beyond the process itself: loaded in its engine,
    evaluated, its sample generated, every workload run once; for a trainable one its training step
    (`training_parts`), for a pruned one (or one made from it) its dense control where it is evaluated again."""
    if trainable(path):
        p, mapped = weights_of(path)
        parts = {f"{tag}: fp32 model": p, f"{tag}: {MAPPED}": mapped,
                 f"{tag}: evaluated, its sample, every workload once (PyTorch: the largest prefill's KV cache and "
                 f"logits, and what the allocator keeps of them)": pytorch_workloads(path, block)}
        if train:
            parts |= {f"{tag}: training step, {k2}": v for k2, v in training_parts(path, block).items()}
    else:
        size = artifacts.dir_size(path)
        engine = engine_of(path)
        if line := engine.memory_line(ALONE_LINE):
            parts = {f"{tag}: loaded in {engine.label}, evaluated, its sample, every workload once":
                     on_line(line, size)}
        else:
            what = "int8 (a quantization backend)" if is_quantized(path) else engine.label
            parts = {f"{tag}: loaded in {what}, evaluated, every workload once (not calibrated: the bench's rule, "
                     "four copies of its folder)": on_line(engines.stage_line("bench", "uncalibrated"), size)}
    if (control := _needs_control(path, data)) is not None:
        p, mapped = weights_of(control)
        parts[f"{tag}: its dense control, loaded to evaluate against"] = p
        parts[f"{tag}: its dense control's {MAPPED}"] = mapped
    return parts


def _peer_parts(engine, reference_bytes: int) -> dict[str, int]:
    """A peer's alone parts, from the reference's fp32 bytes: counted as the engine's fp32 artifact of the reference,
    in its engine's line (`ALONE_LINE`) or, for an engine calibrated in none, the bench's rule (`uncalibrated`). An
    upper bound for an int8 peer alone, which in the timing also covers what the top process keeps of the peers'
    conversions (memory_calibration.json: `bench_alone`)."""
    tag = engine.peer_tag
    if line := engine.memory_line(ALONE_LINE):
        return {f"{tag}: loaded in {engine.label}, evaluated, its sample, every workload once (counted as the "
                "reference's fp32 weights in its engine)": on_line(line, reference_bytes)}
    return {f"{tag}: loaded in {engine.label}, evaluated, every workload once (not calibrated: the bench's rule on "
            "the reference's fp32 weights)": on_line(engines.stage_line("bench", "uncalibrated"), reference_bytes)}


def bench_plan(cfg: BenchConfig, elsewhere: dict[str, str] | None = None) -> stageplan.StagePlan:
    """The memory plan of `effkit bench` with `cfg` (see the module's text): the largest of its three moments (the
    peers' conversions, the artifacts alone, the timing), its parts named by the process that holds them, the other
    moments in the notes."""
    return plan_and_processes(cfg, elsewhere)[0]


TOP = "<top process>"  # the top process's key among `plan_and_processes`' processes (no folder is named so)
PEERS, TIMING = "the top process, converting the peers", "the top process, timing every artifact"


def _peers_process(peers: list, reference: Path, tag: str, top: dict[str, int]) -> dict[str, int]:
    """The top process converting the peers (`--peers`): the reference loaded, each peer engine's conversion in
    turn, the largest one's peak counted whole and of each other one what the allocator keeps (`earlier_kept`). An
    engine calibrated in none counts as the steepest conversion measured."""
    ref_p, ref_mapped = weights_of(reference)
    known = [line for _, e in ENGINES.items() if (line := e.memory_line(PEER_LINE))]
    steepest = max(known, key=lambda line: line[1])
    conv = {e.peer_tag: on_line(e.memory_line(PEER_LINE) or steepest, ref_p) for e in peers}
    big = max(conv, key=conv.get)
    return {**top, f"top process: the reference {tag}, fp32, transformers' objects":
            ref_p + int(figure("load_overhead")), f"top process: the reference's {MAPPED}": ref_mapped,
            **{f"top process: converting it for {t}" + ("" if t == big else ", what the allocator keeps of it"):
               v if t == big else int(figure("earlier_kept") * v) for t, v in conv.items()}}


def _timing_process(cfg: BenchConfig, top: dict[str, int], alone: dict[str, dict[str, int]], names: list[str],
                    paths: list[Path]) -> dict[str, int]:
    """The top process timing every artifact at once: each artifact's alone parts but one training step's
    activations at a time, less what its artifacts share in one process, with the compiled twins."""
    timing = dict(top)
    activations: dict[str, int] = {}
    for parts in alone.values():
        for k, v in parts.items():
            if ACTIVATIONS in k:  # one training step at a time: the largest activations only
                activations[k] = v
            else:
                timing[f"timing (top process) {k}"] = v
    if activations:
        k = max(activations, key=activations.get)
        timing[f"timing (top process) {k}"] = activations[k]
    if len(alone) > 1:
        timing["timing (top process): what its artifacts share in one process (the engines' first use; no "
               "evaluation), less"] = -int(figure("shared_in_timing")) * (len(alone) - 1)
    if cfg.measure.compile:
        timing |= {f"timing (top process) {t}: its torch.compile twin, a frozen copy of its weights (not calibrated)":
                   weights_of(p)[0] for t, p in zip(names, paths, strict=True) if trainable(p)}
    return timing


def _processes(cfg: BenchConfig, paths: list[Path], names: list[str], alone: dict[str, dict[str, int]],
               peers: list) -> dict[str, dict[str, int]]:
    """Every process of the bench by what it does, each its parts: the peers' conversions (with --peers), the
    timing, and each artifact's alone process."""
    top = {"top process: Python and its libraries, the tokenizer, the held-out blocks": int(figure("process"))}
    processes = {PEERS: _peers_process(peers, paths[0], names[0], top)} if peers else {}
    processes[TIMING] = _timing_process(cfg, top, alone, names, paths)
    for tag, parts in alone.items():
        processes[f"the alone process of {tag}"] = {
            f"alone process {tag}: Python and its libraries, the held-out blocks": int(figure("alone_process")),
            **{f"alone process {k}": v for k, v in parts.items()}}
    return processes


def plan_and_processes(cfg: BenchConfig, elsewhere: dict[str, str] | None = None
                       ) -> tuple[stageplan.StagePlan, dict[str, int]]:
    """`bench_plan`, and each process as it predicts it: every alone process by its artifact's folder name (a
    peer's by its tag), what `side_by_side_processes` decides from, and the top process (`TOP`): the larger of its
    peers' conversions and its timing."""
    cfg = cfg.validate()
    device = resolve_device(cfg.what.device)
    _, paths, _ = benched(cfg, device, elsewhere)
    data = artifacts.data_section(paths[0], cfg.what.data)
    config = paths[0] / "config.json"
    n_positions = int(json.loads(config.read_text()).get("n_positions", 1 << 30)) if config.is_file() else 1 << 30
    block = min(int(data.get("block_size", 128)), n_positions)
    names = tags(paths)
    alone = {tag: alone_parts(p, tag, block, data, cfg.measure.train_steps > 0)
             for tag, p in zip(names, paths, strict=True)}
    folders = {tag: p.name for tag, p in zip(names, paths, strict=True)}
    peers = []
    if cfg.what.peers and trainable(paths[0]):
        peers = [e for e in engines.peers(cfg.peer_engine_names) if not e.available(None, int8=True)]
    reference = weights_of(paths[0])[0] if peers else 0
    for e in peers:
        alone[e.peer_tag] = _peer_parts(e, reference)
        folders[e.peer_tag] = e.peer_tag
    processes = _processes(cfg, paths, names, alone, peers)
    totals = {name: sum(parts.values()) for name, parts in processes.items()}
    must_fit = {name: sum(v for k, v in parts.items() if MAPPED not in k) for name, parts in processes.items()}
    largest = max(must_fit, key=must_fit.get)  # as every plan judges: by what must fit
    each = {tag: totals[f"the alone process of {tag}"] for tag in alone}
    n = side_by_side_processes([*paths, *(Path(e.peer_tag) for e in peers)], device, list(each.values()))
    pair = sorted(each.values(), reverse=True)[:n]
    kept = int(figure("peers_kept") * totals[PEERS]) if peers else int(figure("process"))
    what_kept = ", what it keeps of the peers' conversions" if peers else ""
    notes = [f"the largest process: {largest}; " + ", ".join(f"{name}: {t / 2**30:.2f} GiB "
                                                             f"({must_fit[name] / 2**30:.2f} must fit)"
                                                             for name, t in totals.items()),
             f"artifact-alone processes: {'two side by side' if n > 1 else 'one at a time'} (side_by_side_processes, "
             f"from these predictions): at most {(kept + sum(pair)) / 2**30:.2f} GiB at once with the top process "
             f"beside them ({kept / 2**30:.2f} GiB{what_kept})"]
    if device.type != "cpu":
        notes.append(f"on {device}: the parts are a CPU's resident set (calibrated on a CPU), an upper bound of "
                     "what the GPU holds")
    name, available = memplan.device_memory(device)
    parts = processes[largest]
    plan = stageplan.StagePlan("bench", parts, name, available, notes, [], BENCH_METHOD,
                               reclaimable={k for k in parts if MAPPED in k})
    if plan.fits is False:
        plan.tricks = _tricks(cfg, largest, names, peers, paths, elsewhere)
    top_process = max(totals[TIMING], totals.get(PEERS, 0))
    return plan, {**{folders[t]: b for t, b in each.items()}, TOP: top_process}


BENCH_METHOD = ("the parts alive in the bench's largest process at its peak (the top process converting the peers "
                "or timing every artifact at once, or one artifact alone in its fresh process), from the artifacts' "
                "shapes alone (safetensors headers, config.json, folder sizes; no weights read): each artifact as "
                "its alone process holds it, a line in its weights' bytes per engine measured once (gpt2 and "
                "gpt2-mini, one CPU), and each training step simulated by effkit.memplan (FakeTensorMode and "
                "MemTracker)")


def _tricks(cfg: BenchConfig, largest: str, names: list[str], peers: list, paths: list[Path],
            elsewhere: dict[str, str] | None) -> list[str]:
    """What would make the bench's largest process smaller: without the training measure where that plan fits
    (`stageplan.what_fits`), then the changes no plan is needed for, in words."""
    out = []
    if cfg.measure.train_steps and any(trainable(p) for p in paths):
        untrained = replace(cfg, measure=replace(cfg.measure, train_steps=0))
        out += [f"{t.flags} (no training measure: {t.plan.required_bytes / 2**30:.1f} GiB must fit)"
                for t in stageplan.what_fits([("--train-steps 0", untrained)],
                                             lambda c: plan_and_processes(c, elsewhere)[0]) if t.fits]
    if peers and largest in (PEERS, TIMING):
        out.append("without --peers" if len(peers) == 1 else
                   f"fewer peers (--peer-engines, of {', '.join(e.name for e in peers)}), or without --peers")
    if largest == TIMING and len(names) > 1:
        out.append("fewer artifacts timed at once: name them (effkit bench PATH ...), the dense reference first")
    if largest == TIMING and cfg.measure.compile:
        out.append("without --compile (no compiled twins)")
    if largest.startswith("the alone process of ") and len(names) > 1:
        out.append(f"leave {largest.removeprefix('the alone process of ')} out: name the others (effkit bench PATH "
                   "...)")
    return out
