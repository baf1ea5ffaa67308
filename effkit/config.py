"""Config dataclasses, recipe loading and validation.

Flow: recipe (TOML) + CLI flags -> config dataclass -> stage. A recipe holds one table per stage
(`[train]`, `[prune]`, ...) of flat keys, the same names as the command's flags. Configs are frozen: a stage
that needs a variant makes one with `.replace(...)`.

Every stage config is nested by concern on one mechanism (`_Staged`), torchtitan style: its fields are sections
that later stages read on their own, and each field of a section is one flat key, so the command line and
recipes stay flat (`with_flat(lr=...)`). Train's sections are `data` (what the model reads; every artifact
carries its data section in `effkit.json`), `model`, `optim`, `parallel` and `run` (where things go and how
often), saved by section; the other stages' (inputs, method, finetune, measure, folders) are saved flat.

Every option is declared once, as a field of a section (or of a command's own dataclass: `GenerateConfig`,
`StudyConfig`): its default, its type (the annotation: what recipes and flags are checked against) and, in the
field's `metadata` (`opt(default, help, ...)` writes it), everything the command line shows of it and the values
it accepts. The CLI builds each command's flags from these fields (`flat_fields`), so a new option is one field
here. The metadata keys:

- `help`: the `--help` line, or a zero-argument callable making it (text built from a registry, read when the
  CLI builds its flags, so plug-ins registered before that are listed and nothing heavy is imported here). A
  `{choices}` in it is replaced by the choices, joined by ", ".
- `choices`: the accepted values (a tuple, or a zero-argument callable); listed after the help as "(one of ...)"
  unless the help places them itself with `{choices}`.
- `flag`: the flag's declaration where it is not `--the-key` (`--the-key/--no-the-key` for a boolean):
  `--from` for `source`, `--resume` (a boolean without its `--no-` form), `--fixed-rounds/--sequential`.
- `show_default`: what `--help` shows as the default instead of the value (`"auto"` for a None that means auto).
- `cli`: False for a recipe-only key (no flag); `argument`: True for a positional argument (bench's paths).
- `key`: the flat key where it is not the field's name (`[train] data` is `DataConfig.source`).
- `ge`, `gt`, `le`, `lt`: the range a number must lie in (a finite number, bounds inclusive or not).

`check_fields` checks every value against its field's choices and range, in one line naming the flag and what it
accepts; a stage's `validate` adds only the checks between fields.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from effkit import workloads
from effkit.errors import EffkitError
from effkit.registry import BACKENDS, ENGINES, OPTIMIZERS, PRUNERS
from effkit.registry import STAGES as RUN_STAGES

PARALLEL_MODES = ("none", "ddp", "fsdp", "tp", "fsdp+tp", "pp", "pp+fsdp", "auto")
PP_SCHEDULES = ("gpipe", "1f1b")
SYNC_MODES = ("ddp", "all-reduce", "gather-scatter")
DATA_HELP = ("corpus for calibration, fine-tuning and evaluation: builtin, or a folder / file of text (default: "
             "the artifact's own; builtin for a plain Hugging Face folder)")
DEVICE_HELP = "auto (the first GPU if there is one, else the CPU), cpu, cuda or cuda:N"


def opt(default: Any = dataclasses.MISSING, help: str | Callable[[], str] = "", *,
        factory: Callable[[], Any] | Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A field that is a flag and a recipe key: its default (or `factory`), its `--help` line and the rest of what
    the command line shows of it (`flag`, `choices`, `show_default`, `cli`, `argument`: see the module's
    docstring)."""
    return field(default=default, default_factory=factory, metadata={"help": help, **meta})


def field_choices(f: dataclasses.Field) -> tuple[str, ...]:
    """The values a field accepts, where it declares a fixed set (else empty)."""
    choices = f.metadata.get("choices") or ()
    return tuple(choices() if callable(choices) else choices)


def check_field(key: str, f: dataclasses.Field, value: Any) -> None:
    """`value` against the choices and the range (`ge`, `gt`, `le`, `lt`) its field declares (None: auto)."""
    flag, m = "--" + key.replace("_", "-"), f.metadata
    choices = field_choices(f)
    if value is not None and choices and value not in choices:
        raise EffkitError(f"unknown {flag} {value!r}; choose one of {', '.join(map(str, choices))}")
    lo, hi = m.get("ge", m.get("gt")), m.get("le", m.get("lt"))
    if value is None or (lo is None and hi is None):
        return
    if math.isfinite(value) and (lo is None or (value > lo if "gt" in m else value >= lo)) and \
            (hi is None or (value < hi if "lt" in m else value <= hi)):
        return
    if lo is not None and hi is not None:
        excluded = [_num(b) for b, k in ((lo, "gt"), (hi, "lt")) if k in m]
        said = f"between {_num(lo)} and {_num(hi)}" + (", both excluded" if len(excluded) == 2 else
                                                        "".join(f", {b} excluded" for b in excluded))
    elif hi is not None:
        said = f"{'<' if 'lt' in m else '<='} {_num(hi)}"
    else:
        said = f"> {_num(lo)}" if "gt" in m else (f"at least {_num(lo)}" if lo else ">= 0")
        said = f"a finite number {said}" if isinstance(value, float) else said
    raise EffkitError(f"{flag} must be {said} (got {value})")


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_fields(cfg: Any) -> None:
    """Every flat key of a config (a stage's, or a plain dataclass of options) against its field's metadata."""
    values = cfg.flat() if isinstance(cfg, _Staged) else None
    for key, (f, _) in flat_fields(type(cfg)).items():
        check_field(key, f, getattr(cfg, f.name) if values is None else values[key])


def field_help(f: dataclasses.Field) -> str:
    """A field's `--help` line: its help (made now, where it is a callable) with its choices."""
    text = f.metadata.get("help", "")
    text = text() if callable(text) else text
    choices = field_choices(f)
    if "{choices}" in text:
        return text.replace("{choices}", ", ".join(choices))
    return text + (f" (one of {', '.join(choices)})" if choices else "")


def field_flag(key: str, f: dataclasses.Field, kind: Any) -> list[str]:
    """A field's flag declarations: its `flag` metadata, `--key/--no-key` for a boolean, else none (Typer's
    `--key`)."""
    if "flag" in f.metadata:
        return [f.metadata["flag"]]
    dashed = key.replace("_", "-")
    return [f"--{dashed}/--no-{dashed}"] if bool_field(kind) else []


def bool_field(kind: Any) -> bool:
    """Whether a field's type is a boolean: `bool`, or `bool | None` (None: auto)."""
    return kind is bool or _optional_bool(kind)


