"""`effkit quantize`: int8 through one of several backends, behind one interface.

Backends: `dynamic` (PyTorch dynamic int8, per-channel weights, fbgemm/onednn kernels), `bnb` (bitsandbytes
LLM.int8 `Linear8bitLt`, with its outlier threshold), `torchao` (int8 dynamic-activation + int8-weight, or
int8 weight-only with `--torchao-scheme w8`), `onnxruntime` (the model exported to ONNX and quantized by ONNX
Runtime, `effkit.onnx_export`). `auto` builds every backend that runs here, keeps those within 1% of the parent's
held-out loss, and picks the fastest at batch 12.

Every artifact is written first and then reloaded from its folder alone; the reloaded model is the one measured,
and the report counts the int8 layers it really holds. Formats, none of them pickled:
- `bnb`: transformers' own bitsandbytes serialization (`quantization_config` in `config.json`, int8 weights in
  `model.safetensors`): plain `AutoModelForCausalLM.from_pretrained(path)` loads it.
- `onnxruntime`: `model.onnx` (int8 operators), loadable by any ONNX Runtime.
- `dynamic`, `torchao`: effkit's format, loadable by effkit only (`load_quantized`): per-output-row symmetric
  int8 weights plus fp32 scales in safetensors, next to `quantization.json` (backend, scheme, layer names). At
  quantize time the weights are first rounded to exactly those int8 values; reloading dequantizes them and applies
  the same backend again, which reproduces the measured model. transformers has no serialization for them that
  plain `from_pretrained` would load into GPT-2 (see PORTABILITY).
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from effkit import artifacts, metrics, onnx_export, stats
from effkit.config import DataConfig, QuantizeConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.model import conv1d_to_linear, load_model
from effkit.parallel import init_runtime
from effkit.report import write_stage_report

QUANT_FILE = "quantization.json"
WEIGHTS_FILE = "quantized.safetensors"
PROMPT = metrics.GENERATION_PROMPT
AUTO_LOSS_BUDGET = 0.01  # `auto` considers backends whose held-out loss is within 1% of the parent's
PORTABILITY = {
    "bnb": "portable: plain transformers AutoModelForCausalLM.from_pretrained(path) loads it (bitsandbytes "
           "installed): transformers' bitsandbytes serialization",
    "onnxruntime": "portable: any ONNX Runtime loads model.onnx (onnxruntime.InferenceSession)",
    "dynamic": "effkit only (effkit.quantize.load_quantized): PyTorch dynamic int8 modules have no transformers "
               "serialization",
    "torchao": "effkit only (effkit.quantize.load_quantized): transformers 5's torchao integration quantizes only "
               "nn.Linear, and GPT-2's saved layers are Conv1D, so a plain from_pretrained would quantize nothing",
}


# ------------------------------------------------------------------------------------------------ int8 storage

def quant_targets(model: nn.Module, include_head: bool) -> list[str]:
    names = [f"transformer.h.{n}" for n, m in model.transformer.h.named_modules() if isinstance(m, nn.Linear)]
    return names + (["lm_head"] if include_head else [])


def int8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.squeeze(1).float()


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


# ------------------------------------------------------------------------------------------------ backends

def backend_available(backend: str, device: torch.device | None = None) -> str | None:
    """None if the backend can run here (on `device`, default the CPU), else the reason it cannot."""
    if backend == "dynamic" and device is not None and device.type != "cpu":
        return "PyTorch dynamic int8 runs on the CPU only; use --device cpu, or bnb / torchao on the GPU"
    if backend == "dynamic":
        engines = torch.backends.quantized.supported_engines
        return None if any(e in engines for e in ("fbgemm", "x86", "onednn", "qnnpack")) else \
            f"no quantized engine in this torch build ({engines})"
    if backend == "bnb":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: not available
            return f"bitsandbytes does not import ({type(e).__name__}: {str(e)[:100]}); pip install bitsandbytes"
        return None
    if backend == "torchao":
        try:
            import torchao.quantization  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"torchao does not import ({type(e).__name__}: {str(e)[:100]}); pip install torchao"
        return None
    if backend == "onnxruntime":
        if device is not None and device.type != "cpu":
            return "effkit runs ONNX artifacts on the CPU only (CPUExecutionProvider); use --device cpu"
        return onnx_export.onnx_unavailable()
    return f"unknown backend {backend}"


def apply_backend(model: nn.Module, names: list[str], backend: str, threshold: float = 6.0,
                  torchao_scheme: str = "da8w8") -> nn.Module:
    """Replace the Linear layers `names` of `model` with the backend's int8 modules (in place)."""
    import warnings

    if backend == "dynamic":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantize_dynamic is deprecated, and still the fastest CPU int8 path
            return quantize_dynamic(model, {n: per_channel_dynamic_qconfig for n in names}, dtype=torch.qint8,
                                    inplace=True)
    if backend == "torchao":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

        config = Int8DynamicActivationInt8WeightConfig() if torchao_scheme == "da8w8" else Int8WeightOnlyConfig()
        targets = set(names)
        if "lm_head" in targets:  # a quantized head cannot stay tied to the embedding
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        quantize_(model, config, filter_fn=lambda m, fqn: fqn in targets)
        return model
    if backend == "bnb":
        import bitsandbytes as bnb

        for name in names:
            lin = _module(model, name)
            q = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                    has_fp16_weights=False, threshold=threshold)
            q.weight = bnb.nn.Int8Params(lin.weight.detach().clone(), requires_grad=False, has_fp16_weights=False)
            if lin.bias is not None:
                q.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
            q = q.to(lin.weight.device)  # the move quantizes the weight row-wise
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, q)
        return model
    raise EffkitError(f"unknown backend {backend}")


