"""The speculative artifacts of a bench: each target paired with the n-gram draft (prompt lookup). The targets: every
artifact of the run its engine can verify exactly (`targets`, `Engine.speculative_target`: ONNX Runtime's
weight-only graphs, MatMulNBits at 4 or 8 bits, run by effkit's loop, whose activations, where quantized, are
quantized per row, unlike dynamic int8's one scale over every token of a run; OpenVINO's f32-inference artifacts, run
by LLMPipeline's own prompt lookup); where the run has none, the dense reference's own weight-only form (`REF_INT4`,
`reference_int4`: fewer weight bytes per token than fp32, which batch-1 decoding reads in full for every token; its
loss is the bench's to measure, as every artifact's), or its ONNX Runtime fp32 export (with past) where that fails.
Before any timing, for each target: its k chosen on this CPU by `speculative.choose_k` over the prompts the bench's
decode workloads time (`prompts`: cut from the held-out documents, the same for every contender, every one in each
sample: k is never chosen on one prompt), its greedy tokens checked against the plain target's on those prompts (a
mismatch is a failure, listed with where it diverged, and no artifact: exactness is checked per target, never
assumed), and its settings written beside it (`speculative.SETTINGS`, which the engine's loader reads: the measured
k at batch 1, in effkit's loop for ONNX Runtime, in LLMPipeline's prompt lookup for OpenVINO; at batch 12 the artifact
runs its target's plain batched decoding, which the bench's decode b12 times and the row says). Where plain decoding
measured faster, no artifact either. The artifact lives in the run's folder (what `effkit run` ships must outlive the
bench) and is then benched as every other artifact, in the same rounds, and judged as a candidate of the deliverable
(lossless where its target is); its row carries the draft's statistics over the held-out prompts (`annotate`). The
bench's share of a time budget decides whether it is made at all (`left_out`: its cost, effkit/stage_costs.json's
`COST_KEY`)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from effkit import artifacts, workloads
from effkit.artifacts.loader import trainable
from effkit.config import BenchConfig
from effkit.engines import speculative
from effkit.errors import EffkitError
from effkit.stage import costs

SPEC_TAG = "speculative-ngram"  # its folder in the run (the reference's fp32 target; any other target's: suffixed)
# the target the bench writes itself where the run has none: the reference through this backend (fewer weight bytes
# per token than fp32, and its activations quantized per row, which keeps verification exact)
REF_INT4 = "onnxruntime-int4"
COST_KEY = "bench_speculative"  # its entry in effkit/stage_costs.json: weights in training steps, and its share
ROW_KEY = "speculative"  # the row's (and the artifact's record's) key
BATCH_12 = ("at batch 12 it runs its target's plain batched decoding (the draft and k apply at batch 1, where they "
            "were measured): decode b12 times that")


def cost() -> dict[str, float]:
    """Its entry in effkit/stage_costs.json: `choose_k` (weight of choosing k and checking exactness, in training
    steps, beside the artifact's own weight in the bench's rounds) and `from_share` (the least share of its time
    budget on which the bench makes it)."""
    return costs()[COST_KEY]


def left_out(cfg: BenchConfig) -> str | None:
    """Why a bench asked for a speculative artifact (`--speculative`) makes none, else None: the bench's share of a
    time budget (`peer_share`, the share `with_share` gives the whole bench) under `from_share`."""
    if not cfg.what.speculative:
        return None
    share, need = cfg.what.peer_share, cost()["from_share"]
    if share < need:
        return (f"not run: budget share {share:.0%} (the speculative artifact, its k chosen and its exactness "
                f"checked on this CPU, is made from a share of {need:.0%}: effkit/stage_costs.json)")
    return None


def runs(cfg: BenchConfig) -> bool:
    return bool(cfg.what.speculative) and left_out(cfg) is None


def prompts(reference: Path, data: dict[str, Any], tokenizer, count: int = workloads.DECODE_B1.prompts
            ) -> list[np.ndarray]:
    """The built-in decode workloads' held-out prompts (`workloads.DECODE_B1.prompts`, or `count` of them): cut from
    the held-out documents of the reference's data split, as the bench's decode rounds time them."""
    from effkit.measure.generation import heldout_cut

    return [np.asarray(p, np.int64) for p in heldout_cut(data, tokenizer, count)]


def targets(paths: list[Path]) -> list[Path]:
    """The run's artifacts among `paths` (past the reference) that can be speculative targets in their own engine
    (`Engine.speculative_target`: ONNX Runtime's weight-only graphs, MatMulNBits without dynamic int8; OpenVINO's
    f32-inference artifacts), not themselves speculative."""
    from effkit.artifacts.loader import engine_of

    return [p for p in paths[1:] if not p.name.startswith(SPEC_TAG) and not (p / speculative.SETTINGS).is_file()
            and engine_of(p).speculative_target(p)]


def tag_of(target: Path | str | None) -> str:
    """The speculative artifact's folder (and row tag) in the run: `SPEC_TAG` for the reference's fp32 target,
    suffixed with the target's own tag for an artifact of the run (`targets`), or with `REF_INT4` for the
    reference's weight-only form the bench writes."""
    return SPEC_TAG if target is None else f"{SPEC_TAG}-{target if isinstance(target, str) else target.name}"


