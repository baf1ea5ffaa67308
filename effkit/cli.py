"""The `effkit` command line: flags -> config -> stage. Thin by design; every EffkitError becomes one
line on stderr and exit code 2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import typer

from effkit import optim as optim_registry  # (`optim` is also a flag of `train`)
from effkit import workloads
from effkit.config import (
    BackendParams,
    BenchConfig,
    ExportConfig,
    PruneConfig,
    QuantizeConfig,
    Sequential,
    TrainConfig,
    build_config,
    flat_defaults,
)
from effkit.errors import EffkitError, Interrupted, exit_interrupted, interrupt_received
from effkit.measure import results
from effkit.prune import methods
from effkit.quantize import backends

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="effkit: train, prune, quantize and benchmark GPT-2-class models, with honest numbers.")

_D = SimpleNamespace(**TrainConfig.flat_defaults())  # defaults shown in --help
DEVICE_HELP = "auto (the first GPU if there is one, else the CPU), cpu, cuda or cuda:N"


@app.callback()
def _root(remeasure: bool = typer.Option(False, "--remeasure", help="measure again what effkit caches per machine "
                                         "(the CPU's GEMM peak, bf16 or fp32, CTranslate2's threads, the memory "
                                         "plan's runtime) instead of reading it from the cache")) -> None:
    """effkit: train, prune, quantize and benchmark GPT-2-class models, with honest numbers."""
    if remeasure:  # an environment variable, so that the processes effkit starts measure again too
        os.environ["EFFKIT_REMEASURE"] = "1"


DATA_HELP = ("corpus for calibration, fine-tuning and evaluation: builtin, or a folder / file of text (default: "
             "the artifact's own; builtin for a plain Hugging Face folder)")


def _console():
    """A rich console that stays readable when the output is a file or pipe (rich falls back to 80 columns)."""
    from rich.console import Console

    probe = Console()
    return probe if probe.is_terminal else Console(width=160)


TERMINAL_BENCH_COLUMNS = ("artifact", "eval loss (95% CI)", "Δ loss vs ref", "prefill b12 vs ref", "decode b1 tok/s",
                          "decode b1 vs ref", "decode b12 tok/s", "decode b12 vs ref", "size MiB", "peak MiB")


def _bench_table(report: dict, title: str):
    """The bench table for a terminal: the columns that decide (bench.md has them all)."""
    from rich.table import Table

    from effkit.bench import table_rows

    cols, rows = table_rows(report)
    keep = [cols.index(c) for c in TERMINAL_BENCH_COLUMNS]
    t = Table(title=title)
    for i in keep:
        t.add_column(cols[i], justify="left" if cols[i] == "artifact" else "right", no_wrap=cols[i] == "artifact")
    for r in rows:
        t.add_row(*[r[i] for i in keep])
    return t


def _explicit(ctx: typer.Context, names: list[str]) -> dict:
    """Values the user actually typed (so that they override the recipe, and defaults do not)."""
    out = {}
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            out[name] = ctx.params[name]
    return out


def quiet_libraries() -> None:
    from effkit.quiet import quiet_libraries as quiet

    quiet()


def _flags(ctx: typer.Context, cls: type) -> dict:
    """The options of `cls` the user typed, by their flat config key."""
    return _explicit(ctx, [name for name in flat_defaults(cls) if name in ctx.params])


@app.command()
def train(
    ctx: typer.Context,
    recipe: Optional[Path] = typer.Option(None, help="TOML recipe; its \\[train] table sets defaults, flags override"),
    model: str = typer.Option(_D.model, help="preset (gpt2-nano, gpt2-micro, gpt2-mini, gpt2, gpt2-medium, "
                              "gpt2-large, gpt2-xl), a Hugging Face model folder, or a hub id (online)"),
    data: str = typer.Option(_D.data, help="builtin (State of the Union speeches), wikitext-103, wikitext-2, "
                             "or a .txt / folder / .jsonl path"),
    vocab_size: int = typer.Option(_D.vocab_size, help="BPE vocabulary size (ignored for pretrained models)"),
    block_size: int = typer.Option(_D.block_size, help="tokens per training block (<= model context)"),
    heldout_fraction: float = typer.Option(_D.heldout_fraction, help="fraction of documents held out"),
    eval_blocks: int = typer.Option(_D.eval_blocks, help="number of held-out blocks in every evaluation"),
    max_steps: int = typer.Option(_D.max_steps, help="optimizer steps (0 = bounded by tokens/time)"),
    max_tokens: int = typer.Option(_D.max_tokens, help="stop after this many training tokens (0 = no limit)"),
    time_budget: float = typer.Option(_D.time_budget, help="stop after this many seconds (0 = no limit)"),
    batch_size: int = typer.Option(_D.batch_size, help="blocks per micro-step per data-parallel rank"),
    grad_accum: int = typer.Option(_D.grad_accum, help="micro-steps per optimizer step"),
    lr: float = typer.Option(_D.lr, help="peak learning rate"),
    min_lr: float = typer.Option(_D.min_lr, help="learning rate at the end of the cosine"),
    warmup_steps: int = typer.Option(_D.warmup_steps, help="linear warm-up steps"),
    weight_decay: float = typer.Option(_D.weight_decay, help="AdamW weight decay (matrices only)"),
    grad_clip: float = typer.Option(_D.grad_clip, help="gradient norm clip (0 = off)"),
    dropout: float = typer.Option(_D.dropout, help="dropout probability"),
    seed: int = typer.Option(_D.seed, help="random seed (model init and data order)"),
    amp: Optional[bool] = typer.Option(_D.amp, "--amp/--no-amp", show_default="auto",
                                       help="force mixed precision autocast (--amp-dtype) on or off; default: "
                                            "bf16 on CUDA, on a CPU whichever of fp32 and bf16 measures faster "
                                            "for the model's shape (measured once per machine and shape)"),
    amp_dtype: str = typer.Option(_D.amp_dtype, help="bf16, or fp16 (CUDA only, with GradScaler)"),
    optim: str = typer.Option(_D.optim, help="optimizer: " + optim_registry.describe()),
    tf32: bool = typer.Option(_D.tf32, "--tf32/--no-tf32", help="CUDA (Ampere+): fp32 matmuls on TF32 tensor "
                              "cores"),
    activation_checkpointing: bool = typer.Option(_D.activation_checkpointing,
                                                  "--activation-checkpointing/--no-activation-checkpointing",
                                                  help="recompute each block in backward to save memory"),
    workers: int = typer.Option(_D.workers, help="DataLoader worker processes"),
    threads: int = typer.Option(_D.threads, help="torch threads per process (0 = torch default)"),
    parallel: str = typer.Option(_D.parallel, help="none, ddp, fsdp, tp, fsdp+tp, pp, pp+fsdp"),
    nproc: int = typer.Option(_D.nproc, help="processes per node (0 = number of GPUs, or 2 on CPU)"),
    tp_size: int = typer.Option(_D.tp_size, help="tensor-parallel size for fsdp+tp (0 = 2)"),
    pp_size: int = typer.Option(_D.pp_size, help="pipeline stages for pp+fsdp (0 = 2; pp: every process)"),
    pp_schedule: str = typer.Option(_D.pp_schedule, help="pipeline schedule: gpipe or 1f1b"),
    microbatches: int = typer.Option(_D.microbatches, help="pipeline micro-batches per micro-step (divide "
                                     "--batch-size; 1f1b: at least the number of stages)"),
    sync: str = typer.Option(_D.sync, help="gradient sync for --parallel ddp: ddp, all-reduce, gather-scatter"),
    reshard_after_forward: bool = typer.Option(_D.reshard_after_forward,
                                               "--reshard-after-forward/--no-reshard-after-forward",
                                               help="fsdp: free gathered parameters after forward"),
    cpu_offload: bool = typer.Option(_D.cpu_offload, "--cpu-offload", help="fsdp: keep parameters on CPU (GPU only)"),
    nnodes: int = typer.Option(_D.nnodes, help="number of machines"),
    node_rank: int = typer.Option(_D.node_rank, help="rank of this machine"),
    master_addr: str = typer.Option(_D.master_addr, help="address of the rank-0 machine"),
    master_port: int = typer.Option(_D.master_port, help="port of the rank-0 machine"),
    connect_timeout: float = typer.Option(_D.connect_timeout, help="seconds a node other than 0 waits for node 0"),
    eval_interval: int = typer.Option(_D.eval_interval, help="steps between held-out evaluations (0 = end only)"),
    checkpoint_interval: int = typer.Option(_D.checkpoint_interval, help="steps between checkpoints (0 = never)"),
    run_name: str = typer.Option(_D.run_name, help="run folder name (default: timestamp-model)"),
    runs_dir: str = typer.Option(_D.runs_dir, help="where runs/<run>/<stage>/ artifacts go"),
    reports_dir: str = typer.Option(_D.reports_dir, help="where reports/<run>/ go"),
    resume: bool = typer.Option(_D.resume, "--resume", help="continue the run (--run-name, default: latest) "
                                "from its last checkpoint"),
    plan: bool = typer.Option(False, "--plan", help="print the predicted per-rank peak memory and whether it fits, "
                              "allocate nothing, and stop"),
    fit: bool = typer.Option(False, "--fit", help="with --plan: propose the cheapest memory tricks that fit"),
):
    """Train a GPT-2 model (default: the CPU quickstart on the embedded corpus)."""
    quiet_libraries()
    cfg = build_config(TrainConfig, str(recipe) if recipe else None, _flags(ctx, TrainConfig))
    if fit and not plan:
        raise EffkitError("--fit goes with --plan: effkit train --plan --fit [options]")
    if plan:
        _print_plan(cfg, fit)
        return
    if cfg.run.resume and not cfg.run.run_name:
        from effkit.artifacts import latest_run

        cfg = cfg.with_flat(run_name=latest_run(Path(cfg.run.runs_dir)).name)
    from effkit.memplan import predict_quietly
    from effkit.train import train_any

    # a resumed run continues the configuration saved in its checkpoint, not these flags: no plan for it
    report = train_any(cfg, plan=None if cfg.run.resume else predict_quietly(cfg))
    if "node_rank" in report:
        print(f"node {report['node_rank']}: training finished; node 0 saved the artifact "
              f"({report['artifact_on_node0']}) and wrote the report ({report['report_on_node0']}) on its machine")
        return
    _print_train_summary(report)


def _print_plan(cfg, fit: bool) -> None:
    from rich.table import Table

    from effkit import memplan

    changes: list[str] = []
    if fit:
        p, _, changes = memplan.fit(cfg)
    else:
        p = memplan.predict(cfg, probe=True)
    c = p.config
    t = Table(title=f"memory plan: {c['model']}, {c['parallel']} x{c['world']}, batch {c['batch_size']} x "
                    f"{c['block_size']} tokens, {c['optim']}, {c['amp']}, activation checkpointing "
                    f"{'on' if c['activation_checkpointing'] else 'off'}")
    t.add_column("per rank, at the peak")
    t.add_column("MiB", justify="right")
    for k, v in p.per_rank.items():
        t.add_row(k, f"{v / 2**20:,.0f}")
    t.add_row("[bold]total", f"[bold]{p.total_bytes / 2**20:,.0f}")
    t.add_row(p.device, f"{p.device_bytes / 2**20:,.0f}" if p.device_bytes else "unknown")
    if p.usable_bytes:
        t.add_row(f"usable (less {memplan.HEADROOM:.0%} kept free)", f"{p.usable_bytes / 2**20:,.0f}")
    console = _console()
    console.print(t)
    for n in p.notes:
        console.print(f"  {n}")
    verdict = ("fits" if p.fits else "does NOT fit") if p.fits is not None else "fit unknown (device memory unknown)"
    console.print(f"plan: {verdict}; predicted by {memplan.METHOD}")
    if fit:
        if not changes and p.fits:
            console.print("--fit: fits as asked; nothing to change")
        elif p.fits:
            console.print("--fit: add " + " ".join(changes))
        else:
            console.print("--fit: nothing effkit can change on one rank fits; use more processes with "
                          "--parallel fsdp (or a GPU with more memory), or a smaller model")


def _print_train_summary(report: dict) -> None:
    from rich.table import Table

    m, w = report["metrics"], report["what_ran"]
    t = Table(title=f"train: {report['run']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("held-out loss", f"{m['eval_loss']:.4f} nats/token"),
            ("bits per byte", f"{m['bits_per_byte']:.4f}" if m.get("bits_per_byte") else "n/a"),
            ("perplexity", f"{m['perplexity']:.1f}"),
            ("steps", str(m["steps"])), ("train tokens/s", f"{m['train_tokens_per_s']:,.0f}"),
            ("MFU", f"{m['mfu']:.1%}" if m["mfu"] else f"invalid: {m['mfu_invalid']}" if m.get("mfu_invalid")
             else "n/a"),
            ("peak memory / rank", ", ".join(f"{b / 2**20:,.0f} MiB" for b in m["peak_memory_bytes_per_rank"])),
            ("parameters", f"{m['params']:,}"), ("size on disk", f"{m['size_bytes'] / 2**20:.1f} MiB"),
            ("parallel", f"{w['parallel']} x{w['world_size']}"), ("precision", w["amp_dtype"])]
    for r in rows:
        t.add_row(*r)
    _console().print(t)
    print(f"artifact: {report['artifact']}\nreport:   {Path(report['config']['run']['reports_dir']) / report['run']}")


# how long a paired timing comparison runs: the same three options on prune, quantize, export and bench
_S = SimpleNamespace(**Sequential().to_dict())
FIXED_ROUNDS = typer.Option(_S.fixed_rounds, "--fixed-rounds/--sequential",
                            help="exactly the given rounds (95% intervals), or rounds until each ratio is decided "
                                 "or within --precision (at most 4x, Bonferroni-corrected)")
PRECISION = typer.Option(_S.precision, help="sequential: an undecided ratio is settled once its interval is within "
                                            "+-this fraction")
BUDGET_S = typer.Option(_S.budget_s, help="sequential: seconds of further rounds per comparison")

_P = SimpleNamespace(**PruneConfig.flat_defaults())


@app.command()
def prune(
    ctx: typer.Context,
    recipe: Optional[Path] = typer.Option(None, help="TOML recipe; its \\[prune] table sets defaults"),
    source: str = typer.Option(_P.source, "--from", help="artifact or Hugging Face GPT-2 folder to prune (default: "
                                                         "runs/latest/train)"),
    data: str = typer.Option(_P.data, help=DATA_HELP),
    mode: str = typer.Option(_P.mode, help="a pruning method: " + ", ".join(methods.names()) + " (row: MLP "
                                           "channels, width: residual channels, depth: whole blocks, weight: "
                                           "unstructured)"),
    target: float = typer.Option(_P.target, help="fraction removed by the last round (0-1): of the weights, MLP "
                                                 "channels, residual channels or blocks"),
    rounds: int = typer.Option(_P.rounds, help="prune in this many steps up to the target"),
    finetune_steps: int = typer.Option(_P.finetune_steps, help="fine-tuning steps after each round (0 = none)"),
    importance: str = typer.Option(_P.importance, help="weight mode: magnitude, or wanda (|W| x input norm); width "
                                                       "mode: magnitude, or taylor (|W x gradient|)"),
    scope: str = typer.Option(_P.scope, help="weight mode, magnitude: rank globally or per layer"),
    calib_batches: int = typer.Option(_P.calib_batches, help="wanda, taylor, depth: calibration batches"),
    batch_size: int = typer.Option(_P.batch_size, help="fine-tuning batch size (blocks)"),
    lr: float = typer.Option(_P.lr, help="fine-tuning peak learning rate (0: the parent's final learning rate, "
                                         "where its training ended)"),
    warmup_steps: int = typer.Option(_P.warmup_steps, help="fine-tuning warm-up steps"),
    seed: int = typer.Option(_P.seed, help="random seed"),
    control: bool = typer.Option(_P.control, "--control/--no-control",
                                 help="also fine-tune the unpruned parent with the same steps (the fair baseline)"),
    distill: Optional[bool] = typer.Option(_P.distill, "--distill/--no-distill", show_default="auto",
                                           help="fine-tune toward the frozen dense parent's logits (KL); auto: on "
                                                "for row, width and depth, off for weight"),
    distill_alpha: float = typer.Option(_P.distill_alpha, help="weight of the KL term (0-1)"),
    distill_temperature: float = typer.Option(_P.distill_temperature, help="softmax temperature of the KL term"),
    latency_rounds: int = typer.Option(_P.latency_rounds, help="interleaved rounds of the latency against dense"),
    latency_repeats: int = typer.Option(_P.latency_repeats, help="timed forward passes per model per round"),
    fixed_rounds: bool = FIXED_ROUNDS,
    precision: float = PRECISION,
    budget_s: float = BUDGET_S,
    device: str = typer.Option(_P.device, help=DEVICE_HELP),
    runs_dir: str = typer.Option(_P.runs_dir, help="where runs/ are"),
    reports_dir: str = typer.Option(_P.reports_dir, help="where reports/ go"),
):
    """Prune a trained model (row, width, depth or weight), fine-tuning between rounds; one artifact per round."""
    quiet_libraries()
    cfg = build_config(PruneConfig, str(recipe) if recipe else None, _flags(ctx, PruneConfig))
    from effkit.prune.stage import run_prune

    report = run_prune(cfg)
    from rich.table import Table

    from effkit.measure.stats import fmt_delta, fmt_ratio

    t = Table(title=f"prune --mode {cfg.method.mode}: {report['run']}")
    for col in ("round", "removed", "eval loss", "control loss", "Δ loss vs control", "params",
                "latency b12 vs dense", "FLOPs speed-up"):
        t.add_column(col, justify="right")
    for r in report["curve"]:
        first = r["round"] == 0
        delta = r.get(results.EVAL_LOSS_DELTA_VS_CONTROL)
        t.add_row(str(r["round"]), f"{r['achieved_sparsity']:.3f}", f"{r['eval_loss']:.4f}",
                  f"{r['control_eval_loss']:.4f}" if r.get("control_eval_loss") is not None else "not run",
                  "ref" if first else (fmt_delta(delta) if delta else "n/a"), f"{r['params']:,}",
                  "ref" if first else fmt_ratio(r[results.LATENCY_RATIO_B12]),
                  "" if first else f"{r['speedup_projected']:.2f}x")
    _console().print(t)
    for v in report["verdicts"]:
        print(f"note: {v}")
    print(f"artifact: {report['artifact']}\nreport:   {Path(cfg.folders.reports_dir) / report['run']}")


_Q = SimpleNamespace(**QuantizeConfig.flat_defaults())
_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def with_plugin_options(section: type):
    """Add the options plug-ins declare (a `PluginOptions` section: each backend's `Options` dataclass) to a
    command as typer options, with the help and default of their fields (`--x/--no-x` for booleans); the command
    receives them in its `**kwargs`. Declared once, in the plug-in's module."""

    def wrap(fn):
        import inspect

        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        hints = dict(fn.__annotations__)
        try:
            declared = section.declared()
        except EffkitError:  # a plug-in that does not import: said in one line when the command runs
            declared = {}
        for key, f in declared.items():
            kind = _TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type
            flag = key.replace("_", "-")
            decls = [f"--{flag}/--no-{flag}"] if kind is bool else []
            choices = f.metadata.get("choices")
            help_ = f.metadata.get("help", "") + (f" (one of {', '.join(choices)})" if choices else "")
            params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                            default=typer.Option(f.default, *decls, help=help_)))
            hints[key] = kind
        fn.__signature__ = sig.replace(parameters=params)
        fn.__annotations__ = hints
        return fn

    return wrap


