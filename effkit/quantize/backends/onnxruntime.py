"""`onnxruntime`: the model exported to ONNX and quantized by ONNX Runtime (`effkit.engines.onnxruntime`): `model.onnx`
with int8 operators, loadable by any ONNX Runtime.

Two int8 forms: effkit's (`quantize_int8`: every MatMul, the LM head included, the token embedding read from the
int8 head: the smallest file) and ONNX Runtime's defaults (`quantize_standard`: `quantize_dynamic` of MatMul and
Gemm, the head included, the token and position embeddings left fp32 beside it: what a user of ONNX Runtime gets
and the peer row runs). Which decodes faster depends on the CPU and the model's size (the forms differ in how the
embeddings are read and in the graph's quantization plumbing), so `--int8-form auto` (the default) writes both,
keeps those within +0.2% of the parent's loss (the upper end of the paired interval) and times them at
`--optimize-for` under the decision rule, a tie going to the smaller file and an undecided leader leaving ONNX
Runtime's own form in place (the rule's `default`); the record, with its raw samples, is in `onnx.json`
(`int8_form`).

`within_loss`, `time_settings` and `load_variant` are shared with `onnxruntime-int4`, which chooses its settings the
same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit import engines
from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

torch = lazy_module("torch")
nn = lazy_module("torch.nn")
onnx_export = lazy_module("effkit.engines.onnxruntime")


SETTING_LOSS_BUDGET = 0.002  # a form or setting is timed only if its paired loss delta's interval ends within +0.2%
SETTING_BUDGET_S = 10.0  # head-to-head seconds per open contender: one setting of one folder, as openvino's
DECODE_TOKENS = 32  # new tokens per timed call of a setting's choice (within the model's context)
FORMS = ("effkit", "standard")  # the smaller file first: it wins a tie


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend onnxruntime`'s own options (flags, recipe keys and --help lines come from here)."""

    fuse: bool = field(default=False, metadata={
        "help": "onnxruntime: ONNX Runtime's transformer fusions before quantizing"})
    int8_form: str = field(default="auto", metadata={
        "help": "onnxruntime: auto (both forms measured here: loss, then speed), effkit (the token embedding read "
                "from the int8 LM head: the smallest file) or standard (quantize_dynamic's defaults, fp32 embeddings)",
        "choices": ("auto", "effkit", "standard")})


def load_variant(folder: Path, artifact: Path, parent: nn.Module):
    """An `OnnxCausalLM` of the graph written in `folder`, with the artifact's config (saved before the export)."""
    import json
    import shutil

    shutil.copyfile(artifact / "config.json", folder / "config.json")
    (folder / onnx_export.ONNX_DESC).write_text(json.dumps({"params": sum(p.numel() for p in parent.parameters())}))
    return onnx_export.OnnxCausalLM(folder)


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
                  parent: nn.Module, cfg, w, prefer, what: str,
                  default: str | None = None) -> tuple[str, dict[str, Any], str]:
    """The fastest of `within` at the workload `w` by the decision rule: the stage's own rule (its precision), its
    head-to-head budget capped at SETTING_BUDGET_S (one setting of one folder); `prefer` breaks a tie; `default`
    stays where the leader is still undecided against it."""
    from dataclasses import replace

    from effkit.measure import choice, generation, stats

    rule = replace(choice.Rule.of(cfg.measure), budget_s=min(cfg.measure.budget_s, SETTING_BUDGET_S))
    if w.kind == "decode":
        new = min(DECODE_TOKENS, *(generation.generation_budget(models[n], tokenizer, w.tokens or DECODE_TOKENS)[0]
                                   for n in within))
        fns = {n: onnx_export.ENGINE.decode(models[n], tokenizer, w.batch, new) for n in within}
        timed = f"greedy decoding of {new} new tokens from {w.batch} prompt(s), new tokens/s"
    else:
        tokens = w.tokens or min(128, parent.config.n_positions)
        fns = {n: onnx_export.ENGINE.prefill(models[n], w.batch, tokens) for n in within}
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


