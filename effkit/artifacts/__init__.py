"""Run and artifact folders: their names and layout (`RunLayout`, `new_run_name`, `prune_tag`), atomic writes and
the run lock (`atomic_dir`, `atomic_write_text`, `run_lock`), metadata (effkit.json: versions, git commit, the data
section), `runs/latest`, and resolving what a command is given (a folder, `latest`, or a Hugging Face Hub id,
fetched once: `resolve_artifact`)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from effkit.errors import EffkitError

META = "effkit.json"


def new_run_name(model: str) -> str:
    """`20261122-120000-gpt2-mini`: a timestamp and the model's name, reduced to a plain folder name."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{re.sub(r'[^A-Za-z0-9._+-]+', '-', Path(model).name)}"[:128]


def run_of(artifact: Path) -> str:
    """The run an artifact belongs to, as a plain folder name: later stages write there, inside the runs folder,
    wherever the artifact itself lies."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", Path(artifact).resolve().parent.name).strip(".-")[:128]
    return name if name and name != "latest" else "imported"


def prune_tag(mode: str, round_: int) -> str:
    """The artifact tag of pruning round `round_` of `mode` (`prune-row-r2`)."""
    return f"prune-{mode}-r{round_}"


def prune_branch(tag: str) -> str | None:
    """`prune-row-r2` -> `prune-row`: the pruning run a round belongs to (None for other tags)."""
    head, sep, k = tag.rpartition("-r")
    return head if tag.startswith("prune-") and sep and k.isdigit() else None


@dataclass(frozen=True)
class RunLayout:
    """Where one run's files live: `runs/<run>/<tag>/` artifacts and checkpoints, `reports/<run>/` reports."""

    runs_dir: Path
    reports_dir: Path
    name: str

    @classmethod
    def of(cls, runs_dir: str | Path, reports_dir: str | Path, name: str) -> RunLayout:
        return cls(Path(runs_dir), Path(reports_dir), name)

    @classmethod
    def for_run(cls, run) -> RunLayout:
        """The layout of a training config's run section (`TrainConfig.run`: runs_dir, reports_dir, run_name)."""
        return cls.of(run.runs_dir, run.reports_dir, run.run_name)

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    @property
    def report_dir(self) -> Path:
        return self.reports_dir / self.name

    def artifact(self, tag: str) -> Path:
        return self.run_dir / tag

    def report(self, tag: str) -> Path:
        return self.report_dir / f"{tag}.json"

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints" / "last"



@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a temporary folder beside `final`; on success it replaces `final` in one rename,
    on error it is removed, so a reader never sees a half-written artifact."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    tmp.chmod(0o755)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_HELD: set[str] = set()  # run folders this process has locked (the lock is re-entrant within a process)