@app.command()
@with_plugin_options(BackendParams)
def quantize(
    ctx: typer.Context,
    recipe: Optional[Path] = typer.Option(None, help="TOML recipe; its \\[quantize] table sets defaults"),
    source: str = typer.Option(_Q.source, "--from", help="artifact or Hugging Face GPT-2 folder (default: newest of "
                                                         "the latest run)"),
    data: str = typer.Option(_Q.data, help=DATA_HELP),
    backend: str = typer.Option(_Q.backend, help="auto (the fastest within 1% of the parent's loss) or a backend: "
                                + ", ".join(backends.names())),
    include_head: bool = typer.Option(_Q.include_head, "--include-head/--no-include-head",
                                      help="also quantize the tied LM head / token embedding"),
    optimize_for: str = typer.Option(_Q.optimize_for, help="the workload auto picks the fastest backend for: "
                                     + ", ".join(workloads.names()) + " (decode: greedy tokens/s; prefill: latency)"),
    compile: bool = typer.Option(_Q.compile, "--compile/--no-compile",
                                 help="also time parent and int8 under torch.compile (Inductor, freezing)"),
    batch_size: int = typer.Option(_Q.batch_size, help="evaluation batch size"),
    latency_rounds: int = typer.Option(_Q.latency_rounds, help="interleaved rounds of fp32, bf16 and int8 timings"),
    latency_repeats: int = typer.Option(_Q.latency_repeats, help="timed forward passes per model per round"),
    fixed_rounds: bool = FIXED_ROUNDS,
    precision: float = PRECISION,
    budget_s: float = BUDGET_S,
    gen_tokens: int = typer.Option(_Q.gen_tokens, help="new tokens in the generation sample"),
    device: str = typer.Option(_Q.device, help=DEVICE_HELP),
    runs_dir: str = typer.Option(_Q.runs_dir, help="where runs/ are"),
    reports_dir: str = typer.Option(_Q.reports_dir, help="where reports/ go"),
    **backend_options,  # each backend's own options (its `Options` dataclass), added by with_plugin_options
):
    """Quantize an artifact to int8 and compare it with its parent (fp32 and bf16)."""
    quiet_libraries()
    from effkit.quantize.stage import run_quantize

    cfg = build_config(QuantizeConfig, str(recipe) if recipe else None, _flags(ctx, QuantizeConfig))
    report = run_quantize(cfg)
    from rich.table import Table

    from effkit.measure.stats import fmt_delta, fmt_ratio

    m = report["metrics"]
    t = Table(title=f"quantize ({report['what_ran']['backend']}): {report['run']}")
    for col in ("", "eval loss", "Δ loss vs fp32", "size", "latency b12 (p50)", "b12 vs fp32", "generate tok/s"):
        t.add_column(col, justify="right")
    rows = (("parent fp32", m["parent_fp32"], None, None),
            *([("parent bf16", m["parent_bf16"], m["bf16_eval_loss_delta"], m[results.BF16_LATENCY_RATIO_B12])]
              if "parent_bf16" in m else []),  # absent where the CPU has no native bf16: a note says so
            ("int8", m, m[results.EVAL_LOSS_DELTA], m[results.LATENCY_RATIO_B12]))
    for label, r, delta, ratio in rows:
        gen = r.get("generation", {}).get("tokens_per_s")
        t.add_row(label, f"{r['eval_loss']:.4f}", fmt_delta(delta) if delta else "ref",
                  f"{r['size_bytes'] / 2**20:.1f} MiB" if "size_bytes" in r else "",
                  f"{r['latency_b12']['p50_s'] * 1000:.1f} ms", fmt_ratio(ratio) if ratio else "ref",
                  f"{gen:.0f}" if gen else "")
    _console().print(t)
    if m.get("auto"):
        a = Table(title=f"--backend auto picked {m['auto']['picked']} ({m['auto'].get('verdict', 'decided')}): "
                        f"{m['auto']['how']}")
        w = m["auto"]["optimize_for"]
        for col in ("backend", "status", "eval loss", "loss vs parent", f"{w} vs parent", f"{w} vs picked"):
            a.add_column(col)
        for b, row in m["auto"]["table"].items():
            a.add_row(b, row["status"], f"{row['eval_loss']:.4f}" if "eval_loss" in row else "",
                      fmt_delta(row["loss_delta"]) if "loss_delta" in row else "",
                      fmt_ratio(row["ratio_to_parent"]) if "ratio_to_parent" in row else "",
                      "picked" if b == m["auto"]["picked"] else
                      fmt_ratio(row["ratio_to_picked"]) if "ratio_to_picked" in row else "")
        _console().print(a)
    print(f"parent: {m['parent_fp32']['generation']['text'][:120]!r}")
    print(f"int8:   {m['generation']['text'][:120]!r}")
    print(f"int8, sampled ({m['generation']['sampling']}): {m['generation']['sampled_text'][:120]!r}")
    if "note" in m["generation"]:  # e.g. --gen-tokens capped by the model's context
        print(f"note: {m['generation']['note']}")
    for v in report["verdicts"]:
        print(f"note: {v}")
    print(f"int8 layers in the reloaded artifact: {m['int8_layers_reloaded']}; {m['portability']}")
    print(f"artifact: {report['artifact']}\nreport:   {Path(cfg.folders.reports_dir) / report['run']}")


