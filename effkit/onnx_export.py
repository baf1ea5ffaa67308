"""ONNX artifacts: export with `torch.onnx.export(dynamo=True)`, int8 with ONNX Runtime's `quantize_dynamic`, and
`OnnxCausalLM`, which runs an ONNX artifact through an `onnxruntime.InferenceSession` behind the few methods
effkit's measurement code calls on a model (`model(ids).logits`, `generate`, `config`, `eval`).

The TorchScript exporter fails on transformers 5's masking code (`aten::diff`); the dynamo exporter works. The
exported graph maps `input_ids` (batch, seq; both dynamic, seq up to the context) to `logits`. Since it has no
padding mask, attention is exported as what it is, causal: an attention function that calls
`scaled_dot_product_attention(is_causal=True)` (registered with transformers' `AttentionInterface`; transformers
then builds no mask) becomes one ONNX `Attention` node per layer (opset 23) instead of a materialised mask and a
`Where` per layer. The LM head is
exported as its own (transposed) weight rather than tied to the token embedding, so that ONNX Runtime quantizes
it as a per-channel int8 `MatMulInteger` (a tied weight reaches the head through a `Transpose`, which the
quantizer leaves in fp32); the embedding lookup is quantized too (`Gather` on int8, one scale per tensor).

An ONNX artifact folder: `model.onnx`, `onnx.json` (what was exported and how), `config.json`, the tokenizer and
`effkit.json`. Generation with it recomputes the whole prefix for every new token: the graph is exported without
past key/values, and reports say so.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from effkit.errors import EffkitError

ONNX_FILE = "model.onnx"
ONNX_DESC = "onnx.json"
EXPORT_ATOL = 1e-4  # max |logit difference| allowed between the exported graph and PyTorch
OPSET = 23  # the first with the `Attention` operator (ONNX Runtime >= 1.23 runs it)
CAUSAL_ATTENTION = "effkit_causal"
INT8_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QGemm", "QAttention")
GENERATION_NOTE = ("ONNX artifact: exported without past key/values, so generation recomputes the whole prefix for "
                   "every new token (measured as it is)")


def onnx_unavailable() -> str | None:
    """None if ONNX export and ONNX Runtime can run here, else the reason."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return f"{type(e).__name__}: {str(e)[:100]}; pip install onnx onnxruntime onnxscript (effkit[quant])"
    return None


def require_onnx() -> None:
    if reason := onnx_unavailable():
        raise EffkitError(f"ONNX export needs onnx, onnxruntime and onnxscript: {reason}")


def is_onnx(path: str | Path) -> bool:
    return (Path(path) / ONNX_DESC).is_file()


def _causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_):
    """GPT-2 attention without a mask argument: causal by construction (what the exported graph computes)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _causal_attention_for(model: nn.Module):
    """Run `model` with `_causal_attention` (no mask built by transformers) while it is exported, where its
    attention is plain scaled dot-product (GPT-2's inverse-layer-index scaling and upcast reordering are not)."""
    from transformers import AttentionInterface

    cfg = model.config
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        yield
        return
    AttentionInterface.register(CAUSAL_ATTENTION, _causal_attention)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")} | {id(cfg): cfg}
    before = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = CAUSAL_ATTENTION
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = before[k]


class _LogitsOnly(nn.Module):
    """What is exported: input_ids -> logits, with the LM head as its own transposed weight (see the module doc)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.transformer = model.transformer
        head = model.lm_head
        if head.bias is not None:
            raise EffkitError("this model's LM head has a bias, which effkit's ONNX export does not handle")
        self.head = nn.Parameter(head.weight.detach().t().contiguous().clone(), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer(input_ids=input_ids, use_cache=False).last_hidden_state @ self.head


@contextlib.contextmanager
def _quiet_exporter():
    """The exporter and the quantizer print pages of notices (missing torchvision, pre-processing advice)."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript", "root", "")
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