def exactness(model, ids: list[np.ndarray], new_tokens: int, k: int, tag: str = SPEC_TAG) -> dict[str, Any]:
    """`model`'s greedy tokens with the n-gram draft at `k` against its plain ones on every prompt, token for token
    (`speculative.check_exact`: a mismatch raises, saying where), and the draft's statistics over the prompts."""
    import torch

    total = speculative.SpecStats()
    for i, p in enumerate(ids):
        x = torch.as_tensor(p)[None]
        kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
        plain = model.generate(x, prompt_lookup_num_tokens=0, **kw)[0, x.shape[1]:].tolist()
        spec = model.generate(x, **speculative.generate_kwargs("ngram", k), **kw)[0, x.shape[1]:].tolist()
        speculative.check_exact(plain, spec, f"{tag} (n-gram draft, k={k}) on held-out prompt {i}")
        total.add(model.speculative_stats)
    return total.to_dict()


def rule_of(cfg: BenchConfig):
    """`choose_k`'s rule on the bench's own measure: its rounds and budget (a fixed-rounds bench: its rounds, one
    look)."""
    from effkit.measure.choice import Rule

    ms = cfg.measure
    return Rule(rounds=ms.rounds, looks=1) if ms.fixed_rounds else Rule(rounds=ms.rounds, budget_s=ms.budget_s / 3)


def write_target(cfg: BenchConfig, folder: Path, reference: Path, tokenizer, target: Path | str | None) -> str:
    """The target's graph in `folder` (the reference exported to ONNX Runtime fp32, or in its weight-only form,
    `REF_INT4`, or a copy of the run's artifact `target`); what it is, in words."""
    from effkit.model import load_model
    from effkit.registry import ENGINES

    if target is None:
        ENGINES.get("onnxruntime").convert(folder, reference, copy.deepcopy(load_model(str(reference)).eval()),
                                           tokenizer)
        return "the dense reference, ONNX Runtime fp32 with past"
    if target == REF_INT4:
        return reference_int4(cfg, folder, reference, tokenizer)
    shutil.copytree(target, folder, dirs_exist_ok=True)
    if (folder / "onnx.json").is_file():
        precision = json.loads((folder / "onnx.json").read_text()).get("precision", "weight-only")
        return f"{target.name}: ONNX Runtime {precision}, with past"
    from effkit.artifacts.loader import engine_of

    return f"{target.name}: {engine_of(folder).noun} artifact"


