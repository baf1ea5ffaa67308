"""Which artifacts a bench measures and under which names: the artifacts of a run (or the paths given), in the
order the run made them (dense first: the reference), and the peers, the dense reference written through each
engine a user would pick instead of effkit (`effkit.engines.peers`)."""

from __future__ import annotations

from pathlib import Path

from effkit import artifacts, engines
from effkit.artifacts.loader import trainable
from effkit.config import BenchConfig
from effkit.errors import EffkitError

# a run's artifacts in the order they are benched: the dense one first (the reference), the peers last
STAGE_ORDER = {"import": 0, "train": 0, "prune": 1, "quantize": 2, "export": 3, "peer": 4}


def find_artifacts(cfg: BenchConfig) -> tuple[str, list[Path]]:
    """(run name, artifact folders): the paths given, or every artifact of the run (the latest by default)."""
    if cfg.what.paths:
        paths = [Path(p) for p in cfg.what.paths]
        for p in paths:
            if not p.exists():
                raise EffkitError(f"artifact {p} does not exist")
            artifacts.read_meta(p)
        return artifacts.run_of(paths[0]), paths
    runs = Path(cfg.folders.runs_dir)
    run_dir = runs / cfg.what.run if cfg.what.run else artifacts.latest_run(runs)
    if not run_dir.is_dir():
        raise EffkitError(f"unknown run {cfg.what.run!r}: {run_dir} does not exist; see `ls {cfg.folders.runs_dir}`")
    found = [((artifacts.read_meta(d).get("time", ""), (d / artifacts.META).stat().st_mtime_ns), d)
             for d in sorted(run_dir.iterdir()) if (d / artifacts.META).is_file()]  # times to the second, then ns
    if not found:
        raise EffkitError(f"no artifacts found in {run_dir}; run `effkit train` first")
    found.sort(key=lambda td: (STAGE_ORDER.get(artifacts.read_meta(td[1])["stage"], 3), td[0]))
    return run_dir.name, [d for _, d in found]


def tags(paths: list[Path]) -> list[str]:
    """The artifacts' names, or run/name where two artifacts of different runs share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else f"{p.parent.name}/{p.name}" for p in paths]


def make_peers(reference: Path, scratch: Path, only: list[str] | None = None) -> tuple[list[Path], dict[str, str]]:
    """The dense reference through the engines a user would pick instead of effkit (every engine of
    `effkit.registry.ENGINES` with a peer), written into `scratch` as artifacts of stage `peer` (measured like every
    artifact, never delivered); with why a peer is not run. `only`: these engines' peers (default: every one)."""
    from transformers import AutoTokenizer

    from effkit.model import load_model

    peers = engines.peers(only)
    if not trainable(reference):
        return [], {e.peer_tag: f"not run: the reference {reference.name} is not a PyTorch artifact" for e in peers}
    made, not_run = [], {}
    tokenizer, model = AutoTokenizer.from_pretrained(reference), load_model(str(reference)).eval()
    data = artifacts.data_section(reference)
    for engine in peers:
        tag = engine.peer_tag
        if reason := engine.available(None, int8=True):
            not_run[tag] = f"not run: {reason}"
            continue
        folder = scratch / tag
        folder.mkdir()
        try:
            desc = engine.write_peer(folder, reference, model, tokenizer)
        except EffkitError as e:
            not_run[tag] = f"not run: {e}"
            continue
        artifacts.write_meta(folder, "peer", {"engine": engine.label, "how": engine.peer_how}, {}, data=data,
                             parent=str(reference), extra={"peer": desc})
        made.append(folder)
    return made, not_run
