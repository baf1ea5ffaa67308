"""The optimizers `effkit train --optim` chooses from: one registry that the config's validation, `--help`, the
training loop and the memory plan read.

- `adamw`       PyTorch's AdamW, its fused kernel where the parameters allow it (plain tensors), else foreach.
- `adamw-fused` PyTorch's fused AdamW kernel, refused in one line where it cannot run.
- `adamw8bit`   AdamW with 8-bit block-wise moments (2 B per parameter instead of 8): bitsandbytes'
                `AdamW8bit` on plain tensors (single process, ddp, pp), torchao's `AdamW8bit` on sharded
                DTensor parameters (fsdp, tp), which bitsandbytes' kernels do not take. torchao compiles its
                step once per parameter shape (about half a minute on a small CPU, once per process).

Every optimizer gets the same parameter groups (weight decay on matrices only), betas (0.9, 0.95) and learning
rate schedule; `build_optimizer` returns the library that runs it, which the report names. Small tensors keep
fp32 moments in both 8-bit libraries (bitsandbytes below 4,096 elements, torchao below its block size), as the
memory plan counts them. `--optim`'s help is read from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from effkit.errors import EffkitError
from effkit.registry import OPTIMIZERS

BETAS = (0.9, 0.95)


@dataclass(frozen=True)
class OptimSpec:
    name: str
    help: str
    build: Callable[[list[dict[str, Any]], float, bool], tuple[Any, str]]  # (groups, lr, sharded) -> (opt, library)


def _adamw(groups: list[dict[str, Any]], lr: float, sharded: bool) -> tuple[Any, str]:
    import torch

    if not sharded:  # fused AdamW runs on CPU and CUDA tensors; not on DTensors everywhere
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=True), "torch.optim.AdamW (fused kernel)"
        except (RuntimeError, TypeError):
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS), "torch.optim.AdamW (foreach)"


def _adamw_fused(groups: list[dict[str, Any]], lr: float, sharded: bool) -> tuple[Any, str]:
    import torch

    try:
        return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=True), "torch.optim.AdamW (fused kernel)"
    except (RuntimeError, TypeError) as e:
        raise EffkitError(f"--optim adamw-fused: PyTorch's fused AdamW does not run on these parameters "
                          f"({str(e).splitlines()[0][:100]}); use --optim adamw") from None


def _adamw8bit(groups: list[dict[str, Any]], lr: float, sharded: bool) -> tuple[Any, str]:
    if not sharded:
        try:
            import bitsandbytes as bnb
        except Exception:  # noqa: BLE001 - a broken install fails like a missing one; torchao may still run
            bnb = None
        if bnb is not None:
            return (bnb.optim.AdamW8bit(groups, lr=lr, betas=BETAS),
                    f"bitsandbytes {bnb.__version__} AdamW8bit (block-wise 8-bit moments)")
    try:
        import torchao
        from torchao.optim import AdamW8bit
    except Exception:  # noqa: BLE001
        need = "torchao (sharded parameters: fsdp/tp)" if sharded else "bitsandbytes or torchao"
        raise EffkitError(f"--optim adamw8bit needs {need}: pip install -e '.[quant]', or use --optim adamw") \
            from None
    import torch

    for g in groups:  # torchao steps with a tensor learning rate (the scheduler fills it in place)
        g["lr"] = torch.tensor(lr)
    return (AdamW8bit(groups, lr=torch.tensor(lr), betas=BETAS),
            f"torchao {torchao.__version__} AdamW8bit (block-wise 8-bit moments, compiled step)")


# the entries of `effkit.registry.OPTIMIZERS`
ADAMW = OptimSpec("adamw", "PyTorch's, fused where it runs", _adamw)
ADAMW_FUSED = OptimSpec("adamw-fused", "PyTorch's fused kernel", _adamw_fused)
ADAMW8BIT = OptimSpec("adamw8bit", "8-bit moments: bitsandbytes; torchao for fsdp/tp", _adamw8bit)
get = OPTIMIZERS.get


def build_optimizer(model, name: str, lr: float, weight_decay: float) -> tuple[Any, str]:
    """The optimizer `name` over `model`'s trainable parameters (decay on matrices only) and the library that
    runs it."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    sharded = any(type(p).__name__ == "DTensor" for p in decay)
    return get(name).build(groups, lr, sharded)


def training_step(model, opt, x: Any, dtype: Any = None) -> None:
    """One step of a GPT-2 on the CPU as training runs it, for the probes that time one (`memplan.probe_runtime`,
    `parallel.machine.time_layers`): forward and loss (under autocast to `dtype`), backward, the gradients clipped,
    the optimizer's step, the gradients freed."""
    import torch

    from effkit.measure.evaluation import lm_loss
    from effkit.measure.hardware import autocast_ctx

    with autocast_ctx(torch.device("cpu"), dtype):
        loss = lm_loss(model(x).logits, x)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
