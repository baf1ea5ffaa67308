"""Decoding on the `gpt2` shape: effkit's exports against the standard converters and the bandwidth bound.

    python benchmarks/decode_gpt2.py [--tokens 256] [--rounds 4] [--out reports/decode-gpt2]

A GPT-2 of the `gpt2` preset shape (12 x 768, context 1024) with random weights and the quickstart's tokenizer
(vocabulary 8192: 92M parameters) is saved as a plain Hugging Face folder; effkit exports it with past key/values
to ONNX Runtime int8 (`effkit export --format onnx --int8`) and to CTranslate2 int8 (`--format ctranslate2
--int8`); `effkit bench --peers` then times all of them with the dense PyTorch model and the peer rows (the same
weights through CTranslate2's converter and through ONNX Runtime's quantize_dynamic) in the same interleaved
rounds: prefill at batch 1 and 12, greedy decoding of `--tokens` new tokens at batch 1 and 12. The machine's
memory bandwidth is measured (a 128 MB fp32 matrix-vector product), and each artifact's batch-1 decode is put
against the bound bandwidth / weight bytes read per token: in the bench, and alone (each artifact by itself, its
decodings between bandwidth measurements, since the machine's streaming rate drifts). Writes `decode.md` and
`decode.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from effkit.artifacts.loader import load_any
from effkit.bench import make_peers, run_bench
from effkit.config import BenchConfig, DataConfig, ExportConfig
from effkit.data import prepare
from effkit.export import run_export
from effkit.measure import metrics, stats
from effkit.model import build_model, save_model


def weight_bytes_per_token(path: Path, model) -> tuple[int, str]:
    """Bytes of weights one decoding step reads: every block matrix and the LM head (the embedding lookup reads
    one row), at the precision the artifact stores them."""
    c = model.config
    inner = c.n_inner or 4 * c.n_embd
    per_layer = c.n_embd * 3 * c.n_embd + c.n_embd * c.n_embd + 2 * c.n_embd * inner
    n = c.n_layer * per_layer + c.vocab_size * c.n_embd
    if "int8" in path.name:
        return n, "1 byte per block matrix and LM-head weight (int8)"
    return 4 * n, "4 bytes per block matrix and LM-head weight (fp32)"


def alone(path: Path, tokenizer, tokens: int, rounds: int) -> dict:
    """One artifact alone in this process: `rounds` greedy decodings of `tokens` at batch 1, each between two
    bandwidth measurements, so that its share of the bound is taken against the bandwidth of that moment (the
    machine's streaming rate drifts by tens of percent over minutes). Returns the median rate and the mean share
    of the bound with its 95% interval over rounds."""
    model = load_any(path).eval()
    nbytes, how = weight_bytes_per_token(path, model)
    timer = metrics.generation_timer(model, tokenizer, tokens, batch=1)
    timer()  # warm-up
    rates, shares, bws = [], [], []
    settle = metrics.settle_time(model)  # spinning threads (ONNX Runtime) go idle before the bandwidth probe
    for _ in range(rounds):
        time.sleep(settle)
        before = metrics.memory_bandwidth()[0]
        rate = timer()
        time.sleep(settle)
        bw = (before + metrics.memory_bandwidth()[0]) / 2
        rates.append(rate)
        bws.append(bw)
        shares.append(rate * nbytes / bw)
    share, lo, hi = stats.mean_ci(shares)
    del model
    return {"decode_tokens_per_s_b1": statistics.median(rates), "bandwidth_bytes_per_s": bws,
            "weight_bytes_per_token": nbytes, "weight_bytes_how": how, "share_of_bound": share,
            "share_ci95": [lo, hi], "shares": shares, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="reports/decode-gpt2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="effkit-decode-gpt2-"))
    t0 = time.perf_counter()
    tokenizer = prepare(DataConfig(vocab_size=8192)).tokenizer  # the quickstart's tokenizer
    folder = work / "runs" / "gpt2-shape" / "gpt2-random"
    model = build_model("gpt2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    save_model(model, folder, tokenizer)  # a plain Hugging Face folder (Conv1D layout), no effkit.json
    dirs = {"runs_dir": str(work / "runs"), "reports_dir": str(work / "reports")}
    exported = [run_export(ExportConfig.from_flat(source=str(folder), format=f, int8=True, latency_rounds=2,
                                                  latency_repeats=1, gen_tokens=8, **dirs))["artifact"]
                for f in ("onnx", "ctranslate2")]
    bw, bw_how = metrics.memory_bandwidth()
    report = run_bench(BenchConfig.from_flat(paths=(str(folder), *exported), peers=True, rounds=args.rounds, repeats=2,
                                             gen_tokens=args.tokens, train_steps=1, **dirs), progress=False)
    lines = [f"# Decoding on the gpt2 shape ({model.config.n_layer} x {model.config.n_embd}, context "
             f"{model.config.n_positions}, vocabulary {len(tokenizer)}, "
             f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, random weights)", "",
             f"Device: {report['device']}; memory bandwidth {bw / 1e9:.1f} GB/s ({bw_how}).", "",
             "| artifact | decode b1 tok/s | vs dense | decode b12 tok/s | vs dense | prefill b12 ms | weight bytes "
             "/ token | b1 bound tok/s | b1 share of bound |", "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in report["artifacts"]:
        path = Path(r["artifact"])
        m = load_any(path) if path.exists() else model
        nbytes, how = weight_bytes_per_token(path if path.exists() else Path(r["tag"]), m)
        bound = bw / nbytes
        rows.append({**{k: r[k] for k in ("tag", "stage", "decode_tokens_per_s_b1", "decode_tokens_per_s_b12")},
                     "decode_ratio_b1": r["decode_ratio_b1"], "decode_ratio_b12": r["decode_ratio_b12"],
                     "prefill_b12_s": r["latency_b12"]["p50_s"], "weight_bytes_per_token": nbytes,
                     "weight_bytes_how": how, "bound_tokens_per_s_b1": bound,
                     "share_of_bound_b1": r["decode_tokens_per_s_b1"] / bound, "vs_peers": r.get("vs_peers")})
        lines.append(f"| {r['tag']} | {r['decode_tokens_per_s_b1']:.1f} | {stats.fmt_ratio(r['decode_ratio_b1'])} | "
                     f"{r['decode_tokens_per_s_b12']:.1f} | {stats.fmt_ratio(r['decode_ratio_b12'])} | "
                     f"{r['latency_b12']['p50_s'] * 1e3:.0f} | {nbytes / 1e6:.0f} MB | {bound:.0f} | "
                     f"{r['decode_tokens_per_s_b1'] / bound:.0%} |")
    # the bound, measured without contenders: each artifact (the peers remade the same way) alone, rates
    # between bandwidth measurements; the table above is the paired comparison, this is the share of the bound
    (work / "peers").mkdir()
    peers, _ = make_peers(folder, work / "peers")
    solo = {p.name: alone(p, tokenizer, args.tokens, args.rounds + 2) for p in (folder, *map(Path, exported), *peers)}
    lines += ["", f"Alone (each artifact by itself in this process, {args.rounds + 2} greedy decodings of "
              f"{args.tokens} tokens at batch 1, each between two bandwidth measurements; share of the bound = "
              "tokens/s x weight bytes per token / that bandwidth; mean and 95% t-interval over rounds):", "",
              "| artifact | decode b1 tok/s alone | bandwidth GB/s (its rounds) | weight bytes / token | share of the "
              "bound |", "|---|---|---|---|---|"]
    for tag, a in solo.items():
        lines.append(f"| {tag} | {a['decode_tokens_per_s_b1']:.1f} | {min(a['bandwidth_bytes_per_s']) / 1e9:.1f}-"
                     f"{max(a['bandwidth_bytes_per_s']) / 1e9:.1f} | {a['weight_bytes_per_token'] / 1e6:.0f} MB | "
                     f"{a['share_of_bound']:.0%} ({a['share_ci95'][0]:.0%}-{a['share_ci95'][1]:.0%}) |")
    peer_md = (Path(dirs["reports_dir"]) / "gpt2-shape" / "bench.md").read_text()
    lines += ["", "From effkit bench --peers (same rounds):", "", *peer_md.split("Against the engines", 1)[-1]
              .split("\n\n", 2)[1].splitlines(), "",
              f"How measured: {report['protocol']['generation']}; {report['protocol']['latency']}.",
              f"Wall time {time.perf_counter() - t0:.0f} s."]
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    (out / "decode.json").write_text(json.dumps({"bandwidth_bytes_per_s": bw, "bandwidth_how": bw_how, "rows": rows,
                                                 "alone": solo, "bench": report}, indent=2, default=str))
    shutil.rmtree(work, ignore_errors=True)  # its own temporary folder (about 1 GB of models)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
