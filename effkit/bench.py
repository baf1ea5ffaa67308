"""`effkit bench`: every artifact of a run measured with one protocol, deltas against the first (dense) one,
and `bench.json` / `bench.csv` / `bench.md` / `leaderboard.json` in the run's report folder."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch

from effkit import artifacts, metrics
from effkit.config import BenchConfig, DataConfig
from effkit.data import prepare
from effkit.errors import EffkitError
from effkit.isolated import run_isolated
from effkit.parallel import resolve_device
from effkit.quantize import generate_sample, is_quantized, load_any
from effkit.report import atomic_write_text, write_rows_csv

LAT_BATCHES = (1, 12)
TRAIN_BATCHES = (4, 12)
SPREAD_FLAG = 0.10
LEADERBOARD_UNITS = {"loss": "nats/token (held-out eval loss)", "inference_latency_1": "seconds per forward "
                     "(batch 1, p50)", "inference_latency_12": "seconds per forward (batch 12, p50)",
                     "training_throughput_4": "tokens/s (batch 4)", "training_throughput_12": "tokens/s (batch 12)"}


def find_artifacts(cfg: BenchConfig) -> tuple[str, list[Path]]:
    if cfg.paths:
        paths = [Path(p) for p in cfg.paths]
        for p in paths:
            if not p.exists():
                raise EffkitError(f"artifact {p} does not exist")
            artifacts.read_meta(p)
        return paths[0].parent.name, paths
    run_dir = Path(cfg.runs_dir) / cfg.run if cfg.run else artifacts.latest_run(Path(cfg.runs_dir))
    if not run_dir.is_dir():
        raise EffkitError(f"unknown run {cfg.run!r}: {run_dir} does not exist; see `ls {cfg.runs_dir}`")
    found = [(artifacts.read_meta(d).get("time", ""), d) for d in sorted(run_dir.iterdir())
             if (d / artifacts.META).is_file()]
    if not found:
        raise EffkitError(f"no artifacts found in {run_dir}; run `effkit train` first")
    order = {"train": 0, "prune": 1, "quantize": 2}
    found.sort(key=lambda td: (order.get(artifacts.read_meta(td[1])["stage"], 3), td[0]))
    return run_dir.name, [d for _, d in found]


def train_throughput(model, batch: int, block: int, steps: int) -> float:
    """tokens/s of forward + backward + AdamW step on a copy of the model, after one warm-up step."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = metrics.random_tokens(model, batch, block)
    device = metrics.model_device(model)
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        loss = metrics.lm_loss(model(x).logits, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t)
    return batch * block * len(times) / sum(times)


def bench_one(path: Path, cfg: BenchConfig, tokenizer, eval_blocks: torch.Tensor, block: int,
              device: torch.device) -> dict[str, Any]:
    meta = artifacts.read_meta(path)
    with metrics.PeakMemory(device) as mem:
        model = load_any(path, device).eval()
        r: dict[str, Any] = {"artifact": str(path), "tag": path.name, "stage": meta["stage"],
                             "params": sum(p.numel() for p in model.parameters()),
                             "size_bytes": artifacts.dir_size(path), "quantized": is_quantized(path)}
        r.update(metrics.evaluate(model, eval_blocks, cfg.batch_size))
        for b in LAT_BATCHES:
            r[f"latency_b{b}"] = metrics.measure_latency(model, b, block, repeats=cfg.repeats)
        r["generation"] = generate_sample(model, tokenizer, cfg.gen_tokens)
        for b in TRAIN_BATCHES:
            r[f"train_tokens_per_s_b{b}"] = (f"not run: {meta['stage']} int8 artifacts do not train"
                                             if r["quantized"] else
                                             train_throughput(model, b, block, cfg.train_steps))
    r["peak_memory_bytes"] = mem.peak_bytes
    r["flags"] = [f"latency b{b} spread {r[f'latency_b{b}']['spread']:.0%} > {SPREAD_FLAG:.0%}"
                  for b in LAT_BATCHES if r[f"latency_b{b}"]["spread"] > SPREAD_FLAG]
    return r