def _optional_bool(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType) and set(typing.get_args(kind)) == {
        bool, type(None)}


def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's field types, resolved (a plug-in's annotations that do not resolve: {}, then each default's
    type stands in)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a plug-in's forward reference: checked by its defaults' types instead
        return {}


def _section_fields(section: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """flat key -> (field, type) of one section: a dataclass's fields, or what the plug-ins of a
    `PluginOptions` section declare."""
    if issubclass(section, PluginOptions):
        return section.declared_fields()
    hints = _hints(section)
    return {f.metadata.get("key", f.name): (f, hints.get(f.name, type(_default(f))))
            for f in dataclasses.fields(section)}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


class _Section:
    """A frozen dataclass that can be rebuilt from a saved dict (unknown keys ignored) and varied."""

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (values or {}).items() if k in names})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PluginOptions:
    """A config section made of the options plug-ins declare: each plug-in of `registry` (a quantization backend, a
    pruning method) may have an `options` dataclass (`registry.options(name)`: a built-in pruning method's is read
    without importing the method), whose fields (default, type, `help` and `choices` in the field's metadata) are
    its flags, recipe keys and `--help` lines; this section is the union of those fields, read as attributes
    (`cfg.options.threshold`) or, typed, as one plug-in's dataclass (`cfg.options.of(Options)`). Declared once,
    in the plug-in's module: the CLI, recipe validation and `--help` derive from it."""

    registry: Any = None  # set by subclasses
    what = "plug-in"

    @classmethod
    def declared_fields(cls) -> dict[str, tuple[dataclasses.Field, Any]]:
        """flat key -> (its field, its type), over every plug-in of the registry (in registry order)."""
        out: dict[str, tuple[dataclasses.Field, Any]] = {}
        for name, options in cls.plugin_options():
            for key, (f, kind) in _section_fields(options).items():
                if key in out and out[key][0].default != f.default:
                    raise EffkitError(f"{cls.what} {name} declares option {key!r} with another default than an "
                                      "earlier one; rename it")
                out.setdefault(key, (f, kind))
        return out

    @classmethod
    def plugin_options(cls) -> list[tuple[str, type]]:
        """(plug-in name, its options dataclass) for each plug-in of the registry that declares some, in order."""
        return [(name, options) for name in cls.registry.names()
                if (options := cls.registry.options(name)) is not None]

    def __init__(self, **values: Any):
        declared = self.declared_fields()
        unknown = [k for k in values if k not in declared]
        if unknown:
            raise EffkitError(f"unknown {self.what} option {unknown[0]!r}")
        object.__setattr__(self, "_values", {**{k: f.default for k, (f, _) in declared.items()}, **values})

    def __getattr__(self, key: str) -> Any:
        values = self.__dict__.get("_values", {})
        if key in values:
            return values[key]
        raise AttributeError(key)

    def __setattr__(self, key: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {key!r}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values == self._values

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def replace(self, **changes: Any) -> PluginOptions:
        return type(self)(**{**self._values, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> PluginOptions:
        declared = cls.declared_fields()
        return cls(**{k: v for k, v in (values or {}).items() if k in declared})

    def of(self, options: type) -> Any:
        """One plug-in's options as its own dataclass."""
        return options(**{f.name: self._values[f.name] for f in dataclasses.fields(options)})

    def validate(self) -> None:
        """Each plug-in's dataclass made from the values (after `check_fields`, the choices and ranges of the
        metadata), so that its own checks (a `__post_init__` raising an EffkitError) refuse a bad value before the
        stage starts."""
        for options in dict.fromkeys(options for _, options in self.plugin_options()):
            self.of(options)


class _Staged(_Section):
    """A stage config nested by concern: its fields are sections (frozen dataclasses, or a `PluginOptions`) and
    every field of a section is one of the stage's flat keys: a flag and a recipe key of the field's name (or of
    its `key` metadata: `[train] data` is `DataConfig.source`). Flags and recipes reach it through `with_flat`;
    code reads `cfg.method.mode`, `cfg.folders.runs_dir`. `nested`: how the config is saved and varied: flat
    (`to_dict()` flat, `replace` takes flat keys: every stage but train) or by section (train: artifacts and
    checkpoints hold its sections, and `replace` takes sections)."""

    nested = False

    @classmethod
    def sections(cls) -> dict[str, type]:
        return {f.name: f.default_factory for f in dataclasses.fields(cls)}

    @classmethod
    def flat_keys(cls) -> dict[str, tuple[str, str]]:
        """flat key -> (the section holding it, the field's name there)."""
        return {key: (name, f.name) for name, sec in cls.sections().items()
                for key, (f, _) in _section_fields(sec).items()}

    @classmethod
    def from_flat(cls, **values: Any):
        return cls().with_flat(**values)

    def with_flat(self, **values: Any):
        """A copy with flat keys changed."""
        keys = self.flat_keys()
        per_section: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            if key not in keys:
                raise EffkitError(f"unknown {_stage_name(type(self))} option {key!r}")
            section, name = keys[key]
            per_section.setdefault(section, {})[name] = value
        return dataclasses.replace(self, **{s: getattr(self, s).replace(**v) for s, v in per_section.items()})

    def replace(self, **values: Any):
        return dataclasses.replace(self, **values) if self.nested else self.with_flat(**values)

    def flat(self) -> dict[str, Any]:
        return {key: getattr(getattr(self, s), name) for key, (s, name) in self.flat_keys().items()}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) if self.nested else copy.deepcopy(self.flat())

    @classmethod
    def flat_defaults(cls) -> dict[str, Any]:
        return cls().flat()

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None):
        """From a saved dict (an artifact's, a checkpoint's or a report's config); keys this version does not know
        are ignored."""
        values = values or {}
        if cls.nested:
            return cls(**{s: sec.from_dict(values.get(s)) for s, sec in cls.sections().items()})
        keys = cls.flat_keys()
        return cls.from_flat(**{k: v for k, v in values.items() if k in keys})


def _stage_name(cls: type) -> str:
    return cls.__name__.removesuffix("Config").lower()


@dataclass(frozen=True)
class Folders(_Section):
    """Where a stage finds runs and writes reports: the same two keys in every stage."""

    runs_dir: str = opt("runs", "where runs/ are")
    reports_dir: str = opt("reports", "where reports/ go")


@dataclass(frozen=True)
class Inputs(_Section):
    """What a stage reads and where it runs (a stage's own subclass says its `--from` default)."""

    source: str = opt("", "an effkit artifact or a Hugging Face GPT-2 folder", flag="--from")
    data: str = opt("", DATA_HELP)
    device: str = opt("auto", DEVICE_HELP)


@dataclass(frozen=True)
class PruneInputs(Inputs):
    source: str = opt("", "artifact or Hugging Face GPT-2 folder to prune (default: runs/latest/train)", flag="--from")
    force: bool = opt(False, "run even where the memory plan (--plan) predicts a peak above the machine's memory")


@dataclass(frozen=True)
class QuantizeInputs(Inputs):
    source: str = opt("", "artifact or Hugging Face GPT-2 folder (default: newest of the latest run)", flag="--from")
    force: bool = opt(False, "run even where the memory plan (--plan) predicts a peak above the machine's memory")


# ------------------------------------------------------------------------------------------- train sections

MAX_VOCAB = 1_000_000  # beyond any GPT-2-class vocabulary; larger values crash the BPE trainer
MAX_THREADS = 4096


@dataclass(frozen=True)
class DataConfig(_Section):
    source: str = opt("builtin", "builtin (State of the Union speeches), wikitext-103, wikitext-2, or a .txt / "
                      "folder / .jsonl path", key="data")
    vocab_size: int = opt(8192, "BPE vocabulary size (ignored for pretrained models)", ge=300, le=MAX_VOCAB)
    block_size: int = opt(128, "tokens per training block (<= model context)", ge=2)
    heldout_fraction: float = opt(0.05, "fraction of documents held out", gt=0, lt=1)
    eval_blocks: int = opt(64, "number of held-out blocks in every evaluation", ge=1)
    workers: int = opt(0, "DataLoader worker processes", ge=0, le=MAX_THREADS)


@dataclass(frozen=True)
class ModelConfig(_Section):
    name: str = opt("gpt2-mini", "preset (gpt2-nano, gpt2-micro, gpt2-mini, gpt2, gpt2-medium, gpt2-large, "
                    "gpt2-xl), a Hugging Face model folder, or a hub id (online)", key="model")
    dropout: float = opt(0.0, "dropout probability", ge=0, lt=1)
    activation_checkpointing: bool = opt(False, "recompute each block in backward to save memory")


def _optimizers() -> str:
    """`--optim`'s help: `name (help)` of every optimizer (imports effkit.optim, which is light)."""
    return "optimizer: " + ", ".join(f"{o.name} ({o.help})" for _, o in OPTIMIZERS.items())


@dataclass(frozen=True)
class OptimConfig(_Section):
    max_steps: int = opt(200, "optimizer steps (0 = bounded by tokens/time)", ge=0)
    max_tokens: int = opt(0, "stop after this many training tokens (0 = no limit)", ge=0)
    time_budget: float = opt(0.0, "stop after this many seconds (0 = no limit)", ge=0)
    batch_size: int = opt(8, "blocks per micro-step per data-parallel rank", ge=1)
    grad_accum: int = opt(1, "micro-steps per optimizer step", ge=1)
    lr: float = opt(1e-3, "peak learning rate", gt=0)
    min_lr: float = opt(1e-4, "learning rate at the end of the cosine", ge=0)
    warmup_steps: int = opt(20, "linear warm-up steps", ge=0)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only)", ge=0)
    grad_clip: float = opt(1.0, "gradient norm clip (0 = off)", ge=0)
    seed: int = opt(1337, "random seed (model init and data order)")
    # None = auto: bf16 on CUDA; on a CPU whichever measures faster (measure.precision)
    amp: bool | None = opt(None, "force mixed precision autocast (--amp-dtype) on or off; default: bf16 on CUDA, on "
                           "a CPU whichever of fp32 and bf16 measures faster for the model's shape (measured once "
                           "per machine and shape)", show_default="auto")
    amp_dtype: str = opt("bf16", "{choices} (fp16: CUDA only, with GradScaler)", choices=("bf16", "fp16"))
    optim: str = opt("adamw", _optimizers)  # the names of registry.OPTIMIZERS (effkit.optim)
    tf32: bool = opt(True, "CUDA (Ampere+): fp32 matmuls on TF32 tensor cores")


