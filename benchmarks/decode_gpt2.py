"""Decoding on the `gpt2` shape: effkit's exports against the standard converters and the bandwidth bound.

    python benchmarks/decode_gpt2.py [--tokens 256] [--rounds 4] [--fixed-rounds] [--out reports/decode-gpt2]

A GPT-2 of the `gpt2` preset shape (12 x 768, context 1024) with random weights and the quickstart's tokenizer
(vocabulary 8192: 92M parameters) is saved as a plain Hugging Face folder; effkit exports it with past key/values to
ONNX Runtime int8 (`effkit export --format onnx --int8`) and to CTranslate2 int8 (`--format ctranslate2 --int8`);
`effkit bench --peers` then times all of them with the dense PyTorch model and the peer rows (the same weights
through CTranslate2's converter and through ONNX Runtime's quantize_dynamic) in the same interleaved rounds: prefill
at batch 1 and 12, greedy decoding of `--tokens` new tokens at batch 1 and 12. The machine's memory bandwidth is
measured (a 128 MB fp32 matrix-vector product), and each artifact's batch-1 decode is put against the bound
bandwidth / weight bytes read per token: in the bench, and alone (each artifact by itself, its decodings between
bandwidth measurements, since the machine's streaming rate drifts). OpenVINO too (#38): effkit's export with NNCF
int8 weights (`--format openvino --int8`, the CPU plug-in's own inference precision) and the peer row of OpenVINO's
default export; llama.cpp too (#44): effkit's GGUF export in Q8_0 and the peer row (f16 GGUF quantized to Q8_0, as a
llama.cpp user makes it), decoded by llama.cpp's own server loop. At batch 12 the limit is the slower of streaming
the weights once per step and computing it on the matrix units: both are probed in the same run (the bandwidth as
above; the matrix units as the best square-GEMM rate in fp32 and bf16, oneDNN through torch), and the fastest
artifact at batch 12 gets its share of that limit and, for an OpenVINO artifact, a profile of one decode (the plug-
in's per-operator counters: matrix products, attention, the rest; then the time outside the graph: sampling and
Python). Writes `decode.md` and `decode.json` under --out."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from effkit.artifacts.loader import engine_of, load_any
from effkit.bench import make_peers, run_bench
from effkit.config import BenchConfig, DataConfig, ExportConfig
from effkit.data import prepare
from effkit.export import run_export
from effkit.measure import generation, roofline, stats, timing
from effkit.model import build_model, save_model


def weight_bytes_per_token(path: Path, model) -> tuple[int, str]:
    """Bytes of weights one decoding step reads: every block matrix and the LM head (the embedding lookup reads
    one row), at the precision the artifact stores them."""
    c = model.config
    inner = c.n_inner or 4 * c.n_embd
    per_layer = c.n_embd * 3 * c.n_embd + c.n_embd * c.n_embd + 2 * c.n_embd * inner
    n = c.n_layer * per_layer + c.vocab_size * c.n_embd
    if "gguf" in path.name or "llamacpp" in path.name:  # GGUF Q8_0 (--int8): 32 int8 and one f16 scale per block
        return n * 34 // 32, "34 bytes per 32 block-matrix and LM-head weights (GGUF Q8_0)"
    if "int8" in path.name:
        return n, "1 byte per block matrix and LM-head weight (int8)"
    if getattr(model, "inference_precision", "") == "bf16":  # OpenVINO holds fp32 weights in bf16 to compute in it
        return 2 * n, "2 bytes per block matrix and LM-head weight (fp32 stored, held in bf16 by OpenVINO)"
    return 4 * n, "4 bytes per block matrix and LM-head weight (fp32)"


def gemm_peak(dtype, n: int = 2048, repeats: int = 8) -> float:
    """The best square-GEMM FLOP/s of `repeats` (after warm-ups) on torch's threads: measured now, never cached."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def step_flops(model, batch: int) -> int:
    """The multiply-adds x 2 of one decoding step of `batch` rows in the matrix products (blocks and LM head)."""
    c = model.config
    inner = c.n_inner or 4 * c.n_embd
    return 2 * batch * (c.n_layer * (4 * c.n_embd**2 + 2 * c.n_embd * inner) + c.vocab_size * c.n_embd)


