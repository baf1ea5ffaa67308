"""What the engines that convert a PyTorch GPT-2 share: the decoder step they export, the parity rule their
conversions are gated by, and the token picking of the decoding loops they run themselves.

- The with-past decoder step (`WithPast`): what the ONNX Runtime engine's export traces and the OpenVINO engine's
  PyTorch front end converts. Inputs `input_ids` (batch, seq), `attention_mask` (batch, past + seq; 1 = attend),
  `position_ids` (batch, seq) and `past_key_values.{i}.key` / `.value` (batch, heads, past, head_dim) for every
  layer (`past_names`); outputs `logits` (batch, seq, vocab) and `present.{i}.key` / `.value` (batch, heads,
  past + seq, head_dim) (`present_names`). It calls the model's own modules and writes out only the attention
  core, so the exporters never see transformers' masking code. Its LM head is its own transposed weight, so that
  a quantizer sees it as a plain matrix.
- The parity rule: the probe batches every conversion is checked on (`probe_ids`, seeded), the logit tolerance
  relative to the largest logit (`EXPORT_RTOL`) and the greedy tokens compared (`PARITY_TOKENS`); ONNX Runtime,
  OpenVINO and llama.cpp apply it (llama.cpp with its own tolerances).
- `quiet_exporter`: the exporters, quantizers and compressors print pages of notices; this keeps them off the
  console.
- Token picking in numpy for the engines that run their own decoding loop (ONNX Runtime's session, OpenVINO's
  infer request): `never_end`, `next_tokens`.

One engine never imports another: what two of them use lives here.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from effkit.errors import EffkitError

# max |logit difference| allowed between a converted graph and PyTorch, relative to max(1, max |PyTorch logit|):
# the rounding of fp32 kernels summing in another order grows with the logits' scale, so a trained model's logits
# need a relative bound where an absolute one refuses a faithful export, while an export error (a wrong position,
# mask or cache layout) moves logits by a tenth or more
EXPORT_RTOL = 1e-4
PARITY_TOKENS = 32  # greedy tokens compared between the converted graph, PyTorch with its cache and without


def past_names(n_layer: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]


def present_names(n_layer: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]


class WithPast(nn.Module):
    """What is exported: one decoder step over `input_ids` given the past keys and values (see the module doc),
    with the LM head as its own transposed weight."""

    def __init__(self, model: nn.Module):
        super().__init__()
        c = model.config
        if getattr(c, "reorder_and_upcast_attn", False):
            raise EffkitError("this GPT-2 uses reorder_and_upcast_attn, which effkit's ONNX export does not write")
        if model.lm_head.bias is not None:
            raise EffkitError("this model's LM head has a bias, which effkit's ONNX export does not handle")
        self.transformer = model.transformer
        self.head = nn.Parameter(model.lm_head.weight.detach().t().contiguous().clone(), requires_grad=False)
        self.n_head = c.n_head
        self.scales = [(1 / math.sqrt(c.n_embd // c.n_head) if c.scale_attn_weights else 1.0)
                       / (i + 1 if c.scale_attn_by_inverse_layer_idx else 1) for i in range(c.n_layer)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = self.transformer
        b, n = input_ids.shape
        x = t.wte(input_ids) + t.wpe(position_ids)
        p = past[0].shape[2]
        q_pos = torch.arange(n, device=x.device) + p
        k_pos = torch.arange(p + n, device=x.device)
        allowed = (k_pos[None, :] <= q_pos[:, None])[None] & attention_mask[:, None, :].bool()  # (b, n, p + n)
        bias = torch.where(allowed, 0.0, torch.finfo(x.dtype).min)[:, None]  # no -inf: a padded row stays finite
        presents = []
        for i, block in enumerate(t.h):
            qkv = block.attn.c_attn(block.ln_1(x))
            q, k, v = (z.view(b, n, self.n_head, -1).transpose(1, 2) for z in qkv.split(qkv.shape[-1] // 3, -1))
            k, v = torch.cat([past[2 * i], k], dim=2), torch.cat([past[2 * i + 1], v], dim=2)
            presents += [k, v]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scales[i])
            x = x + block.attn.c_proj(a.transpose(1, 2).reshape(b, n, -1))
            x = x + block.mlp(block.ln_2(x))
        return (t.ln_f(x) @ self.head, *presents)


@contextlib.contextmanager
def quiet_exporter():
    """The exporter and the quantizer print pages of notices (missing torchvision, pre-processing advice)."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript", "root", "",
             "onnxruntime.quantization.matmul_nbits_quantizer")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, lv in levels.items():
            logging.getLogger(n).setLevel(lv)


def probe_ids(vocab_size: int, shape: tuple[int, int] = (3, 24)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(0))


def never_end(logits: np.ndarray, eos: int | None) -> np.ndarray:
    """`logits` with end-of-text masked (a copy), as transformers' `min_new_tokens` does while tokens are owed."""
    if eos is None or not 0 <= eos < logits.shape[-1]:
        return logits
    logits = logits.copy()
    logits[..., eos] = -np.inf
    return logits


def next_tokens(logits: np.ndarray, do_sample: bool = False, top_k: int | None = None,
                temperature: float = 1.0) -> np.ndarray:
    """The next token of each row, (batch, 1) int64, from last-position `logits` (batch, vocab): greedy in numpy, or
    top-k / temperature sampling from torch's global generator. The decoding loops of the engines that run their own
    (ONNX Runtime, OpenVINO's infer request) share it. Greedy stays in numpy: a torch argmax over 12 x vocabulary
    runs on torch's threads, which wait for a core that ONNX Runtime's spinning threads hold."""
    if not do_sample:
        return logits.argmax(-1)[:, None].astype(np.int64)
    scores = torch.from_numpy(np.asarray(logits, dtype=np.float32)) / max(temperature, 1e-6)
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scores, -1), 1).numpy()