@dataclass(frozen=True)
class ParallelConfig(_Section):
    mode: str = opt("none", "{choices}", choices=PARALLEL_MODES, key="parallel")
    # 0 = number of GPUs, or 2 on CPU when a parallel mode is asked for
    nproc: int = opt(0, "processes per node (0 = number of GPUs, or 2 on CPU)")
    tp_size: int = opt(0, "tensor-parallel size for fsdp+tp (0 = 2)")  # 0 = min(world, 2)
    pp_size: int = opt(0, "pipeline stages for pp+fsdp (0 = 2; pp: every process)")
    pp_schedule: str = opt("1f1b", "pipeline schedule: {choices}", choices=PP_SCHEDULES)
    microbatches: int = opt(4, "pipeline micro-batches per micro-step (divide --batch-size; 1f1b: at least the "
                            "number of stages)", ge=1)
    sync: str = opt("ddp", "gradient sync for --parallel ddp: {choices}", choices=SYNC_MODES)
    nnodes: int = opt(1, "number of machines", ge=1)
    node_rank: int = opt(0, "rank of this machine")
    master_addr: str = opt("127.0.0.1", "address of the rank-0 machine")
    master_port: int = opt(29500, "port of the rank-0 machine (on one machine, --nnodes 1, a free port is taken)",
                           ge=1, le=65535)
    connect_timeout: float = opt(120.0, "seconds a node other than 0 waits for node 0", gt=0, le=86400)
    reshard_after_forward: bool = opt(True, "fsdp: free gathered parameters after forward")
    cpu_offload: bool = opt(False, "fsdp: keep parameters on CPU (GPU only)", flag="--cpu-offload")
    threads: int = opt(0, "torch threads per process (0 = torch default)", ge=0, le=MAX_THREADS)
    simulate: str = opt("", "with --parallel auto --plan: rank the layouts on paper for a described machine, not "
                        "this one: a preset (a100-nvlink, h100-nvlink, a100-pcie) or a JSON description (file or "
                        "inline: devices_per_node, memory_gib, peak_tflops, efficiency, intra/inter_gbps, "
                        "intra/inter_latency_us)", show_default=False)
    auto_top: int = opt(3, "--parallel auto: how many of the best-predicted layouts are timed side by side before "
                        "training (1: the prediction's first, untimed)", ge=1)
    auto_steps: int = opt(6, "--parallel auto: training steps of each layout per round of that timing (the first "
                          "two not timed)", ge=3)

    @property
    def launched(self) -> bool:
        """Whether training runs in launched processes (a parallel mode, or several processes or nodes)."""
        return self.mode != "none" or self.nproc > 1 or self.nnodes > 1


