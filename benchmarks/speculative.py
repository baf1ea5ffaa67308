"""Plain greedy decoding against n-gram (prompt lookup) speculative decoding, on one model folder and its weight-only
quantized targets, against the peer engines, at batch 1 and at batch 12.

    python benchmarks/speculative.py MODEL_FOLDER [--target QUANTIZED_FOLDER ...] [--data SOURCE] [--tokens 128]
                                     [--k 2,4,6] [--rounds 6] [--prompts 8] [--batch12-prompts 12]
                                     [--engines pytorch,onnxruntime-fp32,onnxruntime-int8] [--check-only]
                                     [--peers ENGINES] [--out reports/speculative]

MODEL_FOLDER is a PyTorch artifact (a Hugging Face GPT-2 folder with its tokenizer, e.g. the quickstart's dense model
or the trained `gpt2` shape). `--engines` names the forms of it decoded here: PyTorch, and its ONNX Runtime fp32 and
effkit int8 exports (`write_artifact`). Each `--target` is a weight-only ONNX Runtime artifact of it (`effkit quantize
--backend onnxruntime-int4`: MatMulNBits, 4 or 8 bits, any accuracy level), decoded as its speculative artifact
decodes it (effkit's loop over its with-past graph). Where MODEL_FOLDER is an effkit artifact, every peer engine
(`--peers` naming which) is written as the bench writes its peers (`make_peers`: ONNX Runtime int8, OpenVINO,
CTranslate2, llama.cpp) and decodes plainly as the bench decodes it (OpenVINO by LLMPipeline, llama.cpp by its
server, the others by `generate`).

Prompts: the bench's (`bench.speculative.prompts`): `workloads.DECODE_B1.prompts` of them (`--prompts` another),
cut from the held-out documents of the model's own data split (`--data` another corpus), the same for every
contender and peer; their count is in the report.

Batch 1: every form and target plainly and with the n-gram draft at each `--k` (ONNX Runtime through effkit's
speculative loop, PyTorch through transformers' `prompt_lookup_num_tokens`). Exactness first: every contender's
tokens against its own plain greedy tokens, token for token (`speculative.check_exact`: a contender that diverges is
recorded with where, and never timed; ONNX Runtime's dynamic int8 quantizes activations with one scale over all the
tokens of a run, so checking k+1 tokens at once can round differently from decoding them one by one); the draft's
statistics (acceptance rate, tokens per target forward, the draft's share of the time) from effkit's loop. Then
`--rounds` interleaved rounds (`timing.interleaved`, order shuffled each round), tokens per second, and each
contender's paired ratio (`stats.paired_ratio`, 95% intervals) to its own plain decoding, to the fastest plain
contender, to every peer (`vs_peers`) and to the fastest peer (`vs_fastest_peer`: the issue's batch-1 comparison).

Batch 12: a speculative artifact runs its target's plain batched decoding there (its draft and k apply at batch 1),
so every form and target decodes `--batch12-prompts` held-out prompts as one batch plainly, beside every peer, in
their own interleaved rounds, with paired ratios to every peer (`batch_12`).

Writes `speculative.json` under --out (samples kept). Timings are results only on an otherwise idle machine.
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

from effkit import artifacts
from effkit.bench import speculative as bench_spec
from effkit.engines import speculative
from effkit.engines.onnxruntime import export as onnx_export
from effkit.engines.onnxruntime.runtime import OnnxCausalLM
from effkit.errors import EffkitError
from effkit.measure import hardware, stats, timing
from effkit.model import load_model
from effkit.workloads import DECODE_B1, DECODE_B12, HELDOUT_PROMPT_TOKENS

FORMS = ("pytorch", "onnxruntime-fp32", "onnxruntime-int8")  # the model's own forms decoded here (`--engines`)


def decode_all(model, batches: list[list[list[int]]], tokens: int, kw: dict) -> tuple[list[list[int]], float,
                                                                                      dict | None]:
    """Greedy decoding of `tokens` new tokens from each batch of prompts (one `generate` a batch): every row's
    tokens, the seconds, and the speculative statistics summed over the batches (effkit's loop only)."""
    made, total, t = [], speculative.SpecStats(), time.perf_counter()
    with torch.inference_mode():
        for rows in batches:
            ids = torch.tensor(rows)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0, **kw)
            made += out[:, ids.shape[1]:].tolist()
            if kw and isinstance(s := getattr(model, "speculative_stats", None), speculative.SpecStats):
                total.add(s)
    return made, time.perf_counter() - t, total.to_dict() if total.forwards else None


def rate_timer(model, batches: list[list[list[int]]], tokens: int, kw: dict | None = None):
    """Tokens per second of `decode_all` over every batch (a no-argument timer)."""
    rows = sum(map(len, batches))

    def once() -> float:
        return rows * tokens / decode_all(model, batches, tokens, kw or {})[1]
    once.settle_s = timing.settle_time(model)
    return once


