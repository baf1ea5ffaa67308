"""A draft made from the model itself, used for speculative decoding through PyTorch: acceptance and speed against
plain greedy decoding.

    python benchmarks/draft.py [MODEL] [--target 0.75] [--narrow 0.0] [--steps 100] [--k 4] [--prompts 8]
                               [--tokens 128] [--rounds 6] [--fixed-rounds] [--draft PATH] [--out reports/draft]

MODEL (default runs/quickstart/train, made by `effkit run`) is copied into OUT/runs/draft/train, so the run's own
artifacts are never touched; `effkit prune --mode draft` cuts it to a draft (`--target` of the blocks, `--narrow` of
the MLP channels) distilled from it for `--steps` steps (one round, no control arm: a draft is judged by acceptance
and cost, not by its loss), or `--draft` names one made before. Then, on `--prompts` prompts from the held-out blocks
(the first half of each; the same prompts for every contender), each decoded at batch 1 to `--tokens` new tokens:

- exactness: the assisted output against the target's own greedy output, token for token (a mismatch is reported
  with the prompt and the position where it diverged);
- acceptance: how a loop proposing k tokens per target forward accepts the draft's tokens (`effkit.prune.draft`);
- speed: greedy decoding of all prompts by the target alone, with the draft (transformers' assisted generation,
  `num_assistant_tokens` = k), and with prompt lookup (`prompt_lookup_num_tokens` = k, an n-gram draft that costs
  nothing), in paired, interleaved rounds (`effkit.measure.stopping`), ratios of time to the target alone.

Writes OUT/draft.json. Timings are results only on a machine nothing else loads."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from effkit import artifacts
from effkit.config import DataConfig, PruneConfig
from effkit.data import prepare
from effkit.engines.pytorch import DRAFT, ENGINE
from effkit.measure import hardware, stopping, timing
from effkit.prune import draft as drafts
from effkit.prune.stage import run_prune
from effkit.quiet import quiet_libraries


def make_draft(a, target: Path, out: Path) -> Path:
    cfg = PruneConfig.from_flat(source=str(target), mode="draft", target=a.target, rounds=1, finetune_steps=a.steps,
                                control=False, draft_narrow=a.narrow, draft_k=a.k, draft_prompts=a.prompts,
                                draft_new_tokens=a.tokens, distill_alpha=a.alpha, runs_dir=str(out / "runs"),
                                reports_dir=str(out / "reports"))
    return Path(run_prune(cfg)["artifact"])


def decode_all(model, prompts: torch.Tensor, new: int, **kw) -> list[torch.Tensor]:
    """Each prompt decoded greedily at batch 1 to exactly `new` tokens (its new tokens)."""
    with torch.inference_mode():
        return [model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0, **kw)[0, len(p):]
                for p in prompts]


def exactness(want: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    diverged = [{"prompt": i, "position": int((w != g).nonzero()[0])}
                for i, (w, g) in enumerate(zip(want, got, strict=True)) if not torch.equal(w, g)]
    return {"exact": not diverged, "diverged": diverged}


def timer(fn):
    def once() -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return once


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="runs/quickstart/train")
    ap.add_argument("--target", type=float, default=0.75, help="fraction of the blocks the draft removes")
    ap.add_argument("--narrow", type=float, default=0.0, help="fraction of the MLP channels it removes")
    ap.add_argument("--steps", type=int, default=100, help="distillation steps")
    ap.add_argument("--alpha", type=float, default=1.0, help="KL weight (1: the target's distribution only)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per target forward")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--fixed-rounds", action="store_true")
    ap.add_argument("--draft", default="", help="a draft made before (skips making one)")
    ap.add_argument("--out", default="reports/draft")
    a = ap.parse_args()
    quiet_libraries()
    out = Path(a.out)
    target = out / "runs" / "draft" / "train"
    if not target.is_dir():
        shutil.copytree(a.model, target)
    draft = Path(a.draft) if a.draft else make_draft(a, target, out)

    plain = ENGINE.load(target, torch.device("cpu")).eval()
    assisted = ENGINE.with_draft(target, draft, torch.device("cpu"), k=a.k).eval()
    blocks = prepare(DataConfig.from_dict(artifacts.data_section(target)), tokenizer_from=str(target)).blocks
    prompts, new = drafts.held_out_prompts(blocks.eval, a.prompts, plain.config.n_positions, a.tokens)
    want = decode_all(plain, prompts, new)
    checks = {"draft": exactness(want, decode_all(assisted, prompts, new)),
              "prompt_lookup": exactness(want, decode_all(plain, prompts, new, prompt_lookup_num_tokens=a.k))}
    sequences = torch.cat([prompts, torch.stack(want)], dim=1)
    acc = drafts.acceptance(assisted.draft, sequences, prompts.shape[1], a.k)

    contenders = {"greedy": timer(lambda: decode_all(plain, prompts, new)),
                  "draft": timer(lambda: decode_all(assisted, prompts, new)),
                  "prompt_lookup": timer(lambda: decode_all(plain, prompts, new, prompt_lookup_num_tokens=a.k))}
    samples = stopping.measure(contenders, stopping.Stopping(rounds=a.rounds, fixed=a.fixed_rounds), 1, warmup=1)
    p50 = {n: timing.latency_stats(s)["p50_s"] for n, s in samples.items()}
    result = {
        "target": str(target), "draft": str(draft), "draft_record": artifacts.read_meta(draft)["metrics"].get(DRAFT),
        "params": {"target": sum(p.numel() for p in plain.parameters()),
                   "draft": sum(p.numel() for p in assisted.draft.parameters())},
        "k": a.k, "prompts": len(prompts), "prompt_tokens": prompts.shape[1], "new_tokens": new,
        "exactness": checks, "acceptance": acc,
        "tokens_per_s": {n: len(prompts) * new / s for n, s in p50.items()},
        "time_ratio_vs_greedy": {n: samples.ratio("greedy", n) for n in ("draft", "prompt_lookup")},
        "stopping": samples.record,
        "protocol": "greedy decoding of every prompt at batch 1 (fp32, KV cache) per sample; "
                    + timing.INTERLEAVED_PROTOCOL.format(warmup=1, rounds=samples.record.get("rounds", a.rounds),
                                                         repeats=1),
        "device": hardware.describe_device(torch.device("cpu")), "cpu_flags": hardware.cpu_flags(),
        "threads": torch.get_num_threads(), "versions": artifacts.versions(), "git_commit": artifacts.git_commit(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({k: result[k] for k in ("params", "exactness", "acceptance", "tokens_per_s",
                                             "time_ratio_vs_greedy")}, indent=2, default=str))


if __name__ == "__main__":
    main()