_E = SimpleNamespace(**ExportConfig.flat_defaults())


@app.command()
def export(
    ctx: typer.Context,
    recipe: Optional[Path] = typer.Option(None, help="TOML recipe; its \\[export] table sets defaults"),
    source: str = typer.Option(_E.source, "--from", help="dense or pruned artifact (default: the latest run's train)"),
    data: str = typer.Option(_E.data, help=DATA_HELP),
    format: str = typer.Option(_E.format, help="onnx (with past key/values, for ONNX Runtime), ctranslate2, "
                                               "openvino (stateful, as optimum-cli writes it) or gguf (llama.cpp)"),
    int8: bool = typer.Option(_E.int8, "--int8/--no-int8", help="int8 weights: ONNX Runtime dynamic int8 after "
                                                                 "export, CTranslate2's int8, or NNCF's int8"),
    fuse: bool = typer.Option(_E.fuse, "--fuse/--no-fuse", help="ONNX Runtime's transformer fusions first"),
    type: str = typer.Option(_E.type, "--type", help="the stored weights, for a format with several: gguf f16 "
                                                     "(default), q8_0 or q4_0 (llama.cpp's blocks of 32)"),
    batch_size: int = typer.Option(_E.batch_size, help="evaluation batch size"),
    latency_rounds: int = typer.Option(_E.latency_rounds, help="interleaved rounds of PyTorch and ONNX timings"),
    latency_repeats: int = typer.Option(_E.latency_repeats, help="timed forward passes per model per round"),
    fixed_rounds: bool = FIXED_ROUNDS,
    precision: float = PRECISION,
    budget_s: float = BUDGET_S,
    gen_tokens: int = typer.Option(_E.gen_tokens, help="new tokens in the generation sample"),
    runs_dir: str = typer.Option(_E.runs_dir, help="where runs/ are"),
    reports_dir: str = typer.Option(_E.reports_dir, help="where reports/ go"),
):
    """Export an artifact to ONNX, CTranslate2 or OpenVINO (optionally int8) and compare it with its PyTorch
    parent."""
    quiet_libraries()
    from effkit.export import run_export
    from effkit.measure.stats import fmt_delta, fmt_ratio

    cfg = build_config(ExportConfig, str(recipe) if recipe else None, _flags(ctx, ExportConfig))
    report = run_export(cfg)
    m = report["metrics"]
    print(f"{report['tag']}: loss {m['eval_loss']:.4f} ({fmt_delta(m[results.EVAL_LOSS_DELTA])} vs PyTorch fp32), "
          f"latency b12 {fmt_ratio(m[results.LATENCY_RATIO_B12])}, size {m['size_ratio_vs_parent']:.2f}x, "
          f"int8 operators {m['int8_layers_reloaded']}")
    print(f"sample: {m['generation']['text'][:120]!r}")
    for v in report["verdicts"]:
        print(f"note: {v}")
    print(f"load it: {report['load_command']}, or effkit bench / generate --from {report['artifact']}")
    print(f"artifact: {report['artifact']}\nreport:   {Path(cfg.folders.reports_dir) / report['run']}")


