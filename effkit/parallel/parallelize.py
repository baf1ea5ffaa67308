"""`parallelize_gpt2(model, dims, ...)`: apply the parallel layout, torchtitan style (one small `apply_*` function
per parallelism), and return a handle with everything mode-specific that the one training loop needs: gradient
sync, clipping, loss averaging, full state dicts, and a description read back from the model itself. The handle
holds the pieces the `apply_*` functions chose (a no-sync context, a gradient-sync function); it never switches
on the mode's name.

- ddp:      Accelerate's `prepare_model` (torch DistributedDataParallel: bucketed, overlapped all-reduce)
- --sync all-reduce / gather-scatter: plain replicas, gradients synchronised by hand after backward
- fsdp:     FSDP2 `fully_shard` on every block and on the root
- tp:       Megatron-style plan on a DeviceMesh: q/k/v column-parallel by whole heads, attention output
            row-parallel, MLP up column-parallel and down row-parallel; embeddings, LayerNorms and the tied
            LM head replicated
- fsdp+tp:  2-D mesh (dp, tp): TP inside each dp group, FSDP2 across groups
- pp:       every process one pipeline stage of consecutive blocks (`pipeline.py`: GPipe or 1F1B)
- pp+fsdp:  2-D mesh (pp, dp): split first, then FSDP2 on each stage within its dp group
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from effkit.errors import EffkitError
from effkit.parallel import pipeline as pp
from effkit.parallel.dims import ParallelDims
from effkit.parallel.runtime import Runtime


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


# ---------------------------------------------------------------------------------------------- apply_* functions

def qkv_interleave_index(embed_dim: int, tp: int) -> torch.Tensor:
    """Row order of the fused q/k/v projection such that an even split into `tp` chunks gives each rank
    [q_r; k_r; v_r] for its own heads (the fused layout is [q; k; v], each embed_dim rows)."""
    local = embed_dim // tp
    parts = [torch.arange(r * local, (r + 1) * local) + j * embed_dim for r in range(tp) for j in range(3)]
    return torch.cat(parts)


def apply_tp(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in pp.blocks_of(model):
        attn = block.attn  # ParallelDims.build checked that tp divides the heads
        idx = qkv_interleave_index(attn.split_size, tp).to(attn.c_attn.weight.device)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[idx])
            attn.c_attn.bias.copy_(attn.c_attn.bias[idx])
        parallelize_module(block, tp_mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })
        attn.split_size //= tp  # local q/k/v width: attention runs on n_head / tp local heads
        attn.num_heads //= tp


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype | None, reshard_after_forward: bool,
               cpu_offload: bool, root: nn.Module | None = None) -> None:
    """FSDP2 on every block of `model`, then on `root` (default: the model; a pipeline stage's wrapper, whose
    forward is the one that runs) for the parameters outside the blocks."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype \
        else MixedPrecisionPolicy()
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp, "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in pp.blocks_of(model):
        fully_shard(block, **kwargs)
    fully_shard(root if root is not None else model, **kwargs)


def apply_ddp(model: nn.Module) -> nn.Module:
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
    wrapped = acc.prepare_model(model)
    if not isinstance(wrapped, DistributedDataParallel):
        raise EffkitError(f"Accelerate did not wrap the model in DDP (its state: {acc.distributed_type}); on CPU "
                          "launch with ACCELERATE_USE_CPU=1 (effkit train --parallel ddp does this)")
    return wrapped


@contextmanager
def fsdp_no_sync(model: nn.Module):
    """FSDP2: skip the reduce-scatter of gradients on micro-steps that are not the last of an accumulation."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def all_reduce_gradients(model: nn.Module) -> None:
    """Hand-written data parallelism: sum every gradient over all processes, then average."""
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)


def gather_scatter_gradients(model: nn.Module) -> None:
    """Parameter-server style: rank 0 gathers every gradient, averages, and scatters the mean back."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for p in model.parameters():
        if p.grad is None:
            continue
        gathered = [torch.empty_like(p.grad) for _ in range(world)] if rank == 0 else None
        dist.gather(p.grad, gather_list=gathered, dst=0)
        chunks = [torch.stack(gathered).mean(0)] * world if rank == 0 else None
        dist.scatter(p.grad, scatter_list=chunks, src=0)


MANUAL_SYNC: dict[str, Callable[[nn.Module], None]] = {"all-reduce": all_reduce_gradients,
                                                       "gather-scatter": gather_scatter_gradients}