# ------------------------------------------------------------------------------------------------ save / load

@torch.no_grad()
def fake_quantize(model: nn.Module, names: list[str], include_head: bool) -> dict[str, torch.Tensor]:
    """Round the target weights to per-row int8 in place; return the int8 tensors and scales to store."""
    stored = {}
    for name in names + (["transformer.wte"] if include_head else []):
        w = _module(model, name).weight
        q, s = int8_rowwise(w.float())
        w.copy_((q.float() * s.unsqueeze(1)).to(w.dtype))
        stored[f"{name}.weight.int8"], stored[f"{name}.weight.scale"] = q, s
    return stored


def save_quantized(folder: Path, model_fp: nn.Module, stored: dict[str, torch.Tensor], include_head: bool,
                   names: list[str], tokenizer) -> None:
    """effkit's format: the int8 tensors and scales, and the rest of the (fake-quantized) fp32 weights."""
    skip = {f"{n}.weight" for n in names} | ({"transformer.wte.weight", "lm_head.weight"} if include_head else set())
    rest = {k: v.detach().cpu().contiguous() for k, v in model_fp.state_dict().items()
            if k not in skip and k != "lm_head.weight"}  # the LM head is tied to the embedding
    save_file({**rest, **{k: v.cpu().contiguous() for k, v in stored.items()}}, folder / WEIGHTS_FILE)
    model_fp.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_quantized(folder: Path, backend: str, parent: nn.Module, source: Path, tokenizer, cfg: QuantizeConfig,
                    device: torch.device) -> dict[str, Any]:
    """Write the `backend` int8 artifact of `parent` (loaded from the artifact `source`) into `folder`; returns
    its description, also written to `quantization.json`."""
    desc: dict[str, Any] = {"backend": backend, "include_head": cfg.include_head, "threshold": cfg.threshold,
                            "torchao_scheme": cfg.torchao_scheme, "portability": PORTABILITY[backend]}
    if backend in ("dynamic", "torchao"):
        names = quant_targets(parent, cfg.include_head)
        model = copy.deepcopy(parent)
        stored = fake_quantize(model, names, cfg.include_head)
        save_quantized(folder, model, stored, cfg.include_head, names, tokenizer)
        desc.update(format="effkit", storage="per-output-row symmetric int8 + fp32 scales (safetensors)")
    elif backend == "bnb":
        if cfg.include_head:
            raise EffkitError("--include-head with bnb: transformers' bitsandbytes format keeps the tied LM head in "
                              "fp32; drop --include-head, or use --backend dynamic or onnxruntime")
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        try:
            model = AutoModelForCausalLM.from_pretrained(
                source, use_safetensors=True, device_map="cpu" if device.type == "cpu" else str(device),
                quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=cfg.threshold))
        except Exception as e:  # noqa: BLE001
            raise EffkitError(f"bitsandbytes could not quantize {source}: {type(e).__name__}: {str(e)[:160]}") from None
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        names = [n for n, m in model.named_modules() if type(m).__name__ == "Linear8bitLt"]
        desc.update(format="transformers-bitsandbytes", storage="transformers' bitsandbytes 8-bit serialization: "
                    "int8 weights and their scales in model.safetensors, quantization_config in config.json")
    elif backend == "onnxruntime":
        onnx = onnx_export.write_artifact(folder, copy.deepcopy(parent).cpu(), tokenizer, int8=True,
                                          fused=cfg.fuse)
        names = sorted(onnx["int8"])
        desc.update(format="onnx", include_head=True, storage="ONNX graph with int8 operators (model.onnx); "
                    "ONNX Runtime quantizes every MatMul (per channel) and the embedding lookups (per tensor), "
                    "the LM head included", onnx=onnx)
    else:
        raise EffkitError(f"unknown backend {backend}")
    desc["layers"] = names
    (folder / QUANT_FILE).write_text(json.dumps(desc, indent=2))
    return desc