@torch.no_grad()
def export_fp32(model: nn.Module, out: Path) -> dict[str, Any]:
    """Export `model` (effkit's Linear form, on the CPU, eval mode) to `out` and check that ONNX Runtime gives
    PyTorch's logits on a probe batch whose shape differs from the traced one (max difference <= EXPORT_ATOL)."""
    require_onnx()
    model = model.cpu().eval()
    n_pos = model.config.n_positions
    wrapper = _LogitsOnly(model).eval()
    example = probe_ids(model.config.vocab_size, (2, min(16, n_pos)))
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=n_pos)
    probe = probe_ids(model.config.vocab_size, (3, min(24, n_pos)))
    reference = wrapper(probe)  # with the model's own attention
    t0 = time.perf_counter()
    try:
        with _quiet_exporter(), _causal_attention_for(model):
            program = torch.onnx.export(wrapper, (example,), dynamo=True, optimize=True, verbose=False,
                                        opset_version=OPSET,
                                        input_names=["input_ids"], output_names=["logits"],
                                        dynamic_shapes={"input_ids": {0: batch, 1: seq}})
            program.save(str(out))
    except EffkitError:
        raise
    except Exception as e:  # noqa: BLE001 - the exporter raises many kinds; the user needs one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise EffkitError(f"ONNX cannot represent this model: {type(e).__name__}: {first[:200]}") from None
    seconds = time.perf_counter() - t0
    diff = float((torch.from_numpy(session(out).run(None, {"input_ids": probe.numpy()})[0]) - reference)
                 .abs().max())
    if not diff <= EXPORT_ATOL:
        raise EffkitError(f"the exported ONNX graph does not reproduce the model (max logit difference {diff:.2e} > "
                          f"{EXPORT_ATOL}); this model cannot be exported faithfully")
    import onnx

    graph = onnx.load(str(out), load_external_data=False)
    return {"exporter": f"torch.onnx.export(dynamo=True, optimize=True, opset_version={OPSET}), torch "
                        f"{torch.__version__}",
            "opset": max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")),
            "attention": (f"{sum(n.op_type == 'Attention' for n in graph.graph.node)} causal ONNX Attention nodes "
                          "(no mask input: the graph takes no padding mask)"),
            "export_seconds": seconds, "max_abs_logit_diff_vs_pytorch": diff,
            "inputs": "input_ids int64 (batch, seq), batch and seq dynamic (seq <= n_positions)",
            "outputs": "logits float32 (batch, seq, vocab)", "past_key_values": False,
            "lm_head": "exported as its own transposed weight (not tied to the embedding), so that it quantizes"}


def fuse(path: Path, config) -> dict[str, Any]:
    """ONNX Runtime's transformer graph fusions (`onnxruntime.transformers.optimizer`, model type gpt2), in place;
    returns the fused operator counts."""
    from onnxruntime.transformers.optimizer import optimize_model

    try:
        with _quiet_exporter():
            opt = optimize_model(str(path), model_type="gpt2", num_heads=config.n_head, hidden_size=config.n_embd)
            opt.save_model_to_file(str(path))
    except Exception as e:  # noqa: BLE001
        raise EffkitError(f"ONNX Runtime's transformer optimizer failed on this graph: {type(e).__name__}: "
                          f"{str(e)[:160]}; export without --fuse") from None
    return {k: v for k, v in opt.get_fused_operator_statistics().items() if v}