@dataclass(frozen=True)
class RunSection(_Section):
    run_name: str = opt("", "run folder name (default: timestamp-model)")
    runs_dir: str = opt("runs", "where runs/<run>/<stage>/ artifacts go")
    reports_dir: str = opt("reports", "where reports/<run>/ go")
    resume: bool = opt(False, "continue the run (--run-name, default: latest) from its last checkpoint",
                       flag="--resume")
    eval_interval: int = opt(50, "steps between held-out evaluations (0 = end only)", ge=0)
    checkpoint_interval: int = opt(100, "steps between checkpoints (0 = never)", ge=0)
    warmup_steps_excluded: int = opt(5, "steps left out of the steady-state tokens/s", cli=False, ge=0)
    profile: bool = opt(False, "synchronise CUDA around each phase so the time breakdown is exact", cli=False)


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


def check_run_name(name: str, what: str = "--run-name") -> str:
    """A run name is a plain folder name under the runs folder: it can never reach outside it."""
    if not RUN_NAME.fullmatch(name) or name == "latest" or name.strip(".") == "":
        raise EffkitError(f"{what} {name!r} is not a plain name: use up to 128 letters, digits, '-', '_', '+' and '.', "
                          "starting with a letter or digit, and not 'latest' (it becomes runs/<name>/)")
    return name


def check_folder_option(what: str, path: str) -> None:
    """An output folder option must be a folder, or not exist yet (then effkit creates it)."""
    if Path(path).exists() and not Path(path).is_dir():
        raise EffkitError(f"{what} {path} is a file, not a folder; give a folder (it is created if missing)")


@dataclass(frozen=True)
class TrainConfig(_Staged):
    """`effkit train`: data (what the model reads), model, optim, parallel, run (where things go, how often)."""

    nested = True  # saved by section in artifacts and checkpoints; `replace` takes sections, `with_flat` flat keys
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunSection = field(default_factory=RunSection)

    def validate(self, allow_no_steps: bool = False) -> TrainConfig:
        check_fields(self)
        o, p = self.optim, self.parallel
        if o.max_steps == 0 and o.max_tokens == 0 and o.time_budget == 0 and not allow_no_steps:
            raise EffkitError("nothing bounds training: set --max-steps, --max-tokens or --time-budget")
        OPTIMIZERS.get(o.optim)  # one line naming the choices
        if p.nproc < 0:  # 0: the number of GPUs, or 2 on CPU
            raise EffkitError(f"--nproc must be at least 1 (got {p.nproc})")
        if p.mode.startswith("pp"):
            if not 1 <= p.microbatches <= o.batch_size or o.batch_size % p.microbatches:
                raise EffkitError(f"--microbatches {p.microbatches} must divide --batch-size {o.batch_size} (each "
                                  "micro-batch gets batch-size / microbatches blocks)")
            if o.amp and o.amp_dtype == "fp16":
                raise EffkitError("--parallel pp does not combine with fp16's GradScaler; use --amp-dtype bf16")
        elif p.pp_size not in (0, 1):
            raise EffkitError(f"--pp-size {p.pp_size} only applies to --parallel pp+fsdp")
        if p.sync != "ddp" and p.mode not in ("ddp", "none"):
            raise EffkitError(f"--sync {p.sync} applies to plain data parallelism; use it with --parallel ddp")
        if not 0 <= p.node_rank < p.nnodes:
            raise EffkitError(f"--node-rank must be in [0, --nnodes) (got {p.node_rank} of {p.nnodes})")
        if self.run.run_name:
            check_run_name(self.run.run_name)
        elif p.nnodes > 1:
            raise EffkitError("a multi-node run needs the same --run-name on every node (a made-up name would differ)")
        check_folder_option("--runs-dir", self.run.runs_dir)
        check_folder_option("--reports-dir", self.run.reports_dir)
        return self


@dataclass(frozen=True)
class PruneMethod(_Section):
    # weight | row (MLP channels) | width (residual channels) | depth (whole blocks) | draft: registry.PRUNERS
    mode: str = opt("row", "a pruning method: {choices} (row: MLP channels, width: residual channels, depth: whole "
                    "blocks, weight: unstructured, draft: a much smaller model for speculative decoding)",
                    choices=PRUNERS.names)
    target: float = opt(0.5, "fraction removed by the last round (0-1): of the weights, MLP channels, residual "
                        "channels or blocks", gt=0, lt=1)
    rounds: int = opt(3, "prune in this many steps up to the target", ge=1)
    importance: str = opt("magnitude", "weight mode: magnitude, or wanda (|W| x input norm); width mode: magnitude, "
                          "or taylor (|W x gradient|)")
    scope: str = opt("global", "weight mode, magnitude: rank over all layers or per layer: {choices}",
                     choices=("global", "layer"))
    calib_batches: int = opt(4, "wanda, taylor, depth: calibration batches", ge=1)


@dataclass(frozen=True)
class PruneFinetune(_Section):
    finetune_steps: int = opt(40, "fine-tuning steps after each round (0 = none)", ge=0)
    batch_size: int = opt(8, "fine-tuning batch size (blocks)", ge=1)
    lr: float = opt(0.0, "fine-tuning peak learning rate (0: the parent's final learning rate, where its training "
                    "ended)", ge=0)
    warmup_steps: int = opt(5, "fine-tuning warm-up steps", ge=0)
    seed: int = opt(1337, "random seed")
    optim: str = opt("", "fine-tuning optimizer, one of effkit train's --optim (empty: the parent's); adamw8bit keeps "
                     "a quarter of AdamW's moments", show_default="the parent's")
    control: bool = opt(True, "also fine-tune the unpruned parent with the same steps (the fair baseline)")
    # fine-tune with a KL term to the frozen dense parent's logits; None = auto: on for the structured modes (it
    # measured better than plain fine-tuning for row, width and depth on the quickstart), off for weight
    distill: bool | None = opt(None, "fine-tune toward the frozen dense parent's logits (KL); auto: on for row, width "
                               "and depth, off for weight", show_default="auto")
    # weight of the KL term; 1 - alpha on the next-token cross-entropy
    distill_alpha: float = opt(0.5, "weight of the KL term (0-1)", ge=0, le=1)
    distill_temperature: float = opt(2.0, "softmax temperature of the KL term", gt=0)


