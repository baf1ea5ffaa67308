"""Pipeline parallelism for GPT-2 through `torch.distributed.pipelining` (GPipe or 1F1B schedules).

The model is built whole on every rank (same seed, same weights as single-process training), then each rank
keeps its stage: consecutive blocks, the embeddings on the first stage, `ln_f` and the LM head on the last.
The kept parts stay inside the Hugging Face module (blocks in a `ModuleDict` keyed by their index), so state
dict keys are the full model's and the gathered artifact is one plain Hugging Face folder.

Pitfalls handled here:
- the LM head is tied to the token embedding; after the split the two copies live on the first and last stage,
  so their gradients are summed over those two ranks after every step (Megatron's approach) and the gradient
  norm counts the weight once: the copies stay identical and match single-process training;
- the schedule scales gradients by 1 / micro-batches and each micro-batch's loss is a token mean over equal-size
  micro-batches, so the gradient is the token mean over the whole batch, as in effkit's other modes;
- attention gets no mask: SDPA then applies its causal mask itself (effkit builds models with SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from effkit.measure.evaluation import lm_loss
from effkit.measure.hardware import autocast_ctx
from effkit.parallel.dims import ParallelDims

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks a (maybe split) GPT-2 holds, in order."""
    h = model.transformer.h
    return list(h.values()) if isinstance(h, nn.ModuleDict) else list(h)


def stage_layers(n_layer: int, stages: int, index: int) -> range:
    """The blocks of stage `index`: consecutive, as even as the count allows."""
    return range(n_layer * index // stages, n_layer * (index + 1) // stages)


class GPT2Stage(nn.Module):
    """One pipeline stage of a GPT-2 (`lm`: the Hugging Face model with only this stage's parts). Input: token ids
    on the first stage, hidden states elsewhere; output: hidden states, or logits on the last stage."""

    def __init__(self, model: nn.Module, index: int, stages: int, amp_dtype: torch.dtype | None):
        super().__init__()
        self.index, self.stages, self.amp_dtype = index, stages, amp_dtype
        self.first, self.last = index == 0, index == stages - 1
        self.layers = stage_layers(model.config.n_layer, stages, index)
        t = model.transformer
        t.h = nn.ModuleDict({str(i): t.h[i] for i in self.layers})
        if not self.first:
            t.wte, t.wpe = None, None
        if not self.last:
            t.ln_f, model.lm_head = None, None
        self.lm = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.lm.transformer
        with autocast_ctx(x.device, self.amp_dtype):
            if self.first:
                positions = torch.arange(x.shape[1], device=x.device)
                x = t.drop(t.wte(x) + t.wpe(positions)[None])
            for block in t.h.values():
                x = block(x)  # attention_mask=None: SDPA's own causal mask
            if self.last:
                x = self.lm.lm_head(t.ln_f(x))
        return x


@dataclass
class Pipeline:
    """This rank's stage and schedule, and the collectives a pipelined step needs around them."""

    module: GPT2Stage
    schedule: Any
    dims: ParallelDims
    group: Any  # this rank's pipeline (all stages of its data-parallel replica)
    ranks: list[int]  # global rank of every stage of that pipeline
    tied_group: Any = None  # first and last stage of this pipeline, when the LM head is tied
    tied: nn.Parameter | None = None  # this rank's copy of the tied embedding / LM head weight
    tied_drift: float | None = None  # max |LM head - embedding| over the two copies, when last gathered (rank 0)
    microbatches: int = 1

    @property
    def first(self) -> bool:
        return self.module.first

    @property
    def last(self) -> bool:
        return self.module.last

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-step (`batch` split into the schedule's micro-batches, through every
        stage); returns its loss (as scaled for gradient accumulation) on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        args = (batch,) if self.first else ()
        self.schedule.step(*args, target=batch if self.last else None, losses=losses, return_outputs=False)
        loss = torch.stack([v.detach().float() for v in losses]).mean() if self.last \
            else torch.zeros((), device=batch.device)
        dist.broadcast(loss, src=self.ranks[-1], group=self.group)
        return loss

    def sync_tied_gradients(self, _model: nn.Module | None = None) -> None:
        """Sum the tied weight's gradient over the first and last stage (each holds one use of it)."""
        if self.tied_group is None or self.tied.grad is None:
            return
        g = self.tied.grad
        dist.all_reduce(g.to_local() if type(g).__name__ == "DTensor" else g, group=self.tied_group)

    @torch.no_grad()
    def block_losses(self, batch: torch.Tensor) -> torch.Tensor:
        """Per-block held-out loss of `batch` (any batch size) on every rank: a plain forward through the stages
        with point-to-point sends (no schedule: evaluation batches need not split into micro-batches)."""
        b, t = batch.shape
        x = batch
        if not self.first:
            x = torch.empty(b, t, self.module.lm.config.n_embd, device=batch.device)
            dist.recv(x, src=self.ranks[self.module.index - 1], group=self.group)
        out = self.module(x)
        if self.last:
            losses = lm_loss(out, batch, reduction="none").view(b, -1).mean(1)
        else:
            dist.send(out.float().contiguous(), dst=self.ranks[self.module.index + 1], group=self.group)
            losses = torch.empty(b, device=batch.device)
        dist.broadcast(losses, src=self.ranks[-1], group=self.group)
        return losses


def split_stage(model: nn.Module, dims: ParallelDims, rank: int, amp_dtype: torch.dtype | None) -> GPT2Stage:
    """Keep this rank's stage of `model` (the rest is dropped)."""
    return GPT2Stage(model, dims.pp_rank(rank), dims.pp, amp_dtype)


def build_pipeline(module: GPT2Stage, dims: ParallelDims, pp_mesh, rank: int, schedule: str, microbatches: int,
                   loss_scale: int) -> Pipeline:
    """The `PipelineStage` and schedule of this rank's stage (after any sharding of it). Collective: every rank
    calls it (the tied-weight groups are made together)."""
    from torch.distributed import pipelining

    group = pp_mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    tie = module.lm.config.tie_word_embeddings
    tied_group, tied = None, None
    last_offset = (dims.pp - 1) * dims.dp * dims.tp
    for replica in range(dims.dp * dims.tp) if tie else ():  # new_group is collective: every rank makes every pair
        pair = dist.new_group([replica, last_offset + replica])
        if rank in (replica, last_offset + replica):
            tied_group = pair
    if tie:
        tied = module.lm.transformer.wte.weight if module.first else module.lm.lm_head.weight if module.last else None
    device = next(module.parameters()).device
    stage = pipelining.PipelineStage(module, module.index, dims.pp, device, group=group)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, target) / loss_scale

    sched = getattr(pipelining, SCHEDULES[schedule])(stage, n_microbatches=microbatches, loss_fn=loss_fn,
                                                    scale_grads=True)
    return Pipeline(module, sched, dims, group, ranks, tied_group, tied, microbatches=microbatches)


