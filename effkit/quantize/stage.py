"""`effkit quantize`: int8 through one of the registered backends (`effkit.quantize.backends`), behind one
interface. `auto` builds every backend that runs here, keeps those within 1% of the parent's held-out loss, and
picks the fastest at `--optimize-for` (greedy decoding at batch 1 by default) by the decision rule; ONNX Runtime's
int8, what a user has without effkit, stays unless another backend is decided faster there and not slower at the
other batch.

Every artifact is written first and then reloaded from its folder alone (`effkit.artifacts.loader`); the reloaded
model is the one measured, and the report counts the int8 layers it really holds. Each backend's module says
which format it writes and who can load it.

The stage of `effkit run` (`QuantizeStage`) quantizes each model the recipe's `quantize_from` names: the trained
model, a pruning round, or `best-pruned`, the most compressed round within the loss budget (`best_pruned`)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effkit import artifacts, engines, stageplan, workloads
from effkit.artifacts import quantized
from effkit.artifacts.loader import engine_of, is_quantized, load_any, newest_artifact, quantized_layers, trainable
from effkit.config import DataConfig, QuantizeConfig, build_config
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.measure import choice, evaluation, generation, hardware, memory, results, stats
from effkit.measure.compare import bf16_not_run, compare_with_parent, generate_sample
from effkit.model import load_model
from effkit.parallel import init_runtime, resolve_device
from effkit.quantize import backends
from effkit.quantize.backends import QUANT_FILE
from effkit.report import StageReport, stamp, write_stage_report
from effkit.stage import (
    Plan,
    RunContext,
    ShapeRun,
    Stage,
    Step,
    by_share,
    complete,
    costs,
    fingerprint,
    left_out_why,
    most_compressed,
    pruning_rounds,
)

AUTO_LOSS_BUDGET = 0.01  # `auto` considers backends whose held-out loss is within this share of the parent's
AUTO_FEWEST = 3  # `auto` on a share of its budget still writes and times this many backends (`auto_candidates`)
AUTO_DEFAULT = "onnxruntime"  # what a user has without effkit (ONNX Runtime's int8): `auto` keeps it unless another
# backend is decided faster at the workload chosen for and not slower at the other batch


def write_quantized(folder: Path, backend: str, parent: nn.Module, source: Path, tokenizer, cfg: QuantizeConfig,
                    device: torch.device) -> dict[str, Any]:
    """Write the `backend` artifact of `parent` (loaded from the artifact `source`) into `folder`; returns its
    description, also written to `quantization.json` (`effkit.artifacts.quantized.write`)."""
    return quantized.write(folder, backends.get(backend), parent, source, tokenizer, cfg, device)


def _checked_source(cfg: QuantizeConfig, device: torch.device) -> Path:
    """The artifact to quantize, refused in one line where it cannot be (already quantized, another engine's), and
    the backend asked for, where it cannot run here."""
    runs = cfg.folders.runs_dir
    source = artifacts.resolve_artifact(cfg.inputs.source, runs) if cfg.inputs.source else newest_artifact(runs)
    meta = artifacts.read_meta(source)
    if meta["stage"] == "quantize" or is_quantized(source):
        raise EffkitError(f"{source} is already quantized; quantize its parent ({meta.get('parent')}) instead")
    if not trainable(source):
        raise EffkitError(f"{source} is {engine_of(source).noun} artifact; quantize its parent "
                          f"({meta.get('parent')}), with --backend onnxruntime or ctranslate2")
    if cfg.method.backend != "auto":
        if reason := backends.unavailable(cfg.method.backend, device):
            raise EffkitError(f"--backend {cfg.method.backend} cannot run here: {reason}")
        if refused := backends.get(cfg.method.backend).refuses(cfg):
            raise EffkitError(refused)
    return source


def run_quantize(cfg: QuantizeConfig) -> dict[str, Any]:
    cfg = cfg.validate()
    device = init_runtime(cfg.inputs.device).device
    source = _checked_source(cfg, device)
    plan = quantize_plan(cfg)  # before the parent is loaded: one that does not fit stops here, unless --force
    stageplan.check(plan, cfg.inputs.force)
    run_dir = Path(cfg.folders.runs_dir) / artifacts.run_of(source)  # inside the runs folder, wherever --from points
    with artifacts.run_lock(run_dir), memory.PeakMemory(device) as mem:
        return _quantize(cfg, device, source, run_dir, memory_of=lambda: {
            "plan": plan.to_dict(), **mem.record()})


# ------------------------------------------------------------------------------------------------ the memory plan
MIB = 2**20
# from the stage's start to the parent's load: the corpus read and tokenized, the tokenizer, transformers' model code
# (measured: effkit/engines/memory_calibration.json)
STAGE_RUNTIME = "stage_runtime"
PLAN_METHOD = ("the parts alive at the stage's largest moment, from the artifact's config.json and file sizes alone "
               "(no weights read): the fp32 parent and its mapped weights' file, its bf16 weight copies where bf16 "
               "runs, the logits of the evaluation and of the timing, and each backend's write and reloaded "
               "artifact as fixed MiB + a multiple of the parent's fp32 weights, measured per backend on two model "
               "sizes (effkit.quantize.backends.MEASURED)")


def model_shapes(source: Path) -> dict[str, int]:
    """Parameter counts of the GPT-2 in `source`, from its config.json alone: all of them (the tied LM head
    counted once) and those of the matrices a forward multiplies by (the blocks' and the head's: what bf16
    autocast copies)."""
    c = json.loads((source / "config.json").read_text())
    d, n_layer, vocab = c["n_embd"], c["n_layer"], c["vocab_size"]
    inner = c.get("n_inner") or 4 * d
    blocks_mm = n_layer * (4 * d * d + 2 * d * inner)
    per_block = 4 * d * d + 4 * d + 2 * d * inner + inner + d + 4 * d  # attention, MLP (weights, biases), 2 norms
    tied = c.get("tie_word_embeddings", True)
    params = vocab * d + c["n_positions"] * d + n_layer * per_block + 2 * d + (0 if tied else vocab * d)
    return {"params": params, "matmul": blocks_mm + vocab * d, "vocab": vocab,
            "n_positions": c["n_positions"]}


def _memory_of(b, cfg: QuantizeConfig, fp32: int, alone: bool = True) -> tuple[int, int, str | None]:
    """A backend's write and its reloaded artifact in bytes (`alone`: measured against the parent; else beside
    auto's other candidates), from its measured `Memory`, or, for one that declares none, the largest of the
    built-ins' and a note saying so."""
    def of(mem: backends.Memory) -> tuple[int, int]:
        return mem.write_bytes(fp32), mem.loaded_bytes(fp32) if alone else mem.beside_bytes(fp32)

    if hasattr(b, "memory"):
        return (*of(b.memory(cfg)), None)
    figures = [of(m.memory(cfg)) for n in backends.names() if hasattr(m := backends.get(n), "memory")]
    return (max((f[0] for f in figures), default=0), max((f[1] for f in figures), default=0),
            f"{b.name} declares no memory figures: planned at the largest built-in backend's")


def _moments(cfg: QuantizeConfig, source: Path, device: torch.device, backend: str,
             notes: list[str]) -> list[tuple[str, dict[str, int]]]:
    """The stage's moments (what is alive at each) with `backend` (a name, or auto), from shapes alone."""
    shapes = model_shapes(source)
    fp32 = 4 * shapes["params"]
    data = artifacts.data_section(source, cfg.inputs.data)
    block = min(int(data.get("block_size", artifacts.IMPORT_BLOCK_SIZE)), shapes["n_positions"])
    batch = max(min(cfg.measure.batch_size, int(data.get("eval_blocks", cfg.measure.batch_size))), 12)
    cpu = device.type == "cpu"
    common = {"parent: the fp32 model": fp32}
    if cpu:
        common["the weights' file, mapped by the parent's load (clean pages)"] = \
            sum(p.stat().st_size for p in source.glob("*.safetensors")) or fp32
        common["the stage's runtime: the data and tokenizer, transformers' model code"] = \
            int(engines.memory_figure("quantize", STAGE_RUNTIME))
    # the evaluation (batch x block) and the timing at batch 12: the logits and the loss's log-softmax, fp32
    common[f"evaluation and timing: logits of {batch} x {block} x {shapes['vocab']} (and the loss's log-softmax)"] = \
        2 * batch * block * shapes["vocab"] * 4
    # bf16 autocast keeps its weight copies while the parent is evaluated or timed under it, not while a backend
    # writes (their pages are then free for the write to reuse)
    timed = {**common, **({} if bf16_not_run(device) else
                          {"parent under bf16 autocast: its matrices' bf16 copies": 2 * shapes["matmul"]})}
    if backend != "auto":
        write, reloaded, note = _memory_of(backends.get(backend), cfg, fp32)
        notes += [note] if note else []
        return [(f"{backend}'s write", {**common, f"{backend}'s write (its exports, copies and quantizer)": write}),
                (f"{backend}'s artifact measured against the parent",
                 {**timed, f"the reloaded artifact in its engine ({backend})": reloaded})]
    moments, loaded = [], {}
    for name in backends.names():
        if backends.unavailable(name, device) or backends.get(name).refuses(cfg):
            continue
        write, beside, note = _memory_of(backends.get(name), cfg, fp32, alone=False)
        notes += [note] if note else []
        moments.append((f"auto: {name}'s write", {**common, f"{name}'s write": write}))
        loaded[f"auto's candidate {name}, reloaded in its engine"] = beside
    # every candidate is timed beside the others (interleaved): all of them alive at once, counted as if every
    # backend that runs here stays within the loss budget (each reloaded model is freed before the next write)
    moments.append(("auto: every candidate timed", {**timed, **loaded}))
    return moments


def quantize_plan(cfg: QuantizeConfig) -> stageplan.StagePlan:
    """The memory plan of `effkit quantize` with `cfg` (validated): the peak resident set of the process over the
    stage, predicted from the artifact's config.json and file sizes alone (no weights read; seconds for any size).
    The stage's moments: the parent loaded (fp32, its safetensors file mapped: clean pages in the resident set) and
    evaluated (with its bf16 weight copies where bf16 autocast runs); the backend's write over it (ONNX Runtime's:
    torch's fp32 ONNX export, the quantizer's copies, both int8 forms with --int8-form auto); the reloaded artifact
    measured against the parent. With --backend auto every backend that runs here is written in turn (each freed
    before the next), then every candidate is timed with the others alive at once. A backend's write and reloaded
    artifact are its `memory(cfg)` figures (effkit.quantize.backends.Memory), measured on two model sizes. The plan
    is the largest moment; the others are in its notes."""
    from effkit.parallel import resolve_device

    device = resolve_device(cfg.inputs.device)
    source = _checked_source(cfg, device)
    plan = _plan(cfg, source, device, cfg.method.backend)
    if plan.fits is False:
        plan.tricks = _tricks(cfg, source, device)
    return plan


RECLAIMABLE = "the weights' file, mapped"  # the parts the kernel can drop (clean file pages): not in what must fit


def _plan(cfg: QuantizeConfig, source: Path, device: torch.device, backend: str) -> stageplan.StagePlan:
    """The plan of the stage with `backend` (a name, or auto): its largest moment, the others in its notes."""
    from effkit import memplan

    name, device_bytes = memplan.device_memory(device)
    notes: list[str] = []
    moments = _moments(cfg, source, device, backend, notes)
    largest, parts = max(moments, key=lambda m: sum(m[1].values()))
    notes.insert(0, f"the largest moment: {largest}; " + ", ".join(
        f"{what} {sum(p.values()) / 2**30:.1f} GiB" for what, p in moments if what != largest))
    if device.type != "cpu":
        notes.append("on a GPU: the backends' figures measured on a CPU, not checked on a GPU; the mapped file and "
                     "the libraries are in host memory, left out")
    notes.append("the increase over the stage (what `memory.measured_peak_bytes` of its report measures); the "
                 "process's imports before it are already out of the memory available now")
    return stageplan.StagePlan("quantize", parts, name, device_bytes, notes, method=PLAN_METHOD,
                               reclaimable={k for k in parts if k.startswith(RECLAIMABLE)})


def _tricks(cfg: QuantizeConfig, source: Path, device: torch.device) -> list[str]:
    """The changes that fit (`stageplan.what_fits`): the backend's own lighter options (ONNX Runtime's one int8
    form), then the single backends that fit, smallest first."""
    def plan_of(option: tuple[QuantizeConfig, str]) -> stageplan.StagePlan:
        return _plan(option[0], source, device, option[1])

    tricks = []
    chosen = None if cfg.method.backend == "auto" else backends.get(cfg.method.backend)
    if chosen is not None and hasattr(chosen, "memory") and (lighter := chosen.memory(cfg).lighter):
        tried = stageplan.what_fits([(lighter[0], (cfg.replace(**lighter[1]), cfg.method.backend))], plan_of)
        tricks += [f"{t.flags}: {t.plan.required_bytes / 2**30:.1f} GiB" for t in tried if t.fits]
    others = [(f"--backend {name}", (cfg, name)) for name in backends.names() if name != cfg.method.backend
              and not (backends.unavailable(name, device) or backends.get(name).refuses(cfg))]
    fitting = sorted((t for t in stageplan.what_fits(others, plan_of, first=False) if t.fits),
                     key=lambda t: (t.plan.required_bytes, t.flags))
    return tricks + [f"{t.flags} ({t.plan.required_bytes / 2**30:.1f} GiB)" for t in fitting[:3]]


def quantize_tag(backend: str, cfg: QuantizeConfig, source: Path) -> str:
    """`quantize-dynamic` for the dense model; `prune-row-r2+quantize-dynamic` for a pruned one (a run can hold
    both)."""
    tag = backends.get(backend).tag(cfg)
    return f"{source.name}+{tag}" if artifacts.read_meta(source)["stage"] == "prune" else tag


def pick_backend(cfg: QuantizeConfig, device: torch.device, parent: nn.Module, source: Path, tokenizer,
                 eval_blocks: torch.Tensor, block: int, parent_blocks: list[float],
                 scratch: Path, docs: tuple[int, ...] = ()) -> tuple[str, dict]:
    """`--backend auto`: write every backend that runs here into `scratch/<backend>` and reload it, keep those
    whose held-out loss is within AUTO_LOSS_BUDGET of the parent's (the upper end of the paired delta's 95%
    interval; `parent_blocks`: the parent's per-block losses), time them with the parent interleaved at the
    workload `optimize_for` by the decision rule (`effkit.measure.choice`: a screen, then the leaders head to head;
    a tie within the precision goes to the smaller folder). The winner's folder is left in `scratch` for the caller
    to move into place. Each backend's reloaded model is freed once evaluated, and the candidates are reloaded
    for the timing: no write runs beside the earlier backends' models (the stage's memory plan counts it so)."""
    table = _within_budget(cfg, device, parent, source, tokenizer, eval_blocks, parent_blocks, scratch, docs)
    kept = [b for b, row in table.items() if row["status"] == "candidate"]
    candidates: dict[str, nn.Module] = {b: load_any(scratch / b, device) for b in kept}  # timed side by side
    if not candidates:
        raise EffkitError(f"no int8 backend stays within {AUTO_LOSS_BUDGET:.0%} of the parent's held-out loss "
                          f"here ({', '.join(b + ': ' + t['status'] for b, t in table.items())}); choose one "
                          "with --backend")
    models = {"parent": parent, **candidates}
    w = workloads.get(cfg.method.optimize_for)
    rule = choice.Rule.of(cfg.measure)
    names = list(candidates)
    engine = {"parent": engine_of(source), **{b: engine_of(scratch / b) for b in candidates}}  # each times its own
    prompts = generation.reference_prompts(source, tokenizer, cfg.inputs.data)
    timers, how = _timers(w, models, engine, tokenizer, block, prompts)
    sizes = {b: table[b]["size_bytes"] for b in names}
    default = AUTO_DEFAULT if AUTO_DEFAULT in candidates else None
    picked = choice.choose(timers, w.higher_is_better, rule, prefer=lambda b: sizes.get(b, 0), reference="parent",
                           default=default)
    for b in names:
        if b in picked.samples:
            table[b]["median"] = stats.median_of_rounds(picked.samples[b])  # tokens/s (decode) or s (prefill)
        if b in picked.reference:
            table[b]["ratio_to_parent"] = picked.reference[b]
        if b in picked.ratios:
            table[b]["ratio_to_picked"] = picked.ratios[b]
        if b in picked.invalid:
            table[b]["status"] = f"left out: {picked.invalid[b]}"
        if b in picked.far:
            table[b]["status"] = f"screened: {picked.far[b]}"
    pick, verdict, guard = picked.picked, picked.label, None
    if default and pick != default and (other := workloads.other_batch(w)):
        guard = _guard(other, {b: models[b] for b in (pick, default)}, engine, tokenizer, block, rule, pick, default,
                       prompts)
        if guard["choice"]["picked"] == default:
            verdict = (f"kept the default: {pick} led at {w.name} ({picked.label}) but was not shown as fast at "
                       f"{other.name}: {guard['line']}")
            pick = default
    return pick, {"picked": pick, "verdict": verdict, "table": table, "optimize_for": w.name,
                  "choice": picked.to_dict(), "tied_with": picked.ties, "default": default,
                  "parent_block_losses": parent_blocks, "block_docs": list(docs), "prompts": prompts[1],
                  **({"guard": guard} if guard else {}),
                  "how": f"{_written(cfg)} written and reloaded; those whose held-out loss is within "
                         f"{AUTO_LOSS_BUDGET:.0%} of the parent's (upper end of the paired 95% interval) timed at "
                         f"{w.name} ({how}), each with its own engine, the fp32 parent in the screen; the rule: "
                         f"{rule.describe()}; a tie within the precision goes to the smaller folder; "
                         + (f"{default} (what a user has without effkit) is kept unless another is decided faster "
                            f"at {w.name} and not slower at the other batch (decided faster or within the "
                            "precision there)" if default else "")}


def _written(cfg: QuantizeConfig) -> str:
    """Which backends `auto` writes, in words (its `how`)."""
    share = cfg.method.auto_share
    return ("every backend that runs here" if share >= 1 else
            f"on {share:.0%} of its time budget, that share of the backends that run here (at least {AUTO_FEWEST}, "
            f"ONNX Runtime's int8 and those measured fastest before: effkit/stage_costs.json; the others listed as "
            "not run)")


def auto_candidates(cfg: QuantizeConfig, device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The backends `auto` writes with `cfg` (`method.auto_share`: the share of its time budget, `by_share` of those
    that run here, ONNX Runtime's int8 always among them), and why each other one is not run."""
    why = {b: f"not run: {r}" for b in backends.names()
           if (r := backends.unavailable(b, device) or backends.get(b).refuses(cfg))}
    speed = costs()["speed"]["backends"]
    kept, left = by_share([b for b in backends.names() if b not in why], cfg.method.auto_share, AUTO_FEWEST, speed,
                          AUTO_DEFAULT)
    return kept, {**why, **{b: left_out_why(cfg.method.auto_share, speed, b) for b in left}}


def _within_budget(cfg: QuantizeConfig, device: torch.device, parent: nn.Module, source: Path, tokenizer,
                   eval_blocks: torch.Tensor, parent_blocks: list[float], scratch: Path,
                   docs: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """`auto`'s table: every backend written into `scratch/<backend>`, reloaded and evaluated (its status
    `candidate` where its held-out loss is within AUTO_LOSS_BUDGET of the parent's), or why it did not run; each
    reloaded model freed before the next backend's write."""
    table: dict[str, dict[str, Any]] = {}
    runnable, left_out = auto_candidates(cfg, device)
    (scratch / ".exports").mkdir()
    with engines.exports_kept(scratch / ".exports"):  # one parent: its export made once for all its candidates
        for b in backends.names():
            if b not in runnable:
                table[b] = {"status": left_out[b]}
                continue
            (scratch / b).mkdir()
            start = time.perf_counter()
            try:
                write_quantized(scratch / b, b, parent, source, tokenizer, cfg, device)
                model = load_any(scratch / b, device)
            except EffkitError as e:
                table[b] = {"status": f"not run: {e}"}
                continue
            result = evaluation.evaluate(model, eval_blocks, cfg.measure.batch_size, docs=docs)
            delta = results.LossDelta.of(stats.paired_delta(parent_blocks, result["block_losses"], docs))
            ok = delta.verdict != results.INVALID and delta.ci95[1] <= AUTO_LOSS_BUDGET
            table[b] = {"status": "candidate" if ok else f"left out: loss {delta.fmt()}, its interval reaches past "
                                                         f"{AUTO_LOSS_BUDGET:.0%}",
                        "eval_loss": result["eval_loss"], "loss_increase": delta.delta, "loss_delta": delta.to_dict(),
                        "size_bytes": artifacts.dir_size(scratch / b),
                        "block_losses": result["block_losses"],  # its loss delta is recomputed from these
                        "seconds": time.perf_counter() - start}  # written, reloaded, evaluated (stage_costs.py)
            del model  # freed before the next backend's write
    return table


def _guard(other: workloads.Workload, pair: dict[str, nn.Module], engine: dict, tokenizer, block: int,
           rule: choice.Rule, pick: str, default: str, prompts: tuple[dict, dict]) -> dict[str, Any]:
    """The pick against the default at the other batch: it must not be slower there either (decided faster, or
    tied and preferred)."""
    timers, how = _timers(other, pair, engine, tokenizer, block, prompts)
    g = choice.choose(timers, other.higher_is_better, rule, prefer=lambda b: b != pick, default=default)
    return {"workload": other.name, "how": how, "choice": g.to_dict(), "line": g.line()}


def _timers(w: workloads.Workload, models: dict[str, nn.Module], engine: dict, tokenizer, block: int,
            prompts: tuple[dict, dict]) -> tuple[dict[str, Any], str]:
    """One timer per model at the workload `w`, each through its own engine, and how it times; a decode workload
    on `prompts` (`generation.reference_prompts`' cut and record: the prompts the bench times)."""
    if w.kind == "decode":
        batches = generation.round_batches(tokenizer, w, prompts[0])
        new = min(generation.generation_budget(m, tokenizer, w.tokens or workloads.DECODE_TOKENS,
                                               batches[0].shape[1] if batches else None)[0] for m in models.values())
        return ({n: engine[n].decode(m, tokenizer, w.batch, new, prompts=batches) for n, m in models.items()},
                f"greedy decoding of {new} new tokens from {w.batch} prompt(s) a round, new tokens/s; prompts: "
                f"{generation.prompts_line(prompts[1])}")
    tokens = w.tokens or block
    return ({n: engine[n].prefill(m, w.batch, tokens) for n, m in models.items()},
            f"forward of ({w.batch}, {tokens}) tokens, seconds")


def _quantize(cfg: QuantizeConfig, device: torch.device, source: Path, run_dir: Path,
              memory_of: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    data_section = artifacts.data_section(source, cfg.inputs.data)
    data_cfg = DataConfig.from_dict(data_section)
    prepared = prepare(data_cfg, tokenizer_from=str(source))
    tokenizer, eval_blocks, n_bytes = prepared.tokenizer, prepared.blocks.eval, prepared.blocks.eval_bytes
    parent = load_model(str(source)).to(device).eval()
    docs = prepared.blocks.eval_docs
    parent_fp32 = evaluation.evaluate(parent, eval_blocks, cfg.measure.batch_size, eval_bytes=n_bytes, docs=docs)
    parent_bf16 = None if bf16_not_run(device) else evaluation.evaluate(  # not on a CPU without native bf16
        parent, eval_blocks, cfg.measure.batch_size, torch.bfloat16, eval_bytes=n_bytes, docs=docs)
    parent_fp32["generation"] = generate_sample(parent, tokenizer, cfg.measure.gen_tokens)
    parent_fp32["size_bytes"] = artifacts.dir_size(source)

    # auto writes every backend here; removed below, or by the next run lock if the process is killed
    scratch = Path(tempfile.mkdtemp(dir=run_dir, prefix=".tmp-auto-"))
    try:
        return _write_and_measure(cfg, device, source, run_dir, scratch, data_section, prepared, parent,
                                  parent_fp32, parent_bf16, memory_of)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_and_measure(cfg: QuantizeConfig, device: torch.device, source: Path, run_dir: Path, scratch: Path,
                       data_section: dict, prepared, parent: nn.Module, parent_fp32: dict,
                       parent_bf16: dict | None, memory_of: Callable[[], dict[str, Any]] | None = None
                       ) -> dict[str, Any]:
    """Choose the backend (auto), write the artifact, reload it, measure it against the parent, report (with the
    memory plan made before the stage beside the peak it measured, `memory_of()`)."""
    tokenizer, eval_blocks, n_bytes = prepared.tokenizer, prepared.blocks.eval, prepared.blocks.eval_bytes
    block = DataConfig.from_dict(data_section).block_size
    backend, auto_note = cfg.method.backend, None
    if backend == "auto":
        backend, auto_note = pick_backend(cfg, device, parent, source, tokenizer, eval_blocks, block,
                                          parent_fp32["block_losses"], scratch, prepared.blocks.eval_docs)
    tag = quantize_tag(backend, cfg, source)
    artifact = run_dir / tag
    with artifacts.atomic_dir(artifact) as tmp:
        if auto_note:  # the winner was written while choosing: moved into place, not written again
            shutil.copytree(scratch / backend, tmp, dirs_exist_ok=True)
            description = json.loads((tmp / QUANT_FILE).read_text())
        else:
            description = write_quantized(tmp, backend, parent, source, tokenizer, cfg, device)
        model = load_any(tmp, device)  # what is measured: the artifact as its folder alone reloads it
        int8_layers = quantized_layers(tmp, model)
        if not int8_layers:
            raise EffkitError(f"{backend} left no int8 layer in the reloaded model: nothing was quantized")
        q = evaluation.evaluate(model, eval_blocks, cfg.measure.batch_size, eval_bytes=n_bytes,
                             docs=prepared.blocks.eval_docs)
        q["generation"] = generate_sample(model, tokenizer, cfg.measure.gen_tokens)
        q["size_bytes"] = artifacts.dir_size(tmp)
        m, verdicts, protocol = compare_with_parent(cfg.measure, device, parent, model, tokenizer, block, parent_fp32,
                                                    parent_bf16, q, f"int8 ({backend})", artifact=tmp,
                                                    prompts=generation.reference_prompts(source, tokenizer,
                                                                                         cfg.inputs.data))
        m.update(params=sum(p.numel() for p in parent.parameters()), quantized_layers=len(description["layers"]),
                 int8_layers_reloaded=int8_layers, portability=backends.get(backend).portability)
        if auto_note:
            m["auto"] = auto_note
        meta_out = artifacts.write_meta(tmp, "quantize", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={"quantization": {k: v for k, v in description.items()
                                                                if k != "layers"}})
    report = StageReport(
        stage="quantize", tag=tag, parent=str(source), run=run_dir.name, artifact=str(artifact),
        config=cfg.to_dict(), metrics=m, verdicts=verdicts,
        what_ran={"device": hardware.describe_device(device), "backend": backend, "source_model": str(source),
                  "data": data_section["source"], "tokenizer": prepared.tokenizer_source,
                  "world_size": 1, "parallel": "none", "amp_dtype": "fp32 activations, int8 weights",
                  "quantized_layers": len(description["layers"]), "int8_layers_reloaded": int8_layers,
                  "include_head": description["include_head"], "format": description["format"],
                  "cpu_flags": " ".join(hardware.cpu_flags()) if device.type == "cpu" else ""},
        protocol=protocol, **stamp(meta_out),
        extras={"memory": memory_of() if memory_of else None},  # the plan made before, beside the peak measured
    )
    write_stage_report(Path(cfg.folders.reports_dir) / run_dir.name, report)
    return report.as_dict()




# ------------------------------------------------------------------------------------- the stage in `effkit run`
BEST_PRUNED = "best-pruned"


def quantize_key(plan: Plan, wanted: str) -> str:
    """How the run names the quantize step of `wanted` (plain `quantize` when only the dense model is)."""
    return f"quantize {wanted}" if plan.run.pipeline.quantize_from != ["train"] else "quantize"


def quantized_from(plan: Plan, source: Path) -> Path | None:
    """The complete quantized artifact of the run made from `source`, if any."""
    if not plan.run_dir.is_dir():
        return None
    for d in plan.run_dir.glob("*quantize-*"):
        if complete(d) and artifacts.read_meta(d).get("parent") == str(source):
            return d
    return None


def best_pruned(plan: Plan) -> tuple[Path | None, dict[str, Any]]:
    """The most compressed pruning round whose held-out loss is within `max_loss_increase` of the dense model (the
    upper end of the paired interval, as the deliverable's rule), and the table it was chosen from."""
    budget = plan.run.pipeline.max_loss_increase
    rows = pruning_rounds(plan)
    best = most_compressed(rows)
    return (plan.layout.artifact(best["tag"]) if best else None), {
        "picked": best["tag"] if best else None, "budget": budget, "rounds": rows,
        "how": f"pruning rounds whose held-out loss is at most {budget:.1%} above the dense model they were pruned "
               "from (the upper end of the paired delta's interval; the control's share, what the fine-tuning "
               "alone did, is beside it); among them the smallest folder, then the lowest latency b12"}


class QuantizeStep(Step):
    """The recipe's quantize backend applied to one of `quantize_from`: `train`, a round, or `best-pruned`."""

    known_early = False  # best-pruned is known only once the pruning rounds exist

    def __init__(self, plan: Plan, wanted: str):
        self.wanted, self.key = wanted, quantize_key(plan, wanted)

    def source(self, ctx: RunContext) -> Path | None:
        if self.wanted != BEST_PRUNED:
            return ctx.plan.layout.artifact(self.wanted)
        if BEST_PRUNED not in ctx.results:  # chosen once, when the step is reached
            ctx.results[BEST_PRUNED] = best_pruned(ctx.plan)
        return ctx.results[BEST_PRUNED][0]

    def fingerprint(self, plan: Plan, before: dict[str, str]) -> str:
        branch = artifacts.prune_branch(self.wanted)
        pruned = [before[f"prune {m}"] for m in plan.prune] if "prune" in plan.stages else []
        parents = ([before["train"]] if self.wanted == "train" else [*pruned, plan.run.pipeline.max_loss_increase]
                   if self.wanted == BEST_PRUNED else [before[f"prune {m}"] for m, c in plan.prune.items()
                                                       if branch == f"prune-{c.label}"])
        q = {k: v for k, v in plan.quantize.to_dict().items() if k != "source"}
        return fingerprint("quantize", q, parents)

    def label(self, ctx: RunContext) -> str:
        if self.wanted == BEST_PRUNED and (source := self.source(ctx)) is not None:
            return f"{self.key} ({source.name})"
        return self.key

    def skip_why(self, ctx: RunContext) -> str | None:
        if self.source(ctx) is None:
            return (f"no pruning round is within {ctx.plan.run.pipeline.max_loss_increase:.1%} of train: nothing to "
                    "quantize")
        return None

    def outputs(self, ctx: RunContext) -> list[Path]:
        made = quantized_from(ctx.plan, self.source(ctx))
        return [made] if made else []

    def complete(self, ctx: RunContext) -> bool:
        return quantized_from(ctx.plan, self.source(ctx)) is not None

    def run(self, ctx: RunContext) -> None:
        run_quantize(ctx.plan.quantize.replace(source=str(self.source(ctx))))

    def work(self, plan: Plan) -> float:
        """Per quantized artifact, in training steps (effkit/stage_costs.json): the parent's evaluation and its
        comparison with the pick, and each backend written, reloaded, evaluated and timed: `auto`'s candidates at
        its share (`auto_candidates`), or the one asked for."""
        q, w = plan.quantize, costs()["quantize"]
        each = w["backends"]
        chosen = (auto_candidates(q, resolve_device(q.inputs.device))[0] if q.method.backend == "auto"
                  else [q.method.backend])
        return w["fixed"] + sum(each.get(b, max(each.values())) for b in chosen)

    def budget(self, plan: Plan) -> float:
        q = plan.quantize
        # the parent comparison's measurements (one per prefill workload, the generation), and auto's choice
        looks = len(workloads.of_kind("prefill")) + 1 + (q.method.backend == "auto")
        return 0.0 if q.measure.fixed_rounds else q.measure.budget_s * looks

    def describe(self, plan: Plan) -> dict[str, Any]:
        what = (f"the most compressed pruning round within {plan.run.pipeline.max_loss_increase:.1%} of train"
                if self.wanted == BEST_PRUNED else str(plan.layout.artifact(self.wanted)))
        return {"stage": f"quantize {self.wanted}", "what": f"{plan.quantize.method.backend} int8 of {what}",
                "leaves": str(plan.run_dir / ("quantize-<backend>" if self.wanted == "train"
                                              else f"<{self.wanted}>+quantize-<backend>"))}


class QuantizeStage(Stage):
    name = "quantize"

    def configure(self, plan: Plan) -> None:
        run, f = plan.run, plan.run.folders
        # auto picks its backend for the workload the deliverable is chosen for
        plan.configs["quantize"] = build_config(QuantizeConfig, plan.recipe, {
            "source": str(plan.layout.artifact("train")), "optimize_for": run.pipeline.optimize_for,
            "runs_dir": f.runs_dir, "reports_dir": f.reports_dir})
        prune = plan.configs.get("prune", {})
        pruning = bool(prune) and "prune" in run.pipeline.stages
        valid = {"train"} | {artifacts.prune_tag(c.label, r) for c in prune.values()
                             for r in range(1, c.method.rounds + 1)}
        for wanted in run.pipeline.quantize_from if "quantize" in run.pipeline.stages else []:
            if wanted not in valid | ({BEST_PRUNED} if pruning else set()):
                raise EffkitError(f"recipe {plan.recipe}: [run] quantize_from = {wanted!r} is not an artifact this "
                                  f"recipe makes; choose among {', '.join(sorted(valid))}"
                                  + (f", {BEST_PRUNED}" if pruning else ""))

    def steps(self, plan: Plan) -> list[Step]:
        return [QuantizeStep(plan, w) for w in plan.run.pipeline.quantize_from]

    def with_share(self, plan: Plan, share: float) -> dict[str, Any]:
        """The time budget of its comparisons (`auto`'s head-to-head among the backends and the pick against its
        parent) times `share` (0 s still runs the first look), and `auto`'s backends (`auto_candidates`: the rest
        listed as not run)."""
        q = plan.quantize
        plan.configs["quantize"] = q.replace(budget_s=q.measure.budget_s * share, auto_share=share)
        got: dict[str, Any] = {"budget_s": plan.quantize.measure.budget_s}
        if q.method.backend == "auto":
            kept, why = auto_candidates(plan.quantize, resolve_device(q.inputs.device))
            got.update(backends=kept, not_run={b: w for b, w in why.items() if "budget share" in w})
        return got

    def memory_plans(self, plan: Plan, shapes: ShapeRun) -> list[tuple[str, str, Any]]:
        """The plan (`effkit quantize --plan`) from the dense model's shapes: the largest parent it may have."""
        dense = shapes.artifacts.get("train")
        if self.name not in plan.stages or dense is None:
            return []
        q = plan.quantize
        q = q.replace(source=str(dense), **shapes.folders.to_dict()).validate()
        if set(plan.run.pipeline.quantize_from) - {"train"}:
            shapes.notes.append("quantize planned from the dense model for each of its parents (a pruned parent "
                                "is smaller)")
        return [("quantize", f"{q.method.backend}, from the dense model", quantize_plan(q))]


STAGE = QuantizeStage()
