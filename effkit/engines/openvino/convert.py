"""OpenVINO conversion: the model converted by OpenVINO's own PyTorch front end (`openvino.convert_model`) into the
stateful layout `optimum-cli export openvino` writes for a decoder, optionally with NNCF's weight compression
(`compress`), and the artifact folder around it (`write_artifact`).

The converted graph is the with-past step effkit exports to ONNX (`engines.decoder_step.WithPast`: inputs
`input_ids`, `attention_mask`, `position_ids`, the past keys and values; outputs `logits` and the presents), then made
stateful as optimum-intel does for its text-generation exports (`optimum.exporters.openvino.stateful`): a `beam_idx`
input gathers the cache rows, and the keys and values become the model's internal state
(`apply_make_stateful_transformation`), so the inputs are `input_ids`, `attention_mask`, `position_ids`, `beam_idx`
and the output `logits`, which `openvino_genai.LLMPipeline` and `optimum.intel.OVModelForCausalLM` both run. The
folder also holds OpenVINO's tokenizer and detokenizer models (`openvino_tokenizers`, which LLMPipeline needs), the
Hugging Face config, generation config and tokenizer, `openvino.json` (how it was written, what it runs with, where
each of those settings travels: `settings.record`) and `effkit.json`. Nothing is written unless the fp32 conversion
passes the parity gate (`check_parity`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines import as_exported
from effkit.engines.decoder_step import WithPast, past_names, present_names, probe_ids, quiet_exporter
from effkit.engines.openvino.compress import DATA_AWARE, WEIGHTS, compress, int4_group_size, weight_types
from effkit.engines.openvino.runtime import OpenVINOCausalLM
from effkit.engines.openvino.settings import (
    EFFKIT_RUNTIME_OPTIONS,
    OV_DESC,
    OV_MODEL,
    plain_compile_settings,
    record,
)
from effkit.engines.openvino.tokenizer import write_tokenizer_models
from effkit.engines.shared import load_or_fail, parity_gate, save_config_and_tokenizer
from effkit.errors import EffkitError


def _stateful(om, n_layer: int, n_head: int, head_dim: int) -> None:
    """Hide the past keys and values inside `om` as state, as optimum-intel's `patch_stateful_decoder` does: a
    `beam_idx` input gathers the cache's rows, the state starts empty (batch from `input_ids`, length 0)."""
    import openvino as ov
    from openvino import opset13
    from openvino._offline_transformations import apply_make_stateful_transformation

    past, present = past_names(n_layer), present_names(n_layer)
    for name in past:  # the head dimension static: the state's initial shape is read from the input's
        om.input(name).get_node().set_partial_shape(ov.PartialShape([-1, n_head, -1, head_dim]))
    om.validate_nodes_and_infer_types()
    beam = opset13.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam.output(0).get_tensor().add_names({"beam_idx"})
    om.add_parameters([beam])
    for name in past:
        port = om.input(name)
        consumers = port.get_target_inputs()
        gathered = opset13.gather(port, beam, opset13.constant(0))
        for c in consumers:
            c.replace_source_output(gathered.output(0))
    om.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(om, dict(zip(past, present, strict=True)))
    ids = om.input("input_ids")
    batch = opset13.gather(opset13.shape_of(ids, output_type="i64"), opset13.constant([0]), opset13.constant(0))
    for op in om.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.min_length for d in list(op.get_output_partial_shape(0))]
            dims[0] = batch
            dims = [opset13.constant(np.array([d], dtype=np.int64)) if isinstance(d, int) else d for d in dims]
            zeros = opset13.broadcast(opset13.constant(0.0, dtype=op.get_output_element_type(0)),
                                      opset13.concat(dims, axis=0))
            op.set_arguments([zeros])
    om.validate_nodes_and_infer_types()


@torch.no_grad()
def convert(model: nn.Module):
    """`model` (effkit's or Hugging Face's GPT-2, CPU, eval) as a stateful OpenVINO model (fp32 weights)."""
    import openvino as ov

    model = model.cpu().eval()
    c = model.config
    wrapper = WithPast(model).eval()
    b, n, p = 2, min(5, c.n_positions - 3), 3
    head_dim = c.n_embd // c.n_head
    example = (probe_ids(c.vocab_size, (b, n)), torch.ones(b, p + n, dtype=torch.long),
               torch.arange(p, p + n).expand(b, n).contiguous(),
               *(torch.zeros(b, c.n_head, p, head_dim) for _ in past_names(c.n_layer)))
    with load_or_fail("OpenVINO cannot convert this model"):  # the converter raises many kinds
        with quiet_exporter():
            om = ov.convert_model(wrapper, example_input=example)
        for port, name in zip(om.inputs, ["input_ids", "attention_mask", "position_ids", *past_names(c.n_layer)],
                              strict=True):
            port.get_tensor().set_names({name})
        for port, name in zip(om.outputs, ["logits", *present_names(c.n_layer)], strict=True):
            port.get_tensor().set_names({name})
        _stateful(om, c.n_layer, c.n_head, head_dim)
    return om