def _owner_alive(owner: dict[str, Any]) -> bool:
    if owner.get("host") != platform.node():
        return True  # another machine's process: it cannot be checked from here
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, KeyError, TypeError):
        return True
    return True


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """One process at a time writes a run: `runs/<run>/.lock` holds the owner's pid and host. A second process
    gets a one-line error naming the owner; a lock whose owner is gone (killed) is taken over. Taking the lock
    also removes the half-written `.tmp-*` / `.old-*` folders killed writes left behind, and a run folder that is
    still empty when the lock is released is removed."""
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    if key in _HELD:
        yield
        return
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / ".lock"
    me = json.dumps({"pid": os.getpid(), "host": platform.node()})
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(lock.read_text() or "{}")
            except (json.JSONDecodeError, OSError):
                owner = {}
            if owner and _owner_alive(owner):
                raise EffkitError(f"run {run_dir.name} is in use by process {owner.get('pid')} on "
                                  f"{owner.get('host')}; wait for it to finish or choose another --run-name") from None
            lock.unlink(missing_ok=True)  # stale: its owner is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    else:
        raise EffkitError(f"could not lock run {run_dir.name} ({lock}); remove it if no effkit process uses the run")
    _HELD.add(key)
    try:
        for stale in [*run_dir.glob(".tmp-*"), *run_dir.glob(".old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        _HELD.discard(key)
        lock.unlink(missing_ok=True)
        if created and run_dir.is_dir() and not any(run_dir.iterdir()):
            run_dir.rmdir()


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    os.chmod(tmp, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def set_latest(runs_dir: Path, run_dir: Path) -> None:
    """Point `runs/latest` at `run_dir` (a relative symlink, swapped atomically)."""
    runs_dir = Path(runs_dir)
    link = runs_dir / "latest"
    tmp = runs_dir / f".latest-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(Path(run_dir).name)
    os.replace(tmp, link)


def latest_run(runs_dir: Path) -> Path:
    link = Path(runs_dir) / "latest"
    if not link.exists():
        raise EffkitError(f"no runs found under {runs_dir}/; run `effkit train` first or pass --from PATH")
    return link.resolve()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5).stdout
        return out.stdout.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("effkit", "torch", "transformers", "accelerate", "tokenizers", "safetensors", "torch-pruning",
                "bitsandbytes", "torchao", "onnx", "onnxruntime", "onnxscript"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def write_meta(folder: Path, stage: str, config: dict[str, Any], metrics: dict[str, Any], data: dict[str, Any],
               parent: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`effkit.json`: what made the artifact. `data` is the data section the model was trained on (every
    artifact carries it, so later stages evaluate on the same held-out blocks without rebuilding a config)."""
    meta = {
        "stage": stage,
        "parent": parent,
        "config": config,
        "data": data,
        "metrics": metrics,
        "versions": versions(),
        "git_commit": git_commit(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    (Path(folder) / META).write_text(json.dumps(meta, indent=2, default=str))
    return meta


TOKENIZER_FILES = ("tokenizer.json", "vocab.json")  # a fast tokenizer, or GPT-2's byte-level BPE files
IMPORT_BLOCK_SIZE = 128  # held-out and fine-tuning blocks of an imported model (capped by its context)


def hf_gpt2_config(folder: Path) -> dict[str, Any]:
    """The config of a plain Hugging Face GPT-2 folder (one effkit did not write), checked: a GPT-2 with its
    tokenizer beside it. A one-line error says what is missing otherwise."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise EffkitError(f"{folder} is not an effkit artifact (no {META}) and not a Hugging Face model folder (no "
                          "readable config.json); give a folder written by effkit or by save_pretrained") from None
    if config.get("model_type") != "gpt2":
        raise EffkitError(f"{folder} is not an effkit artifact (no {META}) and holds a "
                          f"{config.get('model_type') or 'model of no model_type'}; effkit compresses GPT-2 models "
                          "(model_type gpt2)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise EffkitError(f"{folder} has no tokenizer (tokenizer.json, or vocab.json and merges.txt); save it beside "
                          "the model: tokenizer.save_pretrained(folder)")
    return config


def shape_only(folder: Path, model_config: Any, data: dict[str, Any], stage: str = "train",
               parent: str | None = None, config: dict[str, Any] | None = None) -> Path:
    """An artifact folder with the shapes of `model_config` and no weights: config.json, effkit.json (`stage`, its
    data section) and model.safetensors, whose header names every tensor a saved GPT-2 holds (fp32; the tied head
    saved once, as `save_model` does) over a hole of their size. What the stages' plans read, not a model."""
    import math
    import struct

    import torch
    from transformers import GPT2LMHeadModel

    folder = Path(folder)
    folder.mkdir(parents=True)
    with torch.device("meta"):
        model = GPT2LMHeadModel(model_config)
    state = model.state_dict()
    if getattr(model_config, "tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in state.items():
        size = 4 * math.prod(t.shape)
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the weights' bytes: a hole
    model_config.to_json_file(folder / "config.json")
    write_meta(folder, stage, config or {}, {}, data, parent=parent)
    return folder


def read_meta(folder: Path) -> dict[str, Any]:
    """`effkit.json` of an artifact; for a plain Hugging Face GPT-2 folder, what effkit knows of it (stage
    `import`: no parent, no config, evaluated on the built-in corpus unless a stage is given --data)."""
    path = Path(folder) / META
    if not path.is_file():
        config = hf_gpt2_config(folder)
        block = min(IMPORT_BLOCK_SIZE, int(config.get("n_positions", IMPORT_BLOCK_SIZE)))
        return {"stage": "import", "parent": None, "config": {}, "metrics": {}, "source_model": str(folder),
                "data": {"source": "builtin", "block_size": block, "vocab_size": int(config.get("vocab_size", 0))}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EffkitError(f"{path} is corrupt ({e}); re-run the stage that wrote it") from None


def data_section(path: Path, data: str = "") -> dict[str, Any]:
    """The data section of an artifact (for artifacts of older effkit versions: its train ancestor's config), with
    its corpus replaced by `data` when given (a stage's --data)."""
    section = _data_section(path)
    return {**section, "source": data} if data else section


def _data_section(path: Path) -> dict[str, Any]:
    for _ in range(50):
        meta = read_meta(path)
        if "data" in meta:
            return meta["data"]
        if meta["stage"] == "train" or not meta.get("parent"):
            flat = meta.get("config", {})
            return {"source": flat.get("data", "builtin"), **{k: flat[k] for k in
                    ("vocab_size", "block_size", "heldout_fraction", "eval_blocks", "workers") if k in flat}}
        path = Path(meta["parent"])
    raise EffkitError(f"{path}: parent chain too long")


def dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def looks_like_hub_id(source: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source)) and not source.startswith((".", "/", "~"))


def fetch_hub_model(repo_id: str) -> Path:
    """A hub model's folder (config, safetensors weights, tokenizer) in the Hugging Face cache: online users only;
    effkit's defaults and tests never need it."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated: one line
        raise EffkitError(f"{repo_id} is not a local folder and could not be fetched from the Hugging Face hub "
                          f"({type(e).__name__}); give a local GPT-2 folder") from None


def resolve_artifact(source: str, runs_dir: str | Path, default_tag: str = "train") -> Path:
    """`--from PATH` (an effkit artifact, a plain Hugging Face GPT-2 folder, or a hub id online), or the
    `default_tag` artifact of the latest run."""
    path = Path(source) if source else latest_run(Path(runs_dir)) / default_tag
    if not path.exists():
        if source and looks_like_hub_id(source):
            path = fetch_hub_model(source)
        else:
            raise EffkitError(f"artifact {path} does not exist; pass --from PATH to an effkit artifact or a Hugging "
                              "Face GPT-2 folder")
    read_meta(path)
    return path
