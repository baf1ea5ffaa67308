"""Plain greedy decoding against n-gram (prompt lookup) speculative decoding, on one model folder.

    python benchmarks/speculative.py MODEL_FOLDER [--data builtin] [--tokens 128] [--k 2,4,6] [--rounds 6]
                                     [--check-only] [--peers ENGINES] [--out reports/speculative]

MODEL_FOLDER is a PyTorch artifact (a Hugging Face GPT-2 folder with its tokenizer, e.g. the quickstart's dense or
pruned model). It is exported to ONNX Runtime fp32 and effkit's int8 (`write_artifact`), and (where it is an effkit
artifact, `--peers` naming which) written through every peer engine as the bench writes its peers (`make_peers`:
ONNX Runtime int8, OpenVINO, CTranslate2, llama.cpp), each decoding plainly as the bench decodes it (OpenVINO by
LLMPipeline, llama.cpp by its server, the others by `generate`) from the same prompts; the held-out prompts are
`workloads.DECODE_B1_HELDOUT`'s (`measure.generation.heldout_prompts` over the held-out documents of `--data`, the
same for every contender). Contenders, all at batch 1 over every prompt: each engine (ONNX Runtime fp32 and int8
through effkit's speculative loop, PyTorch through transformers' `prompt_lookup_num_tokens`) plainly and with the
n-gram draft at each `--k`. Exactness first: every contender's tokens against its own engine's plain greedy tokens,
token for token (`speculative.check_exact`: a contender that diverges is recorded with where, and never timed;
ONNX Runtime's dynamic int8 quantizes activations with one scale over all the tokens of a run, so checking k+1
tokens at once can round differently from decoding them one by one); the draft's statistics
(acceptance rate, tokens per target forward, the draft's share of the time) from effkit's loop. Then the timing:
`--rounds` interleaved rounds (`timing.interleaved`, order shuffled each round), tokens per second, and each
contender's paired ratio (`stats.paired_ratio`) to its engine's plain decoding, to the fastest plain contender and
to the fastest peer (`vs_fastest_peer`: the issue's batch-1 comparison). Writes `speculative.json` under --out
(samples kept). Timings are results only on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from effkit.data.corpus import load_corpus
from effkit.engines import speculative
from effkit.engines.onnxruntime import export as onnx_export
from effkit.engines.onnxruntime.runtime import OnnxCausalLM
from effkit.errors import EffkitError
from effkit.measure import hardware, stats, timing
from effkit.measure.generation import heldout_prompts
from effkit.model import load_model
from effkit.workloads import DECODE_B1_HELDOUT, HELDOUT_PROMPT_TOKENS


def decode_all(model, prompts: list[list[int]], tokens: int, kw: dict) -> tuple[list[list[int]], float, dict | None]:
    """Greedy decoding of `tokens` new tokens from each prompt at batch 1: the tokens, the seconds, and the
    speculative statistics summed over the prompts (effkit's loop only)."""
    made, total, t = [], speculative.SpecStats(), time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0, **kw)
            made.append(out[0, ids.shape[1]:].tolist())
            if kw and isinstance(s := getattr(model, "speculative_stats", None), speculative.SpecStats):
                total.add(s)
    return made, time.perf_counter() - t, total.to_dict() if total.forwards else None


def peer_timer(engine, model, prompts: list[list[int]], tokens: int):
    """A peer's greedy decoding of every prompt at batch 1 as the bench decodes it (tokens/s over all prompts):
    OpenVINO by LLMPipeline (its tokens checked on the first call), llama.cpp by its server, the others by
    `generate`."""
    if engine.name == "openvino":
        from effkit.engines.openvino import tune

        each = [tune.pipeline_timer(model, np.asarray([p]), tokens, model.decoding()[0]) for p in prompts]
    elif engine.name == "llamacpp":
        def one(p):
            def once() -> float:
                t = time.perf_counter()
                model.complete([p], tokens)
                return tokens / (time.perf_counter() - t)
            return once
        each = [one(p) for p in prompts]
    else:
        def once() -> float:
            return len(prompts) * tokens / decode_all(model, prompts, tokens, {})[1]
        once.settle_s = timing.settle_time(model)
        return once

    def over_all() -> float:
        return len(prompts) * tokens / sum(tokens / f() for f in each)
    over_all.settle_s = getattr(model, "settle_s", 0.0)
    return over_all


def with_peers(model_dir: str, scratch: Path, only: list[str]) -> tuple[dict, dict]:
    """The peers of `model_dir` (an effkit artifact), loaded: {tag: (engine, model)}, and why any is not run."""
    from effkit.artifacts.loader import engine_of, load_any
    from effkit.bench.discover import make_peers

    try:
        made, not_run = make_peers(Path(model_dir), scratch, only or None)
    except EffkitError as e:  # a plain Hugging Face folder has no data section: no peers
        return {}, {"peers": f"not run: {e}"}
    return {p.name: (engine_of(p), load_any(p)) for p in made}, not_run