def write_artifact(folder: Path, model: nn.Module, tokenizer, weights: str = "fp32", precision: str = "default",
                   runtime_options: dict[str, str] | None = None, precision_how: str = "",
                   peer: bool = False, calibration: tuple[np.ndarray, dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """Convert `model` into `folder`: the stateful IR (weights as `weights`; `runtime_options` stored in it, effkit's
    own by default), the tokenizer models and files, the configs, and `openvino.json`, which says how it was
    written and what it runs with (`record`). `precision`: bf16, f32, or "default", the CPU plug-in's own choice,
    pinned to what it picks here unless `peer` (the peer runs as its users run it). `calibration`: a data-aware
    format's (training blocks, what to record of them: their split, count, indices). Refused unless the fp32
    conversion passes the parity gate."""
    import openvino as ov

    if weights not in WEIGHTS:
        raise EffkitError(f"unknown OpenVINO weight format {weights!r}; choose one of {', '.join(WEIGHTS)}")
    if (weights in DATA_AWARE) != (calibration is not None):
        raise EffkitError(f"OpenVINO weight format {weights}: calibration blocks are given to the data-aware "
                          f"formats ({', '.join(sorted(DATA_AWARE))}) and to no other")
    group = int4_group_size(model, weights) if weights.startswith("int4") else 128  # before the conversion: one line
    if runtime_options is None:
        runtime_options = EFFKIT_RUNTIME_OPTIONS
    if precision == "default" and not peer:
        precision = plain_compile_settings()["INFERENCE_PRECISION_HINT"]
        precision_how = precision_how or (f"the CPU plug-in's default on the CPU that measured it (OpenVINO "
                                          f"{ov.__version__}), pinned; not chosen by measurement")
    with as_exported(model) as m:  # read, not copied, where it is on the CPU in fp32
        return _write_artifact(folder, m, tokenizer, weights, precision, runtime_options, precision_how, peer,
                               calibration, group)


def _write_artifact(folder: Path, model: nn.Module, tokenizer, weights: str, precision: str,
                    runtime_options: dict[str, str], precision_how: str, peer: bool,
                    calibration: tuple[np.ndarray, dict[str, Any]] | None, group: int) -> dict[str, Any]:
    import openvino as ov

    t0 = time.perf_counter()
    om = convert(model)
    seconds = time.perf_counter() - t0
    stored = dict(runtime_options or {})
    if precision in ("bf16", "f32"):
        stored["INFERENCE_PRECISION_HINT"] = precision
    for name, value in stored.items():
        om.set_rt_info(value, ["runtime_options", name])
    save_config_and_tokenizer(folder, model, tokenizer, generation_config=True)
    ov.save_model(om, str(folder / OV_MODEL), compress_to_fp16=False)
    desc: dict[str, Any] = {"format": "openvino", "weights": weights, "inference_precision": precision,
                            "precision_how": precision_how, "params": sum(p.numel() for p in model.parameters()),
                            "converter": f"openvino.convert_model (PyTorch front end), OpenVINO {ov.__version__}, "
                                         "made stateful as optimum-intel's patch_stateful_decoder",
                            "convert_seconds": seconds, "runtime_options": dict(runtime_options or {}),
                            "threads": torch.get_num_threads(), **({"peer": True} if peer else {})}
    (folder / OV_DESC).write_text(json.dumps(desc, indent=2))  # the loader needs it for the gate
    desc["parity"] = check_parity(model, folder)
    if weights != "fp32":
        desc.update(compress(om, weights, calibration[0] if calibration else None, group))
        if calibration:
            desc["weight_compression"]["data"] = calibration[1]
        ov.save_model(om, str(folder / OV_MODEL), compress_to_fp16=False)
    desc["weight_types"] = weight_types(om)
    del om
    desc["tokenizer_models"] = write_tokenizer_models(folder, tokenizer)
    return record(folder, desc)


def check_parity(model: nn.Module, folder: Path) -> dict[str, Any]:
    """The conversion's gate (`shared.parity_gate`), the fp32 graph in `folder` compiled with f32 inference and an
    f32 KV cache (the conversion, not the plug-in's u8 cache): logits within EXPORT_RTOL of the largest logit, and
    effkit's greedy loop over the stateful graph equal to PyTorch's with its cache. Compressed weights and bf16
    inference change the numbers by design: their loss is measured by the bench like every other artifact's."""
    ov_model = OpenVINOCausalLM(folder, precision="f32", kv_cache="f32")
    return parity_gate(model, lambda probe: ov_model(probe).logits,
                       lambda prompt, new: ov_model.loop_generate(prompt, new, new), "the converted OpenVINO model",
                       "with OpenVINO's internal KV cache equal PyTorch's with its cache", verb="converted",
                       how_prefix="fp32 weights compiled with f32 inference and an f32 KV cache: ")