def int8_layer_count(model: nn.Module) -> int:
    """The int8 layers a (reloaded) model really holds: PyTorch dynamic quantized Linear, bitsandbytes
    Linear8bitLt with int8 weights, Linear layers whose weight is a torchao quantized tensor, or the int8
    operators of an ONNX graph."""
    if isinstance(model, onnx_export.OnnxCausalLM):
        return onnx_export.int8_layers(onnx_export.int8_counts(model.path / onnx_export.ONNX_FILE))
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    n = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, DynamicLinear) or (type(m).__name__ == "Linear8bitLt" and weight.dtype == torch.int8) or (
                isinstance(m, nn.Linear) and type(weight).__module__.startswith("torchao")):
            n += 1
    return n


def is_quantized(path: str | Path) -> bool:
    return (Path(path) / QUANT_FILE).is_file()


def load_quantized(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """Rebuild a quantized artifact on `device` (default the CPU) from its folder alone: through transformers
    (bnb), ONNX Runtime (onnxruntime), or by dequantizing the stored int8 weights and applying the same backend
    again (effkit's format)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = Path(path)
    device = device or torch.device("cpu")
    try:
        desc = json.loads((path / QUANT_FILE).read_text())
        desc["backend"], desc["layers"]  # noqa: B018 - the keys every description has
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise EffkitError(f"{path / QUANT_FILE} is corrupt ({type(e).__name__}); quantize the parent again") from None
    reason = backend_available(desc["backend"], device)
    if reason:
        raise EffkitError(f"{path} was quantized with {desc['backend']}, which cannot run here: {reason}")
    fmt = desc.get("format", "effkit")
    if fmt == "onnx":
        return onnx_export.OnnxCausalLM(path)
    if fmt == "transformers-bitsandbytes":
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True,
                                                         device_map="cpu" if device.type == "cpu" else str(device))
        except Exception as e:  # noqa: BLE001
            raise EffkitError(f"{path} does not load through transformers ({type(e).__name__}: {str(e)[:120]}); "
                              "quantize the parent again") from None
        model.eval().config.use_cache = False
        return model
    config = GPT2Config.from_pretrained(path)
    config._attn_implementation = "sdpa"
    model = conv1d_to_linear(GPT2LMHeadModel(config))
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise EffkitError(f"{path / WEIGHTS_FILE} is unreadable or truncated ({type(e).__name__}); quantize the "
                          "parent again") from None
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith(".weight.int8")]:
            name = key.removesuffix(".weight.int8")
            w = tensors.pop(key).float() * tensors.pop(f"{name}.weight.scale").unsqueeze(1)
            tensors[f"{name}.weight"] = w
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise EffkitError(f"{path} does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    model.eval().to(device)
    model.config.use_cache = False
    return apply_backend(model, desc["layers"], desc["backend"], desc.get("threshold", 6.0),
                         desc.get("torchao_scheme", "da8w8"))


def load_any(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """Any effkit artifact on `device` (default the CPU): quantized ones through their description, ONNX ones
    through ONNX Runtime, others through transformers."""
    device = device or torch.device("cpu")
    if is_quantized(path):
        return load_quantized(path, device)
    if onnx_export.is_onnx(path):
        if device.type != "cpu":
            raise EffkitError(f"{path} is an ONNX artifact, which effkit runs on the CPU only; use --device cpu")
        return onnx_export.OnnxCausalLM(path)
    return load_model(str(path)).to(device)


def cannot_run_on(path: str | Path, device: torch.device) -> str | None:
    """Why an artifact cannot run on `device` (None if it can): ONNX artifacts run on the CPU only, and an int8
    artifact needs its backend on that device."""
    if is_quantized(path):
        try:
            backend = json.loads((Path(path) / QUANT_FILE).read_text())["backend"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, OSError):
            return None  # loading it says what is wrong
        return backend_available(backend, device)
    if onnx_export.is_onnx(path) and device.type != "cpu":
        return "effkit runs ONNX artifacts on the CPU only; bench them with --device cpu"
    return None


def trainable(path: str | Path) -> bool:
    """Whether an artifact can be trained (and so timed training): dense and pruned PyTorch ones."""
    return not is_quantized(path) and not onnx_export.is_onnx(path)


# ------------------------------------------------------------------------------------------------ measurement

def generate_sample(model: nn.Module, tokenizer, max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation with the KV cache from a fixed prompt (capped at the model's context), and a seeded
    top-k / temperature sample beside it: the texts, and how much of the greedy text repeats itself. Speed is
    measured apart, interleaved with the model it is compared with (`metrics.generation_timer`)."""
    new, note = metrics.generation_budget(model, tokenizer, max_new_tokens)
    ids, _ = metrics.greedy_generate(model, tokenizer, new)
    sampled = metrics.sampled_generate(model, tokenizer, new)
    s = metrics.SAMPLING
    return {"prompt": PROMPT, "text": tokenizer.decode(ids), "new_tokens": len(ids),
            "greedy_repeated_fraction": metrics.repeated_fraction(ids.tolist()),
            "sampled_text": tokenizer.decode(sampled),
            "sampling": f"top-k {s['top_k']}, temperature {s['temperature']}, seed {s['seed']}",
            **({"note": "; ".join(notes)} if (notes := [n for n in (note, getattr(model, "generation_note", None))
                                                         if n]) else {})}


def side_by_side(contenders: dict[str, tuple[nn.Module, torch.dtype | None]], block: int, rounds: int,
                 repeats: int) -> dict[str, dict[str, list[list[float]]]]:
    """Forward latency of every contender (a model and its autocast dtype) at batch 1 and 12, interleaved."""
    return {f"b{b}": metrics.interleaved({name: metrics.forward_timer(m, b, block, dtype)
                                          for name, (m, dtype) in contenders.items()}, rounds, repeats, warmup=2)
            for b in (1, 12)}


# ------------------------------------------------------------------------------------------------ the stage

def newest_artifact(runs_dir: str, quantized: bool = False) -> Path:
    """The newest artifact of the latest run (quantized ones only if `quantized`)."""
    run = artifacts.latest_run(Path(runs_dir))
    found = []
    for d in run.iterdir():
        if (d / artifacts.META).is_file() and (quantized or not is_quantized(d)):
            found.append((artifacts.read_meta(d).get("time", ""), d))
    if not found:
        raise EffkitError(f"no artifact in {run}; run `effkit train` first or pass --from PATH")
    return max(found)[1]


def run_quantize(cfg: QuantizeConfig) -> dict[str, Any]:
    cfg = cfg.validate()
    device = init_runtime(cfg.device).device
    source = Path(cfg.source) if cfg.source else newest_artifact(cfg.runs_dir)
    if not source.exists():
        raise EffkitError(f"artifact {source} does not exist; pass --from PATH to an effkit artifact folder")
    meta = artifacts.read_meta(source)
    if meta["stage"] == "quantize" or is_quantized(source):
        raise EffkitError(f"{source} is already quantized; quantize its parent ({meta.get('parent')}) instead")
    if onnx_export.is_onnx(source):
        raise EffkitError(f"{source} is an ONNX artifact; quantize its parent ({meta.get('parent')}), with "
                          "--backend onnxruntime for ONNX int8")
    if cfg.backend != "auto" and (reason := backend_available(cfg.backend, device)):
        raise EffkitError(f"--backend {cfg.backend} cannot run here: {reason}")
    if cfg.backend == "bnb" and cfg.include_head:
        raise EffkitError("--include-head with bnb: transformers' bitsandbytes format keeps the tied LM head in "
                          "fp32; drop --include-head, or use --backend dynamic or onnxruntime")
    run_dir = Path(cfg.runs_dir) / artifacts.run_of(source)  # inside the runs folder, wherever --from points
    with artifacts.run_lock(run_dir):
        return _quantize(cfg, device, source, run_dir)


def quantize_tag(backend: str, cfg: QuantizeConfig, source: Path) -> str:
    """`quantize-dynamic` for the dense model; `prune-row-r2+quantize-dynamic` for a pruned one (a run can hold
    both)."""
    tag = (f"quantize-{backend}" + (f"-{cfg.torchao_scheme}" if backend == "torchao" else "")
           + ("-head" if cfg.include_head and backend != "onnxruntime" else ""))
    return f"{source.name}+{tag}" if artifacts.read_meta(source)["stage"] == "prune" else tag


def pick_backend(cfg: QuantizeConfig, device: torch.device, parent: nn.Module, source: Path, tokenizer,
                 eval_blocks: torch.Tensor, block: int, parent_blocks: list[float],
                 scratch: Path) -> tuple[str, dict]:
    """`--backend auto`: write every backend that runs here into `scratch/<backend>` and reload it, keep those
    within AUTO_LOSS_BUDGET of the parent's held-out loss (`parent_blocks`: its per-block losses, for a paired
    delta), time them with the parent interleaved at batch 12, and pick the lowest median. The winner's folder is
    left in `scratch` for the caller to move into place."""
    table: dict[str, dict[str, Any]] = {}
    candidates: dict[str, nn.Module] = {}
    for b in ("dynamic", "torchao", "bnb", "onnxruntime"):
        if reason := backend_available(b, device):
            table[b] = {"status": f"not run: {reason}"}
            continue
        if b == "bnb" and cfg.include_head:
            table[b] = {"status": "not run: transformers' bitsandbytes format keeps the tied head in fp32"}
            continue
        (scratch / b).mkdir()
        try:
            write_quantized(scratch / b, b, parent, source, tokenizer, cfg, device)
            model = load_quantized(scratch / b, device)
        except EffkitError as e:
            table[b] = {"status": f"not run: {e}"}
            continue
        result = metrics.evaluate(model, eval_blocks, cfg.batch_size)
        delta = stats.paired_delta(parent_blocks, result["block_losses"])
        ok = delta["delta"] <= AUTO_LOSS_BUDGET
        table[b] = {"status": "candidate" if ok else f"left out: loss {delta['delta']:+.2%} > {AUTO_LOSS_BUDGET:.0%}",
                    "eval_loss": result["eval_loss"], "loss_increase": delta["delta"], "loss_delta": delta,
                    "size_bytes": artifacts.dir_size(scratch / b)}
        if ok:
            candidates[b] = model
    if not candidates:
        raise EffkitError(f"no int8 backend stays within {AUTO_LOSS_BUDGET:.0%} of the parent's held-out loss "
                          f"here ({', '.join(b + ': ' + t['status'] for b, t in table.items())}); choose one "
                          "with --backend")
    trial = side_by_side({"parent": (parent, None), **{b: (m, None) for b, m in candidates.items()}}, block,
                         cfg.latency_rounds, 1)["b12"]
    for b in candidates:
        table[b]["latency_b12_s"] = stats.median_of_rounds(trial[b])
        table[b]["ratio_to_parent_b12"] = stats.paired_ratio(trial["parent"], trial[b])
    picked = min(candidates, key=lambda b: table[b]["latency_b12_s"])
    return picked, {"picked": picked, "table": table,
                    "how": f"every backend that runs here written and reloaded; those within {AUTO_LOSS_BUDGET:.0%} "
                           f"of the parent's held-out loss timed at batch 12 with the fp32 parent interleaved "
                           f"({cfg.latency_rounds} rounds x 1 repeat); the lowest median wins"}


def _quantize(cfg: QuantizeConfig, device: torch.device, source: Path, run_dir: Path) -> dict[str, Any]:
    data_section = artifacts.data_section(source)
    data_cfg = DataConfig.from_dict(data_section)
    prepared = prepare(data_cfg, tokenizer_from=str(source))
    tokenizer, eval_blocks, n_bytes = prepared.tokenizer, prepared.blocks.eval, prepared.blocks.eval_bytes
    parent = load_model(str(source)).to(device).eval()
    parent_fp32 = metrics.evaluate(parent, eval_blocks, cfg.batch_size, eval_bytes=n_bytes)
    parent_bf16 = metrics.evaluate(parent, eval_blocks, cfg.batch_size, torch.bfloat16, eval_bytes=n_bytes)
    parent_fp32["generation"] = generate_sample(parent, tokenizer, cfg.gen_tokens)
    parent_fp32["size_bytes"] = artifacts.dir_size(source)

    # auto writes every backend here; removed below, or by the next run lock if the process is killed
    scratch = Path(tempfile.mkdtemp(dir=run_dir, prefix=".tmp-auto-"))
    try:
        return _write_and_measure(cfg, device, source, run_dir, scratch, data_section, prepared, parent,
                                  parent_fp32, parent_bf16)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_and_measure(cfg: QuantizeConfig, device: torch.device, source: Path, run_dir: Path, scratch: Path,
                       data_section: dict, prepared, parent: nn.Module, parent_fp32: dict,
                       parent_bf16: dict) -> dict[str, Any]:
    """Choose the backend (auto), write the artifact, reload it, measure it against the parent, report."""
    tokenizer, eval_blocks, n_bytes = prepared.tokenizer, prepared.blocks.eval, prepared.blocks.eval_bytes
    block = DataConfig.from_dict(data_section).block_size
    backend, auto_note = cfg.backend, None
    if backend == "auto":
        backend, auto_note = pick_backend(cfg, device, parent, source, tokenizer, eval_blocks, block,
                                          parent_fp32["block_losses"], scratch)
    tag = quantize_tag(backend, cfg, source)
    artifact = run_dir / tag
    with artifacts.atomic_dir(artifact) as tmp:
        if auto_note:  # the winner was written while choosing: moved into place, not written again
            shutil.copytree(scratch / backend, tmp, dirs_exist_ok=True)
            description = json.loads((tmp / QUANT_FILE).read_text())
        else:
            description = write_quantized(tmp, backend, parent, source, tokenizer, cfg, device)
        model = load_quantized(tmp, device)  # what is measured: the artifact as its folder alone reloads it
        int8_layers = int8_layer_count(model)
        if not int8_layers:
            raise EffkitError(f"{backend} left no int8 layer in the reloaded model: nothing was quantized")
        q = metrics.evaluate(model, eval_blocks, cfg.batch_size, eval_bytes=n_bytes)
        q["generation"] = generate_sample(model, tokenizer, cfg.gen_tokens)
        q["size_bytes"] = artifacts.dir_size(tmp)
        m, verdicts, protocol = compare_with_parent(cfg, device, parent, model, tokenizer, block, parent_fp32,
                                                    parent_bf16, q, f"int8 ({backend})")
        m.update(params=sum(p.numel() for p in parent.parameters()), quantized_layers=len(description["layers"]),
                 int8_layers_reloaded=int8_layers, portability=PORTABILITY[backend])
        if auto_note:
            m["auto"] = auto_note
        meta_out = artifacts.write_meta(tmp, "quantize", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={"quantization": {k: v for k, v in description.items()
                                                                if k != "layers"}})
    report = {
        "stage": "quantize", "tag": tag, "parent": str(source), "run": run_dir.name, "artifact": str(artifact),
        "time": meta_out["time"], "config": cfg.to_dict(), "metrics": m, "verdicts": verdicts,
        "what_ran": {"device": metrics.describe_device(device), "backend": backend,
                     "world_size": 1, "parallel": "none", "amp_dtype": "fp32 activations, int8 weights",
                     "quantized_layers": len(description["layers"]), "int8_layers_reloaded": int8_layers,
                     "include_head": description["include_head"], "format": description["format"],
                     "cpu_flags": " ".join(metrics.cpu_flags()) if device.type == "cpu" else ""},
        "versions": meta_out["versions"], "git_commit": meta_out["git_commit"], "protocol": protocol,
    }
    write_stage_report(Path(cfg.reports_dir) / run_dir.name, report)
    return report


def compare_with_parent(cfg, device: torch.device, parent: nn.Module, model: nn.Module, tokenizer, block: int,
                        parent_fp32: dict, parent_bf16: dict, q: dict, label: str) -> tuple[dict, list[str], dict]:
    """A quantized or exported model (`label`) against its PyTorch parent (fp32 and under bf16 autocast), paired
    and interleaved: latency at batch 1 and 12, generation tokens/s, held-out loss per block (the `evaluate`
    results `parent_fp32`, `parent_bf16`, `q`, which are completed in place). `cfg` gives latency_rounds and
    latency_repeats. Returns metrics, verdicts and the protocol. (The contender is named "int8" in the metrics.)"""
    contenders = {"fp32": (parent, None), "bf16": (parent, torch.bfloat16), "int8": (model, None)}
    compiled_status = {}
    if getattr(cfg, "compile", False):  # the compiled twins join the same rounds
        for name, m in (("fp32", parent), ("int8", model)):
            twin, compiled_status[name] = metrics.compile_for_inference(m, (1, 12), block)
            if twin is not None:
                contenders[f"{name} compiled"] = (twin, None)
    timed = side_by_side(contenders, block, cfg.latency_rounds, cfg.latency_repeats)
    new_tokens = q["generation"]["new_tokens"]
    gen = metrics.interleaved({"fp32": metrics.generation_timer(parent, tokenizer, new_tokens),
                               "int8": metrics.generation_timer(model, tokenizer, new_tokens)},
                              cfg.latency_rounds, 1, warmup=1)
    for name, r in (("fp32", parent_fp32), ("bf16", parent_bf16), ("int8", q)):
        for b in (1, 12):
            r[f"latency_b{b}"] = metrics.latency_stats(timed[f"b{b}"][name])
    for name, r in (("fp32", parent_fp32), ("int8", q)):
        r["generation"]["tokens_per_s"] = stats.median_of_rounds(gen[name])
    comparisons = {
        **{f"latency_ratio_b{b}": stats.paired_ratio(timed[f"b{b}"]["fp32"], timed[f"b{b}"]["int8"]) for b in (1, 12)},
        **{f"latency_ratio_b{b}_vs_bf16": stats.paired_ratio(timed[f"b{b}"]["bf16"], timed[f"b{b}"]["int8"])
           for b in (1, 12)},
        **{f"bf16_latency_ratio_b{b}": stats.paired_ratio(timed[f"b{b}"]["fp32"], timed[f"b{b}"]["bf16"])
           for b in (1, 12)},
        "generation_ratio": stats.paired_ratio(gen["fp32"], gen["int8"], higher_is_better=True),
    }
    if compiled_status:
        comparisons["compiled"] = {"status": compiled_status, **{
            f"{name}_compiled_vs_{ref}_b{b}": stats.paired_ratio(timed[f"b{b}"][ref],
                                                                 timed[f"b{b}"][f"{name} compiled"])
            for name, ref in (("fp32", "fp32"), ("int8", "int8"), ("int8", "fp32")) for b in (1, 12)
            if f"{name} compiled" in timed[f"b{b}"]}}
    fp32_blocks = parent_fp32.pop("block_losses")
    comparisons["eval_loss_delta"] = stats.paired_delta(fp32_blocks, q.pop("block_losses"))
    comparisons["bf16_eval_loss_delta"] = stats.paired_delta(fp32_blocks, parent_bf16.pop("block_losses"))
    verdicts = [stats.summary_of(comparisons["latency_ratio_b12"], f"{label} latency b12 vs fp32"),
                stats.summary_of(comparisons["eval_loss_delta"], f"{label} loss vs fp32")]
    if comparisons["eval_loss_delta"]["ci95"][0] > 0.01:
        verdicts.append(f"{label} loss is worse than the parent's by more than 1% (the whole 95% interval is above)")
    for key, what in (("int8_compiled_vs_fp32_b12", f"{label} compiled latency b12 vs fp32 eager"),
                      ("int8_compiled_vs_int8_b12", f"{label} compiled vs eager, b12")):
        if key in comparisons.get("compiled", {}):
            verdicts.append(stats.summary_of(comparisons["compiled"][key], what))
    bf16 = comparisons["bf16_latency_ratio_b12"]
    verdicts.append(stats.summary_of(bf16, "bf16 autocast latency b12 vs fp32")
                    + ("; this CPU has no native bf16 (AVX512-BF16/AMX)" if device.type == "cpu"
                       and not metrics.cpu_has_native_bf16() else ""))
    m = {**q, **comparisons, "parent_fp32": parent_fp32, "parent_bf16": parent_bf16,
         "eval_loss_delta_vs_parent": comparisons["eval_loss_delta"]["delta"],
         "size_ratio_vs_parent": q["size_bytes"] / parent_fp32["size_bytes"]}
    generation = (f"greedy decoding of {new_tokens} new tokens from {PROMPT!r}, fp32 parent and {label} "
                  f"interleaved ({cfg.latency_rounds} rounds); new tokens / wall time; the PyTorch models use the "
                  "KV cache" + ("; " + onnx_export.GENERATION_NOTE
                                if isinstance(model, onnx_export.OnnxCausalLM) else ""))
    protocol = {"eval_loss": metrics.EVAL_PROTOCOL + "; " + stats.LOSS_METHOD,
                "latency": f"forward of (batch, {block}) random tokens: fp32 parent, parent under bf16 autocast and "
                           f"{label} (reloaded from its folder) "
                           + metrics.INTERLEAVED_PROTOCOL.format(warmup=2, rounds=cfg.latency_rounds,
                                                                 repeats=cfg.latency_repeats)
                           + f"; {stats.RATIO_METHOD}"
                           + ("; with --compile, torch.compile twins (Inductor, freezing, static shapes) of the fp32 "
                              "parent and of the int8 model in the same rounds" if compiled_status else ""),
                "generation": generation, "size": "bytes of all files in the artifact folder",
                "int8_layers": "counted in the model reloaded from the artifact folder (int8 modules, or int8 "
                               "operators of the ONNX graph)"}
    return m, verdicts, protocol