def _dequantized(state: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The full optimizer state with 8-bit moments (torchao's tensor subclass, which PyTorch's state-dict
    utilities can neither broadcast nor chunk) as plain fp32 tensors, and whether there were any."""
    found = False
    out: dict[str, Any] = {"param_groups": state["param_groups"], "state": {}}
    for key, pstate in state["state"].items():
        out["state"][key] = {}
        for name, v in pstate.items():
            if type(v).__name__ == "OptimState8bit":
                v, found = v.dequantize(), True
            out["state"][key][name] = v
    return out, found


def _dequantize_columns(optimizer) -> list[tuple[dict, str, Any]]:
    """Replace the 8-bit moments of shards that are not runs of whole rows (tensor-parallel columns, `Shard(1)`)
    by fp32 DTensors of their values, and return what was replaced. PyTorch's state-dict utilities can neither
    gather torchao's 8-bit subclass along a column nor copy a column of a full tensor into it; as fp32 they do
    both. Row shards (FSDP) keep their 8-bit codes, which are saved and restored exactly."""
    from torch.distributed.tensor import DTensor

    replaced = []
    for st in optimizer.state.values():
        for name, v in list(st.items()):
            if (_is_dtensor(v) and type(v.to_local()).__name__ == "OptimState8bit"
                    and any(pl.is_shard() and pl.dim != 0 for pl in v.placements)):
                st[name] = DTensor.from_local(v.to_local().dequantize(), v.device_mesh, v.placements,
                                              run_check=False, shape=v.shape, stride=v.stride())
                replaced.append((st, name, v))
    return replaced


@contextmanager
def _column_states_dequantized(optimizer):
    """While the optimizer state is gathered for a checkpoint: column shards' 8-bit moments as fp32 values (saved
    so, and quantized again on load, block by block as they were: `_requantize`)."""
    replaced = _dequantize_columns(optimizer)
    try:
        yield
    finally:
        for st, name, v in replaced:
            st[name] = v


def _holds_8bit_states(optimizer) -> bool:
    """torchao's 8-bit AdamW (the one effkit runs on sharded parameters), whose moments `_requantize` rebuilds."""
    return hasattr(optimizer, "_new_buffer")