class OnnxRuntime:
    name = "onnxruntime"
    options = Options
    summary = "ONNX Runtime int8 of the ONNX export"
    format = "onnx"
    devices = ("cpu",)

    @property
    def portability(self) -> str:
        return onnx_export.PORTABILITY

    def available(self, device: torch.device | None = None) -> str | None:
        if device is not None and device.type != "cpu":
            return "effkit runs ONNX artifacts on the CPU only (CPUExecutionProvider); use --device cpu"
        return onnx_export.onnx_unavailable()

    def refuses(self, cfg) -> str | None:
        return None

    def tag(self, cfg) -> str:
        form = cfg.options.of(Options).int8_form
        return "quantize-onnxruntime" + ("" if form in ("auto", "effkit") else f"-{form}")

    def write(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        o = cfg.options.of(Options)
        if o.int8_form != "auto":
            onnx = onnx_export.write_artifact(folder, parent, tokenizer, int8=True,
                                              fused=o.fuse, standard_int8=o.int8_form == "standard")
            onnx["int8_form"] = {"picked": o.int8_form, "how_chosen": "as asked (--int8-form)"}
        else:
            onnx = self.choose_form(folder, parent, source, tokenizer, cfg)
        form = onnx["int8_form"]["picked"]
        # the granularity is read from what the quantizer was told (onnx["weights"]), never typed beside it
        what = ("ONNX Runtime quantizes every MatMul and the embedding lookups, the LM head included"
                if form == "effkit" else
                "quantize_dynamic's defaults: every MatMul and Gemm (the LM head too), the token and position "
                "embeddings left fp32 beside it")
        return {"format": self.format, "include_head": True, "int8_form": form,
                "layers": sorted(onnx["int8"]), "onnx": onnx,
                "storage": f"ONNX graph with int8 operators (model.onnx), {form} form "
                           f"({onnx['int8_form']['how_chosen']}); {what}: "
                           f"{onnx.get('weights') or onnx.get('quantizer')}"}

    def choose_form(self, folder: Path, parent: nn.Module, source: Path, tokenizer, cfg) -> dict[str, Any]:
        """Both int8 forms written beside the artifact, the faster of those within +0.2% of the parent's loss moved
        into `folder` (see the module's text); its description with the record of the decision (`int8_form`)."""
        import json
        import shutil

        from effkit import workloads

        o = cfg.options.of(Options)
        w = workloads.get(cfg.method.optimize_for)
        scratch = folder / ".int8-forms"
        scratch.mkdir(exist_ok=True)
        try:
            descs, models, table = {}, {}, {}
            with engines.exports_kept(scratch):  # one export of the parent for both forms
                for form in FORMS:
                    (scratch / form).mkdir()
                    descs[form] = onnx_export.write_artifact(scratch / form, parent, tokenizer,
                                                             int8=True, fused=o.fuse, standard_int8=form == "standard")
                    models[form] = onnx_export.OnnxCausalLM(scratch / form)
                    table[form] = {"size_bytes": (scratch / form / onnx_export.ONNX_FILE).stat().st_size}
            within, loss_rule = within_loss(models, table, parent, source, cfg)
            decision = None
            if len(within) > 1:
                picked, decision, how = time_settings(
                    within, models, table, tokenizer, parent, cfg, w, prefer=lambda n: table[n]["size_bytes"],
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
            (folder / onnx_export.ONNX_DESC).write_text(json.dumps(desc, indent=2))
            return desc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def load(self, folder: Path, desc: dict[str, Any], device: torch.device) -> nn.Module:
        return onnx_export.OnnxCausalLM(folder)

    def quantized_layers(self, model: nn.Module) -> int:
        return onnx_export.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return onnx_export.ENGINE.load_command(folder)  # with the threads it was timed with

    def memory(self, cfg) -> Memory:
        # the write, measured as MEASURED says but on gpt2 (351 MiB of fp32 weights) and gpt2-large (2,746 MiB; the
        # line through those two, gpt2-mini's figures below it), since the parent is exported in place and the
        # quantizer holds one fp32 graph (session 22): --int8-form auto (both forms exported, quantized, reloaded)
        # 1,024 and 5,257 MiB; one form (--int8-form effkit) 926 and 4,434 (3,365 on a 149M model before). The
        # reload 463 and 194 on gpt2 and gpt2-mini; kept beside the others in auto's order 100 and 69. auto's line
        # takes one form's constant (its own came out 8 MiB lower): two forms never cost less than one
        both = cfg.options.of(Options).int8_form == "auto"
        return Memory(write=(412, 1.77) if both else (412, 1.47), loaded=(146, 0.90), beside=(63, 0.10),
                      measured=MEASURED + "; the write on gpt2 and gpt2-large (2,746 MiB of fp32 weights)",
                      lighter=("--int8-form effkit (one int8 form written, not both)", {"int8_form": "effkit"})
                      if both else None)

BACKEND = OnnxRuntime()
