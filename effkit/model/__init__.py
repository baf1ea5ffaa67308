"""GPT-2 models: presets, build / load / save, and the Conv1D <-> nn.Linear conversion."""

from effkit.model.convert import conv1d_to_linear, hf_state_dict
from effkit.model.gpt2 import (PRESETS, build_model, count_params, flops_per_token, is_pretrained_source,
                               load_model, save_model)

__all__ = ["PRESETS", "build_model", "load_model", "save_model", "count_params", "flops_per_token",
           "conv1d_to_linear", "hf_state_dict", "is_pretrained_source"]
