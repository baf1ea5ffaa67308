"""Drafts for speculative decoding: the target cut to a much smaller model of the same vocabulary, distilled on the
target's own next-token distribution, and judged as a draft is used.

`effkit prune --mode draft` removes `--target` of the blocks (ranked as depth ranks them) and, with
`--draft-narrow`, that fraction of the MLP channels too (ranked as row ranks them); the fine-tuning between rounds
distils from the frozen target, on the training blocks only (the prune stage's loop). What decides whether a draft
pays is not its own loss but how often the target accepts its tokens and what it costs per token, so every round
records (`DRAFT` in its artifact's metrics, `effkit.json`):

- which target it drafts for: its folder and a digest of its configuration and weights (`target_digest`);
- its acceptance of the target's greedy tokens on held-out prompts, as a loop proposing k tokens per target forward
  would accept them (`acceptance`): the target's greedy continuation of each prompt, then one forward of the draft
  over it. While the draft agrees, its context is the target's, so the tokens a k-token loop accepts at each step
  are the leading run of positions where the draft's argmax equals the target's token, capped at k;
- its decode cost per token against the target's (greedy decoding with the KV cache at batch 1, paired and
  interleaved), and the speed-up these two imply for k tokens per step, `tokens per forward / (1 + k x cost)`.

The same tokenizer holds by construction (the draft is cut from the target); a draft paired with a target whose
vocabulary differs is refused in one line (`effkit.engines.pytorch.check_vocabulary`)."""

from __future__ import annotations

import copy
import hashlib
import time
from pathlib import Path
from typing import Any

import torch

from effkit.engines.pytorch import DRAFT
from effkit.measure import stopping, timing
from effkit.prune.depth import DepthPruner
from effkit.prune.methods import options_of
from effkit.prune.options import DraftOptions
from effkit.prune.row import prune_mlp_channels
from effkit.prune.structure import kept_width


def target_digest(path: str | Path) -> str:
    """sha256 of the target's configuration and weights (config.json and its *.safetensors, in name order)."""
    h = hashlib.sha256()
    files = [Path(path) / "config.json", *sorted(Path(path).glob("*.safetensors"))]
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def held_out_prompts(eval_blocks: torch.Tensor, n: int, n_positions: int, new_tokens: int) -> tuple[torch.Tensor, int]:
    """The first `n` held-out blocks' first halves as prompts, and the new tokens that fit after them."""
    prompt_len = eval_blocks.shape[1] // 2
    return eval_blocks[:n, :prompt_len], max(1, min(new_tokens, n_positions - prompt_len))


@torch.no_grad()
def target_greedy(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The prompts followed by exactly `new_tokens` of the target's greedy tokens (KV cache)."""
    device = next(target.parameters()).device
    ids = prompts.to(device)
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                           pad_token_id=target.config.eos_token_id or 0).cpu()


def accepted_runs(matches: list[bool], k: int) -> tuple[int, int, int]:
    """(tokens accepted, tokens proposed, target forwards) of a loop proposing up to k tokens per target forward
    over a continuation whose positions the draft gets right (`matches`): each step accepts the leading run of
    matches and the target adds its own next token."""
    accepted = proposed = forwards = pos = 0
    while pos < len(matches):
        m = min(k, len(matches) - pos)
        run = next((i for i in range(m) if not matches[pos + i]), m)
        accepted, proposed, forwards, pos = accepted + run, proposed + m, forwards + 1, pos + run + 1
    return accepted, proposed, forwards


@torch.no_grad()
def acceptance(draft, sequences: torch.Tensor, prompt_len: int, k: int) -> dict[str, Any]:
    """How a k-token loop would accept the draft's tokens on `sequences` (prompts + the target's greedy tokens)."""
    was_training = draft.training
    draft.eval()
    device = next(draft.parameters()).device
    pred = draft(sequences.to(device)).logits[:, prompt_len - 1:-1].argmax(-1).cpu()
    draft.train(was_training)
    matches = (pred == sequences[:, prompt_len:]).tolist()
    runs = [accepted_runs(row, k) for row in matches]
    accepted, proposed, forwards = (sum(r[i] for r in runs) for i in range(3))
    new = sequences.shape[1] - prompt_len
    return {"k": k, "acceptance_rate": accepted / proposed, "tokens_per_target_forward": len(runs) * new / forwards,
            "agreement": sum(map(sum, matches)) / (len(matches) * new), "prompts": len(runs),
            "prompt_tokens": prompt_len, "new_tokens": new}


