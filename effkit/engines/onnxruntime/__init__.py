"""ONNX Runtime over effkit's with-past ONNX export (the layout optimum writes): the engine (`ENGINE`, what
`effkit.registry.ENGINES` names) and the package that owns the format end to end, one job a module:

- `graph.py`: the artifact's files, and what is read back from a graph without running it (its int8 and 4-bit
  operators, MatMulNBits settings, weight bytes per token, the digest of its computation); no torch;
- `export.py`: torch -> ONNX of the with-past decoder step, its parity gate, ONNX Runtime's fusions, and
  `write_artifact`, which writes a whole folder (fp32, int8 or 4-bit);
- `int8.py`: ONNX Runtime's dynamic int8 (effkit's form, the embedding read from the int8 head, and ONNX Runtime's
  defaults, the peer's);
- `int4.py`: weight-only MatMulNBits (4 or 8 bits, rtn / hqq / gptq, mixed graphs) and the settings it can run;
- `choose.py`: the settings of both chosen by measurement (loss, then speed);
- `runtime.py`: the session and `OnnxCausalLM`, the artifact behind effkit's model interface.

`effkit export --int8` and `effkit quantize --backend onnxruntime` both write through `write_int8`;
`--backend onnxruntime-int4` through `write_int4`. Importing this package imports no torch: the backends' options
read `graph.refused_combination` while a recipe is checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from effkit.engines import Engine
from effkit.engines.onnxruntime import graph
from effkit.engines.shared import cpu_only, require_cpu
from effkit.registry import lazy_module

export = lazy_module("effkit.engines.onnxruntime.export")
choose = lazy_module("effkit.engines.onnxruntime.choose")
runtime = lazy_module("effkit.engines.onnxruntime.runtime")


class OnnxRuntimeEngine(Engine):
    """ONNX Runtime over effkit's with-past export (the layout optimum writes)."""

    name = "onnxruntime"
    marker = graph.ONNX_DESC
    label = "ONNX Runtime"
    noun = "an ONNX"  # "is an ONNX artifact"
    summary = "ONNX Runtime, with-past ONNX graph (fp32 or dynamic int8)"
    format = "onnx"
    fuses = True  # ONNX Runtime's transformer fusions
    portability = graph.PORTABILITY
    peer_tag = "peer-onnxruntime-int8"
    peer_how = ("the with-past ONNX export of the reference (the layout optimum writes) + "
                "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8, MatMul and Gemm), per tensor; "
                "deviations from how its users run it: decoded by effkit's numpy greedy loop over the graph's "
                "session (ONNX Runtime ships no decoding loop of its own; optimum's runs the same graph from its own "
                "Python loop), not by optimum's ORTModelForCausalLM.generate")

    @property
    def settle_s(self) -> float:  # type: ignore[override]
        from effkit.measure.timing import SETTLE_S  # its sessions' threads spin-wait after a run

        return SETTLE_S

    def available(self, device: Any = None, path: Path | None = None, **options: Any) -> str | None:
        return cpu_only(device, "ONNX") or graph.onnx_unavailable()

    def load(self, path: Path, device: Any):
        require_cpu(path, device, self.noun)
        return runtime.OnnxCausalLM(path)

    def convert(self, folder: Path, source: Path, model: Any, tokenizer, int8: bool = False,
                fuse: bool = False, **options: Any) -> dict[str, Any]:
        if int8:
            return self.write_int8(folder, model, tokenizer, fuse=fuse)
        return export.write_artifact(folder, model, tokenizer, int8=False, fused=fuse)

    def write_int8(self, folder: Path, model: Any, tokenizer, form: str = "effkit", fuse: bool = False,
                   source: Path | None = None, cfg: Any = None) -> dict[str, Any]:
        """The dynamic int8 artifact of `model` in `folder`: `form` effkit or standard as asked, or auto: both
        written and measured (`choose.choose_form`: the stage's `cfg`, the `source` artifact's data)."""
        if form == "auto":
            return choose.choose_form(folder, model, source, tokenizer, cfg, fuse)
        return export.write_artifact(folder, model, tokenizer, int8=True, fused=fuse, standard_int8=form == "standard")

    def write_int4(self, folder: Path, model: Any, source: Path, tokenizer, options: Any, cfg: Any) -> dict[str, Any]:
        """The MatMulNBits artifact of `model` in `folder`, its settings those of the backend's `options`, chosen by
        measurement where they say auto (`choose.choose_settings`)."""
        choose.settings_of(model, options)  # a setting this model cannot take is refused before the export

        def measured(src: Path, dst: Path) -> dict[str, Any]:
            return choose.choose_settings(src, dst, model, source, tokenizer, options, cfg)

        return export.write_artifact(folder, model, tokenizer, int8=False, fused=False, int4=True,
                                     int4_quantize=measured)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        ran = {"precision": desc["precision"], "past_key_values": desc["past_key_values"], "runtime": desc["runtime"],
               "exporter": desc["exporter"], "opset": desc["opset"],
               "fused_operators": desc.get("fused_operators", "not applied (--fuse to apply)"),
               "int8_operators": desc.get("int8", {})}
        return ran, {"max_abs_logit_diff_vs_pytorch": desc["max_abs_logit_diff_vs_pytorch"],
                     "parity": desc["parity"]}

    def write_peer(self, folder: Path, reference: Path, model: Any, tokenizer) -> dict[str, Any]:
        return self.write_int8(folder, model, tokenizer, form="standard")

    def speculative_target(self, path: Path) -> bool:
        """Whether the graph at `path` holds weight-only block-quantized matmuls (MatMulNBits) and no dynamic int8
        operator, whose one activation scale over every token of a run would make a token's logits depend on the
        others verified beside it."""
        counts = graph.int8_counts(Path(path) / graph.ONNX_FILE) if (Path(path) / graph.ONNX_FILE).is_file() else {}
        return "MatMulNBits" in counts and not set(counts) & set(graph.INT8_OPS)

    def quantized_layers(self, model: Any, path: Path | None = None) -> int:
        return runtime.quantized_layers(model)

    def computation(self, path: Path) -> str | None:
        """The graph's digest, and the speculative settings the loader applies (another computation per step)."""
        from effkit.engines import speculative

        digest, spec = graph.graph_digest(path), speculative.read_settings(Path(path))
        return f"{digest}+{spec['draft']}-k{spec['k']}" if digest and spec else digest

    def load_command(self, path: Path) -> str:
        """With the session options effkit timed it with (`runtime.session`): ONNX Runtime's defaults but the thread
        counts, which are written out so that a machine with another default runs what was measured."""
        import torch

        from effkit.engines import speculative

        line = (f"so = onnxruntime.SessionOptions(); so.intra_op_num_threads = {torch.get_num_threads()}; "
                f"so.inter_op_num_threads = 1; onnxruntime.InferenceSession('{Path(path) / graph.ONNX_FILE}', so, "
                "providers=['CPUExecutionProvider'])")
        if spec := speculative.read_settings(Path(path)):  # ONNX Runtime has no speculative decoding of its own
            line += (f"; greedy decoding with effkit's speculative loop ({spec['draft']} draft, k={spec['k']}, at "
                     f"batch 1): OnnxCausalLM('{path}').generate(ids, ...)")
        return line


ENGINE = OnnxRuntimeEngine()
