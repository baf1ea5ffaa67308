"""`effkit quantize`: int8 Linear layers through one of several backends, behind one interface.

Backends: `dynamic` (PyTorch dynamic int8, per-channel weights, fbgemm/onednn kernels), `bnb` (bitsandbytes
LLM.int8 `Linear8bitLt`, with its outlier threshold), `torchao` (int8 dynamic-activation + int8-weight, or
int8 weight-only with `--torchao-scheme w8`). `auto` measures every backend that runs here at batch 12 and
keeps the fastest.

Storage is the same for all backends and never uses pickle: the weights of the quantized layers are stored as
symmetric per-output-row int8 plus fp32 scales in safetensors, next to `quantization.json` (backend, scheme,
layer names). At quantize time the weights are first rounded to exactly those int8 values; reloading
dequantizes them and applies the same backend again, which reproduces the measured model (per-row symmetric
int8 of an already-int8 tensor is the tensor itself).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from effkit import artifacts, metrics, stats
from effkit.config import DataConfig, QuantizeConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.model import conv1d_to_linear, load_model
from effkit.parallel import init_runtime
from effkit.report import write_stage_report

QUANT_FILE = "quantization.json"
WEIGHTS_FILE = "quantized.safetensors"
PROMPT = metrics.GENERATION_PROMPT


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


def save_quantized(folder: Path, model_fp: nn.Module, stored: dict[str, torch.Tensor], names: list[str],
                   description: dict[str, Any], tokenizer) -> None:
    skip = {f"{n}.weight" for n in names} | ({"transformer.wte.weight", "lm_head.weight"}
                                            if description["include_head"] else set())
    rest = {k: v.detach().cpu().contiguous() for k, v in model_fp.state_dict().items()
            if k not in skip and k != "lm_head.weight"}  # the LM head is tied to the embedding
    save_file({**rest, **{k: v.contiguous() for k, v in stored.items()}}, folder / WEIGHTS_FILE)
    model_fp.config.save_pretrained(folder)
    (folder / QUANT_FILE).write_text(json.dumps({**description, "layers": names}, indent=2))
    tokenizer.save_pretrained(folder)


def is_quantized(path: str | Path) -> bool:
    return (Path(path) / QUANT_FILE).is_file()


def load_quantized(path: str | Path, device: torch.device | None = None) -> nn.Module:
    """Rebuild a quantized artifact on `device` (default the CPU): dequantize the stored int8 weights and apply
    the same backend again."""
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
    """Any effkit artifact on `device` (default the CPU): quantized ones through their description, others
    through transformers."""
    if is_quantized(path):
        return load_quantized(path, device)
    return load_model(str(path)).to(device or torch.device("cpu"))


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
            **({"note": note} if note else {})}


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
    if cfg.backend != "auto" and (reason := backend_available(cfg.backend, device)):
        raise EffkitError(f"--backend {cfg.backend} cannot run here: {reason}")
    run_dir = Path(cfg.runs_dir) / artifacts.run_of(source)  # inside the runs folder, wherever --from points
    with artifacts.run_lock(run_dir):
        return _quantize(cfg, device, source, run_dir)


def _quantize(cfg: QuantizeConfig, device: torch.device, source: Path, run_dir: Path) -> dict[str, Any]:

    data_section = artifacts.data_section(source)
    data_cfg = DataConfig.from_dict(data_section)
    prepared = prepare(data_cfg, tokenizer_from=str(source))
    tokenizer, eval_blocks, block = prepared.tokenizer, prepared.blocks.eval, data_cfg.block_size
    n_bytes = prepared.blocks.eval_bytes
    parent = load_model(str(source)).to(device).eval()
    parent_fp32 = metrics.evaluate(parent, eval_blocks, cfg.batch_size, eval_bytes=n_bytes)
    parent_bf16 = metrics.evaluate(parent, eval_blocks, cfg.batch_size, torch.bfloat16, eval_bytes=n_bytes)
    parent_fp32["generation"] = generate_sample(parent, tokenizer, cfg.gen_tokens)
    parent_fp32["size_bytes"] = artifacts.dir_size(source)

    names = quant_targets(parent, cfg.include_head)
    backend, auto_note = cfg.backend, None
    if backend == "auto":
        candidates, skipped = {}, {}
        for b in ("dynamic", "torchao", "bnb"):
            if reason := backend_available(b, device):
                skipped[b] = f"not run: {reason}"
                continue
            cand = copy.deepcopy(parent)
            fake_quantize(cand, names, cfg.include_head)
            candidates[b] = (apply_backend(cand, names, b, cfg.threshold, cfg.torchao_scheme), None)
        trial = side_by_side({"parent": (parent, None), **candidates}, block, cfg.latency_rounds, 1)["b12"]
        medians = {b: stats.median_of_rounds(trial[b]) for b in candidates}
        backend = min(medians, key=medians.get)
        auto_note = {"picked": backend,
                     "how": f"forward latency at batch 12, every backend and the fp32 parent interleaved "
                            f"({cfg.latency_rounds} rounds x 1 repeat); the lowest median wins",
                     "latency_b12_s": {**medians, **skipped},
                     "ratio_to_parent_b12": {b: stats.paired_ratio(trial["parent"], trial[b]) for b in candidates}}
        del candidates

    model = copy.deepcopy(parent)
    stored = fake_quantize(model, names, cfg.include_head)
    fp_copy = copy.deepcopy(model)  # the fake-quantized fp32 weights, for storage of the non-quantized rest
    apply_backend(model, names, backend, cfg.threshold, cfg.torchao_scheme)
    q = metrics.evaluate(model, eval_blocks, cfg.batch_size, eval_bytes=n_bytes)
    q["generation"] = generate_sample(model, tokenizer, cfg.gen_tokens)
    timed = side_by_side({"fp32": (parent, None), "bf16": (parent, torch.bfloat16), "int8": (model, None)}, block,
                         cfg.latency_rounds, cfg.latency_repeats)
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
    fp32_blocks = parent_fp32.pop("block_losses")
    comparisons["eval_loss_delta"] = stats.paired_delta(fp32_blocks, q.pop("block_losses"))
    comparisons["bf16_eval_loss_delta"] = stats.paired_delta(fp32_blocks, parent_bf16.pop("block_losses"))
    tag = (f"quantize-{backend}" + (f"-{cfg.torchao_scheme}" if backend == "torchao" else "")
           + ("-head" if cfg.include_head else ""))
    description = {"backend": backend, "include_head": cfg.include_head, "threshold": cfg.threshold,
                   "torchao_scheme": cfg.torchao_scheme, "storage": "per-output-row symmetric int8 + fp32 scales"}
    verdicts = [stats.summary_of(comparisons["latency_ratio_b12"], f"int8 ({backend}) latency b12 vs fp32"),
                 stats.summary_of(comparisons["eval_loss_delta"], f"int8 ({backend}) loss vs fp32")]
    if comparisons["eval_loss_delta"]["ci95"][0] > 0.01:
        verdicts.append("int8 loss is worse than the parent's by more than 1% (the whole 95% interval is above)")
    bf16 = comparisons["bf16_latency_ratio_b12"]
    verdicts.append(stats.summary_of(bf16, "bf16 autocast latency b12 vs fp32")
                    + ("; this CPU has no native bf16 (AVX512-BF16/AMX)" if device.type == "cpu"
                       and not metrics.cpu_has_native_bf16() else ""))

    artifact = run_dir / tag
    with artifacts.atomic_dir(artifact) as tmp:
        save_quantized(tmp, fp_copy, stored, names, description, tokenizer)
        q["size_bytes"] = artifacts.dir_size(tmp)
        m = {**q, **comparisons, "parent_fp32": parent_fp32, "parent_bf16": parent_bf16,
             "eval_loss_delta_vs_parent": comparisons["eval_loss_delta"]["delta"],
             "size_ratio_vs_parent": q["size_bytes"] / parent_fp32["size_bytes"],
             "params": sum(p.numel() for p in parent.parameters()), "quantized_layers": len(names)}
        if auto_note:
            m["auto"] = auto_note
        meta_out = artifacts.write_meta(tmp, "quantize", cfg.to_dict(), m, data=data_section, parent=str(source),
                                        extra={"quantization": description})
    report = {
        "stage": "quantize", "tag": tag, "parent": str(source), "run": run_dir.name, "artifact": str(artifact),
        "time": meta_out["time"], "config": cfg.to_dict(), "metrics": m, "verdicts": verdicts,
        "what_ran": {"device": metrics.describe_device(device), "backend": backend,
                     "world_size": 1, "parallel": "none", "amp_dtype": "fp32 activations, int8 weights",
                     "quantized_layers": len(names), "include_head": cfg.include_head},
        "versions": meta_out["versions"], "git_commit": meta_out["git_commit"],
        "protocol": {"eval_loss": metrics.EVAL_PROTOCOL + "; " + stats.LOSS_METHOD,
                     "latency": f"forward of (batch, {block}) random tokens: fp32 parent, parent under bf16 "
                                "autocast and int8 model "
                                + metrics.INTERLEAVED_PROTOCOL.format(warmup=2, rounds=cfg.latency_rounds,
                                                                      repeats=cfg.latency_repeats)
                                + f"; {stats.RATIO_METHOD}",
                     "generation": f"greedy decoding with the KV cache of {new_tokens} new tokens from "
                                   f"{PROMPT!r}, fp32 parent and int8 model interleaved ({cfg.latency_rounds} "
                                   "rounds); new tokens / wall time",
                     "size": "bytes of all files in the artifact folder"},
    }
    write_stage_report(Path(cfg.reports_dir) / run_dir.name, report)
    return report