def peer_timer(engine, model, batches: list[list[list[int]]], tokens: int):
    """A peer's greedy decoding of every batch of prompts as the bench decodes it (tokens/s over all rows):
    OpenVINO by LLMPipeline (its tokens checked on the first call), llama.cpp by its server (a batch's rows as
    parallel sequences of one request), the others by `generate`."""
    if engine.name == "openvino":
        from effkit.engines.openvino import tune

        each = [tune.pipeline_timer(model, [np.asarray(rows)], tokens, model.decoding()[0]) for rows in batches]
    elif engine.name == "llamacpp":
        def one(rows):
            def once() -> float:
                t = time.perf_counter()
                model.complete(rows, tokens)
                return len(rows) * tokens / (time.perf_counter() - t)
            return once
        each = [one(rows) for rows in batches]
    else:
        return rate_timer(model, batches, tokens)
    total = sum(map(len, batches)) * tokens

    def over_all() -> float:
        return total / sum(len(rows) * tokens / f() for rows, f in zip(batches, each, strict=True))
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


def own_models(a, tmp: Path, tok) -> dict:
    """The model's forms asked for (`--engines`) and every `--target`, loaded: {name: model}."""
    unknown = sorted(set(a.engines) - set(FORMS))
    if unknown:
        raise EffkitError(f"--engines: unknown {', '.join(unknown)}; choose among {', '.join(FORMS)}")
    pt = load_model(a.model).eval()
    models = {"pytorch": pt} if "pytorch" in a.engines else {}
    for name, int8 in (("onnxruntime-fp32", False), ("onnxruntime-int8", True)):
        if name in a.engines:
            (folder := tmp / name).mkdir()
            onnx_export.write_artifact(folder, copy.deepcopy(pt), tok, int8=int8, fused=False)
            models[name] = OnnxCausalLM(folder)
    for target in a.target:
        from effkit.artifacts.loader import load_any

        model = load_any(target)
        if not isinstance(model, OnnxCausalLM):
            raise EffkitError(f"--target {target}: not an ONNX Runtime artifact (effkit quantize --backend "
                              "onnxruntime-int4 writes one)")
        models[Path(target).name] = model
    return models


def contenders(models: dict, prompts: list[list[int]], tokens: int, ks: list[int]) -> tuple[dict, dict]:
    """The batch-1 timers (tokens/s) of every form and target, plain and at each k, and each one's exactness and
    draft statistics (checked here, before any timing)."""
    timers, checks, batches = {}, {}, [[p] for p in prompts]
    for engine, model in models.items():
        plain, _, _ = decode_all(model, batches, tokens, {})
        for k in [0, *ks]:
            kw = speculative.generate_kwargs("ngram", k) if k else {}
            name = f"{engine} k{k}" if k else f"{engine} plain"
            made, seconds, spec = decode_all(model, batches, tokens, kw)
            try:
                for i, (a, b) in enumerate(zip(plain, made, strict=True)):
                    speculative.check_exact(a, b, f"{name} on held-out prompt {i}")
            except EffkitError as e:  # not the target's text: reported, never timed
                checks[name] = {"exact": False, "diverged": str(e), **({"draft": spec} if spec else {})}
                continue
            checks[name] = {"exact": f"{len(prompts)} prompts x {tokens} tokens equal to {engine} plain",
                            **({"draft": spec} if spec else {})}
            timers[name] = rate_timer(model, batches, tokens, kw)
    return timers, checks


def ratios(samples: dict, peers: list[str]) -> dict:
    """Every contender's paired ratio to every peer, and the fastest peer's name and ratios."""
    rates = {n: float(np.median([x for r in s for x in r])) for n, s in samples.items()}
    out = {"tokens_per_s": rates, "samples": samples}
    if peers:
        fastest = max(peers, key=rates.__getitem__)
        out |= {"vs_peers": {n: {p: stats.paired_ratio(samples[p], s, True) for p in peers}
                             for n, s in samples.items() if n not in peers},
                "fastest_peer": fastest,
                "vs_fastest_peer": {n: stats.paired_ratio(samples[fastest], s, True)
                                    for n, s in samples.items() if n not in peers}}
    return out


def time_b1(timers: dict, rounds: int, peers: list[str]) -> dict:
    """Batch 1: every timer in interleaved rounds, with the paired ratios the report keeps."""
    samples = timing.interleaved(timers, rounds, 1, seed=0)
    out = ratios(samples, peers)
    rates = out["tokens_per_s"]
    best = max((n for n in rates if n.endswith("plain")), key=rates.__getitem__)
    return out | {"fastest_plain": best,
                  "vs_own_plain": {n: stats.paired_ratio(samples[n.rsplit(" ", 1)[0] + " plain"], s, True)
                                   for n, s in samples.items() if n.rsplit(" ", 1)[-1][:1] == "k"},
                  "vs_fastest_plain": {n: stats.paired_ratio(samples[best], s, True)
                                       for n, s in samples.items() if n != best}}