@dataclass(frozen=True)
class Sequential(_Section):
    """How long a paired timing comparison runs (effkit.measure.stopping): rounds until every ratio is decided
    or within +-precision, in at most 3 looks (rounds, 2x, 4x) and `budget_s` seconds beyond the first look;
    `fixed_rounds` runs the rounds once, as before. The same three flags on prune, quantize, export and bench."""

    fixed_rounds: bool = opt(False, "exactly the given rounds (95% intervals), or rounds until each ratio is decided "
                             "or within --precision (at most 4x, Bonferroni-corrected)",
                             flag="--fixed-rounds/--sequential")
    # half-width, relative, under which an undecided ratio counts as settled
    precision: float = opt(0.03, "sequential: an undecided ratio is settled once its interval is within +-this "
                           "fraction", gt=0, lt=1)
    # seconds of further rounds per comparison after the first look
    budget_s: float = opt(60.0, "sequential: seconds of further rounds per comparison", ge=0)


@dataclass(frozen=True)
class LatencyMeasure(Sequential):
    latency_rounds: int = opt(5, "interleaved rounds of the latency against dense", ge=2)
    latency_repeats: int = opt(3, "timed forward passes per model per round", ge=1)


class PrunerParams(PluginOptions):
    """Every pruning method's own options (`options` of its method, a built-in one's named in `registry.PRUNERS`
    so that none is imported for them: row's and width's `--width-multiple`, a plug-in's)."""

    registry = PRUNERS
    what = "prune"


@dataclass(frozen=True)
class PruneConfig(_Staged):
    """`effkit prune`: method (what is cut), options (the methods' own), finetune (between rounds, and the control
    arm), measure (the paired latency), inputs, folders."""

    inputs: PruneInputs = field(default_factory=PruneInputs)  # --from default: runs/latest/train
    method: PruneMethod = field(default_factory=PruneMethod)
    options: PrunerParams = field(default_factory=PrunerParams)  # `methods.options_of(cfg, Options)` reads them
    finetune: PruneFinetune = field(default_factory=PruneFinetune)
    measure: LatencyMeasure = field(default_factory=LatencyMeasure)
    folders: Folders = field(default_factory=Folders)

    @property
    def distilling(self) -> bool:
        """Whether the fine-tuning between rounds distils from the dense parent (resolves the auto default)."""
        if self.finetune.distill is not None:
            return self.finetune.distill
        return PRUNERS.get(self.method.mode).structured and self.finetune.finetune_steps > 0

    @property
    def label(self) -> str:
        """The mode as artifact tags and report names use it: `width`, or `width-distill` when distilling."""
        return f"{self.method.mode}-distill" if self.distilling else self.method.mode

    def validate(self) -> PruneConfig:
        check_fields(self)
        m, f = self.method, self.finetune
        pruner = PRUNERS.get(m.mode)
        if m.importance not in pruner.importances:
            accept = [n for n in PRUNERS.names() if m.importance in PRUNERS.get(n).importances]
            if not accept:
                known = sorted({i for n in PRUNERS.names() for i in PRUNERS.get(n).importances})
                raise EffkitError(f"unknown --importance {m.importance!r}; choose one of {', '.join(known)}")
            raise EffkitError(f"--importance {m.importance} applies to --mode {' or '.join(accept)}; --mode "
                              f"{m.mode} ranks by {pruner.ranks_by(self)}")
        if f.optim:
            OPTIMIZERS.get(f.optim)  # one line naming the choices
        if f.distill and not pruner.structured:
            structured = [n for n in PRUNERS.names() if PRUNERS.get(n).structured]
            raise EffkitError(f"--distill applies to the structured modes ({', '.join(structured)}), not to "
                              f"--mode {m.mode}")
        if f.distill and not f.finetune_steps:
            raise EffkitError("--distill needs fine-tuning steps (--finetune-steps > 0): it is a fine-tuning loss")
        self.options.validate()  # every method's options, whichever --mode runs: a recipe's bad value is a mistake
        check_device(self.inputs.device)
        check_folder_option("--reports-dir", self.folders.reports_dir)
        return self



@dataclass(frozen=True)
class BackendOptions(_Section):
    backend: str = opt("auto", "{choices} (auto: the fastest within 1% of the parent's loss)",
                       choices=lambda: ("auto", *BACKENDS.names()))
    # what auto picks the fastest backend for: a workload (effkit.workloads)
    optimize_for: str = opt(workloads.GENERATION, "the workload auto picks the fastest backend for: {choices} "
                            "(decode: greedy tokens/s; prefill: latency)", choices=workloads.names)
    # also the (tied) LM head and token embeddings
    include_head: bool = opt(False, "also quantize the tied LM head / token embedding")
    # the share of its time budget `effkit run` gives the stage: auto writes that share of the backends (the ones
    # measured fastest before first, effkit.stage.by_share) and lists the rest as not run
    auto_share: float = opt(1.0, "auto: write and time this share of the backends that run here (at least 3, those "
                            "measured fastest before first: effkit/stage_costs.json); the rest are listed as not run",
                            gt=0, le=1)


class BackendParams(PluginOptions):
    """Every quantization backend's own options (`options` in its module: bnb's threshold, torchao's scheme,
    onnxruntime's fuse, ctranslate2's compute type, a plug-in's)."""

    registry = BACKENDS
    what = "quantize"


@dataclass(frozen=True)
class ParentMeasure(Sequential):
    """How a quantized or exported model is measured against its PyTorch parent."""

    batch_size: int = opt(8, "evaluation batch size", ge=1)
    # interleaved rounds: the parent (fp32, and bf16 for quantize) and the model in each
    latency_rounds: int = opt(5, "interleaved rounds of the parent's and the model's timings", ge=2)
    latency_repeats: int = opt(3, "timed forward passes per model per round", ge=1)
    gen_tokens: int = opt(64, "new tokens in the generation sample", ge=1)


@dataclass(frozen=True)
class QuantizeMeasure(ParentMeasure):
    latency_rounds: int = opt(5, "interleaved rounds of fp32, bf16 and int8 timings", ge=2)
    compile: bool = opt(False, "also time parent and int8 under torch.compile (Inductor, freezing)")


@dataclass(frozen=True)
class ExportMeasure(ParentMeasure):
    latency_rounds: int = opt(5, "interleaved rounds of PyTorch and ONNX timings", ge=2)


@dataclass(frozen=True)
class QuantizeConfig(_Staged):
    """`effkit quantize`: method (the backend and its knobs), measure (against the parent), inputs, folders."""

    inputs: QuantizeInputs = field(default_factory=QuantizeInputs)  # --from default: the newest of the latest run
    method: BackendOptions = field(default_factory=BackendOptions)
    options: BackendParams = field(default_factory=BackendParams)
    measure: QuantizeMeasure = field(default_factory=QuantizeMeasure)
    folders: Folders = field(default_factory=Folders)

    def validate(self) -> QuantizeConfig:
        check_fields(self)
        self.options.validate()
        check_device(self.inputs.device)
        check_folder_option("--reports-dir", self.folders.reports_dir)
        return self