def openvino_profile(path: Path, tokenizer, tokens: int, batch: int = 12) -> dict:
    """Where one greedy decode of `tokens` at `batch` goes for an OpenVINO artifact: the CPU plug-in's per-operator
    counters (PERF_COUNT) summed by kind over every step, the graph's total, and the rest of the wall time
    (sampling, feeding inputs, Python) — through effkit's Python loop over the infer request (LLMPipeline's C++
    loop exposes no counters), at the artifact's precision."""
    import numpy as np
    import openvino as ov

    from effkit.engines.openvino.settings import OV_MODEL, compile_config

    desc = json.loads((path / "openvino.json").read_text())
    compiled = ov.Core().compile_model(str(path / OV_MODEL), "CPU", {
        **compile_config(desc.get("inference_precision", "default")), "PERF_COUNT": "YES"})
    req = compiled.create_infer_request()
    ids = tokenizer(generation.GENERATION_PROMPT, return_tensors="np").input_ids.repeat(batch, 0)
    kinds: dict[str, float] = {}

    def kind(t: str) -> str:  # the plug-in's node types: FullyConnectedCompressed for int8 weights, ...
        if "FullyConnected" in t or "MatMul" in t or "Convolution" in t:
            return "matrix products"
        if "Attention" in t:
            return "attention (with the KV cache)"
        if t in ("Reorder", "Convert", "Transpose"):
            return "reorders, conversions, transposes"
        return "other operators (norms, activations, gathers, adds)"

    req.reset_state()
    t0 = time.perf_counter()
    graph = 0.0
    todo, done = ids, 0
    for _ in range(tokens):
        b, n = todo.shape
        t = time.perf_counter()
        req.infer({"input_ids": todo, "attention_mask": np.ones((b, done + n), np.int64),
                   "position_ids": np.broadcast_to(np.arange(done, done + n), (b, n)),
                   "beam_idx": np.arange(b, dtype=np.int32)})
        graph += time.perf_counter() - t
        for info in req.profiling_info:
            if info.status == ov.ProfilingInfo.Status.EXECUTED:
                k = kind(info.node_type)
                kinds[k] = kinds.get(k, 0.0) + info.real_time.total_seconds()
        done += n
        todo = req.get_tensor("logits").data[:, -1].argmax(-1)[:, None].astype(np.int64)
    wall = time.perf_counter() - t0
    counted = sum(kinds.values())
    parts = {**kinds, "inside the graph, not attributed to an operator": max(graph - counted, 0.0),
             "outside the graph (sampling, inputs, Python)": wall - graph}
    return {"wall_s": wall, "tokens_per_s": batch * tokens / wall, "parts_s": parts,
            "shares": {k: v / wall for k, v in parts.items()},
            "how": f"{tokens} greedy steps at batch {batch}, effkit's Python loop over an infer request compiled "
                   f"with PERF_COUNT=YES at the artifact's settings ({desc.get('inference_precision')}); operator "
                   "times are the plug-in's counters summed over the steps"}


