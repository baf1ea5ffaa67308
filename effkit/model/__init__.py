"""GPT-2 models: presets, build / load / save, and the Conv1D <-> nn.Linear conversion."""

from effkit.model.convert import conv1d_to_linear, hf_state_dict
from effkit.model.gpt2 import (
    PRESETS,
    activation_checkpointing_enabled,
    build_model,
    check_block_size,
    check_model_folder,
    check_preset,
    config_of,
    count_params,
    enable_activation_checkpointing,
    flops_per_token,
    is_pretrained_source,
    load_model,
    save_model,
    shape_of,
)

__all__ = [
    "PRESETS", "activation_checkpointing_enabled", "build_model", "check_block_size", "check_model_folder",
    "check_preset",
    "config_of", "conv1d_to_linear", "count_params", "enable_activation_checkpointing", "flops_per_token",
    "hf_state_dict", "is_pretrained_source", "load_model", "shape_of", "save_model",
]