def decode_timer(model, prompt: torch.Tensor, new_tokens: int):
    """A no-argument timer of greedy decoding of `new_tokens` from `prompt` at batch 1 (seconds)."""
    device = next(model.parameters()).device
    ids = prompt[:1].to(device)
    pad = model.config.eos_token_id or 0

    @torch.inference_mode()
    def once() -> float:
        timing.synchronize(device)
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, use_cache=True, pad_token_id=pad)
        timing.synchronize(device)
        return time.perf_counter() - t

    return once


def cost_per_token(target, draft, prompt: torch.Tensor, new_tokens: int, cfg) -> dict[str, Any]:
    """The draft's decode time per token against the target's, paired and interleaved (the prune stage's
    stopping rule and repeats)."""
    was_training = draft.training
    draft.eval()
    samples = stopping.measure({"target": decode_timer(target, prompt, new_tokens),
                                "draft": decode_timer(draft, prompt, new_tokens)},
                               stopping.Stopping.of(cfg.measure, "latency_rounds"), cfg.measure.latency_repeats,
                               warmup=1)
    draft.train(was_training)
    per_token = {n: timing.latency_stats(s)["p50_s"] / new_tokens for n, s in samples.items()}
    return {"cost_ratio": samples.ratio("target", "draft"), "target_s_per_token": per_token["target"],
            "draft_s_per_token": per_token["draft"], "stopping": samples.record,
            "how": f"greedy decoding of {new_tokens} tokens at batch 1 with the KV cache, draft / target, paired "
                   "and interleaved"}


class DraftPruner(DepthPruner):
    """Blocks removed as depth removes them, MLP channels as row does (`--draft-narrow`); each round judged as a
    draft: its acceptance of the target's greedy tokens and its cost per token."""

    name = "draft"
    options = DraftOptions

    def ranks_by(self, cfg) -> str:
        return ("blocks: calibration-loss increase when skipped; MLP channels: L2 norm of their c_fc row; judged by "
                "acceptance of the target's greedy tokens and cost per token")

    def _mlp(self, cfg, config, fraction: float) -> int:
        o = options_of(cfg, DraftOptions)
        n = config.n_inner or 4 * config.n_embd
        if not o.draft_narrow:
            return n
        return kept_width(n, o.draft_narrow * fraction / cfg.method.target, o.width_multiple, "an MLP width")

    def plan(self, cfg, model) -> dict:
        out = super().plan(cfg, model)
        n = model.config.n_inner or 4 * model.config.n_embd
        return {**out, "n_inner": f"{n} -> {self._mlp(cfg, model.config, cfg.method.target)}"}

    def cut_config(self, cfg, config, fraction: float):
        c = super().cut_config(cfg, config, fraction)
        c.n_inner = self._mlp(cfg, config, fraction)
        return c

    def start(self, cfg, model):
        blocks, config0 = super().start(cfg, model), copy.deepcopy(model.config)

        def cut(model, fraction, calib):
            model, done, _ = blocks(model, fraction, calib)
            keep = self._mlp(cfg, config0, fraction)
            if keep < (model.config.n_inner or 4 * model.config.n_embd):
                prune_mlp_channels(model, keep)
            return model, {**done, "n_inner": keep}, None

        return cut

    def round_metrics(self, cfg, model, target, blocks, source: Path) -> dict[str, Any]:
        """The draft record of a round (see the module's text): what it drafts for, its acceptance, its cost."""
        o = options_of(cfg, DraftOptions)
        prompts, new = held_out_prompts(blocks.eval, o.draft_prompts, target.config.n_positions, o.draft_new_tokens)
        sequences = target_greedy(target, prompts, new)
        acc = acceptance(model, sequences, prompts.shape[1], o.draft_k)
        cost = cost_per_token(target, model, prompts, new, cfg)
        ratio = cost["cost_ratio"]["ratio"]
        return {DRAFT: {"target": str(source), "target_digest": target_digest(source), **acc, "cost": cost,
                        "projected_speedup": acc["tokens_per_target_forward"] / (1 + o.draft_k * ratio),
                        "held_out": "prompts: the first half of each of the first held-out blocks; the continuation: "
                                    "the target's greedy tokens"}}


PRUNER = DraftPruner()