_B = SimpleNamespace(**BenchConfig.flat_defaults())


@app.command()
def bench(
    ctx: typer.Context,
    paths: Optional[list[str]] = typer.Argument(None, help="artifact folders (default: every artifact of the run)"),
    recipe: Optional[Path] = typer.Option(None, help="TOML recipe; its \\[bench] table sets defaults"),
    run: str = typer.Option(_B.run, help="run name under --runs-dir (default: the latest run)"),
    data: str = typer.Option(_B.data, help=DATA_HELP),
    quick: bool = typer.Option(_B.quick, "--quick", help="3 rounds, fewer repeats and tokens: a fast, wider look"),
    rounds: int = typer.Option(_B.rounds, help="interleaved rounds of the first look (every artifact timed in each, "
                                               "order rotated)"),
    repeats: int = typer.Option(_B.repeats, help="timed forward passes per artifact per round"),
    fixed_rounds: bool = FIXED_ROUNDS,
    precision: float = PRECISION,
    budget_s: float = BUDGET_S,
    gen_tokens: int = typer.Option(_B.gen_tokens, help="new tokens per generation (capped by the context)"),
    train_steps: int = typer.Option(_B.train_steps, help="timed training steps per artifact per round"),
    compile: bool = typer.Option(_B.compile, "--compile/--no-compile",
                                 help="also time each PyTorch artifact under torch.compile (Inductor, freezing)"),
    peers: Optional[bool] = typer.Option(None, "--peers/--no-peers",
                                         help="also the dense reference through the engines a user would pick "
                                              "instead (CTranslate2 int8, ONNX Runtime int8 with past, ...), in the "
                                              "same rounds (default: on in effkit run)"),
    peer_engines: str = typer.Option(_B.peer_engines, help="with --peers: comma-separated engines giving a peer row "
                                                           "(default: every engine that has one)"),
    batch_size: int = typer.Option(_B.batch_size, help="evaluation batch size"),
    json_out: bool = typer.Option(False, "--json", help="print the machine-readable result instead of the table"),
    device: str = typer.Option(_B.device, help=DEVICE_HELP),
    runs_dir: str = typer.Option(_B.runs_dir, help="where runs/ are"),
    reports_dir: str = typer.Option(_B.reports_dir, help="where reports/ go"),
):
    """Measure every artifact of a run with one protocol; table, bench.json/csv/md and leaderboard.json."""
    quiet_libraries()
    cfg = build_config(BenchConfig, str(recipe) if recipe else None,
                       {**_flags(ctx, BenchConfig), "paths": tuple(paths or ())})
    from effkit.bench import run_bench

    report = run_bench(cfg, progress=not json_out)
    if json_out:
        print(json.dumps(report, indent=2, default=str))
        return

    _console().print(_bench_table(report, f"effkit bench: {report['run']} ({report['device']})"))
    for v in report["verdicts"]:
        print(f"note: {v}")
    print("ratios are paired with the first artifact, with 95% intervals; ≈: the interval contains 1")
    print(f"report: {Path(cfg.folders.reports_dir) / report['run']}/bench.md")