def _requantize(optimizer, model: nn.Module, saved: dict[str, Any]) -> None:
    """Back to 8-bit moments after loading them as fp32 shards: a fresh 8-bit buffer of the optimizer's own kind
    for each parameter shard, given this shard's rows of the saved codes and scales (exactly what was saved);
    where the shard is not a block-aligned run of rows (tensor-parallel columns), re-quantized from the loaded
    values instead (each block's scale is its largest value, so the codes come back up to rounding)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for fqn, p in model.named_parameters():
        st = optimizer.state.get(p)
        if not st:
            continue
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False)):
            v = st.get(name)
            if v is None:
                continue
            buf = optimizer._new_buffer(p, signed)
            full = saved["state"].get(fqn, {}).get(name)
            local = buf.to_local() if _is_dtensor(buf) else buf
            piece = None
            if full is not None and type(local).__name__ == type(full).__name__ == "OptimState8bit":
                shape, offset = (compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                                 if _is_dtensor(p) else (tuple(p.shape), (0,) * p.dim()))
                if tuple(shape[1:]) == tuple(p.shape[1:]):  # a run of whole rows
                    try:
                        piece = full[offset[0]:offset[0] + shape[0]]
                    except ValueError:  # rows not aligned with the quantization blocks
                        piece = None
            if piece is not None and piece.codes.shape == local.codes.shape:
                local.codes.copy_(piece.codes)
                local.scale.copy_(piece.scale)
            else:
                buf.copy_(v)
            st[name] = buf


# ---------------------------------------------------------------------------------------------- the handle

@dataclass
class Parallelized:
    """The model as the training loop sees it. `model` is what forward runs on (maybe a DDP wrapper),
    `base_model` the module itself (state dicts, masks, config)."""

    model: nn.Module
    base_model: nn.Module
    rt: Runtime
    dims: ParallelDims
    no_sync: Callable[[], AbstractContextManager] = nullcontext
    grad_sync: Callable[[nn.Module], None] | None = None  # hand-written gradient sync after backward
    dp_group: Any = None
    applied: dict[str, Any] = field(default_factory=dict)  # options applied beyond the mesh (fsdp, sync)
    pipeline: pp.Pipeline | None = None  # this rank's stage and schedule (pp modes)
    save_as: nn.Module | None = None  # a full model to save the gathered state with (pp: a meta skeleton)

    @property
    def sharded(self) -> bool:
        return any(_is_dtensor(p) for p in self.base_model.parameters())

    def sync_gradients(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync(self.base_model)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients (sharded DTensors summed over their shard dims), then scale. Every
        collective runs on tensors on the run's device (NCCL takes no CPU tensors, and with --cpu-offload the
        gradient shards live on the CPU)."""
        grads = [p.grad for p in self.base_model.parameters() if p.grad is not None]
        total = torch.zeros((), device=self.rt.device, dtype=torch.float32)
        pipe = self.pipeline
        counted = [p.grad for p in self.base_model.parameters() if p.grad is not None
                   and not (pipe is not None and pipe.last and not pipe.first and p is pipe.tied)]  # tied: once
        for g in counted:  # CPU-offloaded shards are summed where they live, then reduced on the run's device
            if _is_dtensor(g):
                local = g.to_local().float().pow(2).sum().to(total.device)
                for dim, placement in enumerate(g.placements):
                    if placement.is_shard():
                        dist.all_reduce(local, group=g.device_mesh.get_group(dim))
                total += local
            else:
                total += g.float().pow(2).sum().to(total.device)
        if pipe is not None:  # every stage holds different parameters
            dist.all_reduce(total, group=pipe.group)
        norm = total.sqrt()
        coef = min(1.0, max_norm / (norm.item() + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    # collectives for reporting --------------------------------------------------------------------
    def mean_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.dp == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t / self.dims.dp

    def gather_ints(self, x: int) -> list[int]:
        if not self.rt.distributed:
            return [int(x)]
        t = torch.tensor([int(x)], dtype=torch.int64, device=self.rt.device)
        out = [torch.zeros_like(t) for _ in range(self.rt.world_size)]
        dist.all_gather(out, t)
        return [int(o.item()) for o in out]

    # state dicts ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded model state on rank 0 (CPU), in effkit's Linear layout; {} elsewhere."""
        if not self.rt.distributed:
            return {k: v.detach().cpu() for k, v in self.base_model.state_dict().items()}
        if self.pipeline is not None:
            return pp.gather_model_state(self.pipeline, self.sharded, self.rt.rank)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.base_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.dims.tp > 1 and sd:
            for key in [k for k in sd if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias"))]:
                idx = qkv_interleave_index(sd[key].shape[0] // 3, self.dims.tp)
                restored = torch.empty_like(sd[key])
                restored[idx] = sd[key]
                sd[key] = restored
        return sd

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if not self.rt.distributed:
            return optimizer.state_dict()
        if self.pipeline is not None:
            return pp.gather_optimizer_state(self.pipeline, optimizer, self.sharded, self.rt.rank)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        with _column_states_dequantized(optimizer):
            return get_optimizer_state_dict(self.base_model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, optimizer, state: dict[str, Any]) -> None:
        if not self.rt.distributed:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        plain, quantized = _dequantized(state)
        eight = _holds_8bit_states(optimizer)
        if eight:  # create the states (as PyTorch's loader would), then load column shards as fp32
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(optimizer)
            _dequantize_columns(optimizer)
        if self.pipeline is not None:
            pp.load_optimizer_state(self.pipeline, optimizer, plain, self.sharded)
        else:
            set_optimizer_state_dict(self.base_model, optimizer, plain,
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        if quantized or eight:
            _requantize(optimizer, self.pipeline.module if self.pipeline is not None else self.base_model, state)

    # what was applied, read back from the model -----------------------------------------------------
    def describe(self) -> dict[str, Any]:
        from torch.nn.parallel import DistributedDataParallel

        sharded_dims: set[str] = set()
        for p in self.base_model.parameters():
            if _is_dtensor(p):
                names = p.device_mesh.mesh_dim_names or ()
                sharded_dims |= {names[i] for i, pl in enumerate(p.placements) if pl.is_shard() and i < len(names)}
        if self.pipeline is not None:
            mode = "pp+fsdp" if "dp" in sharded_dims else "pp"
        elif isinstance(self.model, DistributedDataParallel):
            mode = "ddp"
        elif {"dp", "tp"} <= sharded_dims:
            mode = "fsdp+tp"
        elif "dp" in sharded_dims:
            mode = "fsdp"
        elif "tp" in sharded_dims:
            mode = "tp"
        elif self.rt.distributed and self.grad_sync is not None:
            mode = f"data-parallel ({self.applied['sync']})"
        else:
            mode = "none"
        world = dist.get_world_size() if dist.is_initialized() else 1
        param_bytes = sum((p.to_local() if _is_dtensor(p) else p).numel() * p.element_size()
                          for p in self.base_model.parameters())
        detail = {"process_group_world_size": world, "backend": self.rt.backend, "dp_size": self.dims.dp,
                  "tp_size": self.dims.tp, "param_bytes_this_rank": param_bytes}
        if self.pipeline is not None:
            stage = self.pipeline.module
            detail.update(pp_size=self.dims.pp, pp_schedule=type(self.pipeline.schedule).__name__,
                          microbatches=self.pipeline.microbatches,
                          stage_of_this_rank=stage.index, blocks_of_this_rank=[stage.layers.start, stage.layers.stop],
                          tied_embedding=("gradients summed over the first and last stage"
                                          if self.pipeline.tied_group is not None else "not tied"))
            if self.pipeline.tied_drift is not None:
                detail["tied_copies_max_abs_diff"] = self.pipeline.tied_drift
        if self.dims.tp > 1:
            detail["tp_plan"] = ("q/k/v colwise by whole heads, attn out rowwise, mlp up colwise, mlp down rowwise; "
                                 "embeddings, LayerNorms, tied LM head replicated")
        if "fsdp" in self.applied:
            detail["fsdp"] = self.applied["fsdp"]
        return {"mode": mode, "detail": detail, "param_bytes_this_rank": param_bytes}


def parallelize_gpt2(model: nn.Module, dims: ParallelDims, sync: str, amp_dtype: torch.dtype | None,
                     reshard_after_forward: bool, cpu_offload: bool, rt: Runtime,
                     pp_schedule: str = "1f1b", microbatches: int = 1, loss_scale: int = 1) -> Parallelized:
    """Apply `dims` to `model` (already on `rt.device`), torchtitan style: pipeline split first, then tp, then
    data parallelism. `loss_scale`: the gradient-accumulation divisor the pipeline's loss applies."""
    if not dims.enabled:
        return Parallelized(model, model, rt, dims)
    if not rt.distributed and not dist.is_initialized():
        raise EffkitError(f"--parallel {dims.mode} needs launched processes; use `effkit train --parallel "
                          f"{dims.mode}`")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = None
    if names_sizes := dims.mesh_dims():  # built once, every dimension named
        names, sizes = zip(*names_sizes, strict=True)
        mesh = init_device_mesh(rt.device.type, sizes, mesh_dim_names=names)
    fsdp_options = {"reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload}
    handle: dict[str, Any] = {"applied": {}}
    root, skeleton, stage = model, None, None
    if dims.pp_enabled:  # split first: each rank keeps its stage
        with torch.device("meta"):  # the full model's shape, to save the gathered state with
            skeleton = type(model)(model.config)
        stage = root = pp.split_stage(model, dims, rt.rank, amp_dtype)
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"])
    if dims.dp_shard:  # a pipeline stage is sharded before the schedule sees its parameters
        apply_fsdp(model, mesh["dp"], amp_dtype, reshard_after_forward, cpu_offload, root=stage)
        handle["applied"]["fsdp"] = fsdp_options
        if not dims.pp_enabled:
            handle["no_sync"] = lambda: fsdp_no_sync(model)
    elif dims.dp_replicate:
        handle["applied"]["sync"] = sync
        if sync == "ddp":
            root = apply_ddp(model)
            handle["no_sync"] = root.no_sync
        else:
            for p in model.parameters():  # identical replicas to start from
                dist.broadcast(p.data, src=0)
            handle["grad_sync"] = MANUAL_SYNC[sync]
    if mesh is not None and "dp" in mesh.mesh_dim_names and (dims.pp_enabled or dims.tp_enabled):
        handle["dp_group"] = mesh["dp"].get_group()
    if dims.pp_enabled:
        pipe = pp.build_pipeline(stage, dims, mesh["pp"], rt.rank, pp_schedule, microbatches, loss_scale)
        handle.update(grad_sync=pipe.sync_tied_gradients, pipeline=pipe, save_as=skeleton)
    return Parallelized(root, model, rt, dims, **handle)
