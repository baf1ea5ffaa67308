"""The `effkit` command line: flags -> config -> stage -> `console.show_*(report)`. Thin by design: a stage
command's flags are made from its config's fields (`with_stage_options`), what it prints is in `effkit.console`,
and every EffkitError becomes one line on stderr and exit code 2."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from effkit import console, studies, workloads
from effkit.config import (
    BenchConfig,
    ExportConfig,
    Folders,
    GenerateConfig,
    PruneConfig,
    QuantizeConfig,
    RunConfig,
    StudyConfig,
    TrainConfig,
    bool_field,
    build_config,
    check_fields,
    field_flag,
    field_help,
    flat_defaults,
    flat_fields,
)
from effkit.errors import EffkitError, Interrupted, exit_interrupted, interrupt_received

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="effkit: train, prune, quantize and benchmark GPT-2-class models, with honest numbers.")


@app.callback()
def _root(remeasure: bool = typer.Option(False, "--remeasure", help="measure again what effkit caches per machine "
                                         "(the CPU's GEMM peak, bf16 or fp32, CTranslate2's threads, the memory "
                                         "plan's runtime) instead of reading it from the cache")) -> None:
    """effkit: train, prune, quantize and benchmark GPT-2-class models, with honest numbers."""
    if remeasure:  # an environment variable, so that the processes effkit starts measure again too
        os.environ["EFFKIT_REMEASURE"] = "1"


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


def _stage_parameter(key: str, f: dataclasses.Field, kind: Any) -> inspect.Parameter:
    """The typer option (or argument) of one flat key, from its field: default, type, and the metadata's help,
    choices, flag and show_default."""
    if f.metadata.get("argument"):  # a variadic positional (bench's paths: a tuple field)
        item = (typing.get_args(kind) or (str,))[0]
        return inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[list[item]],
                                 default=typer.Argument(None, help=field_help(f)))
    annotation = Optional[bool] if bool_field(kind) and kind is not bool else kind
    option = typer.Option(f.default, *field_flag(key, f, kind), help=field_help(f),
                          show_default=f.metadata.get("show_default", True))
    return inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)


def with_stage_options(cls: type, only: tuple[str, ...] | None = None):
    """Add a command's flags: one per flat key of the config class `cls` (`config.flat_fields`: a stage's sections'
    fields, a quantization backend's `Options` among them, or a plain dataclass's fields: `generate`, `study`),
    placed after `--recipe` (else last), with the default, type and help of the field; recipe-only keys (`cli:
    False` in the metadata) get none. The command declares only what is no field (ctx, --recipe, --plan, ...) and
    receives the flags in its `**kwargs`; `_flags(ctx, cls)` reads those the user typed. A new option is one field
    in config.py. `only`: just these keys (`effkit run`, whose table is otherwise recipe-only)."""

    def wrap(fn):
        sig = inspect.signature(fn, eval_str=True)  # `Plan` and the like: typer reads their Annotated metadata
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        at = next((i + 1 for i, p in enumerate(own) if p.name == "recipe"), len(own))
        # a plug-in that does not import loses its flags here and is said in one line when the command runs
        stage = [_stage_parameter(key, f, kind)
                 for key, (f, kind) in flat_fields(cls, skip_broken_plugins=True).items()
                 if f.metadata.get("cli", True) and (only is None or key in only)]
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[at:]]
        fn.__signature__ = sig.replace(parameters=[*own[:at], *stage, *rest])
        fn.__annotations__ = {**fn.__annotations__, **{p.name: p.annotation for p in stage}}
        return fn

    return wrap


def _recipe(stage: str) -> Any:
    return typer.Option(None, help=f"TOML recipe; its \\[{stage}] table sets the defaults, flags override")


# `--plan`, the same on every stage command and on `effkit run`
Plan = Annotated[bool, typer.Option("--plan", help="predict, allocate nothing, and stop: the peak memory (per rank, "
                                    "per stage), its parts and whether it fits; `effkit run` also its time (a few "
                                    "training steps timed now)")]


@app.command()
@with_stage_options(TrainConfig)
def train(
    ctx: typer.Context,
    recipe: Optional[Path] = _recipe("train"),
    plan: Plan = False,
    fit: bool = typer.Option(False, "--fit", help="with --plan: propose the cheapest memory tricks that fit"),
    **stage_options,  # TrainConfig's flags, added by with_stage_options
):
    """Train a GPT-2 model (default: the CPU quickstart on the embedded corpus)."""
    quiet_libraries()
    cfg = build_config(TrainConfig, str(recipe) if recipe else None, _flags(ctx, TrainConfig))
    if fit and not plan:
        raise EffkitError("--fit goes with --plan: effkit train --plan --fit [options]")
    choice = None
    if cfg.parallel.mode == "auto" or cfg.parallel.simulate:
        from effkit.parallel import auto
        from effkit.train import time_steps

        cfg, choice = auto.choose(cfg, plan, time_steps)
        if plan and choice:
            return console.show_layouts(choice)
    if plan:
        from effkit import memplan

        changes: list[str] = []
        if fit:
            p, _, changes = memplan.fit(cfg)
        else:
            p = memplan.predict(cfg, probe=True)
        console.show_plan(p)
        return
    if cfg.run.resume and not cfg.run.run_name:
        from effkit.artifacts import latest_run

        cfg = cfg.with_flat(run_name=latest_run(Path(cfg.run.runs_dir)).name)
    from effkit.memplan import predict_quietly
    from effkit.train import Planned, train_any

    # a resumed run continues the configuration saved in its checkpoint, not these flags: no plan for it
    console.show_train(train_any(cfg, planned=Planned(None if cfg.run.resume else predict_quietly(cfg),
                                                      layout=choice)))


@app.command()
@with_stage_options(PruneConfig)
def prune(ctx: typer.Context, recipe: Optional[Path] = _recipe("prune"), plan: Plan = False, **stage_options):
    """Prune a trained model (row, width, depth or weight), fine-tuning between rounds; one artifact per round."""
    quiet_libraries()
    cfg = build_config(PruneConfig, str(recipe) if recipe else None, _flags(ctx, PruneConfig))
    from effkit.prune.stage import prune_plan, run_prune

    if plan:
        console.show_plan(prune_plan(cfg.validate(), probe=True))
        return

    console.show_prune(run_prune(cfg), cfg.method.mode, cfg.folders.reports_dir)


@app.command()
@with_stage_options(QuantizeConfig)
def quantize(ctx: typer.Context, recipe: Optional[Path] = _recipe("quantize"), plan: Plan = False, **stage_options):
    """Quantize an artifact to int8 and compare it with its parent (fp32 and bf16)."""
    quiet_libraries()
    from effkit.quantize.stage import quantize_plan, run_quantize

    cfg = build_config(QuantizeConfig, str(recipe) if recipe else None, _flags(ctx, QuantizeConfig))
    if plan:
        console.show_plan(quantize_plan(cfg.validate()))
        return
    console.show_quantize(run_quantize(cfg), cfg.folders.reports_dir)


@app.command()
@with_stage_options(ExportConfig)
def export(ctx: typer.Context, recipe: Optional[Path] = _recipe("export"), plan: Plan = False, **stage_options):
    """Export an artifact to ONNX, CTranslate2 or OpenVINO (optionally int8) and compare it with its PyTorch
    parent."""
    quiet_libraries()
    from effkit.export import export_plan, run_export

    cfg = build_config(ExportConfig, str(recipe) if recipe else None, _flags(ctx, ExportConfig))
    if plan:
        console.show_plan(export_plan(cfg))
        return
    console.show_export(run_export(cfg), cfg.folders.reports_dir)


@app.command()
@with_stage_options(BenchConfig)
def bench(
    ctx: typer.Context,
    recipe: Optional[Path] = _recipe("bench"),
    json_out: bool = typer.Option(False, "--json", help="print the machine-readable result instead of the table"),
    plan: Plan = False,
    **stage_options,  # BenchConfig's flags (and its paths argument), added by with_stage_options
):
    """Measure every artifact of a run with one protocol; table, bench.json/csv/md and leaderboard.json."""
    quiet_libraries()
    cfg = build_config(BenchConfig, str(recipe) if recipe else None, _flags(ctx, BenchConfig))
    from effkit.bench import run_bench

    if plan:
        from effkit.bench.plan import bench_plan

        console.show_plan(bench_plan(cfg))
        return
    console.show_bench(run_bench(cfg, progress=not json_out), cfg.folders.reports_dir, as_json=json_out)


@app.command()
@with_stage_options(GenerateConfig)
def generate(**options):
    """Stream text from any artifact, quantized ones included."""
    quiet_libraries()
    import torch
    from transformers import TextStreamer

    from effkit.artifacts import read_meta, resolve_artifact
    from effkit.artifacts.loader import load_any
    from effkit.data.tokenizer import saved_tokenizer
    from effkit.parallel import resolve_device

    g = GenerateConfig(**options)
    check_fields(g)
    if not g.prompt.strip():
        raise EffkitError("--prompt is empty; give some text to continue")
    path = resolve_artifact(g.source, g.runs_dir, default_tag="") if g.source else _newest(g.runs_dir)
    read_meta(path)
    dev = resolve_device(g.device)
    tok = saved_tokenizer(path)
    model = _with_draft(g, path, dev) if g.draft else load_any(path, dev).eval()
    ids = tok(g.prompt, return_tensors="pt").input_ids.to(dev)
    if ids.shape[1] + g.max_new_tokens > model.config.n_positions:
        raise EffkitError(f"prompt ({ids.shape[1]} tokens) + --max-new-tokens exceed the model's context "
                          f"({model.config.n_positions}); ask for fewer tokens")
    kwargs = {"do_sample": True, "temperature": g.temperature, "top_k": g.top_k} if g.temperature > 0 else \
        {"do_sample": False}
    if g.compile:
        import time

        from effkit.measure.generation import compiled_generation, greedy_generate

        compiled, status = compiled_generation(model)
        if compiled is None:
            raise EffkitError(f"--compile: {status}; run without --compile")
        t = time.perf_counter()
        greedy_generate(model, tok, g.max_new_tokens, g.prompt, generate_kwargs=compiled)  # compiles (same shapes)
        print(f"compiled in {time.perf_counter() - t:.1f} s: {status}", file=sys.stderr)
        kwargs.update(compiled)
    torch.manual_seed(g.seed)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=g.max_new_tokens, pad_token_id=tok.eos_token_id, use_cache=True,
                       streamer=TextStreamer(tok), **kwargs)


def _with_draft(g, path: Path, dev):
    """The target at `path` decoding with `--draft` through PyTorch's assisted generation."""
    from effkit.artifacts import resolve_artifact
    from effkit.artifacts.loader import engine_of

    if g.compile:
        raise EffkitError("--compile and --draft: transformers' assisted generation does not run the compiled static "
                          "cache; drop one")
    draft = resolve_artifact(g.draft, g.runs_dir, default_tag="")
    engine = engine_of(path)
    if not hasattr(engine, "with_draft") or engine_of(draft) is not engine:
        raise EffkitError(f"--draft: {path} is {engine.noun} artifact and {draft} {engine_of(draft).noun} one; "
                          "a draft runs beside its target in an engine that decodes with one (PyTorch)")
    return engine.with_draft(path, draft, dev, k=g.draft_k or None).eval()