def alone(path: Path, tokenizer, tokens: int, rounds: int) -> dict:
    """One artifact alone in this process: `rounds` greedy decodings of `tokens` at batch 1, each between two
    bandwidth measurements, so that its share of the bound is taken against the bandwidth of that moment (the
    machine's streaming rate drifts by tens of percent over minutes). Returns the median rate and the mean share
    of the bound with its 95% interval over rounds."""
    model = load_any(path).eval()
    nbytes, how = weight_bytes_per_token(path, model)
    timer = engine_of(path).decode(model, tokenizer, 1, tokens)  # as the bench decodes it (OpenVINO: LLMPipeline)
    timer()  # warm-up
    rates, shares, bws = [], [], []
    settle = timing.settle_time(model)  # spinning threads (ONNX Runtime) go idle before the bandwidth probe
    for _ in range(rounds):
        time.sleep(settle)
        before = roofline.memory_bandwidth()[0]
        rate = timer()
        time.sleep(settle)
        bw = (before + roofline.memory_bandwidth()[0]) / 2
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
    ap.add_argument("--fixed-rounds", action="store_true",
                    help="exactly --rounds interleaved rounds (95%% intervals), not rounds until each ratio settles")
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
    formats = ["onnx", "ctranslate2"]
    from effkit.engines.openvino.settings import ov_unavailable

    if reason := ov_unavailable():
        print(f"openvino: not run: {reason}")
    else:
        formats.append("openvino")
    from effkit.engines.llamacpp.runtime import llamacpp_unavailable

    if reason := llamacpp_unavailable():
        print(f"gguf (llama.cpp): not run: {reason}")
    else:
        formats.append("gguf")  # effkit's GGUF export, Q8_0 (--int8); the peer row is llama.cpp's f16 -> Q8_0
    exported = [run_export(ExportConfig.from_flat(source=str(folder), format=f, int8=True, latency_rounds=2,
                                                  latency_repeats=1, gen_tokens=8, **dirs))["artifact"]
                for f in formats]
    import torch

    bw, bw_how = roofline.memory_bandwidth()
    peaks = {"fp32": gemm_peak(torch.float32), "bf16": gemm_peak(torch.bfloat16)}
    report = run_bench(BenchConfig.from_flat(paths=(str(folder), *exported), peers=True, rounds=args.rounds, repeats=2,
                                             fixed_rounds=args.fixed_rounds,
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
        if r["tag"] == "peer-openvino":  # its folder is gone: the plug-in's precision is in the row's notes
            nbytes, how = weight_bytes_per_token(Path(r["tag"]), SimpleNamespace(
                config=model.config, inference_precision="bf16" if "precision bf16" in str(r) else "f32"))
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
    bw_after, _ = roofline.memory_bandwidth()
    fastest = max(rows, key=lambda r: r["decode_tokens_per_s_b12"])
    flops12 = step_flops(model, 12)
    limits = {}
    for prec, peak in peaks.items():  # the step at batch 12: weights streamed once, or the products computed
        step_s = max(fastest["weight_bytes_per_token"] / bw, flops12 / peak)
        limits[prec] = {"tokens_per_s": 12 / step_s, "share": fastest["decode_tokens_per_s_b12"] * step_s / 12,
                        "bound_by": "bandwidth" if fastest["weight_bytes_per_token"] / bw >= flops12 / peak
                        else "matrix units"}
    lines += ["", "## Batch 12: the fastest artifact against this machine's limit", "",
              f"Probed in this run: memory bandwidth {bw / 1e9:.1f} GB/s before the bench, {bw_after / 1e9:.1f} after "
              f"({bw_how}); matrix units: best {2048}x{2048} GEMM {peaks['fp32'] / 1e9:.0f} GFLOP/s in fp32, "
              f"{peaks['bf16'] / 1e9:.0f} GFLOP/s in bf16 (torch, oneDNN, {torch.get_num_threads()} threads).", "",
              f"Fastest at decode b12: **{fastest['tag']}**, {fastest['decode_tokens_per_s_b12']:.0f} tokens/s. One "
              f"step of 12 tokens streams {fastest['weight_bytes_per_token'] / 1e6:.0f} MB of weights "
              f"({fastest['weight_bytes_how']}) and computes {flops12 / 1e9:.1f} GFLOP in the matrix products.", "",
              "| compute precision assumed | limit tokens/s | bound by | share reached |", "|---|---|---|---|"]
    for prec, lim in limits.items():
        lines.append(f"| {prec} | {lim['tokens_per_s']:.0f} | {lim['bound_by']} | {lim['share']:.0%} |")
    profile = None
    fastest_path = Path(next(r["artifact"] for r in report["artifacts"] if r["tag"] == fastest["tag"]))
    if not fastest_path.exists():  # a peer: the bench removed its folder; the same peer remade above
        fastest_path = next((p for p in peers if p.name == fastest["tag"]), fastest_path)
    if (fastest_path / "openvino.json").is_file():
        profile = openvino_profile(fastest_path, tokenizer, min(args.tokens, 64))
        lines += ["", f"Where the time goes ({profile['how']}; {profile['tokens_per_s']:.0f} tokens/s in this loop):",
                  "", "| part | seconds | share |", "|---|---|---|"]
        lines += [f"| {k} | {v:.3f} | {profile['shares'][k]:.0%} |" for k, v in profile["parts_s"].items()]
    else:
        lines += ["", "Profile: not run: the fastest artifact at batch 12 is not an OpenVINO artifact (this script "
                      "profiles OpenVINO's per-operator counters only)"]
    peer_md = (Path(dirs["reports_dir"]) / "gpt2-shape" / "bench.md").read_text()
    lines += ["", "From effkit bench --peers (same rounds):", "", *peer_md.split("Against the engines", 1)[-1]
              .split("\n\n", 2)[1].splitlines(), "",
              f"How measured: {report['protocol']['generation']}; {report['protocol']['latency']}.",
              f"Wall time {time.perf_counter() - t0:.0f} s."]
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    (out / "decode.json").write_text(json.dumps({"bandwidth_bytes_per_s": bw, "bandwidth_after_bytes_per_s": bw_after,
                                                 "bandwidth_how": bw_how, "gemm_peak_flops": peaks,
                                                 "b12_limits": limits, "b12_fastest": fastest["tag"],
                                                 "b12_profile": profile, "rows": rows, "alone": solo,
                                                 "bench": report}, indent=2, default=str))
    shutil.rmtree(work, ignore_errors=True)  # its own temporary folder (about 1 GB of models)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