def time_b12(models: dict, peers: dict, prompts: list[list[int]], tokens: int, rounds: int) -> dict:
    """Batch 12: every form and target's plain batched decoding (what its speculative artifact runs there) and every
    peer's, of the same prompts as one batch."""
    timers = {f"{n} plain": rate_timer(m, [prompts], tokens) for n, m in models.items()}
    timers |= {tag: peer_timer(engine, m, [prompts], tokens) for tag, (engine, m) in peers.items()}
    out = ratios(timing.interleaved(timers, rounds, 1, seed=1), list(peers))
    return {"batch": len(prompts), "runs": "plain batched decoding of each target (a speculative artifact's draft "
            "and k apply at batch 1)", **out}


def heldout(a, tok) -> tuple[list[list[int]], list[list[int]], dict]:
    """The batch-1 and batch-12 prompts (the bench's cut of the held-out documents) and where they come from."""
    data = artifacts.data_section(Path(a.model), a.data)
    b1, b12 = ([p.tolist() for p in bench_spec.prompts(Path(a.model), data, tok, n)]
               for n in (a.prompts, a.batch12_prompts))
    return b1, b12, {"count": len(b1), "batch_12_count": len(b12), "tokens": HELDOUT_PROMPT_TOKENS,
                     "data": data["source"], "from": "held-out documents (the bench's decode workloads' cut), the "
                     "same for every contender and peer"}


def run(a, tok) -> dict:
    ks = [int(k) for k in a.k.split(",") if k]
    prompts, prompts12, where = heldout(a, tok)
    with tempfile.TemporaryDirectory() as tmp:
        models = own_models(a, Path(tmp), tok)
        timers, checks = contenders(models, prompts, a.tokens, ks)
        (scratch := Path(tmp) / "peers").mkdir()
        peers, peers_not_run = with_peers(a.model, scratch, [n for n in a.peers.split(",") if n])
        timers |= {tag: peer_timer(engine, m, [[p] for p in prompts], a.tokens) for tag, (engine, m) in peers.items()}
        result = {"model": str(Path(a.model).resolve()), "targets": [str(Path(t).resolve()) for t in a.target],
                  "cpu": hardware.describe_device(torch.device("cpu")), "cpu_flags": hardware.cpu_flags(),
                  "threads": torch.get_num_threads(), "tokens": a.tokens, "prompts": where, "batch": 1, "k": ks,
                  "checks": checks, "peers": list(peers), "peers_not_run": peers_not_run}
        if not a.check_only:
            result |= {"rounds": a.rounds, **time_b1(timers, a.rounds, list(peers))}
            result["batch_12"] = time_b12(models, peers, prompts12, a.tokens, a.rounds)
    return result


def show(result: dict) -> None:
    rates = result.get("tokens_per_s", {})
    for name, c in result["checks"].items():
        d = c.get("draft") or {}
        line = (f"acceptance {d['acceptance_rate']:.2f}, {d['tokens_per_target_forward']:.2f} tokens/forward, "
                f"draft {d['draft_share_of_time']:.0%} of the time" if d else "")
        rate = f"{rates[name]:8.1f} tok/s  " if name in rates else ""
        print(f"{name:32s} {rate}{'exact' if c['exact'] else c['diverged']}  {line}")
    for tag in result["peers"]:
        print(f"{tag:32s} {rates[tag]:8.1f} tok/s" if tag in rates else tag)
    for b, part in (("1", result), (f"{DECODE_B12.batch}", result.get("batch_12", {}))):
        if "vs_peers" in part:
            print(f"batch {b}, paired ratios to every peer (95% intervals; fastest: {part['fastest_peer']}):")
            for n, vs in part["vs_peers"].items():
                print(f"  {n:30s} {part['tokens_per_s'][n]:8.1f} tok/s  "
                      + ", ".join(f"{p} {stats.fmt_ratio(r)}" for p, r in vs.items()))
    if b12 := result.get("batch_12"):
        print(f"batch {b12['batch']}: {b12['runs']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--target", action="append", default=[], help="a weight-only ONNX Runtime artifact of MODEL "
                    "(effkit quantize --backend onnxruntime-int4); repeatable")
    ap.add_argument("--data", default="", help="the corpus whose held-out documents give the prompts (default: "
                    "the model's own data split)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", default="2,4,6")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=DECODE_B1.prompts, help="held-out prompts at batch 1")
    ap.add_argument("--batch12-prompts", type=int, default=DECODE_B12.batch, help="held-out prompts of the batch")
    ap.add_argument("--engines", default=",".join(FORMS), help="the model's forms decoded here, comma-separated")
    ap.add_argument("--check-only", action="store_true", help="exactness and draft statistics, no timing")
    ap.add_argument("--peers", default="", help="comma-separated peer engines (default: every one the bench runs)")
    ap.add_argument("--out", default="reports/speculative")
    a = ap.parse_args()
    a.engines = [e for e in a.engines.split(",") if e]
    try:
        result = run(a, AutoTokenizer.from_pretrained(a.model))
    except EffkitError as e:
        raise SystemExit(f"error: {e}") from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(result, indent=2))
    show(result)
    print(f"wrote {out / 'speculative.json'}")


if __name__ == "__main__":
    main()
