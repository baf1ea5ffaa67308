"""GPT-2 presets and build / load / save, activation checkpointing, and the counts reports use (parameters,
FLOPs per token).

Artifacts are plain Hugging Face folders (config.json + model.safetensors + tokenizer files), written
through `save_pretrained` from a Conv1D-layout state dict, so `AutoModelForCausalLM.from_pretrained`
loads them and gives the same logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from effkit.errors import EffkitError
from effkit.model.convert import conv1d_to_linear, hf_state_dict

# n_layer, n_embd, n_head, n_positions
PRESETS: dict[str, dict[str, int]] = {
    "gpt2-nano": dict(n_layer=2, n_embd=64, n_head=2, n_positions=128),  # tests
    "gpt2-micro": dict(n_layer=4, n_embd=256, n_head=4, n_positions=256),  # CPU quickstart, fastest to train
    "gpt2-mini": dict(n_layer=6, n_embd=384, n_head=6, n_positions=256),  # CPU quickstart until 0.1
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16, n_positions=1024),  # 355M
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20, n_positions=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25, n_positions=1024),  # 1.5B
}


def is_pretrained_source(name: str) -> bool:
    """A model that brings its own weights and tokenizer: an existing local folder, or a hub id written
    with its owner (`openai-community/gpt2-medium`, online users only). Other names must be presets."""
    return name not in PRESETS and (Path(name).expanduser().exists() or "/" in name)


def shape_of(name: str) -> dict[str, int]:
    """`n_head` and `n_layer` of a preset or a local model folder, without loading weights ({} for a hub id:
    checked when the model is loaded)."""
    import json

    if not is_pretrained_source(name):
        preset = check_preset(name)
        return {"n_head": preset["n_head"], "n_layer": preset["n_layer"]}
    config = Path(name) / "config.json"
    if config.is_file():
        try:
            values = json.loads(config.read_text())
        except (json.JSONDecodeError, OSError):
            raise EffkitError(f"{config} is not valid JSON; give an effkit artifact or a Hugging Face folder") from None
        return {k: values[k] for k in ("n_head", "n_layer") if isinstance(values, dict) and k in values}
    return {}


def check_block_size(block_size: int, n_positions: int) -> None:
    if block_size > n_positions:
        raise EffkitError(f"--block-size {block_size} is larger than the model's context ({n_positions}); "
                          f"use --block-size {n_positions} or less")


def _finish(model: nn.Module) -> nn.Module:
    model.config.use_cache = False
    return conv1d_to_linear(model)


def check_preset(name: str) -> dict[str, int]:
    if name not in PRESETS:
        raise EffkitError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, "
                          "or give a Hugging Face model folder")
    return PRESETS[name]


def preset_config(name: str, vocab_size: int, dropout: float = 0.0, eos_token_id: int | None = None):
    """The transformers `GPT2Config` of a preset (nothing allocated)."""
    from transformers import GPT2Config

    check_preset(name)
    cfg = GPT2Config(vocab_size=vocab_size, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                     bos_token_id=eos_token_id, eos_token_id=eos_token_id, **PRESETS[name])
    cfg._attn_implementation = "sdpa"
    return cfg


def build_from_config(config) -> nn.Module:
    """A randomly initialised model of a `GPT2Config`, in effkit's Linear layout."""
    from transformers import GPT2LMHeadModel

    return _finish(GPT2LMHeadModel(config))


def config_of(name: str, vocab_size: int, eos_token_id: int | None = None):
    """The `GPT2Config` a model name stands for: a local folder's or hub id's own, or a preset's with this
    vocabulary (nothing allocated, no weights read)."""
    if is_pretrained_source(name):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(name)
    return preset_config(name, vocab_size, eos_token_id=eos_token_id)


def build_model(name: str, vocab_size: int, dropout: float = 0.0, eos_token_id: int | None = None) -> nn.Module:
    return build_from_config(preset_config(name, vocab_size, dropout, eos_token_id))


def check_model_folder(p: Path) -> None:
    """Refuse, in one line, a folder `load_model` cannot load: what loads it and what a plan of it reads agree."""
    if not (p / "config.json").is_file():
        raise EffkitError(f"{p} is not a model folder (no config.json); give an effkit artifact or a "
                          "Hugging Face model folder")
    if (p / "model.onnx").is_file():
        raise EffkitError(f"{p} is an ONNX artifact, which PyTorch stages cannot load; give its parent (see "
                          f"{p / 'effkit.json'}), or run it with effkit bench / generate")
    if not any(p.glob("*.safetensors")):
        raise EffkitError(f"{p} holds no .safetensors weights; effkit never loads pickled weights")


def load_model(path: str, dropout: float | None = None) -> nn.Module:
    """Load a transformers GPT-2 (folder or hub id) and convert it to effkit's Linear layout."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.exists():
        check_model_folder(p)
    elif "/" in path and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise EffkitError(f"model path {path} does not exist")
    kwargs = {}
    if dropout is not None:
        kwargs = dict(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", use_safetensors=True,
                                                     dtype=torch.float32, **kwargs)
    except EffkitError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise EffkitError(f"could not load model {path}: {type(e).__name__}: {first[:200]}") from None
    if model.config.model_type != "gpt2":
        raise EffkitError(f"{path} is a {model.config.model_type!r} model; effkit handles GPT-2 models")
    return _finish(model)


def save_model(model: nn.Module, path: Path, tokenizer=None, state_dict: dict | None = None) -> None:
    """Write a plain transformers folder (safetensors) into `path` (the caller makes it atomic)."""
    sd = state_dict if state_dict is not None else model.state_dict()
    sd = {k: v.detach().to("cpu").contiguous() for k, v in hf_state_dict(sd).items()}
    if getattr(model.config, "tie_word_embeddings", False):  # saved once; loading ties the head to it
        sd.pop("lm_head.weight", None)
    model.config.use_cache = True
    try:
        model.save_pretrained(path, state_dict=sd)
    finally:
        model.config.use_cache = False
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each GPT-2 block in backward (non-reentrant torch.utils.checkpoint, via transformers)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 and later
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def activation_checkpointing_enabled(model: nn.Module) -> bool:
    """Read back from the blocks whether they recompute in backward."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def count_params(model: nn.Module, non_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if non_embedding:
        n -= model.transformer.wpe.weight.numel()
    return n


def flops_per_token(config, seq_len: int, n_params: int, training: bool = True) -> float:
    """Model FLOPs per token: 6N (2N forward) for the weights plus the attention term
    12 * n_layer * n_embd * seq_len (forward+backward; a third of it forward only), as in PaLM / nanoGPT."""
    attn = 12 * config.n_layer * config.n_embd * seq_len
    return (6 * n_params + attn) if training else (2 * n_params + attn / 3)