@dataclass(frozen=True)
class ExportWhat(_Section):
    source: str = opt("", "dense or pruned artifact (default: the latest run's train)", flag="--from")
    data: str = opt("", DATA_HELP)
    format: str = opt("onnx", "onnx (with past key/values, for ONNX Runtime), ctranslate2, openvino (stateful, as "
                      "optimum-cli writes it) or gguf (llama.cpp)")
    int8: bool = opt(False, "int8 weights: ONNX Runtime dynamic int8 after export, CTranslate2's int8, or NNCF's "
                     "int8")
    fuse: bool = opt(False, "ONNX Runtime's transformer fusions first")  # before quantizing
    # the stored weights, for a format with several (its engine's `types`: gguf f16, q8_0, q4_0)
    type: str = opt("", "the stored weights, for a format with several: gguf f16 (default), q8_0 or q4_0 "
                    "(llama.cpp's blocks of 32)")
    force: bool = opt(False, "run even where the memory plan (--plan) predicts a peak above the machine's memory")


@dataclass(frozen=True)
class ExportConfig(_Staged):
    """`effkit export`: what (the artifact, the format), measure (against the parent), folders."""

    what: ExportWhat = field(default_factory=ExportWhat)
    measure: ExportMeasure = field(default_factory=ExportMeasure)
    folders: Folders = field(default_factory=Folders)

    def validate(self) -> ExportConfig:
        check_fields(self)
        check_folder_option("--reports-dir", self.folders.reports_dir)
        return self


@dataclass(frozen=True)
class BenchWhat(_Section):
    paths: tuple[str, ...] = opt((), "artifact folders (default: every artifact of the run)", argument=True)
    data: str = opt("", DATA_HELP)
    run: str = opt("", "run name under --runs-dir (default: the latest run)")
    # also the dense reference through the engines a user would pick instead (CTranslate2 int8 by its converter,
    # ONNX Runtime int8 of the with-past export), in the same rounds; None = on in `effkit run`, off otherwise
    peers: bool | None = opt(None, "also the dense reference through the engines a user would pick instead "
                             "(CTranslate2 int8, ONNX Runtime int8 with past, ...), in the same rounds (default: on "
                             "in effkit run)")
    # which engines give a peer row: comma-separated engine names ("" = every engine of the registry with a peer)
    peer_engines: str = opt("", "with --peers: comma-separated engines giving a peer row (default: every engine "
                            "that has one)")
    # the share of its time budget `effkit run` gives the stage: that share of the peers (those measured fastest
    # before first, effkit.stage.by_share), the rest listed as not run
    peer_share: float = opt(1.0, "with --peers: bench this share of the peers (at least 2, those measured fastest "
                            "before first: effkit/stage_costs.json); the rest are listed as not run", gt=0, le=1)
    # each exact target with the n-gram draft, its k measured here, benched beside the rest
    # (effkit.bench.speculative); None = on in `effkit run`, off otherwise
    speculative: bool | None = opt(None, "also the speculative artifacts: each target an engine verifies exactly "
                                   "(the run's weight-only ONNX Runtime and f32 OpenVINO artifacts, else the dense "
                                   "reference's own 4-bit form) with the n-gram draft, k chosen on this CPU, "
                                   "exactness checked on held-out prompts (default: on in effkit run)")
    device: str = opt("auto", DEVICE_HELP)
    force: bool = opt(False, "run even where the memory plan (--plan) predicts a peak above the machine's memory")


@dataclass(frozen=True)
class BenchMeasure(Sequential):
    # fewer rounds, repeats and tokens, for a fast look (fixed rounds)
    quick: bool = opt(False, "3 rounds, fewer repeats and tokens: a fast, wider look", flag="--quick")
    # interleaved rounds of the first look (of the only one with fixed_rounds)
    rounds: int = opt(8, "interleaved rounds of the first look (every artifact timed in each, order rotated; a "
                      "confidence interval needs two)", ge=2)
    repeats: int = opt(3, "timed forward passes per artifact per round", ge=1)
    gen_tokens: int = opt(workloads.DECODE_TOKENS, "new tokens per generation (capped by the context)", ge=1)
    train_steps: int = opt(1, "timed training steps per artifact per round (0: no training measure, its memory "
                              "neither)", ge=0)
    compile: bool = opt(False, "also time each PyTorch artifact under torch.compile (Inductor, freezing)")
    batch_size: int = opt(8, "evaluation batch size", ge=1)
    # the deliverable's own rounds (`effkit run`, `effkit.bench.timing.deliverable_rounds`): seconds of head-to-head
    # looks for each contender still open against its leader (times the bench's peer share): the evidence grows with
    # what is at stake, as in every decision of effkit's
    contest_budget_s: float = opt(20.0, "effkit run: seconds of the deliverable's head-to-head rounds per contender "
                                  "still open against the leader", ge=0)


@dataclass(frozen=True)
class BenchConfig(_Staged):
    """`effkit bench`: what (artifacts, peers, device), measure (the protocol's rounds and sizes), folders."""

    @property
    def peer_engine_names(self) -> list[str]:
        return [n.strip() for n in self.what.peer_engines.split(",") if n.strip()]

    what: BenchWhat = field(default_factory=BenchWhat)
    measure: BenchMeasure = field(default_factory=BenchMeasure)
    folders: Folders = field(default_factory=Folders)

    def validate(self) -> BenchConfig:
        check_fields(self)
        ms = self.measure
        check_device(self.what.device)
        if self.what.run:
            check_run_name(self.what.run, "--run")
        for name in self.peer_engine_names:
            if name not in ENGINES:
                raise EffkitError(f"unknown engine {name!r} in --peer-engines; choose among "
                                  f"{', '.join(ENGINES.names())}")
        if self.peer_engine_names:  # an engine without a peer would be asked for a row it never writes
            with_peer = [n for n, e in ENGINES.items() if e.peer_tag]  # effkit.engines.peers(), not importable here
            if missing := [n for n in self.peer_engine_names if n not in with_peer]:
                raise EffkitError(f"engine{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} in "
                                  f"--peer-engines {'have' if len(missing) > 1 else 'has'} no peer row; "
                                  f"choose among {', '.join(with_peer) or 'none: no engine has a peer here'}")
            if self.what.peers is not True:  # off (or "auto", off outside `effkit run`): the engines would be unused
                raise EffkitError("--peer-engines chooses among the peer rows: add --peers (peers = true in a "
                                  "recipe)")
        check_folder_option("--reports-dir", self.folders.reports_dir)
        if ms.quick:
            return self.replace(rounds=min(ms.rounds, 3), repeats=min(ms.repeats, 2), fixed_rounds=True,
                                gen_tokens=min(ms.gen_tokens, 32), train_steps=min(ms.train_steps, 1), quick=False)
        return self


