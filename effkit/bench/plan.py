"""`effkit bench --plan` and the plan every bench makes before it loads a model (#47): the peak resident memory of
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
them). The per-engine lines were measured once (see `ALONE`); the plan's parts are the largest process's, the
others' totals and what the machine holds at once while two alone processes run side by side in its notes, and the
report puts each process's prediction beside the peak it measured (`memory`: the top process's, and
`alone_processes`)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, engines, memplan, stageplan, workloads
from effkit.artifacts.loader import cannot_run_on, engine_of, kind, trainable
from effkit.bench.discover import find_artifacts, tags
from effkit.bench.static import side_by_side_processes
from effkit.bench.timing import TRAIN_BATCHES
from effkit.config import BenchConfig
from effkit.errors import EffkitError
from effkit.parallel import resolve_device

MIB = 2**20
# Calibration: `effkit bench --quick [--peers] PATH ...` of the artifacts of two random-init models, gpt2 (92.1M
# parameters, 351.5 MiB in fp32) and gpt2-mini (13.9M, 53.0 MiB), both with 8,192 tokens and blocks of 128: their
# train artifact and its `effkit export --format onnx | openvino | ctranslate2` (fp32); the top process' RSS sampled
# every 5 ms around each step, each alone process' own peak from bench.json; on a 2-core x86-64 with AVX512-BF16
# and 24 GiB, torch 2.13 CPU, onnxruntime 1.32, OpenVINO 2026.4, CTranslate2 4.8.5 (issue #47). A part that grows
# with the model is a + b x S, the line through the two measurements (S: the artifact's weights: fp32 bytes for a
# PyTorch one, its folder's bytes for another engine's).
BENCH_PROCESS = 432 * MIB  # the top process after its imports and the held-out blocks: 320-432 MiB (with the
# engines' libraries imported or not)
ALONE_PROCESS = 305 * MIB  # an alone process before its artifact loads: 304-305 MiB (absolute less increase)
# an artifact alone beyond that (loaded, evaluated, its sample generated, every workload once), a line in its
# folder's bytes: `peak_memory_bytes` of its alone process, gpt2 / gpt2-mini: onnxruntime 1,316 MiB for a folder of
# 376.5 MiB / 342 for 65.8, openvino 1,414 for 352.9 / 415 for 54.2, ctranslate2 (fp32) 916 for 352.1 / 229 for 53.7;
# each constant 20 MiB above the line through the two (a held-out model's, 29.9M parameters, and a second gpt2
# run's alone processes came within 6 MiB of it, either side)
ALONE = {"onnxruntime": (155.3 * MIB, 3.136), "openvino": (254.1 * MIB, 3.343), "ctranslate2": (125.7 * MIB, 2.301)}
# an engine calibrated in no line (a quantized PyTorch artifact, llama.cpp): the bench's own rule, four copies of
# its folder (`side_by_side_processes`), plus what llama.cpp's peer of gpt2-mini took beyond it (244 MiB measured
# for a folder of 15.3 MiB)
UNCALIBRATED = (183.0 * MIB, 4.0)
# a dense or pruned PyTorch artifact alone beyond its fp32 model, its mapped file and its training step
# (`training_parts`): its largest prefill's KV cache and logits (`prefill_bytes`: the PyTorch engine's prefill builds
# the cache), which the allocator keeps about as much again of after the forward (glibc's heap, freed blocks it does
# not hand back): `PREFILL_KEPT` times. Measured beyond the loaded model: gpt2 116 and 309 MiB (the largest of four
# alone processes, 3,998 and 4,191 MiB less 351.5 + 351.5 + 3,179), 312 counted; gpt2-mini 139 and 181, 150 counted;
# gpt2-large (36 x 1,280; session 23, prefill b12 x 128 after the load, anonymous memory) 0.69, 0.69, 1.30 and 1.51
# GiB in four processes, 1.15 counted (0.58 GiB of cache and logits); never under the 310 MiB a small model's
# evaluation, sample and workloads were measured at before this line (`PYTORCH_ALONE`: gpt2-mini 139 and 181 MiB)
PREFILL_KEPT = 2.0
PYTORCH_ALONE = 310 * MIB
# what a real training step held beyond memplan's simulation of it (`train_step_timers` in the top process: the
# copy, then batch 4 and 12): gpt2-mini 825 MiB measured, 743 simulated; gpt2 2,966 measured, 3,080 simulated
TRAIN_RUNTIME = 100 * MIB
# what an alone process spends that the timing spends once for all its artifacts, or not at all (the engines' first
# use; the evaluation and the sample): the timing's measured peak came 326 and 437 MiB under the sum of its
# artifacts' parts for gpt2-mini's three and four artifacts, 407 for the held-out model's three (29.9M parameters),
# 172 for one CTranslate2 artifact of gpt2; taken off once per artifact beyond the first
SHARED_IN_TIMING = 100 * MIB
# the peers (`--peers`): the top process loads the reference (its fp32 model, its mapped file and transformers' own
# objects: LOAD_OVERHEAD, 98-99 MiB measured) and converts it for each peer engine in turn, each conversion's peak
# over the loaded reference a line in the reference's fp32 bytes (P): onnxruntime (its copy of the model, the fp32
# export with its parity session, then quantize_dynamic) 1,771 MiB at gpt2 (`--peer-engines onnxruntime`), 366 at
# gpt2-mini; ctranslate2 (its converter's own load) 115 at gpt2-mini and, at gpt2, the 492 of its fp32 `effkit
# export`; openvino (the conversion, its parity check, LLMPipeline) 313 at gpt2-mini and, at gpt2, the 1,968 of
# its fp32 `effkit export`; llama.cpp, not calibrated, counted as openvino's
LOAD_OVERHEAD = 100 * MIB
PEER_CONVERSION = {"onnxruntime": (116.5 * MIB, 4.707), "ctranslate2": (48.1 * MIB, 1.263),
                   "openvino": (19.2 * MIB, 5.544)}
PEER_CONVERSION_UNCALIBRATED = PEER_CONVERSION["openvino"]
# the conversions run one after the other: the largest one's peak counted whole, of each other one what the
# allocator keeps (gpt2-mini's four peers: 1,255 MiB measured, 1,004 with the largest conversion alone, the three
# others' peaks 741: a third kept)
EARLIER_KEPT = 0.35
# what the top process keeps of the peers' conversions while the artifacts run alone: its RSS after the peers over
# its peak during them, gpt2 (onnxruntime) 1,751 / 2,917 = 0.60, gpt2-mini (four peers) 967 / 1,255 = 0.77
PEERS_KEPT = 0.8
LARGEST_TRAIN_BATCH = max(TRAIN_BATCHES)
MAPPED = "weights' file, mapped (clean pages)"  # in a part's name: pages the kernel can drop (not what must fit)
ACTIVATIONS = "activations, batch"  # how a training step's activations are named (one step at a time)


def weights_of(path: Path) -> tuple[int, int]:
    """(fp32 bytes, weight files' bytes) of a dense or pruned PyTorch artifact, from its safetensors headers alone
    (each tensor's shape; no weight read)."""
    fp32 = files = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        files += f.stat().st_size
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        fp32 += 4 * sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return fp32, files


def prefill_bytes(path: Path, block: int) -> int:
    """The KV cache and logits (fp32) of the largest prefill workload the bench runs on the PyTorch artifact at
    `path`, from its config.json: per token, keys and values of every layer (2 x n_layer x n_embd) and a row of
    logits (the vocabulary)."""
    c = json.loads((Path(path) / "config.json").read_text())
    tokens = max(w.batch * (w.tokens or block) for w in workloads.of_kind("prefill"))
    return 4 * tokens * (2 * int(c["n_layer"]) * int(c["n_embd"]) + int(c["vocab_size"]))


def pytorch_workloads(path: Path, block: int) -> int:
    """What a PyTorch artifact's evaluation, sample and workloads hold beyond its model: `PREFILL_KEPT` times its
    largest prefill's KV cache and logits, at least `PYTORCH_ALONE`."""
    return max(PYTORCH_ALONE, int(PREFILL_KEPT * prefill_bytes(path, block)))


def _line(ab: tuple[float, float], size: int) -> int:
    return int(ab[0] + ab[1] * size)


def training_parts(path: Path, block: int) -> dict[str, int]:
    """A trainable artifact's training step as `train_step_timers` runs it (a private copy, AdamW's moments, one
    step at the largest training batch), simulated by `effkit.memplan` on fake tensors from its config.json: the
    copy, the moments, the activations and temporaries at the peak, its gradients counted whole beside them (a real
    step holds the gradients already computed beside the activations still alive), and what a real step held
    beyond the simulation (`TRAIN_RUNTIME`)."""
    from transformers import GPT2Config

    mc = GPT2Config.from_pretrained(path)
    sim = memplan.simulate_layers(mc, LARGEST_TRAIN_BATCH, block, mc.n_layer, checkpointing=False, optim="adamw")
    copy = sim["parameters"] + sim["buffers"]
    return {"its private copy": copy, "AdamW's moments": sim["optimizer"],
            "its gradients": max(sim["gradients"], copy),
            f"{ACTIVATIONS} {LARGEST_TRAIN_BATCH} x {block} (memplan's simulation)":
            sim["activations"] + sim["temporaries"],
            "the step's runtime beyond the simulation": TRAIN_RUNTIME}


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
    k = kind(path)
    if k == "pytorch":
        p, mapped = weights_of(path)
        parts = {f"{tag}: fp32 model": p, f"{tag}: {MAPPED}": mapped,
                 f"{tag}: evaluated, its sample, every workload once (PyTorch: the largest prefill's KV cache and "
                 f"logits, and what the allocator keeps of them)": pytorch_workloads(path, block)}
        if trainable(path) and train:
            parts |= {f"{tag}: training step, {k2}": v for k2, v in training_parts(path, block).items()}
    else:
        size = artifacts.dir_size(path)
        engine = engine_of(path)
        if k in ALONE:
            parts = {f"{tag}: loaded in {engine.label}, evaluated, its sample, every workload once":
                     _line(ALONE[k], size)}
        else:
            what = "int8 (a quantization backend)" if k == "quantized" else engine.label
            parts = {f"{tag}: loaded in {what}, evaluated, every workload once (not calibrated: the bench's rule, "
                     "four copies of its folder)": _line(UNCALIBRATED, size)}
    if (control := _needs_control(path, data)) is not None:
        p, mapped = weights_of(control)
        parts[f"{tag}: its dense control, loaded to evaluate against"] = p
        parts[f"{tag}: its dense control's {MAPPED}"] = mapped
    return parts


def _peer_parts(engine, reference_bytes: int) -> dict[str, int]:
    """A peer's alone parts, from the reference's fp32 bytes: counted as the engine's fp32 artifact of the reference,
    in its engine's line (`ALONE`) or, for an engine calibrated in none, the bench's rule (`UNCALIBRATED`). An upper
    bound for an int8 peer alone (its process beyond the base: gpt2's onnxruntime int8 peer 580 MiB, 1,238
    counted; gpt2-mini's int8 peers 216-251, 228-301 counted), which in the timing also covers what the top process
    keeps of the peers' conversions (gpt2 with its onnxruntime peer: the top process 5,473 MiB measured, 5,693
    predicted)."""
    tag = engine.peer_tag
    if engine.name in ALONE:
        return {f"{tag}: loaded in {engine.label}, evaluated, its sample, every workload once (counted as the "
                "reference's fp32 weights in its engine)": _line(ALONE[engine.name], reference_bytes)}
    return {f"{tag}: loaded in {engine.label}, evaluated, every workload once (not calibrated: the bench's rule on "
            "the reference's fp32 weights)": _line(UNCALIBRATED, reference_bytes)}


def bench_plan(cfg: BenchConfig, elsewhere: dict[str, str] | None = None) -> stageplan.StagePlan:
    """The memory plan of `effkit bench` with `cfg` (see the module's text): the largest of its three moments (the
    peers' conversions, the artifacts alone, the timing), its parts named by the process that holds them, the other
    moments in the notes."""
    return plan_and_processes(cfg, elsewhere)[0]


TOP = "<top process>"  # the top process's key among `plan_and_processes`' processes (no folder is named so)
PEERS, TIMING = "the top process, converting the peers", "the top process, timing every artifact"


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
    if cfg.what.peers and kind(paths[0]) == "pytorch":
        peers = [e for e in engines.peers(cfg.peer_engine_names) if not e.available(None, int8=True)]
    ref_p, ref_mapped = weights_of(paths[0]) if peers else (0, 0)
    for e in peers:
        alone[e.peer_tag] = _peer_parts(e, ref_p)
        folders[e.peer_tag] = e.peer_tag
    top = {"top process: Python and its libraries, the tokenizer, the held-out blocks": BENCH_PROCESS}
    processes: dict[str, dict[str, int]] = {}
    if peers:
        conv = {e.peer_tag: _line(PEER_CONVERSION.get(e.name, PEER_CONVERSION_UNCALIBRATED), ref_p) for e in peers}
        big = max(conv, key=conv.get)
        processes[PEERS] = {
            **top, f"top process: the reference {names[0]}, fp32, transformers' objects": ref_p + LOAD_OVERHEAD,
            f"top process: the reference's {MAPPED}": ref_mapped,
            **{f"top process: converting it for {t}" + ("" if t == big else ", what the allocator keeps of it"):
               v if t == big else int(EARLIER_KEPT * v) for t, v in conv.items()}}
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
               "evaluation), less"] = -SHARED_IN_TIMING * (len(alone) - 1)
    if cfg.measure.compile:
        timing |= {f"timing (top process) {t}: its torch.compile twin, a frozen copy of its weights (not calibrated)":
                   weights_of(p)[0] for t, p in zip(names, paths, strict=True) if kind(p) == "pytorch"}
    processes[TIMING] = timing
    for tag, parts in alone.items():
        processes[f"the alone process of {tag}"] = {
            f"alone process {tag}: Python and its libraries, the held-out blocks": ALONE_PROCESS,
            **{f"alone process {k}": v for k, v in parts.items()}}
    totals = {name: sum(parts.values()) for name, parts in processes.items()}
    must_fit = {name: sum(v for k, v in parts.items() if MAPPED not in k) for name, parts in processes.items()}
    largest = max(must_fit, key=must_fit.get)  # as every plan judges: by what must fit
    each = {tag: totals[f"the alone process of {tag}"] for tag in alone}
    n = side_by_side_processes([*paths, *(Path(e.peer_tag) for e in peers)], device, list(each.values()))
    pair = sorted(each.values(), reverse=True)[:n]
    kept = int(PEERS_KEPT * totals[PEERS]) if peers else BENCH_PROCESS
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
        plan.tricks = _tricks(cfg, largest, names, peers)
        if cfg.measure.train_steps and any(trainable(p) for p in paths):
            untrained = plan_and_processes(replace(cfg, measure=replace(cfg.measure, train_steps=0)), elsewhere)[0]
            if untrained.fits:
                plan.tricks.insert(0, f"--train-steps 0 (no training measure: "
                                      f"{untrained.required_bytes / 2**30:.1f} GiB must fit)")
    top_process = max(totals[TIMING], totals.get(PEERS, 0))
    return plan, {**{folders[t]: b for t, b in each.items()}, TOP: top_process}


BENCH_METHOD = ("the parts alive in the bench's largest process at its peak (the top process converting the peers "
                "or timing every artifact at once, or one artifact alone in its fresh process), from the artifacts' "
                "shapes alone (safetensors headers, config.json, folder sizes; no weights read): each artifact as "
                "its alone process holds it, a line in its weights' bytes per engine measured once (gpt2 and "
                "gpt2-mini, one CPU), and each training step simulated by effkit.memplan (FakeTensorMode and "
                "MemTracker)")


def _tricks(cfg: BenchConfig, largest: str, names: list[str], peers: list) -> list[str]:
    """What would make the bench's largest process smaller, in words."""
    out = []
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