def _gather_to_rank0(local: dict[str, Any], pipeline: Pipeline, rank: int) -> dict[str, Any]:
    """Merge one dict per stage (sent by the stage's first data-parallel rank) on global rank 0; {} elsewhere."""
    send = local if pipeline.dims.dp_rank(rank) == 0 else {}
    parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(send, parts, dst=0)
    merged: dict[str, Any] = {}
    for part in parts or []:
        merged.update(part or {})
    return merged


def gather_model_state(pipeline: Pipeline, sharded: bool, rank: int) -> dict[str, torch.Tensor]:
    """The full model state (every stage's parts, the full model's keys) on global rank 0, CPU; {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # full_state_dict gathers shards within the stage's dp group (cpu_offload would keep them on global rank 0)
    local = get_model_state_dict(pipeline.module, options=StateDictOptions(full_state_dict=sharded))
    local = {k.removeprefix("lm."): v.detach().cpu() for k, v in local.items()}
    merged = _gather_to_rank0(local, pipeline, rank)
    if pipeline.tied is not None and "lm_head.weight" in merged:  # both copies, as a whole model's state dict
        pipeline.tied_drift = float((merged["lm_head.weight"] - merged["transformer.wte.weight"]).abs().max())
    return merged


def gather_optimizer_state(pipeline: Pipeline, optimizer, sharded: bool, rank: int) -> dict[str, Any]:
    """Every stage's optimizer state, keyed by parameter name, on global rank 0 (a checkpoint for the same
    pipeline layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    local = get_optimizer_state_dict(pipeline.module, optimizer, options=StateDictOptions(full_state_dict=sharded))
    local = {"state": {k: {n: (v.detach().cpu() if torch.is_tensor(v) else v) for n, v in s.items()}
                       for k, s in local["state"].items()},
             "param_groups": local["param_groups"]}
    parts = _gather_to_rank0({f"stage{pipeline.module.index}": local}, pipeline, rank)
    if rank != 0:
        return {}
    state: dict[str, Any] = {}
    for part in parts.values():
        state.update(part["state"])
    groups = [dict(g, params=[p for part in parts.values() for p in part["param_groups"][i]["params"]])
              for i, g in enumerate(parts["stage0"]["param_groups"])]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(pipeline: Pipeline, optimizer, state: dict[str, Any], sharded: bool) -> None:
    """Load this stage's part of a pipeline checkpoint's optimizer state (every rank read the whole file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {n for n, _ in pipeline.module.named_parameters()}
    own = {"state": {k: v for k, v in state["state"].items() if k in names},
           "param_groups": [dict(g, params=[p for p in g["params"] if p in names]) for g in state["param_groups"]]}
    set_optimizer_state_dict(pipeline.module, optimizer, own, options=StateDictOptions(full_state_dict=sharded))