def quantize_int8(src: Path, dst: Path) -> dict[str, Any]:
    """ONNX Runtime dynamic int8: weights int8 per output channel for MatMul, per tensor for Gather (position
    embeddings); activations quantized at run time. Then the token embedding is re-tied to the int8 LM head
    (`tie_embedding_to_head`)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet_exporter():
        # the weight-bearing ops only: left to itself the quantizer turns ONNX `Attention` into com.microsoft's
        # `QAttention`, which rejects the `is_causal` attribute (an invalid graph)
        quantize_dynamic(str(src), str(dst), per_channel=True, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gemm", "Gather"])
    tied = tie_embedding_to_head(dst)
    return {"quantizer": "onnxruntime.quantization.quantize_dynamic(per_channel=True, weight_type=QInt8, "
                         "op_types_to_quantize=[MatMul, Gemm, Gather])",
            "token_embedding": tied, "int8": int8_counts(dst)}


def tie_embedding_to_head(path: Path) -> str:
    """Make the token-embedding lookup read the int8 LM head (`head_quantized`, (n_embd, vocab), one scale and zero
    point per token) instead of its own per-tensor int8 table, and drop that table: the tied weight is stored once,
    as in the PyTorch model, and each token's embedding gets its own scale. In place; returns what was done."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    head = {k: inits.get(f"head_{k}") for k in ("quantized", "scale", "zero_point")}
    if any(v is None for v in head.values()):
        return "own per-tensor int8 table (the LM head was not quantized per channel)"
    n_embd, vocab = head["quantized"].dims
    lookup = next((n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
                   and list(inits[n.input[0]].dims) == [vocab, n_embd]), None)
    dequant = next((n for n in graph.node if lookup is not None and n.op_type == "DequantizeLinear"
                    and n.input[0] == lookup.output[0]), None)
    if dequant is None:
        return "own per-tensor int8 table (no int8 token-embedding lookup found)"
    ids, out = lookup.input[1], dequant.output[0]
    p = "effkit_tied_embedding"
    graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{p}_axes"))
    new_nodes = [
        helper.make_node("Gather", ["head_quantized", ids], [f"{p}_q"], axis=1),  # (n_embd, B, T)
        helper.make_node("Transpose", [f"{p}_q"], [f"{p}_qt"], perm=[1, 2, 0]),  # (B, T, n_embd)
        helper.make_node("Cast", [f"{p}_qt"], [f"{p}_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", ["head_zero_point", ids], [f"{p}_zp"], axis=0),  # (B, T)
        helper.make_node("Cast", [f"{p}_zp"], [f"{p}_zpf"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [f"{p}_zpf", f"{p}_axes"], [f"{p}_zpu"]),
        helper.make_node("Sub", [f"{p}_f", f"{p}_zpu"], [f"{p}_c"]),
        helper.make_node("Gather", ["head_scale", ids], [f"{p}_s"], axis=0),
        helper.make_node("Unsqueeze", [f"{p}_s", f"{p}_axes"], [f"{p}_su"]),
        helper.make_node("Mul", [f"{p}_c", f"{p}_su"], [out]),
    ]
    nodes = list(graph.node)
    at = nodes.index(lookup)
    nodes = nodes[:at] + new_nodes + [n for n in nodes[at:] if n is not lookup and n is not dequant]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    for name in (lookup.input[0], *dequant.input[1:]):
        if name not in used and name in inits:
            graph.initializer.remove(inits[name])
    onnx.save(model, str(path))
    return "read from the int8 LM head (stored once, one scale per token), as the PyTorch model ties them"


def int8_counts(path: Path) -> dict[str, int]:
    """The int8 operators of an ONNX graph, read back from the file: integer matmuls, and lookups (Gather) whose
    table is an int8 initializer."""
    import onnx

    graph = onnx.load(str(path)).graph
    int8_inits = {i.name for i in graph.initializer if i.data_type == onnx.TensorProto.INT8}
    counts = Counter(n.op_type for n in graph.node if n.op_type in INT8_OPS)
    counts["Gather (int8 table)"] = sum(1 for n in graph.node if n.op_type == "Gather" and n.input[0] in int8_inits)
    counts["int8 initializers"] = len(int8_inits)
    return {k: v for k, v in counts.items() if v}


def int8_layers(counts: dict[str, int]) -> int:
    """Weight-bearing int8 operators (integer matmuls and int8 lookups) in `int8_counts`."""
    return sum(v for k, v in counts.items() if k in INT8_OPS or k.startswith("Gather"))


def session(path: Path):
    """An ONNX Runtime CPU session with as many intra-op threads as torch uses, whose idle threads do not spin (so
    comparisons with the models timed beside it are fair)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # ONNX Runtime's idle threads spin-wait after each run by default, taking the cores from whatever runs next;
    # in interleaved timing that is the next contender, so effkit's sessions yield instead
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise EffkitError(f"ONNX Runtime cannot open {path}: {type(e).__name__}: {str(e)[:160]}; export the "
                          "parent again") from None


class OnnxCausalLM(nn.Module):
    """An ONNX artifact behind the interface effkit's measurement code uses: `model(ids).logits` (a torch tensor),
    `generate(...)` (greedy or top-k sampling, prefix recomputed each token), `config`, `eval()`. It holds no
    PyTorch parameters: `n_params` gives the parent's parameter count."""

    generation_note = GENERATION_NOTE
    compilable = False  # torch.compile has nothing to do: ONNX Runtime optimizes the graph

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import GPT2Config

        path = Path(path)
        require_onnx()
        try:
            self.description = json.loads((path / ONNX_DESC).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise EffkitError(f"{path / ONNX_DESC} is unreadable ({type(e).__name__}); export the parent again") \
                from None
        if not (path / ONNX_FILE).is_file():
            raise EffkitError(f"{path} has no {ONNX_FILE}; export the parent again")
        self.config = GPT2Config.from_pretrained(path)
        self.n_params = int(self.description.get("params", 0))
        self.session = session(path / ONNX_FILE)
        self.path = path

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        if input_ids.shape[-1] > self.config.n_positions:
            raise EffkitError(f"{input_ids.shape[-1]} tokens exceed the model's context ({self.config.n_positions})")
        logits = self.session.run(None, {"input_ids": input_ids.detach().cpu().long().numpy()})[0]
        return SimpleNamespace(logits=torch.from_numpy(logits))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, **_: Any) -> torch.Tensor:
        """Exactly `max_new_tokens` new tokens (never stops early, like effkit's `min_new_tokens` calls), the
        whole prefix recomputed each step; sampling draws from torch's global generator (seed it first)."""
        ids = input_ids.cpu()
        if streamer is not None:
            streamer.put(ids)
        for _ in range(max_new_tokens):
            logits = self(ids).logits[:, -1, :].float()
            if do_sample:
                logits = logits / max(temperature, 1e-6)
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if streamer is not None:
                streamer.put(nxt)
        if streamer is not None:
            streamer.end()
        return ids


def write_artifact(folder: Path, model: nn.Module, tokenizer, int8: bool, fused: bool) -> dict[str, Any]:
    """Export `model` into `folder` (fp32, or ONNX Runtime int8 with `int8`; ORT's fusions first with `fused`),
    with its config and tokenizer; returns the description written to `onnx.json`."""
    model.config.use_cache = True  # how a Hugging Face folder is usually saved
    model.config.save_pretrained(folder)
    model.config.use_cache = False
    tokenizer.save_pretrained(folder)
    fp32 = folder / ("fp32.onnx" if int8 else ONNX_FILE)
    desc: dict[str, Any] = {"format": "onnx", "precision": "int8 (dynamic)" if int8 else "fp32",
                            "params": sum(p.numel() for p in model.parameters()), **export_fp32(model, fp32)}
    if fused:
        desc["fused_operators"] = fuse(fp32, model.config)
    if int8:
        desc.update(quantize_int8(fp32, folder / ONNX_FILE))
        fp32.unlink()
        for extra in fp32.parent.glob(fp32.name + "*"):  # external-data side files, if any
            extra.unlink()
        if not int8_layers(desc["int8"]):
            raise EffkitError("ONNX Runtime's quantizer left no int8 operator in the graph; nothing was quantized")
    desc["runtime"] = ("onnxruntime.InferenceSession, CPUExecutionProvider, intra-op threads = torch threads, no "
                       "spin-waiting")
    desc["generation"] = GENERATION_NOTE
    (folder / ONNX_DESC).write_text(json.dumps(desc, indent=2))
    return desc
