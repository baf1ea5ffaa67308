"""The gate an OpenVINO conversion passes before anything is written: the fp32 graph, compiled with f32 inference and
an f32 KV cache, reproduces PyTorch's logits within `EXPORT_RTOL` of the largest logit on a probe batch and PyTorch's
greedy tokens with its cache (the ONNX export's rule, shared in `effkit.engines.decoder_step`). Compressed weights and
bf16 inference change the numbers by design: their loss is measured by the bench like every other artifact's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from effkit.engines.decoder_step import EXPORT_RTOL, PARITY_TOKENS, probe_ids
from effkit.engines.openvino.runtime import OpenVINOCausalLM
from effkit.errors import EffkitError


@torch.no_grad()
def parity_gate(model: nn.Module, folder: Path) -> dict[str, Any]:
    """The gate of an fp32 conversion, compiled with f32 inference and an f32 KV cache: logits within EXPORT_RTOL x
    max(1, max |logit|) of PyTorch's on a (3, 24) probe batch, and PARITY_TOKENS greedy tokens of effkit's loop over
    the stateful graph equal to PyTorch's with its cache."""
    ov_model = OpenVINOCausalLM(folder, precision="f32", kv_cache="f32")  # the conversion, not the u8 cache
    c = model.config
    probe = probe_ids(c.vocab_size, (3, min(24, c.n_positions)))
    reference = model(probe).logits
    diff = float((ov_model(probe).logits - reference).abs().max())
    allowed = EXPORT_RTOL * max(1.0, float(reference.abs().max()))
    if not diff <= allowed:
        raise EffkitError(f"the converted OpenVINO model does not reproduce the model (max logit difference "
                          f"{diff:.2e} > {allowed:.2e}); this model cannot be converted faithfully")
    prompt = probe_ids(c.vocab_size, (1, min(8, c.n_positions // 2)))
    new = min(PARITY_TOKENS, c.n_positions - prompt.shape[1])
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    ours = torch.from_numpy(ov_model.loop_generate(prompt.numpy(), new, new))
    cached = model.generate(prompt, use_cache=True, **kw)
    if not torch.equal(ours, cached):
        raise EffkitError("the converted OpenVINO model's greedy tokens with its internal KV cache differ from "
                          "PyTorch's; this model cannot be converted faithfully")
    return {"max_abs_logit_diff": diff, "max_abs_logit_diff_allowed": allowed, "greedy_tokens_equal": new,
            "how": f"fp32 weights compiled with f32 inference and an f32 KV cache: logits of a (3, {probe.shape[1]}) "
                   f"probe batch within {allowed:.2e} of PyTorch's ({EXPORT_RTOL} of the largest logit's magnitude); "
                   f"{new} greedy tokens with OpenVINO's internal KV cache equal PyTorch's with its cache"}