PIPELINE = tuple(RUN_STAGES.builtin)  # the default stages of `effkit run`, in the order they run


@dataclass(frozen=True)
class RunPlan(_Section):
    """`effkit run`'s [run] table: recipe keys only (a list key takes one value as a list of one)."""

    stages: list[str] = opt(factory=lambda: list(PIPELINE), help="the stages to run, in their order: "
                            + ", ".join(PIPELINE) + " (and registered ones)")
    run_name: str = opt("quickstart", "the run's folder name under runs_dir")
    prune_modes: list[str] = opt(factory=lambda: ["row", "weight"], help="the pruning methods to run, each its own "
                                 "rounds")
    # artifact tags to quantize: train, a round (prune-row-r2), or best-pruned: the most compressed round (smallest
    # folder) whose held-out loss is within max_loss_increase of train, the model it was pruned from (relative)
    quantize_from: list[str] = opt(factory=lambda: ["train"], help="artifact tags to quantize: train, a round "
                                   "(prune-row-r2), or best-pruned")
    max_loss_increase: float = opt(0.02, "best-pruned and the deliverable: the held-out loss allowed over train's "
                                   "(relative)", ge=0)
    # the workload the delivered artifact is chosen for (effkit.workloads: greedy decoding with the KV cache, or one
    # prefill forward, at a batch size); every table shows them all. Also `effkit run --workload`
    optimize_for: str = opt(workloads.GENERATION, "the workload the delivered artifact (and auto's backend) is "
                            "chosen for, among every engine: {choices}", choices=workloads.names, flag="--workload",
                            show_default=f"the recipe's [run] optimize_for, else {workloads.GENERATION}")
    # the whole run's time, shared among its stages (effkit.pipeline.HOW_SHARED), decided once before training and
    # re-fitted once from training's own first steps (kept in pipeline.json, reused on resume)
    time_budget_min: float = opt(0.0, "minutes the whole run may take on this machine: where the recipe would take "
                                 "longer, training and every measuring stage run on one share of what the recipe gives "
                                 "them (at least 20%; decided before training, re-fitted once from its first steps, "
                                 "kept on resume); typed here, a budget even the floors cannot meet is refused; 0 = "
                                 "the recipe's full schedule (also --full)", show_default="the recipe's, else 0", ge=0)
    # what the recipe's full schedule reached where it was measured, with its source: shown beside the bits per byte
    # of a run the time budget shortened (text, shown as written: effkit does not measure it)
    full_schedule_result: str = opt("", "what the recipe's full training schedule reached where it was measured, with "
                                    "its source (shown beside the bits per byte of a run the time budget shortened)")


@dataclass(frozen=True)
class RunConfig(_Staged):
    """`effkit run`'s own table: pipeline (stages, what to prune and quantize, what to deliver), folders."""

    pipeline: RunPlan = field(default_factory=RunPlan)
    folders: Folders = field(default_factory=Folders)

    def validate(self) -> RunConfig:
        check_fields(self)
        r = self.pipeline
        if not isinstance(r.stages, list) or not r.stages:
            raise EffkitError(f"stages must be a non-empty list, e.g. {list(PIPELINE)}")
        known = RUN_STAGES.names()  # registered stages run after the built-in ones, in registration order
        for st in r.stages:
            if st not in known:
                raise EffkitError(f"unknown stage {st!r} in stages; known: {', '.join(known)}")
        order = [known.index(st) for st in r.stages]
        if order != sorted(order) or len(set(order)) != len(order):
            raise EffkitError(f"stages {r.stages} are in an impossible order; they run as "
                              f"{' -> '.join(known)}")
        if not r.quantize_from or not all(isinstance(t, str) and t for t in r.quantize_from):
            raise EffkitError(f"quantize_from must be a tag or a list of tags, e.g. [\"train\", \"best-pruned\"] "
                              f"(got {r.quantize_from!r})")
        for m in r.prune_modes:
            if m not in PRUNERS.names():
                raise EffkitError(f"unknown prune mode {m!r} in prune_modes; choose among {', '.join(PRUNERS.names())}")
        check_run_name(r.run_name, "run_name")
        check_folder_option("runs_dir", self.folders.runs_dir)
        check_folder_option("reports_dir", self.folders.reports_dir)
        return self


@dataclass(frozen=True)
class GenerateConfig(_Section):
    """`effkit generate`'s options."""

    source: str = opt("", "artifact folder (default: newest artifact of the latest run)", flag="--from")
    prompt: str = opt("The state of the Union", "text to continue")
    max_new_tokens: int = opt(64, "tokens to generate", ge=1)
    temperature: float = opt(0.0, "0 = greedy; otherwise sample at this temperature", ge=0)
    top_k: int = opt(50, "sample among the k most likely tokens (with --temperature > 0)", ge=1)
    seed: int = opt(0, "random seed for sampling")
    compile: bool = opt(False, "decode with a static KV cache and a torch.compile'd step (compiled before the "
                        "streamed text)", flag="--compile")
    draft: str = opt("", "a draft of the model (effkit prune --mode draft): PyTorch decodes with it through "
                     "transformers' assisted generation, the greedy text unchanged")
    draft_k: int = opt(0, "--draft: tokens it proposes per step (0: the k its acceptance was measured with)", ge=0)
    device: str = opt("auto", DEVICE_HELP)
    runs_dir: str = opt("runs", "where runs/ are")


@dataclass
class StudyConfig:
    """`effkit study NAME`'s options (the flags), and what single studies sweep (recipe-only: no flag)."""

    model: str = opt("gpt2-mini", "model preset")
    data: str = opt("builtin", "corpus (as for effkit train)")
    vocab_size: int = opt(8192, "BPE vocabulary size")
    block_size: int = opt(128, "tokens per block")
    batch_size: int = opt(4, "blocks per step per data-parallel rank", ge=1)
    steps: int = opt(12, "optimizer steps per run", ge=2)
    nproc: int = opt(2, "processes for the multi-process studies (scaling goes 1..nproc)", ge=1)
    out: str = opt("reports/studies", "where reports/studies/NAME/ goes")
    runs_dir: str = opt("runs/studies", "where the study's runs go")
    batch_sizes: tuple[int, ...] = opt((1, 2, 4, 8), "batch-size study: the batch sizes", cli=False)
    block_sizes: tuple[int, ...] = opt((64, 128, 256), "checkpointing study: the block sizes", cli=False)
    max_workers: int = opt(-1, "dataloader study: 0..max_workers (-1: the number of CPU cores)", cli=False)
    microbatches: tuple[int, ...] = opt((1, 2, 4, 8), "pipeline study: the micro-batches", cli=False)
    memory_models: tuple[str, ...] = opt(("gpt2-medium",), "memory study: the models after --model", cli=False)
    memory_optims: tuple[str, ...] = opt(("adamw", "adamw8bit"), "memory study: the optimizers", cli=False)
    memory_checkpointing: tuple[bool, ...] = opt((False, True), "memory study: activation checkpointing", cli=False)
    memory_default_allocator: bool = opt(True, "memory study: the first configuration again, with glibc's "
                                         "defaults", cli=False)
    memory_default_allocator_all: bool = opt(False, "memory study: every single-process configuration again with "
                                             "them", cli=False)
    memory_tuned_allocator: bool = opt(True, "memory study: the configurations with the tuned (tensor-tracking) "
                                       "allocator", cli=False)