@app.command()
def generate(
    source: str = typer.Option("", "--from", help="artifact folder (default: newest artifact of the latest run)"),
    prompt: str = typer.Option("The state of the Union", help="text to continue"),
    max_new_tokens: int = typer.Option(64, help="tokens to generate"),
    temperature: float = typer.Option(0.0, help="0 = greedy; otherwise sample at this temperature"),
    top_k: int = typer.Option(50, help="sample among the k most likely tokens (with --temperature > 0)"),
    seed: int = typer.Option(0, help="random seed for sampling"),
    compile: bool = typer.Option(False, "--compile", help="decode with a static KV cache and a torch.compile'd "
                                                          "step (compiled before the streamed text)"),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    runs_dir: str = typer.Option("runs", help="where runs/ are"),
):
    """Stream text from any artifact, quantized ones included."""
    quiet_libraries()
    import math

    import torch
    from transformers import AutoTokenizer, TextStreamer

    from effkit.artifacts import read_meta, resolve_artifact
    from effkit.artifacts.loader import load_any
    from effkit.parallel import resolve_device

    if max_new_tokens < 1:
        raise EffkitError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if not math.isfinite(temperature) or temperature < 0:
        raise EffkitError(f"--temperature must be a finite number >= 0 (got {temperature})")
    if top_k < 1:
        raise EffkitError(f"--top-k must be at least 1 (got {top_k})")
    if not prompt.strip():
        raise EffkitError("--prompt is empty; give some text to continue")
    path = resolve_artifact(source, runs_dir, default_tag="") if source else _newest(runs_dir)
    read_meta(path)
    dev = resolve_device(device)
    tok = AutoTokenizer.from_pretrained(path)
    model = load_any(path, dev).eval()
    ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
    if ids.shape[1] + max_new_tokens > model.config.n_positions:
        raise EffkitError(f"prompt ({ids.shape[1]} tokens) + --max-new-tokens exceed the model's context "
                          f"({model.config.n_positions}); ask for fewer tokens")
    kwargs = {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else \
        {"do_sample": False}
    if compile:
        import time

        from effkit.measure.metrics import compiled_generation, greedy_generate

        compiled, status = compiled_generation(model)
        if compiled is None:
            raise EffkitError(f"--compile: {status}; run without --compile")
        t = time.perf_counter()
        greedy_generate(model, tok, max_new_tokens, prompt, generate_kwargs=compiled)  # compiles (same shapes)
        print(f"compiled in {time.perf_counter() - t:.1f} s: {status}", file=sys.stderr)
        kwargs.update(compiled)
    torch.manual_seed(seed)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=tok.eos_token_id, use_cache=True,
                       streamer=TextStreamer(tok), **kwargs)