def contenders(models: dict, prompts: list[list[int]], tokens: int, ks: list[int]) -> tuple[dict, dict]:
    """The timers (tokens/s) of every engine, plain and at each k, and each one's exactness and draft statistics
    (checked here, before any timing)."""
    timers, checks = {}, {}
    for engine, model in models.items():
        plain, _, _ = decode_all(model, prompts, tokens, {})
        for k in [0, *ks]:
            kw = speculative.generate_kwargs("ngram", k) if k else {}
            name = f"{engine} k{k}" if k else f"{engine} plain"
            made, seconds, spec = decode_all(model, prompts, tokens, kw)
            try:
                for i, (a, b) in enumerate(zip(plain, made, strict=True)):
                    speculative.check_exact(a, b, f"{name} on held-out prompt {i}")
            except EffkitError as e:  # not the target's text: reported, never timed
                checks[name] = {"exact": False, "diverged": str(e), **({"draft": spec} if spec else {})}
                continue
            checks[name] = {"exact": f"{len(prompts)} prompts x {tokens} tokens equal to {engine} plain",
                            **({"draft": spec} if spec else {})}

            def once(model=model, kw=kw) -> float:
                return len(prompts) * tokens / decode_all(model, prompts, tokens, kw)[1]
            once.settle_s = timing.settle_time(model)
            timers[name] = once
    return timers, checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--data", default="builtin")
    ap.add_argument("--heldout-fraction", type=float, default=0.05)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", default="2,4,6")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--check-only", action="store_true", help="exactness and draft statistics, no timing")
    ap.add_argument("--peers", default="", help="comma-separated peer engines (default: every one the bench runs)")
    ap.add_argument("--out", default="reports/speculative")
    a = ap.parse_args()
    ks = [int(k) for k in a.k.split(",") if k]
    tok = AutoTokenizer.from_pretrained(a.model)
    corpus = load_corpus(a.data, a.heldout_fraction)
    prompts = heldout_prompts([t for _, t in corpus.heldout], tok, DECODE_B1_HELDOUT.prompts, HELDOUT_PROMPT_TOKENS)
    pt = load_model(a.model).eval()
    with tempfile.TemporaryDirectory() as tmp:
        models = {"pytorch": pt}
        for name, int8 in (("onnxruntime-fp32", False), ("onnxruntime-int8", True)):
            (folder := Path(tmp) / name).mkdir()
            onnx_export.write_artifact(folder, copy.deepcopy(pt), tok, int8=int8, fused=False)
            models[name] = OnnxCausalLM(folder)
        timers, checks = contenders(models, prompts, a.tokens, ks)
        (scratch := Path(tmp) / "peers").mkdir()
        peers, peers_not_run = with_peers(a.model, scratch, [n for n in a.peers.split(",") if n])
        timers |= {tag: peer_timer(engine, m, prompts, a.tokens) for tag, (engine, m) in peers.items()}
        result = {"model": str(Path(a.model).resolve()), "cpu": hardware.describe_device(torch.device("cpu")),
                  "cpu_flags": hardware.cpu_flags(), "threads": torch.get_num_threads(), "tokens": a.tokens,
                  "prompts": {"count": len(prompts), "tokens": HELDOUT_PROMPT_TOKENS, "data": corpus.name,
                              "from": "held-out documents (workloads.DECODE_B1_HELDOUT)"},
                  "batch": 1, "k": ks, "checks": checks, "peers": list(peers), "peers_not_run": peers_not_run}
        if not a.check_only:
            samples = timing.interleaved(timers, a.rounds, 1, seed=0)
            rates = {n: float(np.median([x for r in s for x in r])) for n, s in samples.items()}
            best = max((n for n in rates if n.endswith("plain")), key=rates.__getitem__)
            if peers:  # the fastest peer at batch 1, and every speculative contender against it
                fastest = max(peers, key=rates.__getitem__)
                result |= {"fastest_peer": fastest,
                           "vs_fastest_peer": {n: stats.paired_ratio(samples[fastest], s, True)
                                               for n, s in samples.items() if n not in peers}}
            result |= {"rounds": a.rounds, "tokens_per_s": rates, "fastest_plain": best, "samples": samples,
                       "vs_own_plain": {n: stats.paired_ratio(samples[n.rsplit(" ", 1)[0] + " plain"], s, True)
                                        for n, s in samples.items() if not n.endswith("plain") and n not in peers},
                       "vs_fastest_plain": {n: stats.paired_ratio(samples[best], s, True)
                                            for n, s in samples.items() if n != best}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(result, indent=2))
    for name, c in checks.items():
        d = c.get("draft") or {}
        line = (f"acceptance {d['acceptance_rate']:.2f}, {d['tokens_per_target_forward']:.2f} tokens/forward, "
                f"draft {d['draft_share_of_time']:.0%} of the time" if d else "")
        rate = f"{result['tokens_per_s'][name]:8.1f} tok/s  " if name in result.get("tokens_per_s", {}) else ""
        print(f"{name:24s} {rate}{'exact' if c['exact'] else c['diverged']}  {line}")
    for tag in result["peers"]:
        print(f"{tag:24s} {result['tokens_per_s'][tag]:8.1f} tok/s" if "tokens_per_s" in result else tag)
    if "fastest_peer" in result:
        print("vs the fastest peer at batch 1 (" + result["fastest_peer"] + "): " + ", ".join(
            f"{n} {stats.fmt_ratio(r)}"
            for n, r in result["vs_fastest_peer"].items()))
    print(f"wrote {out / 'speculative.json'}")


if __name__ == "__main__":
    main()