def reference_int4(cfg: BenchConfig, folder: Path, reference: Path, tokenizer) -> str:
    """The reference's weight-only form in `folder`, as `effkit quantize --from <reference> --backend
    onnxruntime-int4 --int4-block-size 32 --accuracy-level 4 --int4-share 1` writes it (level 1 where the backend
    refuses 4: no int8 kernels for it on this CPU): the smallest block its int8 kernels take, the most accurate;
    measuring the settings, as that backend does by default, would cost the run more than the artifact's own
    rounds. What it is, in words."""
    from effkit.artifacts import quantized
    from effkit.config import QuantizeConfig
    from effkit.model import load_model
    from effkit.parallel import resolve_device
    from effkit.registry import BACKENDS

    backend = BACKENDS.get(REF_INT4)
    q = QuantizeConfig.from_flat(source=str(reference), backend=REF_INT4, data=cfg.what.data, device="cpu",
                                 int4_block_size="32", int4_share="1", accuracy_level="4")
    q = q.with_flat(accuracy_level="1") if backend.refuses(q) else q
    desc = quantized.write(folder, backend, load_model(str(reference)).eval(), reference, tokenizer, q.validate(),
                           resolve_device(q.inputs.device))
    return f"the dense reference, {desc['storage']}"


def make(cfg: BenchConfig, reference: Path, folder: Path, new_tokens: int, target: Path | str | None = None
         ) -> str | None:
    """The speculative artifact of `target` (None: the reference, a PyTorch artifact, exported to fp32; `REF_INT4`:
    the reference in its weight-only form; else an artifact of the run, `targets`) written to
    `folder`; None, or why there is none (a failure: "failed: ..."; plain decoding faster: "not run: ..."), the
    folder then removed."""
    import torch
    from transformers import AutoTokenizer

    from effkit.artifacts.loader import engine_of

    shutil.rmtree(folder, ignore_errors=True)
    context = int(json.loads((reference / "config.json").read_text()).get("n_positions", 1 << 30))
    new_tokens = min(new_tokens, context - workloads.HELDOUT_PROMPT_TOKENS)  # the prompt and its tokens fit
    tokenizer, data = AutoTokenizer.from_pretrained(reference), artifacts.data_section(reference)
    ids = prompts(reference, data, tokenizer)
    folder.mkdir(parents=True)
    try:
        described = write_target(cfg, folder, reference, tokenizer, target)
        model = engine_of(folder).load(folder, torch.device("cpu"))
        chosen = speculative.choose_k(model, ids, new_tokens, rule=rule_of(cfg))
        if chosen.k == 0:
            invalid = chosen.choice.get("invalid") or {}
            raise _NoArtifact(f"not run: plain decoding of {described} measured no slower than the n-gram draft "
                              f"at every k on this CPU ({chosen.choice.get('label', 'the decision rule')})"
                              + (f"; {'; '.join(f'{n}: {w}' for n, w in invalid.items())}" if invalid else ""))
        record = speculative.write_settings(folder, chosen, f"{len(ids)} prompts x {new_tokens} new tokens at batch 1, "
                                            "from the held-out documents (the decode workloads' prompts)")
        draft = exactness(model, ids, new_tokens, chosen.k, folder.name)
        del model
    except EffkitError as e:
        shutil.rmtree(folder, ignore_errors=True)
        return e.args[0] if isinstance(e, _NoArtifact) else f"failed: {e}"
    what = {"draft": "ngram", "k": chosen.k, "target": described,
            "prompts": {"count": len(ids), "tokens": workloads.HELDOUT_PROMPT_TOKENS,
                        "from": "held-out documents (the decode workloads' prompts), the same for every k"},
            "tokens_per_prompt": new_tokens, "exact": f"{len(ids)} prompts x {new_tokens} tokens equal to the target's",
            **draft, "batch_12": BATCH_12, "choice": record["choice"]}
    if not isinstance(target, Path):  # made here from the reference: exported, or quantized weight-only
        artifacts.write_meta(folder, "export" if target is None else "quantize",
                             {"speculative": {"draft": "ngram", "k": chosen.k}, "target": target or "fp32"}, {},
                             data=data, parent=str(reference), extra={ROW_KEY: what})
    else:  # the target's own record (its stage, parent and settings), the draft's beside it
        (folder / artifacts.META).write_text(json.dumps({**artifacts.read_meta(target), ROW_KEY: what,
                                                         "speculative_of": str(target)}, indent=2, default=str))
    return None