def bench_in_this_process(path: str, cfg: dict[str, Any], data: dict[str, Any], tokenizer_from: str,
                          device: str) -> dict[str, Any]:
    """`bench_one` from JSON-able arguments: what `run_isolated` calls in a fresh process."""
    data_cfg = DataConfig.from_dict(data)
    prepared = prepare(data_cfg, tokenizer_from=tokenizer_from)
    return bench_one(Path(path), BenchConfig.from_dict(cfg), prepared.tokenizer, prepared.blocks.eval,
                     data_cfg.block_size, resolve_device(device))


def bench_isolated(path: Path, cfg: BenchConfig, data: dict[str, Any], tokenizer_from: Path) -> dict[str, Any]:
    """`bench_one` in a fresh Python process: on CPU the peak-memory figure is the process' RSS high-water
    mark, which memory freed by an earlier artifact (and kept by the allocator) would otherwise hide."""
    return run_isolated("effkit.bench:bench_in_this_process",
                        {"path": str(path), "cfg": cfg.to_dict(), "data": data, "tokenizer_from": str(tokenizer_from),
                         "device": cfg.device}, what=f"bench of {path}")


def with_deltas(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    for r in rows:
        r["delta"] = {
            "eval_loss": r["eval_loss"] / base["eval_loss"] - 1,
            "latency_b1": r["latency_b1"]["p50_s"] / base["latency_b1"]["p50_s"] - 1,
            "latency_b12": r["latency_b12"]["p50_s"] / base["latency_b12"]["p50_s"] - 1,
            "size": r["size_bytes"] / base["size_bytes"] - 1,
            "generation_tokens_per_s": r["generation"]["tokens_per_s"] / base["generation"]["tokens_per_s"] - 1,
        }


def leaderboard(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def num(v):
        return v if isinstance(v, float) else None

    return {"units": LEADERBOARD_UNITS, "artifacts": {r["tag"]: {
        "loss": r["eval_loss"], "inference_latency_1": r["latency_b1"]["p50_s"],
        "inference_latency_12": r["latency_b12"]["p50_s"], "training_throughput_4": num(r["train_tokens_per_s_b4"]),
        "training_throughput_12": num(r["train_tokens_per_s_b12"])} for r in rows}}


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    cfg = cfg.validate()
    device = resolve_device(cfg.device)
    run_name, paths = find_artifacts(cfg)
    data = artifacts.data_section(paths[0])  # every artifact is evaluated on the first one's held-out blocks
    data_cfg = DataConfig.from_dict(data)
    n_eval = len(prepare(data_cfg, tokenizer_from=str(paths[0])).blocks.eval)  # builds the caches once
    block = data_cfg.block_size
    rows = []
    if progress:
        from rich.progress import Progress

        with Progress() as bar:
            task = bar.add_task("bench", total=len(paths))
            for p in paths:
                bar.update(task, description=f"bench {p.name}")
                rows.append(bench_isolated(p, cfg, data, paths[0]))
                bar.advance(task)
    else:
        rows = [bench_isolated(p, cfg, data, paths[0]) for p in paths]
    with_deltas(rows)
    report = {
        "stage": "bench", "run": run_name, "config": cfg.to_dict(), "artifacts": rows,
        "device": metrics.describe_device(device), "versions": artifacts.versions(),
        "git_commit": artifacts.git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "protocol": {
            "eval_loss": metrics.EVAL_PROTOCOL + f"; the blocks of {paths[0].name}'s data ({n_eval} blocks)",
            "latency": metrics.LATENCY_PROTOCOL.format(warmup=3, repeats=cfg.repeats) + f", block {block}; "
                       f"a spread (max-min)/p50 above {SPREAD_FLAG:.0%} is flagged",
            "generation": f"greedy decoding with the KV cache, {cfg.gen_tokens} new tokens after a 4-token warm-up",
            "training_throughput": f"forward+backward+AdamW on a copy, batch x {block} tokens, {cfg.train_steps} "
                                   "timed steps after 1 warm-up",
            "peak_memory": metrics.PeakMemory(device).method + ", while loading and measuring the artifact, "
                           "each artifact in a fresh process",
            "deltas": f"relative to the first artifact ({rows[0]['tag']})",
        },
    }
    out = Path(cfg.reports_dir) / run_name
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "bench.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(out / "leaderboard.json", json.dumps(leaderboard(rows), indent=2))
    write_rows_csv(out / "bench.csv", [flat_row(r) for r in rows])
    atomic_write_text(out / "bench.md", bench_markdown(report))
    return report


def flat_row(r: dict[str, Any]) -> dict[str, Any]:
    def num(v):
        return round(v, 2) if isinstance(v, float) else v

    return {"tag": r["tag"], "stage": r["stage"], "eval_loss": r["eval_loss"], "perplexity": r["perplexity"],
            "latency_b1_p50_ms": r["latency_b1"]["p50_s"] * 1e3,
            "latency_b12_p50_ms": r["latency_b12"]["p50_s"] * 1e3,
            "latency_b12_min_ms": r["latency_b12"]["min_s"] * 1e3,
            "latency_b12_max_ms": r["latency_b12"]["max_s"] * 1e3,
            "generation_tokens_per_s": r["generation"]["tokens_per_s"],
            "train_tokens_per_s_b4": num(r["train_tokens_per_s_b4"]),
            "train_tokens_per_s_b12": num(r["train_tokens_per_s_b12"]),
            "peak_memory_mb": r["peak_memory_bytes"] / 2**20,
            "params": r["params"], "size_mb": r["size_bytes"] / 2**20, "delta_loss": r["delta"]["eval_loss"],
            "delta_latency_b12": r["delta"]["latency_b12"], "delta_size": r["delta"]["size"],
            "flags": "; ".join(r["flags"])}


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    cols = ["artifact", "eval loss", "Δ loss", "lat b1 ms", "lat b12 ms (min-max)", "Δ lat b12", "gen tok/s",
            "train tok/s b4 / b12", "size MiB", "Δ size", "peak MiB"]
    rows = []
    for r in report["artifacts"]:
        lat12 = r["latency_b12"]
        train = " / ".join(f"{r[f'train_tokens_per_s_b{b}']:,.0f}" if isinstance(r[f"train_tokens_per_s_b{b}"], float)
                           else "n/a" for b in TRAIN_BATCHES)
        flag = " ⚠" if r["flags"] else ""
        rows.append([r["tag"], f"{r['eval_loss']:.4f}", f"{r['delta']['eval_loss']:+.1%}",
                     f"{r['latency_b1']['p50_s'] * 1e3:.1f}",
                     f"{lat12['p50_s'] * 1e3:.1f} ({lat12['min_s'] * 1e3:.0f}-{lat12['max_s'] * 1e3:.0f}){flag}",
                     f"{r['delta']['latency_b12']:+.0%}", f"{r['generation']['tokens_per_s']:.0f}", train,
                     f"{r['size_bytes'] / 2**20:.1f}", f"{r['delta']['size']:+.0%}",
                     f"{r['peak_memory_bytes'] / 2**20:.0f}"])
    return cols, rows


def bench_markdown(report: dict[str, Any]) -> str:
    cols, rows = table_rows(report)
    lines = [f"# effkit bench: {report['run']}", "", f"Device: {report['device']}; torch "
             f"{report['versions'].get('torch')}; {report['time']}", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    flags = [f"- {r['tag']}: {f}" for r in report["artifacts"] for f in r["flags"]]
    if flags:
        lines += ["", "Noisy timings (⚠):", *flags]
    lines += ["", "How measured:", *[f"- {k}: {v}" for k, v in report["protocol"].items()], ""]
    return "\n".join(lines)
