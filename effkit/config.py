"""Config dataclasses, recipe loading and validation.

Flow: recipe (TOML) + CLI flags -> config dataclass -> stage. A recipe holds one table per stage
(`[train]`, `[prune]`, ...); every key must be a field of that stage's dataclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from effkit.errors import EffkitError

PARALLEL_MODES = ("none", "ddp", "fsdp", "tp", "fsdp+tp")
SYNC_MODES = ("ddp", "all-reduce", "gather-scatter")


@dataclass
class TrainConfig:
    # what
    model: str = "gpt2-mini"
    data: str = "builtin"
    vocab_size: int = 8192
    block_size: int = 128
    heldout_fraction: float = 0.05
    eval_blocks: int = 64
    # how long
    max_steps: int = 200
    max_tokens: int = 0  # 0 = no limit
    time_budget: float = 0.0  # seconds, 0 = no limit
    # optimisation
    batch_size: int = 8  # per data-parallel rank, per micro-step
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    seed: int = 1337
    # efficiency
    amp: bool = False
    amp_dtype: str = "bf16"  # bf16 | fp16 (fp16 only on CUDA)
    activation_checkpointing: bool = False
    workers: int = 0
    threads: int = 0  # torch intra-op threads per process, 0 = torch default
    # parallelism
    parallel: str = "none"
    nproc: int = 0  # 0 = number of GPUs, or 2 on CPU when a parallel mode is asked for
    tp_size: int = 0  # fsdp+tp: tensor-parallel size (0 = all processes on one node)
    sync: str = "ddp"  # gradient sync of plain data parallelism: ddp | all-reduce | gather-scatter
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # bookkeeping
    eval_interval: int = 50
    log_interval: int = 10
    checkpoint_interval: int = 100
    warmup_steps_excluded: int = 5  # steps left out of the steady-state tokens/s
    profile: bool = False  # synchronise CUDA around each phase so the time breakdown is exact
    run_name: str = ""
    runs_dir: str = "runs"
    reports_dir: str = "reports"
    resume: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """A config saved in an artifact or checkpoint (keys this version does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def validate(self, allow_no_steps: bool = False) -> TrainConfig:
        if self.batch_size < 1:
            raise EffkitError(f"--batch-size must be at least 1 (got {self.batch_size})")
        if self.grad_accum < 1:
            raise EffkitError(f"--grad-accum must be at least 1 (got {self.grad_accum})")
        if self.max_steps < 0:
            raise EffkitError(f"--max-steps must be >= 0 (got {self.max_steps}); use 0 with --max-tokens "
                              "or --time-budget")
        if self.max_tokens < 0 or self.time_budget < 0:
            raise EffkitError("--max-tokens and --time-budget must be >= 0")
        if self.max_steps == 0 and self.max_tokens == 0 and self.time_budget == 0 and not allow_no_steps:
            raise EffkitError("nothing bounds training: set --max-steps, --max-tokens or --time-budget")
        if self.block_size < 2:
            raise EffkitError(f"--block-size must be at least 2 (got {self.block_size})")
        if self.vocab_size < 300:
            raise EffkitError(f"--vocab-size must be at least 300 for byte-level BPE (got {self.vocab_size})")
        if not 0 < self.heldout_fraction < 1:
            raise EffkitError(f"--heldout-fraction must be in (0, 1) (got {self.heldout_fraction})")
        if self.amp_dtype not in ("bf16", "fp16"):
            raise EffkitError(f"--amp-dtype must be bf16 or fp16 (got {self.amp_dtype!r})")
        if self.parallel not in PARALLEL_MODES:
            raise EffkitError(f"unknown --parallel {self.parallel!r}; choose one of {', '.join(PARALLEL_MODES)}")
        if self.sync not in SYNC_MODES:
            raise EffkitError(f"unknown --sync {self.sync!r}; choose one of {', '.join(SYNC_MODES)}")
        if self.nproc < 0:
            raise EffkitError(f"--nproc must be at least 1 (got {self.nproc})")
        if self.sync != "ddp" and self.parallel not in ("ddp", "none"):
            raise EffkitError(f"--sync {self.sync} applies to plain data parallelism; use it with --parallel ddp")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise EffkitError(f"--node-rank must be in [0, --nnodes) (got {self.node_rank} of {self.nnodes})")
        if self.eval_blocks < 1:
            raise EffkitError(f"--eval-blocks must be at least 1 (got {self.eval_blocks})")
        if self.workers < 0:
            raise EffkitError(f"--workers must be >= 0 (got {self.workers})")
        return self


PRUNE_MODES = ("weight", "row")
IMPORTANCE = ("magnitude", "wanda")


@dataclass
class PruneConfig:
    source: str = ""  # --from: an effkit artifact folder (default: runs/latest/train)
    mode: str = "row"
    target: float = 0.5  # fraction of the prunable weights removed at the last round
    rounds: int = 3
    finetune_steps: int = 40  # per round; 0 = no fine-tuning
    importance: str = "magnitude"  # weight mode: magnitude | wanda
    scope: str = "global"  # weight mode, magnitude: global | layer
    calib_batches: int = 4
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 5
    seed: int = 1337
    latency_repeats: int = 20
    runs_dir: str = "runs"
    reports_dir: str = "reports"

    def validate(self) -> PruneConfig:
        if self.mode not in PRUNE_MODES:
            raise EffkitError(f"unknown --mode {self.mode!r}; choose weight or row")
        if not 0 < self.target < 1:
            raise EffkitError(f"--target must be between 0 and 1, exclusive (got {self.target}); "
                              "it is the fraction of prunable weights removed")
        if self.rounds < 1:
            raise EffkitError(f"--rounds must be at least 1 (got {self.rounds})")
        if self.finetune_steps < 0:
            raise EffkitError(f"--finetune-steps must be >= 0 (got {self.finetune_steps})")
        if self.importance not in IMPORTANCE:
            raise EffkitError(f"unknown --importance {self.importance!r}; choose magnitude or wanda")
        if self.importance == "wanda" and self.mode != "weight":
            raise EffkitError("--importance wanda applies to --mode weight")
        if self.scope not in ("global", "layer"):
            raise EffkitError(f"unknown --scope {self.scope!r}; choose global or layer")
        if self.batch_size < 1 or self.calib_batches < 1 or self.latency_repeats < 1:
            raise EffkitError("--batch-size, --calib-batches and --latency-repeats must be at least 1")
        return self


BACKENDS = ("auto", "dynamic", "bnb", "torchao")


@dataclass
class QuantizeConfig:
    source: str = ""  # --from: an effkit artifact (default: the newest artifact of the latest run)
    backend: str = "auto"
    include_head: bool = False  # also the (tied) LM head and token embeddings
    threshold: float = 6.0  # bnb outlier threshold
    torchao_scheme: str = "da8w8"  # da8w8 (dynamic activation + weight) or w8 (weight-only)
    batch_size: int = 8  # evaluation batch
    latency_repeats: int = 20
    gen_tokens: int = 64
    runs_dir: str = "runs"
    reports_dir: str = "reports"

    def validate(self) -> QuantizeConfig:
        if self.backend not in BACKENDS:
            raise EffkitError(f"unknown --backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.torchao_scheme not in ("da8w8", "w8"):
            raise EffkitError(f"unknown --torchao-scheme {self.torchao_scheme!r}; choose da8w8 or w8")
        if self.batch_size < 1 or self.latency_repeats < 1 or self.gen_tokens < 1:
            raise EffkitError("--batch-size, --latency-repeats and --gen-tokens must be at least 1")
        return self


@dataclass
class BenchConfig:
    paths: tuple[str, ...] = ()  # artifacts to measure (default: every artifact of the run)
    run: str = ""  # run name under runs_dir (default: the latest run)
    quick: bool = False  # fewer repeats and tokens, for a fast look
    repeats: int = 20
    gen_tokens: int = 128
    train_steps: int = 3  # timed optimizer steps per training-throughput figure (after 1 warm-up step)
    batch_size: int = 8  # evaluation batch
    runs_dir: str = "runs"
    reports_dir: str = "reports"

    def validate(self) -> BenchConfig:
        if self.repeats < 1 or self.gen_tokens < 1 or self.train_steps < 1:
            raise EffkitError("--repeats, --gen-tokens and --train-steps must be at least 1")
        if self.batch_size < 1:
            raise EffkitError(f"--batch-size must be at least 1 (got {self.batch_size})")
        if self.quick:
            self.repeats, self.gen_tokens, self.train_steps = min(self.repeats, 5), min(self.gen_tokens, 32), 1
        return self


PIPELINE = ("train", "prune", "quantize", "bench", "report")


@dataclass
class RunConfig:
    stages: list = dataclasses.field(default_factory=lambda: list(PIPELINE))
    run_name: str = "quickstart"
    prune_modes: list = dataclasses.field(default_factory=lambda: ["row", "weight"])
    quantize_from: str = "train"  # the artifact tag to quantize (train, or e.g. prune-row-r2)
    runs_dir: str = "runs"
    reports_dir: str = "reports"

    def validate(self) -> RunConfig:
        if not isinstance(self.stages, list) or not self.stages:
            raise EffkitError(f"stages must be a non-empty list, e.g. {list(PIPELINE)}")
        for st in self.stages:
            if st not in PIPELINE:
                raise EffkitError(f"unknown stage {st!r} in stages; known: {', '.join(PIPELINE)}")
        order = [PIPELINE.index(st) for st in self.stages]
        if order != sorted(order) or len(set(order)) != len(order):
            raise EffkitError(f"stages {self.stages} are in an impossible order; they run as "
                              f"{' -> '.join(PIPELINE)}")
        for m in self.prune_modes:
            if m not in PRUNE_MODES:
                raise EffkitError(f"unknown prune mode {m!r} in prune_modes; choose weight or row")
        if not self.run_name:
            raise EffkitError("run_name must not be empty")
        return self


STAGES: dict[str, type] = {"train": TrainConfig, "prune": PruneConfig, "quantize": QuantizeConfig,
                           "bench": BenchConfig, "run": RunConfig}


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def load_recipe(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML recipe: `{stage: {key: value}}`. Unknown stages or keys are errors naming the file."""
    p = Path(path)
    if not p.is_file():
        raise EffkitError(f"recipe {p} not found; pass an existing .toml file (see recipes/)")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise EffkitError(f"recipe {p} is not valid TOML: {e}") from None
    for stage, table in data.items():
        if stage not in STAGES and stage not in EXTRA_SECTIONS:
            known = ", ".join(sorted([*STAGES, *EXTRA_SECTIONS]))
            raise EffkitError(f"recipe {p}: unknown section [{stage}]; known sections: {known}")
        if not isinstance(table, dict):
            raise EffkitError(f"recipe {p}: [{stage}] must be a table of key = value")
        if stage in STAGES:
            names = field_names(STAGES[stage])
            for key in table:
                if key.replace("-", "_") not in names:
                    raise EffkitError(f"recipe {p}: unknown key {key!r} in [{stage}]; "
                                      f"run `effkit {stage} --help` for the options")
    return data


EXTRA_SECTIONS: set[str] = set()


def build_config(cls: type, recipe: str | None, overrides: dict[str, Any]) -> Any:
    """Defaults <- recipe[stage] <- explicit CLI overrides; then validate."""
    stage = next(name for name, c in STAGES.items() if c is cls)
    values: dict[str, Any] = {}
    if recipe:
        values.update({k.replace("-", "_"): v for k, v in load_recipe(recipe).get(stage, {}).items()})
    values.update(overrides)
    where = f"recipe {recipe}: [{stage}]" if recipe else f"[{stage}]"
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        default = defaults[key].default
        if default is not dataclasses.MISSING and value is not None:
            want = type(default)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                values[key] = float(value)
            elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise EffkitError(f"{where}: {key} must be {want.__name__} (got {value!r})")
    cfg = cls(**values)
    try:
        return cfg.validate()
    except EffkitError as e:
        raise EffkitError(f"{where}: {e}" if recipe and not str(e).startswith(where) else str(e)) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


__all__ = ["TrainConfig", "load_recipe", "build_config", "to_dict", "PARALLEL_MODES", "SYNC_MODES"]