class _NoArtifact(EffkitError):
    """Plain decoding measured faster: no speculative artifact, and no failure either."""


def add(cfg: BenchConfig, run_dir: Path, paths: list[Path], new_tokens: int) -> tuple[list[Path], dict[str, str]]:
    """The bench's paths with the speculative artifacts of every target among them (`targets`), or,
    where there is none, of their reference's (the first's) weight-only form (`REF_INT4`; its fp32 export where
    every one of those failed), made and put after the run's own artifacts (those of an earlier bench removed), and
    why any is not there (by tag: a target that diverged says where). A bench not asked for them benches the ones it
    finds as any other artifact."""
    if not cfg.what.speculative:
        return paths, {}
    earlier = {p.resolve() for p in run_dir.glob(f"{SPEC_TAG}*")}
    paths = [p for p in paths if p.resolve() not in earlier]
    for p in earlier:  # those of an earlier bench are of a reference maybe since retrained: made again below
        shutil.rmtree(p, ignore_errors=True)
    if why := left_out(cfg):
        return paths, {SPEC_TAG: why}
    if not trainable(paths[0]):
        return paths, {SPEC_TAG: f"not run: the reference {paths[0].name} is not a PyTorch artifact"}
    made, why_not = [], {}
    # the run's targets, else the reference's own weight-only form: fewer weight bytes per token than fp32, which
    # batch-1 decoding reads in full for every token; the fp32 export where none was written or exact
    kept = targets(paths) or [REF_INT4]
    for target in kept:
        folder = run_dir / tag_of(target)
        if why := make(cfg, paths[0], folder, new_tokens, target):
            why_not[folder.name] = why
        else:
            made.append(folder)
        # none written or exact here (never where plain decoding measured faster): the fp32 export's then
        if not made and target is kept[-1] is not None and all(w.startswith("failed: ") for w in why_not.values()):
            kept.append(None)
    return paths + made, why_not


def annotate(rows: list[dict[str, Any]]) -> None:
    """The speculative rows' draft statistics (acceptance rate, tokens per target forward, the draft's share of the
    time), target, k and its choice, from each artifact's record, and what it does at batch 12 with its decode b12
    figure; in words among its flags (bench.md's notes)."""
    for r in rows:
        if r["stage"] != "peer" and (what := artifacts.read_meta(Path(r["artifact"])).get(ROW_KEY)):
            b12 = r.get(workloads.DECODE_B12.figure)
            r[ROW_KEY] = what = {**what, **({"batch_12_tokens_per_s": b12} if isinstance(b12, int | float) else {})}
            r["flags"].append(f"speculative: {what['draft']} draft, k={what['k']} (chosen on this CPU), exact on "
                              f"{what['prompts']['count']} held-out prompts x {what['tokens_per_prompt']} tokens; "
                              f"{_figures(what)}; "
                              f"decode b1 runs it; {what.get('batch_12', BATCH_12)}"
                              + (f" ({b12:.1f} tokens/s)" if isinstance(b12, int | float) else ""))


def _figures(what: dict[str, Any]) -> str:
    """`acceptance 0.78, 5.54 tokens per target forward, the draft 8% of the time`, each figure the loop counted."""
    acc, share = what.get("acceptance_rate"), what.get("draft_share_of_time")
    return ", ".join(
        [*([f"acceptance {acc:.2f}"] if acc is not None else []),
         f"{what['tokens_per_target_forward']:.2f} tokens per target forward",
         *([f"the draft {share:.0%} of the time"] if share is not None else
           ["the draft's proposals and time not reported by the engine's own loop"])])
