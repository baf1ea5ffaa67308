"""The weights `effkit run` prices the stages with (its estimate, `effkit run --plan` and the time budget's share),
fitted from measured runs, and the speeds that rank quantize `auto`'s backends and the bench's peers when a time
budget leaves them a share: effkit/stage_costs.json.

    python benchmarks/stage_costs.py --measure-auto runs/quickstart/train auto.json   # one `auto` at share 1, timed
    python benchmarks/stage_costs.py reports/quickstart [...] --auto auto.json        # print the fit
    python benchmarks/stage_costs.py reports/quickstart [...] --auto auto.json --write # and keep it
    python benchmarks/stage_costs.py --predict 0.479   # the quickstart's decision and per-stage minutes with it
    python benchmarks/stage_costs.py reports/quickstart [...] --check                        # leave-one-out
    python benchmarks/stage_costs.py reports/quickstart [...] --units --reference 50 --write # measuring_s, kept

Each report folder is a finished `effkit run`'s: eta.json (each stage's seconds, the step time of training's own
steps, the time budget's shares, the weights it ran with, the caches each stage consulted and what filling the cold
ones cost, the process's wall time) and the stage reports. Every weight is in training steps of that run (seconds /
its step time), the time budget's part taken off first (`pipeline.BUDGET_USED` of each measuring stage's budget), and
so are the caches a stage filled (their `fill_s`): the weights are a stage's work with its caches warm, and the
caches are priced apart. Several runs (any mix of cold and warm caches) are combined so: each weight is the mean of
the runs' own fits, each cache's `cache_fill` the mean of its fills (in each run's steps) over the runs that filled
it, and `step_caches` the caches a step filled in any run, by run name (the report folder's) and step (what a first
run of that run name here is priced with, all cold).
A run whose eta.json predates the cache record (no `caches_used`) has its fills read off its quantize reports: a
backend that consults a cache (`LEGACY_CACHES`) filled it where its row took longer than the same row of another run
given, by the difference to the fastest (the rows are the same work once the cache is warm); give its wall time with
`--wall-s` (one figure per folder, in order; 0: unknown).
- outside_s: seconds of the run outside its stages (imports, the report, the last lines), the caches filled before
  training (the step-time prediction's) taken off;
- train_setup: the train stage less its training loop (train.json's `train_wall_s`);
- prune_round: a prune stage less its fine-tuning, per round;
- quantize: a quantize stage is `fixed` + each backend it wrote, in the shares of the seconds of an `auto` that
  wrote every backend (`--measure-auto`, on one machine at one time: the shares, not the seconds, are kept; a
  backend's part: written, reloaded, evaluated, and the choice's timing over the contenders it timed), scaled so
  that the runs' quantize stages (dense and pruned parents alike: which round is best-pruned is not known before
  the run) are what they predict on average;
- bench: per artifact per round of the first look (`artifact_round`) and per artifact (`artifact`); one run gives
  one equation, so the two keep the ratio of the weights before and are scaled together.
The measuring steps are priced in seconds, not in training steps (their speed does not follow training's code):
`measuring_s` holds each measuring step's seconds per unit of its work (the weights above) on the machine the runs
ran on, by run name and step, fitted with `--units` after the weights (the mean of the runs' own: its seconds less
`BUDGET_USED` of its time budget and the cold caches it filled, over the work the plan it ran has with the weights
in the file), and that machine's `pipeline.reference_s` (`--reference N`: the least of N, measured here, idle), which a
run divides its own by (`pipeline.machine_factor`). `--check` predicts each run from the others alone, with the step
time predicted before training and with training's own, against its wall time (`--wall-s` where eta.json has none);
its `margin_needed` is what `pipeline.BUDGET_MARGIN` covers.
Speeds at the workload the runs optimize for (decode at batch 1), relative to the fastest: the backends from the
quantize reports' `auto` tables (the medians of those timed, the far screen's cost ratios of the others), the peers
from bench.json; those the runs did not time keep the file's figures (runs on a share time the fastest only).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from effkit.pipeline import BUDGET_USED  # noqa: E402
from effkit.stage import COSTS  # noqa: E402

# the file as it is: the speeds of backends and peers the runs given did not time are kept from it
COSTS_NOW = json.loads(COSTS.read_text()) if COSTS.is_file() else {}
# the weights before this file (the code's constants): for runs whose eta.json does not record its weights
BEFORE = {"train_setup": 80.0, "prune_round": 38.0, "bench": {"artifact_round": 13.0, "artifact": 18.0}}
FAR = re.compile(r"([\d.]+)x (\S+)'s cost per call")
# the machine caches quantize `auto`'s backends consult (for runs whose eta.json records no caches)
LEGACY_CACHES = {"ctranslate2": "ct2_threads", "openvino": "openvino_attention_choice",
                 "openvino-int4": "openvino_attention_choice"}


def measure_auto(artifact: Path, out: Path) -> None:
    """`effkit quantize --backend auto` at share 1 on a copy of `artifact`, timed: its report and its seconds."""
    from effkit.config import QuantizeConfig, build_config
    from effkit.quantize.stage import run_quantize

    with tempfile.TemporaryDirectory(prefix="effkit-stage-costs-") as tmp:
        runs, reports = Path(tmp) / "runs", Path(tmp) / "reports"
        copy = runs / artifact.parent.name / artifact.name
        shutil.copytree(artifact, copy)
        cfg = build_config(QuantizeConfig, None, {"source": str(copy), "backend": "auto", "budget_s": 3.0,
                                                  "runs_dir": str(runs), "reports_dir": str(reports)})
        start = time.perf_counter()
        report = run_quantize(cfg)
        report["stage_s"] = time.perf_counter() - start
    report["measured_from"] = str(artifact)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{out}: {report['stage_s']:.0f} s")


def backend_parts(auto: dict) -> dict[str, float]:
    """Each backend's share of an `auto` stage that wrote them all: its own seconds, plus its part of the choice's
    timing (the choice's seconds over the contenders it timed or screened)."""
    a = auto["metrics"]["auto"]
    written = {b: row["seconds"] for b, row in a["table"].items() if "seconds" in row}
    timed = [b for b in written if "median" in a["table"][b] or b in a["choice"].get("far", {})]
    per_contender = a["choice"]["record"]["seconds"] / max(1, len(timed))
    return {b: (s + (per_contender if b in timed else 0.0)) / auto["stage_s"] for b, s in written.items()}


def speeds(reports: list[Path]) -> dict[str, dict[str, float]]:
    """Decode-b1 rates relative to the fastest: backends (auto tables) and peers (bench.json, by engine name)."""
    from effkit import engines

    backends: dict[str, list[float]] = {}
    peers: dict[str, list[float]] = {}
    peer_engine = {e.peer_tag: e.name for e in engines.peers()}
    for folder in reports:
        for path in folder.glob("*quantize-*.json"):
            a = json.loads(path.read_text())["metrics"].get("auto")
            if not a:
                continue
            rate = {b: row["median"] for b, row in a["table"].items() if "median" in row}
            for b, why in a["choice"].get("far", {}).items():
                if (m := FAR.search(why)) and m.group(2) in rate:
                    rate[b] = rate[m.group(2)] / float(m.group(1))
            for b, r in rate.items():
                backends.setdefault(b, []).append(r / max(rate.values()))
        bench = json.loads((folder / "bench.json").read_text())
        rate = {peer_engine[r["tag"]]: r["decode_tokens_per_s_b1"] for r in bench["artifacts"]
                if r["tag"] in peer_engine and isinstance(r.get("decode_tokens_per_s_b1"), float)}
        for n, r in rate.items():
            peers.setdefault(n, []).append(r / max(rate.values()))
    return {"backends": {b: round(statistics.mean(v), 4) for b, v in backends.items()},
            "peers": {n: round(statistics.mean(v), 4) for n, v in peers.items()}}


def quantize_reports(folder: Path) -> dict[str, dict]:
    """The run's quantize reports by step (`quantize train`, `quantize best-pruned`: the one whose parent is pruned)."""
    return {("quantize best-pruned" if "+" in p.name else "quantize train"): json.loads(p.read_text())
            for p in folder.glob("*quantize-*.json")}


def legacy_caches(folders: list[Path]) -> dict[Path, dict[str, list[dict]]]:
    """For runs whose eta.json records no caches: each quantize step's cache fills read off its backends' rows
    (`LEGACY_CACHES`; the module's text says how), as `caches_used` records them."""
    rows: dict[tuple[str, str], dict[Path, float]] = {}
    for f in folders:
        for step, rep in quantize_reports(f).items():
            for b, row in rep["metrics"].get("auto", {}).get("table", {}).items():
                if b in LEGACY_CACHES and "seconds" in row:
                    rows.setdefault((step, b), {})[f] = row["seconds"]
    out: dict[Path, dict[str, list[dict]]] = {f: {} for f in folders}
    for (step, b), by_run in rows.items():
        fastest = min(by_run.values())
        for f, sec in by_run.items():
            out[f].setdefault(step, []).append({"cache": LEGACY_CACHES[b], "key": f"{b} in {step}",
                                                "warm": sec == fastest, "fill_s": sec - fastest})
    return out


def fit_run(folder: Path, parts: dict[str, float], used: dict[str, list[dict]], wall_s: float) -> dict:
    """One run's weights, its caches' fills and its time outside the stages (see the module's text)."""
    eta = json.loads((folder / "eta.json").read_text())
    step, actual, budgets = eta["step_time_s"], eta["actual_s"], eta["sequential_budgets_s"]
    before = eta.get("weights", BEFORE)
    used = eta.get("caches_used", used)
    fills = {k: [(u["cache"], u["fill_s"] / step) for u in us if not u.get("warm") and u.get("fill_s")]
             for k, us in used.items()}
    steps = {k: (actual[k] - BUDGET_USED * budgets.get(k, 0.0)) / step - sum(f for _, f in fills.get(k, []))
             for k in actual}
    # the stage less its training loop (whose steps the estimate counts at the step time of the first ones)
    fit = {"train_setup": steps["train"] - json.loads((folder / "train.json").read_text())["metrics"]["train_wall_s"]
           / step}
    rounds = {f"prune {r['mode']}": r["config"]["rounds"] for p in folder.glob("prune-*.json")
              if "rounds" in (r := json.loads(p.read_text())).get("config", {}) and "curve" in r}
    fit["prune_round"] = statistics.mean(  # the work recorded less its rounds' weight then: the fine-tuning
        (steps[k] - (eta["work_in_steps"][k] - n_r * before["prune_round"])) / n_r for k, n_r in rounds.items())
    rest = 1 - sum(parts.values())  # the share of a stage beside its backends
    units = [steps[k] / (rest + sum(parts[b] for b, row in rep["metrics"].get("auto", {}).get("table", {}).items()
                                    if "eval_loss" in row))  # each quantize stage per unit of a full `auto`
             for k, rep in quantize_reports(folder).items()]
    unit = statistics.mean(units)
    bench = json.loads((folder / "bench.json").read_text())
    ms, b = bench["config"], before["bench"]
    k = steps["bench"] / (len(bench["artifacts"]) * (ms["rounds"] * b["artifact_round"] * ms["gen_tokens"] / 128
                                                     * ms["repeats"] / 3 + b["artifact"]))
    base = before.get("outside_s", 30.0)  # the caches filled before training: in the decision's outside_s
    filled_before = eta.get("time_budget", {}).get("outside_s", base) - base
    wall_s = eta.get("wall_s", wall_s)
    return {**fit, "quantize_fixed": unit * rest, "quantize": {b: unit * p for b, p in parts.items()},
            "bench": {"artifact_round": b["artifact_round"] * k, "artifact": b["artifact"] * k},
            "fills": [f for fs in fills.values() for f in fs], "step_caches": {f"{folder.name}|{k}": [c for c, _ in fs]
                                                                               for k, fs in fills.items() if fs},
            "outside_s": wall_s - sum(actual.values()) - filled_before if wall_s else None}


def fit(reports: list[Path], auto: dict, walls: list[float] | None = None) -> dict:
    parts = backend_parts(auto)
    legacy = legacy_caches(reports)
    runs = [fit_run(f, parts, legacy[f], w) for f, w in zip(reports, walls or [0.0] * len(reports), strict=True)]
    mean = lambda key: round(statistics.mean(r[key] for r in runs), 1)  # noqa: E731
    fills: dict[str, list[float]] = {}
    for r in runs:
        for c, f in r["fills"]:
            fills.setdefault(c, []).append(f)
    outside = [r["outside_s"] for r in runs if r["outside_s"] is not None]
    return {
        "how": "weights in training steps of each run (its seconds / its training step time) with the caches a "
               "stage consults warm; cache_fill: what filling a cold one adds, in training steps; step_caches: "
               "those a first run here fills, by step; outside_s: seconds outside the stages with the caches warm; "
               "fitted by benchmarks/stage_costs.py (its text says how); speeds: decode-b1 rates relative to the "
               "fastest",
        "fitted_from": [str(f) for f in reports] + [
            f"an auto at share 1 of {auto.get('measured_from', auto['parent'])} at {auto['git_commit']} "
            f"({auto['stage_s']:.0f} s; its shares kept)"],
        "train_setup": mean("train_setup"), "prune_round": mean("prune_round"),
        "quantize": {"fixed": mean("quantize_fixed"),
                     "backends": {b: round(statistics.mean(r["quantize"][b] for r in runs), 1) for b in parts}},
        "bench": {k: round(statistics.mean(r["bench"][k] for r in runs), 2) for k in ("artifact_round", "artifact")},
        "cache_fill": {c: round(statistics.mean(v), 1) for c, v in fills.items()},
        "step_caches": {k: sorted({c for r in runs for c in r["step_caches"].get(k, [])})
                        for k in sorted({k for r in runs for k in r["step_caches"]})},
        **({"outside_s": round(statistics.mean(outside), 1)} if outside else {}),
        "speed": {k: {**COSTS_NOW.get("speed", {}).get(k, {}), **v} for k, v in speeds(reports).items()},
    }


def run_record(folder: Path, recipe: str, wall_s: float, legacy: dict[str, list[dict]]) -> dict:
    """One finished run as the measuring steps' fit and its check read it: the plan it ran (the recipe at the steps
    it trained, with the weights in the file now), each step's work, time budget, cold caches' fills (seconds) and
    seconds; its wall time, seconds outside the steps, the step time predicted before training and training's, and
    its machine factor (`pipeline.machine_factor` as its decision recorded it; 1 for a run that predates it)."""
    from effkit.pipeline import make_plan, shared, stage_budgets, stage_work, step_timer, steps

    eta = json.loads((folder / "eta.json").read_text())
    decided = eta["time_budget"]
    plan = make_plan(recipe)
    trial, _ = shared(plan, step_timer(plan), decided["steps"])
    used = eta.get("caches_used") or legacy
    wall = eta.get("wall_s") or wall_s
    base = eta["weights"].get("outside_s", 30.0)  # the caches filled before training: in the decision's outside_s
    actual = eta["actual_s"]
    return {"name": folder.name, "folder": str(folder), "work": stage_work(trial), "budgets": stage_budgets(trial),
            "measures": [s.key for s in steps(trial) if s.measures and s.key in actual], "actual": actual, "wall": wall,
            "fills": {k: sum(u["fill_s"] for u in us if not u.get("warm") and u.get("fill_s"))
                      for k, us in used.items()},
            "outside": wall - sum(eta["actual_s"].values()) - max(0.0, decided.get("outside_s", base) - base)
            if wall else None,
            "step_before": decided["step_time_s"], "step_training": decided.get("training_step_time_s"),
            "factor": decided.get("machine", {}).get("factor", 1.0)}


def measuring_units(runs: list[dict]) -> dict[str, float]:
    """Seconds per unit of work of each measuring step (by run name and step), the mean of the runs' own: its
    seconds less `BUDGET_USED` of its time budget and the cold caches it filled, over its work and its run's machine
    factor."""
    per: dict[str, list[float]] = {}
    for r in runs:
        for k in r["measures"]:
            per.setdefault(f"{r['name']}|{k}", []).append(
                (r["actual"][k] - BUDGET_USED * r["budgets"].get(k, 0.0) - r["fills"].get(k, 0.0))
                / r["work"][k] / r["factor"])
    return {k: round(statistics.mean(v), 4) for k, v in per.items()}


def predicted_wall(run: dict, units: dict[str, float], outside_s: float, step_s: float) -> dict[str, float]:
    """The run's steps as `pipeline.expected_seconds` prices them (training at `step_s`; the measuring steps at
    `units` x the run's machine factor) with the cold caches it filled at what they cost, and the whole with
    `outside_s`."""
    got = {k: w * (units[f"{run['name']}|{k}"] * run["factor"] if k in run["measures"] else step_s)
           + BUDGET_USED * run["budgets"].get(k, 0.0) + run["fills"].get(k, 0.0) for k, w in run["work"].items()}
    return {**got, "wall": sum(got.values()) + outside_s}


def check(runs: list[dict]) -> dict:
    """Each run predicted from the others alone (their `measuring_units` and time outside the steps), with the step
    time predicted before training and with training's own (the re-fit's), against its wall time; `margin_needed`:
    the share of a budget that the largest under-prediction needs left unused (1 - predicted / wall)."""
    rows = []
    for r in runs:
        others = [o for o in runs if o is not r]
        units = measuring_units(others)
        outside = statistics.mean(o["outside"] for o in others if o["outside"] is not None)
        row = {"run": r["folder"], "wall_s": round(r["wall"], 1)}
        for label, step_s in (("before_training", r["step_before"]), ("training", r["step_training"])):
            got = predicted_wall(r, units, outside, step_s)
            row[label] = {"step_s": round(step_s, 4), "predicted_s": round(got["wall"], 1),
                          "error": round(got["wall"] / r["wall"] - 1, 4),
                          "stages_s": {k: [round(got[k], 1), round(r["actual"][k], 1)] for k in r["work"]}}
        rows.append(row)
    worst = max(1 - row[k]["predicted_s"] / row["wall_s"] for row in rows for k in ("before_training", "training"))
    return {"runs": rows, "margin_needed": round(max(0.0, worst), 4),
            "how": "each run predicted from the others (leave-one-out): stages [predicted, actual] in seconds"}


def measuring_entry(runs: list[dict], reference: float | None) -> dict:
    """effkit/stage_costs.json's `measuring_s`: the seconds per unit fitted from `runs` and the machine's reference."""
    from effkit.measure.hardware import cpu_identity

    units = measuring_units(runs)
    return {"how": "seconds per unit of a measuring step's work (the weights in this file) on the machine the runs "
                   "fitted ran on, by run name and step (the mean of the runs' own: its seconds less its time budget's "
                   "part and the cold caches it filled, over its work); default: their mean, for any other step; "
                   "reference_s: that machine's `pipeline.reference_s` (thread CPU seconds), which a run on another "
                   "CPU (cpu: `hardware.cpu_identity` of the machine measured) divides its own by; fitted by "
                   "benchmarks/stage_costs.py --units",
            "fitted_from": [r["folder"] for r in runs], "steps": units,
            "default": round(statistics.mean(units.values()), 4),
            "reference_s": reference if reference is not None else COSTS_NOW.get("measuring_s", {}).get("reference_s"),
            "cpu": cpu_identity() if reference is not None else COSTS_NOW.get("measuring_s", {}).get("cpu")}


def predict(step_s: float, recipe: str = "recipes/quickstart.toml") -> None:
    """What `effkit run` decides and predicts before training for `recipe` with a training step of `step_s`."""
    from effkit.pipeline import decide, make_plan, step_timer

    plan = make_plan(recipe)
    d = decide(plan, step_timer(plan), step_s, plan.run.pipeline.time_budget_min or float("inf"))
    print(f"{recipe}, one training step {step_s:.3f} s: {d['steps']} steps (share {d['share']:.0%}), "
          f"{d['predicted_s'] / 60:.1f} min in all ({d['outside_s']:.0f} s outside the steps), fits: {d['fits']}")
    for k, v in d["stage_s"].items():
        print(f"  {k}: {v / 60:.2f} min")
    for stage, got in d["shares"].items():
        print(f"  {stage}: {json.dumps(got)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="*", type=Path, help="report folders of finished `effkit run`s")
    ap.add_argument("--auto", type=Path, help="the file --measure-auto wrote")
    ap.add_argument("--wall-s", type=float, nargs="*", help="each run's wall time in seconds, in the order of the "
                    "folders, for runs whose eta.json predates `wall_s` (0: unknown)")
    ap.add_argument("--measure-auto", nargs=2, type=Path, metavar=("ARTIFACT", "OUT"))
    ap.add_argument("--write", action="store_true", help=f"write {COSTS.relative_to(ROOT)}")
    ap.add_argument("--predict", type=float, metavar="STEP_S", help="print the quickstart's decision and per-stage "
                    "prediction for a training step of this many seconds, with the weights in the file")
    ap.add_argument("--units", action="store_true", help="fit the measuring steps' seconds per unit (`measuring_s`) "
                    "from the runs, with the weights in the file (after any --auto fit of them)")
    ap.add_argument("--check", action="store_true", help="predict each run from the others (`check`) and print it")
    ap.add_argument("--reference", type=int, metavar="REPEATS", help="measure this machine's `pipeline.reference_s`"
                    " (the least of this many) and keep it with --units --write: run it on the fitting machine, idle")
    ap.add_argument("--recipe", default="recipes/quickstart.toml", help="the recipe the runs ran (--units, --check)")
    args = ap.parse_args()
    if args.measure_auto:
        measure_auto(*args.measure_auto)
        return
    if args.predict:
        predict(args.predict)
        return
    if args.units or args.check:
        walls = args.wall_s or [0.0] * len(args.reports)
        legacy = legacy_caches(args.reports)
        runs = [run_record(f, args.recipe, w, legacy[f]) for f, w in zip(args.reports, walls, strict=True)]
        if args.check:
            print(json.dumps(check(runs), indent=2))
        if not args.units:
            return
        from effkit.pipeline import reference_s

        got = {"measuring_s": measuring_entry(runs, round(reference_s(args.reference), 5) if args.reference else None)}
    else:
        got = fit(args.reports, json.loads(args.auto.read_text()), args.wall_s)
    # entries this script does not fit (e.g. bench_speculative, estimated by its own module) are kept as they are
    got = {**{k: v for k, v in json.loads(COSTS.read_text()).items() if k not in got}, **got}
    text = json.dumps(got, indent=2) + "\n"
    print(text)
    if args.write:
        COSTS.write_text(text)


if __name__ == "__main__":
    main()