def _newest(runs_dir: str) -> Path:
    from effkit.artifacts.loader import newest_artifact

    return newest_artifact(runs_dir, quantized=True)


@app.command()
@with_stage_options(Folders)
def report(run: Optional[str] = typer.Argument(None, help="run name (default: the latest run)"), **folders):
    """Render reports/<run>/summary.md with PNG plots (loss curves, pruning curves, artifact comparison)."""
    from effkit.artifacts import latest_run
    from effkit.config import check_run_name
    from effkit.report import render_run_report

    where = Folders(**folders)
    name = check_run_name(run, "run") if run else latest_run(Path(where.runs_dir)).name
    summary, plots = render_run_report(Path(where.reports_dir), name)
    print(f"report: {summary}")
    for p in plots:
        print(f"plot:   {p}")


def _default_recipe() -> str:
    local = Path("recipes/quickstart.toml")
    if local.is_file():
        return str(local)
    shipped = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.toml"
    return str(shipped if shipped.is_file() else local)


RUN_FLAGS = ("optimize_for", "time_budget_min")  # the [run] keys `effkit run` also takes as flags (--workload, ...)


@app.command("run")
@with_stage_options(RunConfig, only=RUN_FLAGS)
def run_cmd(
    ctx: typer.Context,
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe (default: recipes/quickstart.toml)"),
    force: bool = typer.Option(False, "--force", help="redo every stage, even complete ones"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the plan (stages, launch command, artifacts) only"),
    plan: Plan = False,
    full: bool = typer.Option(False, "--full", help="train the recipe's full schedule, whatever the time budget "
                              "(the same as --time-budget-min 0)"),
    **stage_options,  # the [run] keys in RUN_FLAGS, added by with_stage_options
):
    """Run the whole pipeline from one recipe: train, prune, quantize, bench, report. Resumable."""
    quiet_libraries()
    from effkit.pipeline import run_pipeline

    out = console.terminal()
    recipe = recipe or _default_recipe()
    overrides = _explicit(ctx, list(RUN_FLAGS))
    if "optimize_for" in overrides:
        workloads.get(overrides["optimize_for"], "--workload")  # a bad name is the flag's error, not the recipe's
    if full:
        if overrides.get("time_budget_min"):
            raise EffkitError("--full trains the recipe's full schedule; drop --time-budget-min (or --full)")
        overrides["time_budget_min"] = 0.0
    if plan:
        from effkit.runplan import run_plan

        console.show_run_plan(run_plan(recipe, overrides or None))
        return
    result = run_pipeline(recipe, force=force, dry_run=dry_run, console=out, overrides=overrides or None)
    console.show_run(result, recipe, dry_run, out)


@app.command()
def doctor():
    """What this machine offers: devices, backends, bf16, quantization backends, versions, matmul peak."""
    quiet_libraries()
    import torch
    import torch.distributed as dist
    from rich.table import Table

    from effkit.artifacts import versions
    from effkit.measure import hardware, roofline
    from effkit.quantize import backends

    t = Table(title="effkit doctor")
    t.add_column("what")
    t.add_column("this machine")
    cuda = torch.cuda.is_available()
    t.add_row("device", hardware.describe_device(torch.device("cuda", 0) if cuda else torch.device("cpu")))
    t.add_row("GPUs", str(torch.cuda.device_count()) if cuda else "none: CPU + gloo")
    t.add_row("CPU cores / torch threads", f"{os.cpu_count()} / {torch.get_num_threads()}")
    t.add_row("distributed backends", ", ".join(b for b, ok in (("gloo", dist.is_gloo_available()),
                                                               ("nccl", dist.is_nccl_available())) if ok))
    if cuda:
        bf16 = "yes" if torch.cuda.is_bf16_supported() else "no"
    else:
        bf16 = ("native (AVX512-BF16/AMX)" if hardware.cpu_has_native_bf16()
                else "emulated: slower than fp32 here, train with --no-amp")
    t.add_row("bf16", bf16)
    t.add_row("fp16 autocast", "yes (with GradScaler)" if cuda else "no-op on CPU: refused")
    for b in backends.names():
        reason = backends.unavailable(b)
        t.add_row(f"int8 backend {b}", "available" if reason is None else f"not available: {reason}")
    if cuda:
        dev = torch.device("cuda", 0)
        t.add_row("TF32 for fp32 matmuls", "yes (on by default; --no-tf32 turns it off)"
                  if hardware.tf32_supported(dev) else "no (needs compute capability 8.0+)")
        for precision in ("fp32", "tf32", "bf16"):
            peak, src = roofline.gpu_peak_flops(torch.cuda.get_device_name(dev), precision)
            t.add_row(f"peak {precision} (for MFU)", f"{peak / 1e12:,.1f} TFLOP/s ({src})" if peak else src)
    else:
        for dtype in (torch.float32, torch.bfloat16):
            peak, src = roofline.cpu_peak_flops(dtype)
            emulated = dtype == torch.bfloat16 and hardware.no_native_bf16() is not None  # MFU is over native ones
            use = "emulated, not for MFU" if emulated else "for MFU"
            t.add_row(f"peak {str(dtype).removeprefix('torch.')} ({use})",
                      f"{peak / 1e9:,.0f} GFLOP/s ({src})" if peak else src)
    for k, v in versions().items():
        t.add_row(k, v)
    console.terminal().print(t)


@app.command()
@with_stage_options(StudyConfig)
def study(name: str = typer.Argument(..., help=", ".join(studies.names())), **options):
    """Reproduce a classic distributed-training experiment on this machine; table, JSON, Markdown, PNG."""
    quiet_libraries()
    from rich.table import Table

    from effkit.studies import fmt_value, run_study

    s = StudyConfig(**options)
    result = run_study(name, s)
    t = Table(title=f"study {name} ({result['device']})")
    cols = list(result["rows"][0])
    for c in cols:
        t.add_column(c, justify="right")
    for r in result["rows"]:
        t.add_row(*[fmt_value(r[c]) for c in cols])
    console.terminal().print(t)
    for n in result["notes"]:
        print(f"note: {n}")
    print(f"report: {Path(s.out) / name}/{name}.md ({result['wall_s']:.0f} s)")


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
