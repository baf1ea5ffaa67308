"""Width pruning: remove residual channels (`n_embd`) uniformly, through Torch-Pruning's dependency graph.

The residual stream is one coupled group: the token and position embeddings, every LayerNorm, the input of
every projection that reads the stream (`c_attn`, `c_fc`, the tied LM head) and the output of every projection
that writes to it (`attn.c_proj`, `mlp.c_proj`). Torch-Pruning's `DependencyGraph` traces it on effkit's Linear
form of the model, its group importance ranks the channels (`GroupMagnitudeImportance`, or `GroupTaylorImportance`
from the gradients of a few calibration batches) and the group is pruned as a whole.

`GPT2Config` ties the attention width to the residual (`head_dim = n_embd / n_head`), so the attention width
shrinks with it, and it must stay the same in every head. Torch-Pruning knows neither the fused q/k/v layout of
`c_attn` nor that q and k share their dimensions: its graph maps output channel i of `c_attn` to input column i
of `attn.c_proj`, through the split, for i up to 3 x n_embd (checked on transformers 5.23: its group importance
then indexes past the end). So effkit chooses those channels itself, head by head, with the same kind of score
as the residual group's importance (the squared L2 norm of the coupled weights, or |weight x gradient| for
taylor): each head keeps the `head_dim'` q/k dimensions whose q and k rows score highest together (the same
index set is cut from q and from k), and the `head_dim'` value dimensions whose v row and `attn.c_proj` column
score highest. The kept queries are scaled by
`sqrt(head_dim' / head_dim)` so that the attention logits of the kept dimensions keep their scale under the new
`1/sqrt(head_dim')`. The model is then rebuilt from a `GPT2Config` with the new `n_embd` (and the MLP width made
explicit, since `n_inner=None` means `4 * n_embd`), so plain `from_pretrained` loads the artifact.

The width kept is a multiple of the heads and of `--width-multiple` (default 32, `options.Options`): every
projection that reads the residual stream (`c_attn`, `c_fc`, the head) stores its rows, n_embd long, in llama.cpp's
Q8_0/Q4_0 blocks of 32 or ONNX Runtime's MatMulNBits blocks, so a width that is no multiple of the block cannot be
exported to them.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from effkit.errors import EffkitError
from effkit.measure import evaluation
from effkit.prune.methods import options_of
from effkit.prune.options import Options, check_multiple
from effkit.prune.structure import kept_width, rebuild


def valid_width(n_embd: int, n_head: int, fraction: float, multiple: int = 1) -> int:
    """The residual width left after removing `fraction` of `n_embd`, rounded to the nearest multiple of both `n_head`
    (GPT2Config's heads are equal) and `multiple` (`--width-multiple`; 1: of the heads alone, as before it existed),
    never 0 and never above `n_embd`."""
    keep = round(n_embd * (1 - fraction) / n_head) * n_head
    if keep < n_head:
        raise EffkitError(f"removing {fraction:.0%} of {n_embd} residual channels leaves less than one channel per "
                          f"head ({n_head} heads); use a smaller --target")
    check_multiple(multiple)  # before lcm, which takes 0 and negative numbers without a word
    return kept_width(n_embd, fraction, math.lcm(multiple, n_head), "a residual width",
                      of=f"the least common multiple of --width-multiple {multiple} and the {n_head} heads")


def _importance(kind: str):
    import torch_pruning as tp

    return tp.importance.GroupTaylorImportance() if kind == "taylor" else tp.importance.GroupMagnitudeImportance(p=2)


def _gradients(model: nn.Module, calib: list[torch.Tensor]) -> None:
    """Accumulate the calibration batches' next-token-loss gradients in `.grad` (Taylor importance)."""
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    for b in calib:
        b = b.to(device)
        (evaluation.lm_loss(model(b).logits, b) / len(calib)).backward()


def _channel_scores(weight: torch.Tensor, bias: torch.Tensor | None, dim: int, taylor: bool) -> torch.Tensor:
    """Per channel along `dim` (0: output rows, 1: input columns) of one layer: the squared L2 norm of its weights
    (and bias), or with `taylor` the sum of |weight x gradient| (the first-order loss change of removing it)."""
    def score(t: torch.Tensor) -> torch.Tensor:
        if taylor:
            return (t * t.grad).abs() if t.grad is not None else torch.zeros_like(t)
        return t.detach().pow(2)

    s = score(weight).sum(dim=1 - dim)
    if bias is not None and dim == 0:
        s = s + score(bias)
    return s


def _head_keep(scores: torch.Tensor, n_head: int, keep: int) -> torch.Tensor:
    """(n_head, head_dim) scores -> flat channel indices of the `keep` best dimensions of every head."""
    head_dim = scores.shape[1]
    best = scores.topk(keep, dim=1).indices.sort(dim=1).values
    return (best + torch.arange(n_head, device=best.device)[:, None] * head_dim).flatten()


def prune_width(model: nn.Module, width: int, importance: str = "magnitude",
                calib: list[torch.Tensor] | None = None) -> tuple[nn.Module, dict]:
    """`model` with its residual (and attention) width cut to `width` channels, and what was done."""
    import torch_pruning as tp

    cfg = model.config
    n, n_head = cfg.n_embd, cfg.n_head
    if width >= n:
        return model, {"n_embd": n, "removed_channels": 0}
    if width % n_head:
        raise EffkitError(f"a width of {width} does not divide by the {n_head} heads")
    if importance == "taylor" and not calib:
        raise EffkitError("--importance taylor needs calibration batches (gradients of the loss on training data)")
    head_dim, new_head_dim = n // n_head, width // n_head
    work = copy.deepcopy(model).eval()
    example = (calib[0][:1] if calib else torch.zeros(1, 8, dtype=torch.long)).to(next(work.parameters()).device)
    graph = tp.DependencyGraph().build_dependency(work, example_inputs=example,
                                                  output_transform=lambda out: out.logits.sum())
    imp = _importance(importance)
    if importance == "taylor":
        _gradients(work, calib)

    with torch.no_grad():
        # attention: scored by head before anything is cut
        attn_keep = []
        taylor = importance == "taylor"
        for block in work.transformer.h:
            c_attn, c_proj = block.attn.c_attn, block.attn.c_proj
            q, k, v = _channel_scores(c_attn.weight, c_attn.bias, 0, taylor).view(3, n_head, head_dim)
            v = v + _channel_scores(c_proj.weight, None, 1, taylor).view(n_head, head_dim)
            attn_keep.append((_head_keep(q + k, n_head, new_head_dim), _head_keep(v, n_head, new_head_dim)))

        # the residual group, found and cut by the dependency graph
        wte = work.transformer.wte
        group = graph.get_pruning_group(wte, tp.prune_embedding_out_channels, idxs=list(range(n)))
        scores = imp(group)
        drop = sorted(scores.argsort()[: n - width].tolist())
        group = graph.get_pruning_group(wte, tp.prune_embedding_out_channels, idxs=drop)
        if not graph.check_pruning_group(group):
            raise EffkitError("Torch-Pruning refused the residual-channel group of this model")
        group.prune()

        sd = {k: v.detach().clone() for k, v in work.state_dict().items()}
        for i, (qk, v) in enumerate(attn_keep):
            rows = torch.cat([qk, n + qk, 2 * n + v]).to(sd[f"transformer.h.{i}.attn.c_attn.weight"].device)
            for name in ("weight", "bias"):
                t = sd[f"transformer.h.{i}.attn.c_attn.{name}"][rows]
                t[:width] *= math.sqrt(new_head_dim / head_dim)  # the queries: same logit scale
                sd[f"transformer.h.{i}.attn.c_attn.{name}"] = t
            sd[f"transformer.h.{i}.attn.c_proj.weight"] = sd[f"transformer.h.{i}.attn.c_proj.weight"][:, v]
    n_inner = cfg.n_inner or 4 * n
    try:
        new = rebuild(model, sd, n_embd=width, n_inner=n_inner)
    except RuntimeError as e:  # a tensor the group missed or cut twice: never save a half-pruned model
        raise EffkitError(f"width pruning left inconsistent shapes: {str(e).splitlines()[0][:200]}") from None
    return new, {"n_embd": width, "removed_channels": n - width, "head_dim": new_head_dim, "n_inner": n_inner,
                 "importance": f"residual: torch_pruning {type(imp).__name__} over its dependency group ("
                               f"{len(group)} dependencies); attention: per head, "
                               + ("|weight x gradient|" if taylor else "squared L2 norm")}


class WidthPruner:
    """The residual-channel group cut uniformly (Torch-Pruning's dependency graph; q/k/v chosen per head)."""

    name = "width"
    options = Options
    structured = True
    importances = ("magnitude", "taylor")
    counts_block_params = True

    def ranks_by(self, cfg) -> str:
        return f"Torch-Pruning group {cfg.method.importance} importance (residual group; per head for q/k and v)"

    def needs_calibration(self, cfg) -> bool:
        return cfg.method.importance == "taylor"

    def plan(self, cfg, model) -> dict:
        c = model.config
        m = options_of(cfg, Options).width_multiple
        width = valid_width(c.n_embd, c.n_head, cfg.method.target, m)
        if width == c.n_embd:
            raise EffkitError(f"--target {cfg.method.target} removes no residual channel of {c.n_embd} once rounded "
                              f"to a multiple of the {c.n_head} heads and of {m} (--width-multiple); use a larger "
                              "--target or a smaller --width-multiple")
        return {"n_embd": f"{c.n_embd} -> {width} (a multiple of n_head={c.n_head}, since GPT2Config needs equal "
                          f"heads, and of --width-multiple {m}; {1 - width / c.n_embd:.1%} removed for --target "
                          f"{cfg.method.target})",
                "head_dim": f"{c.n_embd // c.n_head} -> {width // c.n_head}"}

    def cut_config(self, cfg, config, fraction: float):
        """`config` with the residual width a cut of `fraction` keeps (the memory plan's student)."""
        c = copy.deepcopy(config)
        c.n_embd = valid_width(config.n_embd, config.n_head, fraction, options_of(cfg, Options).width_multiple)
        return c

    def start(self, cfg, model):
        n_embd0 = model.config.n_embd
        m = options_of(cfg, Options).width_multiple

        def cut(model, fraction, calib):
            # the width is rounded, then the group importance picks the channels as before: rounding changes how
            # many survive, never which ones rank first
            width = valid_width(n_embd0, model.config.n_head, fraction, m)
            model, done = prune_width(model, width, cfg.method.importance, calib)
            return model, {**done, "width_multiple": m, "target": fraction,
                           "fraction_reached": 1 - width / n_embd0}, None

        return cut


PRUNER = WidthPruner()
