"""`onnxruntime`: the model exported to ONNX and quantized by ONNX Runtime's dynamic int8, written by the engine's
`write_int8` (`effkit.engines.onnxruntime`), which `effkit export --int8` calls too: `model.onnx` with int8
operators, loadable by any ONNX Runtime. `--int8-form`: effkit's form (the token embedding read from the int8 head:
the smallest file), ONNX Runtime's defaults (`standard`: what its users get, and the peer row runs), or `auto` (the
default): both written and measured here, loss then speed (`effkit.engines.onnxruntime.choose.choose_form`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effkit.quantize.backends import MEASURED, Memory
from effkit.registry import lazy_module

engine = lazy_module("effkit.engines.onnxruntime")
shared = lazy_module("effkit.engines.shared")


@dataclass(frozen=True)
class Options:
    """`effkit quantize --backend onnxruntime`'s own options (flags, recipe keys and --help lines come from here)."""

    fuse: bool = field(default=False, metadata={
        "help": "onnxruntime: ONNX Runtime's transformer fusions before quantizing"})
    int8_form: str = field(default="auto", metadata={
        "help": "onnxruntime: auto (both forms measured here: loss, then speed), effkit (the token embedding read "
                "from the int8 LM head: the smallest file) or standard (quantize_dynamic's defaults, fp32 embeddings)",
        "choices": ("auto", "effkit", "standard")})


class OnnxRuntime:
    name = "onnxruntime"
    options = Options
    summary = "ONNX Runtime int8 of the ONNX export"
    format = "onnx"
    devices = ("cpu",)

    @property
    def portability(self) -> str:
        return engine.graph.PORTABILITY

    def available(self, device: Any = None) -> str | None:
        return shared.cpu_only(device, "ONNX", "CPUExecutionProvider") or engine.graph.onnx_unavailable()

    def refuses(self, cfg) -> str | None:
        return None

    def tag(self, cfg) -> str:
        form = cfg.options.of(Options).int8_form
        return "quantize-onnxruntime" + ("" if form in ("auto", "effkit") else f"-{form}")

    def write(self, folder: Path, parent: Any, source: Path, tokenizer, cfg, device) -> dict[str, Any]:
        o = cfg.options.of(Options)
        onnx = engine.ENGINE.write_int8(folder, parent, tokenizer, o.int8_form, o.fuse, source, cfg)
        if o.int8_form != "auto":
            onnx["int8_form"] = {"picked": o.int8_form, "how_chosen": "as asked (--int8-form)"}
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

    def load(self, folder: Path, desc: dict[str, Any], device: Any) -> Any:
        return engine.ENGINE.load(folder, device)

    def quantized_layers(self, model: Any) -> int:
        return engine.ENGINE.quantized_layers(model)

    def load_command(self, folder: Path) -> str:
        return engine.ENGINE.load_command(folder)  # with the threads it was timed with

    def memory(self, cfg) -> Memory:
        # the write on gpt2 and gpt2-large (the line through those two), since the parent is exported in place and
        # the quantizer holds one fp32 graph; auto's line takes one form's constant: two forms never cost less than
        # one (the figures: docs/benchmarks.md)
        both = cfg.options.of(Options).int8_form == "auto"
        return Memory(write=(412, 1.77) if both else (412, 1.47), loaded=(146, 0.90), beside=(63, 0.10),
                      measured=MEASURED + "; the write on gpt2 and gpt2-large (2,746 MiB of fp32 weights)",
                      lighter=("--int8-form effkit (one int8 form written, not both)", {"int8_form": "effkit"})
                      if both else None)


BACKEND = OnnxRuntime()