def _newest(runs_dir: str) -> Path:
    from effkit.artifacts.loader import newest_artifact

    return newest_artifact(runs_dir, quantized=True)


@app.command()
def report(
    run: Optional[str] = typer.Argument(None, help="run name (default: the latest run)"),
    runs_dir: str = typer.Option("runs", help="where runs/ are (to find the latest run)"),
    reports_dir: str = typer.Option("reports", help="where reports/ are"),
):
    """Render reports/<run>/summary.md with PNG plots (loss curves, pruning curves, artifact comparison)."""
    from effkit.artifacts import latest_run
    from effkit.config import check_run_name
    from effkit.report import render_run_report

    name = check_run_name(run, "run") if run else latest_run(Path(runs_dir)).name
    summary, plots = render_run_report(Path(reports_dir), name)
    print(f"report: {summary}")
    for p in plots:
        print(f"plot:   {p}")


def _default_recipe() -> str:
    local = Path("recipes/quickstart.toml")
    if local.is_file():
        return str(local)
    shipped = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.toml"
    return str(shipped if shipped.is_file() else local)


@app.command("run")
def run_cmd(
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe (default: recipes/quickstart.toml)"),
    force: bool = typer.Option(False, "--force", help="redo every stage, even complete ones"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan (stages, launch command, artifacts) only"),
    workload: Optional[str] = typer.Option(None, help="the workload the delivered artifact (and auto's backend) is "
                                           "chosen for, among every engine: " + ", ".join(workloads.names()) +
                                           " (default: the recipe's [run] optimize_for, else decode-b1)"),
):
    """Run the whole pipeline from one recipe: train, prune, quantize, bench, report. Resumable."""
    quiet_libraries()
    from rich.table import Table

    from effkit.pipeline import run_pipeline

    console = _console()
    recipe = recipe or _default_recipe()
    if workload:
        workloads.get(workload, "--workload")  # a bad name is the flag's error, not the recipe's
    result = run_pipeline(recipe, force=force, dry_run=dry_run, console=console,
                          overrides={"optimize_for": workload} if workload else None)
    if dry_run:
        t = Table(title=f"plan of {recipe}")
        for col in ("stage", "what", "leaves"):
            t.add_column(col, overflow="fold")
        for s in result["plan"]:
            t.add_row(s["stage"], s["what"], s["leaves"])
        console.print(t)
        for s in result["plan"]:
            if "launch" in s:
                console.print(f"launch ({s['stage']}): {s['launch']}", soft_wrap=True)
        return
    if result["bench"]:

        console.print(_bench_table(result["bench"], f"effkit run: {result['bench']['run']}"))
    console.print(f"stages: {', '.join(result['done'])}; wall time {result['wall_s'] / 60:.1f} min")
    console.print(f"report: {result['report']}")
    if result.get("deliverable"):
        console.print(result["deliverable"]["line"], soft_wrap=True, highlight=False)


@app.command()
def doctor():
    """What this machine offers: devices, backends, bf16, quantization backends, versions, matmul peak."""
    quiet_libraries()
    import torch
    import torch.distributed as dist
    from rich.table import Table

    from effkit.artifacts import versions
    from effkit.measure import metrics
    from effkit.quantize import backends

    t = Table(title="effkit doctor")
    t.add_column("what")
    t.add_column("this machine")
    cuda = torch.cuda.is_available()
    t.add_row("device", metrics.describe_device(torch.device("cuda", 0) if cuda else torch.device("cpu")))
    t.add_row("GPUs", str(torch.cuda.device_count()) if cuda else "none: CPU + gloo")
    t.add_row("CPU cores / torch threads", f"{os.cpu_count()} / {torch.get_num_threads()}")
    t.add_row("distributed backends", ", ".join(b for b, ok in (("gloo", dist.is_gloo_available()),
                                                               ("nccl", dist.is_nccl_available())) if ok))
    if cuda:
        bf16 = "yes" if torch.cuda.is_bf16_supported() else "no"
    else:
        bf16 = ("native (AVX512-BF16/AMX)" if metrics.cpu_has_native_bf16()
                else "emulated: slower than fp32 here, train with --no-amp")
    t.add_row("bf16", bf16)
    t.add_row("fp16 autocast", "yes (with GradScaler)" if cuda else "no-op on CPU: refused")
    for b in backends.names():
        reason = backends.unavailable(b)
        t.add_row(f"int8 backend {b}", "available" if reason is None else f"not available: {reason}")
    if cuda:
        dev = torch.device("cuda", 0)
        t.add_row("TF32 for fp32 matmuls", "yes (on by default; --no-tf32 turns it off)"
                  if metrics.tf32_supported(dev) else "no (needs compute capability 8.0+)")
        for precision in ("fp32", "tf32", "bf16"):
            peak, src = metrics.gpu_peak_flops(torch.cuda.get_device_name(dev), precision)
            t.add_row(f"peak {precision} (for MFU)", f"{peak / 1e12:,.1f} TFLOP/s ({src})" if peak else src)
    else:
        for dtype in (torch.float32, torch.bfloat16):
            peak, src = metrics.cpu_peak_flops(dtype)
            emulated = dtype == torch.bfloat16 and metrics.no_native_bf16() is not None  # MFU is over native ones
            use = "emulated, not for MFU" if emulated else "for MFU"
            t.add_row(f"peak {str(dtype).removeprefix('torch.')} ({use})",
                      f"{peak / 1e9:,.0f} GFLOP/s ({src})" if peak else src)
    for k, v in versions().items():
        t.add_row(k, v)
    _console().print(t)


@app.command()
def study(
    name: str = typer.Argument(..., help="sync, scaling, batch-size, amp, checkpointing, dataloader, profile, "
                              "pipeline, pp-memory, memory"),
    model: str = typer.Option("gpt2-mini", help="model preset"),
    data: str = typer.Option("builtin", help="corpus (as for effkit train)"),
    vocab_size: int = typer.Option(8192, help="BPE vocabulary size"),
    block_size: int = typer.Option(128, help="tokens per block"),
    batch_size: int = typer.Option(4, help="blocks per step per data-parallel rank"),
    steps: int = typer.Option(12, help="optimizer steps per run"),
    nproc: int = typer.Option(2, help="processes for the multi-process studies (scaling goes 1..nproc)"),
    out: str = typer.Option("reports/studies", help="where reports/studies/NAME/ goes"),
    runs_dir: str = typer.Option("runs/studies", help="where the study's runs go"),
):
    """Reproduce a classic distributed-training experiment on this machine; table, JSON, Markdown, PNG."""
    quiet_libraries()
    from rich.table import Table

    from effkit.studies import StudyConfig, fmt_value, run_study

    result = run_study(name, StudyConfig(model=model, data=data, vocab_size=vocab_size, block_size=block_size,
                                         batch_size=batch_size, steps=steps, nproc=nproc, out=out,
                                         runs_dir=runs_dir))
    t = Table(title=f"study {name} ({result['device']})")
    cols = list(result["rows"][0])
    for c in cols:
        t.add_column(c, justify="right")
    for r in result["rows"]:
        t.add_row(*[fmt_value(r[c]) for c in cols])
    _console().print(t)
    for n in result["notes"]:
        print(f"note: {n}")
    print(f"report: {Path(out) / name}/{name}.md ({result['wall_s']:.0f} s)")


def main() -> None:
    try:
        code = app(standalone_mode=False)  # click's own errors come back here, to be said in one line
    except EffkitError as e:
        print(f"effkit: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Interrupted as e:
        exit_interrupted(str(e))
    except KeyboardInterrupt:  # Ctrl-C before or after Typer's own guard
        exit_interrupted()
    except Exception as e:
        # click's usage errors (from click, or the copy Typer vendors): a bad flag or an unparsable value
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            message = " ".join(e.format_message().split())
            if message:  # (no message: `effkit` alone, whose help was printed)
                ctx = getattr(e, "ctx", None)
                where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
                print(f"effkit: error: {message}{where}", file=sys.stderr)
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort" or interrupt_received():  # Ctrl-C while click was parsing, or inside a C
            exit_interrupted()  # extension's import, which turns it into its own error (numpy: an ImportError)
        raise
    if code == 130:  # Typer turns Ctrl-C outside training (loading libraries, data or a model) into exit 130
        exit_interrupted()
    sys.exit(code if isinstance(code, int) else 0)