def check_device(device: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` (whether it exists is checked where the device is opened)."""
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise EffkitError(f"unknown --device {device!r}; choose auto, cpu, cuda or cuda:N")
    return device


STAGES: dict[str, type] = {"train": TrainConfig, "prune": PruneConfig, "quantize": QuantizeConfig,
                           "export": ExportConfig, "bench": BenchConfig, "run": RunConfig}


def flat_defaults(cls: type) -> dict[str, Any]:
    """The flat keys of a stage (its flags and recipe keys) with their defaults."""
    return cls.flat_defaults()


def _plugin_tables() -> dict[str, type]:
    """Recipe tables of registered (not built-in) stages that declare options: `[toy]` -> its dataclass."""
    return {name: opts for name in RUN_STAGES.names() if name not in RUN_STAGES.builtin
            and (opts := getattr(RUN_STAGES.get(name), "options", None)) is not None}


def flat_fields(cls: type, skip_broken_plugins: bool = False) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every flat key of a stage config (its flags and recipe keys), or every field of a plug-in stage's options
    dataclass -> (its field, its type): what the flags, `--help`, recipe keys and type checks derive from.
    `skip_broken_plugins`: leave out the options of plug-ins that do not import (the CLI says so when the command
    runs) instead of raising."""
    if not issubclass(cls, _Staged):
        return _section_fields(cls)
    out: dict[str, tuple[dataclasses.Field, Any]] = {}
    for section in cls.sections().values():
        try:
            out.update(_section_fields(section))
        except EffkitError:
            if not (skip_broken_plugins and issubclass(section, PluginOptions)):
                raise
    return out


def load_recipe(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML recipe: `{stage: {key: value}}`. Unknown stages or keys are errors naming the file."""
    p = Path(path)
    if not p.is_file():
        raise EffkitError(f"recipe {p} not found; pass an existing .toml file (see recipes/)")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise EffkitError(f"recipe {p} is not valid TOML: {e}") from None
    tables = {**STAGES, **_plugin_tables()}
    for stage, table in data.items():
        if stage not in tables:
            raise EffkitError(f"recipe {p}: unknown section [{stage}]; known sections: {', '.join(sorted(tables))}")
        if not isinstance(table, dict):
            raise EffkitError(f"recipe {p}: [{stage}] must be a table of key = value")
        names = flat_fields(tables[stage])
        for key in table:
            if key.replace("-", "_") not in names:
                raise EffkitError(f"recipe {p}: unknown key {key!r} in [{stage}]; "
                                  f"run `effkit {stage} --help` for the options")
    return data


def build_section(cls: type, recipe: str | None, table: str) -> Any:
    """A plug-in stage's options (a plain dataclass) from its recipe table `[table]`, type-checked like every
    stage's: defaults <- recipe."""
    where = f"recipe {recipe}: [{table}]" if recipe else f"[{table}]"
    values = load_recipe(recipe).get(table, {}) if recipe else {}
    return cls(**_typed(cls, {k.replace("-", "_"): v for k, v in values.items()}, where))


def build_config(cls: type, recipe: str | None, overrides: dict[str, Any],
                 defaults: dict[str, Any] | None = None) -> Any:
    """Defaults <- recipe[stage] <- explicit CLI overrides (flat keys); then validate. `defaults`: the caller's own
    (flat keys), for what neither the recipe nor a flag sets or what they leave "auto" (None): `effkit run` turns
    the bench's peers on this way, before validation, so its checks see the peers the run will measure."""
    stage = next(name for name, c in STAGES.items() if c is cls)
    where = f"recipe {recipe}: [{stage}]" if recipe else f"[{stage}]"
    values: dict[str, Any] = {}
    if recipe:  # the recipe is checked whole, before flags override any of its keys
        values.update(_typed(cls, {k.replace("-", "_"): v for k, v in load_recipe(recipe).get(stage, {}).items()},
                             where))
    values.update(_typed(cls, dict(overrides), where))
    for key, value in (defaults or {}).items():
        if values.get(key) is None:
            values[key] = value
    cfg = cls.from_flat(**values)
    try:
        return cfg.validate()
    except EffkitError as e:
        raise EffkitError(f"{where}: {e}" if recipe and not str(e).startswith(where) else str(e)) from None


def _typed(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` (flat keys of `cls`) checked against their fields' types (None passes: a default or auto)."""
    fields = flat_fields(cls)
    for key, value in values.items():
        if value is not None and key in fields:  # an unknown key is refused by `from_flat`, naming the stage
            values[key] = _coerce(fields[key][1], value, f"{where}: {key}")
    return values


def _coerce(kind: Any, value: Any, what: str) -> Any:
    """`value` as a field of type `kind` takes it: a `bool | None` takes true, false or "auto" (None); a list
    takes one value as a list of one; a tuple takes a list; a float takes an int; anything else its own type."""
    if _optional_bool(kind):
        if not (isinstance(value, bool) or value == "auto"):
            raise EffkitError(f"{what} must be true, false or \"auto\" (got {value!r})")
        return None if value == "auto" else value
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        kind = args[0]  # `X | None`: None passed already
    want = typing.get_origin(kind) or kind
    if want is list and isinstance(value, str):
        return [value]
    if want is tuple and isinstance(value, list):
        return tuple(value)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(want, type) and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
        raise EffkitError(f"{what} must be {want.__name__} (got {value!r})")
    return value


__all__ = ["BenchConfig", "DataConfig", "ExportConfig", "GenerateConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "PruneConfig", "QuantizeConfig", "RunConfig", "RunSection", "StudyConfig", "TrainConfig",
           "build_config", "load_recipe", "PARALLEL_MODES", "SYNC_MODES", "check_fields", "flat_fields", "field_help",
           "opt"]
