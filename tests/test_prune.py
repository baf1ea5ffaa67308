import csv
import json
import sys

import pytest
import torch
from conftest import loss_verdict_matches_interval
from transformers import AutoModelForCausalLM

from effkit import cli
from effkit.config import PruneConfig
from effkit.prune import methods
from effkit.prune.row import RowPruner
from effkit.prune.stage import run_prune


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_tiny):
    tmp = tmp_path_factory.mktemp("prune")
    return tmp, train_tiny(tmp, "p")


def prune_cfg(tmp, artifact, **kw):
    base = dict(source=artifact, rounds=2, finetune_steps=3, batch_size=4, latency_repeats=1, latency_rounds=2,
                calib_batches=1, distill=False, runs_dir=str(tmp / "runs"), reports_dir=str(tmp / "reports"))
    return PruneConfig.from_flat(fixed_rounds=True, **{**base, **kw})


def block_weights(model):
    """The Conv1D weights of the blocks of a plain transformers GPT-2."""
    return {n: p for n, p in model.named_parameters() if ".h." in n and n.endswith("weight") and p.dim() == 2}


def test_row_pruned_artifact_is_smaller_and_loads_in_plain_transformers(trained):
    tmp, artifact = trained
    report = run_prune(prune_cfg(tmp, artifact, mode="row", target=0.5), progress=False)
    assert [r["round"] for r in report["curve"]] == [0, 1, 2]
    final = report["curve"][-1]["artifact"]
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert model.config.n_inner == 128  # half of 4 x 64
    mlp = model.transformer.h[0].mlp
    assert tuple(mlp.c_fc.weight.shape) == (64, 128) and tuple(mlp.c_proj.weight.shape) == (128, 64)
    with torch.no_grad():
        logits = model(torch.randint(0, 512, (2, 16))).logits
    assert logits.shape == (2, 16, 512) and torch.isfinite(logits).all()
    assert report["curve"][-1]["params"] < report["curve"][0]["params"]
    assert report["curve"][-1]["achieved_sparsity"] == pytest.approx(0.5)  # half of the MLP weights removed
    rdir = tmp / "reports" / "p"
    for name in ("prune-row.json", "prune-row.csv", "prune_loss.png", "prune_latency.png", "prune-row-r2.json"):
        assert (rdir / name).is_file(), name
    meta = json.loads((tmp / "runs" / "p" / "prune-row-r2" / "effkit.json").read_text())
    assert meta["stage"] == "prune" and meta["parent"].endswith("prune-row-r1")


def test_weight_masks_stay_zero_through_finetuning_and_sparsity_is_counted(trained):
    tmp, artifact = trained
    report = run_prune(prune_cfg(tmp, artifact, mode="weight", target=0.6), progress=False)
    r1, r2 = (AutoModelForCausalLM.from_pretrained(report["curve"][i]["artifact"]) for i in (1, 2))
    w1, w2 = block_weights(r1), block_weights(r2)
    zeros = sum(int((w == 0).sum()) for w in w2.values())
    total = sum(w.numel() for w in w2.values())
    assert report["curve"][-1]["achieved_sparsity"] == pytest.approx(zeros / total)
    assert 0.59 <= zeros / total <= 0.61
    for name in w1:  # every weight pruned in round 1 is still exactly zero after round 2's fine-tuning
        assert (w2[name][w1[name] == 0] == 0).all(), name
    # embeddings and layer norms are left alone
    assert (r2.transformer.wte.weight != 0).all()


def test_wanda_prunes_the_same_fraction_of_every_row(trained):
    tmp, artifact = trained
    report = run_prune(prune_cfg(tmp, artifact, mode="weight", importance="wanda", target=0.5, rounds=1,
                                 finetune_steps=0), progress=False)
    model = AutoModelForCausalLM.from_pretrained(report["artifact"])
    w = model.transformer.h[0].mlp.c_fc.weight  # Conv1D: (in, out); Linear rows are its columns
    per_row = (w == 0).sum(0)
    assert (per_row == w.shape[0] // 2).all()


def run_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", "prune", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    return exc.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args, needle", [
    (["--target", "0"], "--target must be between 0 and 1"),
    (["--target", "1.5"], "--target must be between 0 and 1"),
    (["--mode", "channel"], "unknown --mode 'channel'"),
    (["--mode", "depth", "--target", "0.9"], "would remove all 2 blocks"),
    (["--mode", "row", "--distill", "--finetune-steps", "0"], "--distill needs fine-tuning steps"),
    (["--from", "/nonexistent/model"], "does not exist"),
])
def test_bad_prune_input(args, needle, trained, capsys, monkeypatch):
    tmp, artifact = trained
    base = ["--runs-dir", str(tmp / "runs"), "--reports-dir", str(tmp / "reports")]
    if "--from" not in args:
        base += ["--from", artifact]
    code, err = run_cli([*base, *args], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_prune_refuses_non_effkit_and_quantized_folders(trained, tmp_path, capsys, monkeypatch):
    tmp, artifact = trained
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    code, err = run_cli(["--from", str(plain)], capsys, monkeypatch)
    assert code == 2 and "not an effkit artifact" in err
    quant = tmp_path / "quant"
    quant.mkdir()
    (quant / "effkit.json").write_text(json.dumps({"stage": "quantize", "parent": artifact, "config": {},
                                                   "metrics": {}}))
    code, err = run_cli(["--from", str(quant)], capsys, monkeypatch)
    assert code == 2 and "is a quantized artifact" in err and len(err.splitlines()) == 1


def test_the_control_arm_is_a_plain_finetune_of_the_parent_and_is_reused(trained):
    from pathlib import Path

    from effkit import artifacts
    from effkit.artifacts import RunLayout
    from effkit.config import DataConfig
    from effkit.model import load_model
    from effkit.parallel import init_runtime
    from effkit.prune.stage import finetune_config
    from effkit.train import finetune

    tmp, artifact = trained
    cfg = prune_cfg(tmp, artifact, mode="row", target=0.5)
    report = run_prune(cfg, progress=False)
    controls = sorted(p.name for p in (tmp / "runs" / "p" / "controls").iterdir())
    assert len(controls) == 2 and all(p.endswith(("-r1", "-r2")) for p in controls)
    for row in report["curve"][1:]:
        d = row["eval_loss_delta_vs_control"]
        assert set(d) >= {"delta", "ci95", "verdict"} and loss_verdict_matches_interval(d)
        assert row["control_eval_loss"] is not None
        # what the fine-tuning alone did to the dense model: it starts at the parent's final learning rate, so
        # the control is not worse than its parent beyond its interval (by held-out document)
        c = row["control_eval_loss_delta_vs_dense"]
        assert c["ci95"][0] <= 0 and c["verdict"] in ("same", "better") and c["documents"] >= 2
        assert c["delta"] == pytest.approx(row["control_eval_loss"] / report["dense"]["eval_loss"] - 1, abs=1e-9)
    saved = json.loads((tmp / "runs" / "p" / "prune-row-r1" / "effkit.json").read_text())["metrics"]
    assert saved["eval_loss_delta_vs_control"] == report["curve"][1]["eval_loss_delta_vs_control"]

    # the same fine-tuning of round 1, done by hand on the unpruned parent
    meta = artifacts.read_meta(Path(artifact))
    layout = RunLayout.of(tmp / "plain-runs", tmp / "plain-reports", "plain")
    plain = finetune(finetune_config(cfg, Path(artifact), meta, DataConfig.from_dict(meta["data"]), 1, layout),
                     load_model(artifact), init_runtime("cpu"), stage="control", tag="plain", parent=artifact,
                     progress=False)
    # the same run to the last rounding: bitwise equality failed once (6.1422261 vs 6.1422234) with the machine
    # loaded by a benchmark beside the suite (the BLAS's dynamic threading reorders sums); another fine-tuning
    # (other steps, data or learning rate) moves the loss by far more than a millionth
    assert plain["metrics"]["eval_loss"] == pytest.approx(report["curve"][1]["control_eval_loss"], rel=1e-5)
    steps = tmp / "reports" / "p" / "controls" / f"{controls[0]}_steps.csv"
    plain_steps = tmp / "plain-reports" / "plain" / "plain_steps.csv"
    assert [float(r["loss"]) for r in csv.DictReader(steps.open())] == pytest.approx(
        [float(r["loss"]) for r in csv.DictReader(plain_steps.open())], rel=1e-5)

    # the weight mode with the same fine-tuning budget reuses the control instead of training it again
    before = {p: p.stat().st_mtime for p in (tmp / "runs" / "p" / "controls").rglob("effkit.json")}
    weight = run_prune(prune_cfg(tmp, artifact, mode="weight", target=0.5), progress=False)
    after = {p: p.stat().st_mtime for p in (tmp / "runs" / "p" / "controls").rglob("effkit.json")}
    assert before == after
    assert weight["curve"][2]["control_eval_loss"] == report["curve"][2]["control_eval_loss"]


def test_no_control_says_the_delta_is_confounded(trained):
    tmp, artifact = trained
    report = run_prune(prune_cfg(tmp, artifact, mode="row", target=0.25, rounds=1, control=False), progress=False)
    assert report["curve"][1]["eval_loss_delta_vs_control"] is None
    assert any("confounded" in v for v in report["verdicts"])


class EveryOtherChannel(RowPruner):
    """A pruning method defined outside effkit: registered, the stage runs it like a built-in one."""

    name = "fake-rows"

    def ranks_by(self, cfg) -> str:
        return "every other channel"


def test_a_registered_pruning_method_runs_through_the_stage(trained):
    tmp, artifact = trained
    methods.register(EveryOtherChannel())
    try:
        report = run_prune(prune_cfg(tmp, artifact, mode="fake-rows", target=0.5, rounds=1, finetune_steps=0,
                                     control=False), progress=False)
    finally:
        methods.unregister("fake-rows")
    assert report["tag"] == "prune-fake-rows" and report["curve"][-1]["artifact"].endswith("prune-fake-rows-r1")
    assert report["protocol"]["importance"] == "every other channel"
    assert AutoModelForCausalLM.from_pretrained(report["curve"][-1]["artifact"]).config.n_inner == 128


def test_a_distilling_control_is_distilled_from_the_same_teacher_not_plainly_fine_tuned(trained):
    from pathlib import Path

    from effkit import artifacts
    from effkit.artifacts import RunLayout
    from effkit.config import DataConfig
    from effkit.model import load_model
    from effkit.parallel import init_runtime
    from effkit.prune.distill import Distiller
    from effkit.prune.stage import finetune_config
    from effkit.train import finetune

    tmp, artifact = trained
    cfg = prune_cfg(tmp, artifact, mode="row", target=0.25, rounds=1, distill=True)
    report = run_prune(cfg, progress=False)
    control = Path(json.loads((Path(report["artifact"]) / "effkit.json").read_text())["metrics"]["control_artifact"])
    assert control.name.endswith("-kd0.5-T2-r1")  # its own cached chain, apart from the plain controls
    assert "the parent's learning rate at its last training step" in report["protocol"]["finetune_lr"]
    steps = [float(r["loss"]) for r in csv.DictReader(
        (tmp / "reports" / "p" / "controls" / f"{control.name}_steps.csv").open())]
    meta = artifacts.read_meta(Path(artifact))
    data = DataConfig.from_dict(meta["data"])
    by_hand = {}
    for name, distilled in (("kd", True), ("plain", False)):
        layout = RunLayout.of(tmp / f"{name}-runs", tmp / f"{name}-reports", name)
        loss = Distiller(load_model(artifact), 0.5, 2.0) if distilled else None
        finetune(finetune_config(cfg, Path(artifact), meta, data, 1, layout), load_model(artifact),
                 init_runtime("cpu"), stage="control", tag=name, parent=artifact, loss=loss, progress=False)
        by_hand[name] = [float(r["loss"]) for r in csv.DictReader(
            (tmp / f"{name}-reports" / name / f"{name}_steps.csv").open())]
    assert steps == by_hand["kd"]  # the same loss, step for step
    assert steps != by_hand["plain"]  # and not a plain fine-tune


# ----------------------------------------------------------------- --width-multiple (#44): widths engines can store
def with_options(mode, target, **options):
    """A prune config for applying a method directly: the methods' options (`width_multiple`) are flat keys of the
    stage's config like any flag's (its `options` section), read by the method with `options_of`."""
    return PruneConfig.from_flat(fixed_rounds=True, mode=mode, target=target, **options)


def test_row_pruning_keeps_a_multiple_of_32_mlp_channels_by_default_the_best_by_norm():
    """llama.cpp's Q8_0/Q4_0 store c_proj's rows in blocks of 32: 30% off gpt2-nano's 256 channels leaves 179.2,
    which is 179 unrounded and 192 at the default multiple."""
    from effkit.model import build_model
    from effkit.prune.row import PRUNER

    torch.manual_seed(0)
    model = build_model("gpt2-nano", 512)
    fc0 = [b.mlp.c_fc.weight.detach().clone() for b in model.transformer.h]
    cfg = with_options("row", 0.3)
    assert PRUNER.plan(cfg, model)["n_inner"].startswith("256 -> 192 (a multiple of --width-multiple 32; 25.0% ")
    model, done, _ = PRUNER.start(cfg, model)(model, 0.3, None)
    assert model.config.n_inner == 192 and {b.mlp.c_fc.out_features for b in model.transformer.h} == {192}
    assert {b.mlp.c_proj.in_features for b in model.transformer.h} == {192}
    # the round's report: the rounded width and the fraction it reached (not the 30% asked)
    assert done == {"n_inner": 192, "removed_channels": 64, "width_multiple": 32, "target": 0.3,
                    "fraction_reached": 0.25}
    for w0, block in zip(fc0, model.transformer.h, strict=True):  # the count is rounded, the choice is as before
        assert torch.equal(block.mlp.c_fc.weight, w0[w0.norm(dim=1).topk(192).indices.sort().values])


def test_a_width_multiple_of_1_gives_back_the_unrounded_mlp_width():
    from effkit.model import build_model
    from effkit.prune.row import PRUNER

    model = build_model("gpt2-nano", 512)
    cfg = with_options("row", 0.3, width_multiple=1)
    model, done, _ = PRUNER.start(cfg, model)(model, 0.3, None)
    assert model.config.n_inner == done["n_inner"] == 179 == round(256 * 0.7)  # the count effkit kept before


@pytest.mark.parametrize("bad", [0, -32, True, 2.5])
def test_a_bad_width_multiple_is_one_line(bad):
    from effkit.errors import EffkitError
    from effkit.prune.structure import Options, kept_width
    from effkit.prune.width import valid_width

    for make in (lambda: Options(width_multiple=bad), lambda: kept_width(256, 0.3, bad, "an MLP width"),
                 lambda: valid_width(64, 2, 0.3, bad)):
        with pytest.raises(EffkitError) as e:
            make()
        assert str(e.value).startswith("--width-multiple must be a whole number of channels, 1 or more (got ")
        assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("mode, target, options, says", [
    ("row", 0.05, {}, "--target 0.05 removes no MLP channel of 256 once rounded to a multiple of 32"),  # 243.2 -> 256
    ("row", 0.3, {"width_multiple": 512}, "an MLP width of 256 holds no multiple of 512"),
    ("width", 0.2, {}, "--target 0.2 removes no residual channel of 64 once rounded"),  # 51.2 -> 64
    ("width", 0.3, {"width_multiple": 128}, "a residual width of 64 holds no multiple of 128"),
])
def test_a_target_the_rounding_leaves_nothing_to_cut_or_nothing_to_keep_is_refused_by_the_plan(mode, target, options,
                                                                                              says):
    """`plan` runs before anything is written: a rounded width that cuts nothing or cannot exist is one line."""
    from effkit.errors import EffkitError
    from effkit.model import build_model

    with pytest.raises(EffkitError) as e:
        methods.get(mode).plan(with_options(mode, target, **options), build_model("gpt2-nano", 512))
    assert says in str(e.value) and len(str(e.value).splitlines()) == 1


def test_width_multiple_is_a_flag_of_prune_with_its_default():
    """Declared once (`effkit.prune.options.Options`): `effkit prune --help` lists it with its default and help."""
    import dataclasses

    import typer.main
    from typer.testing import CliRunner

    from effkit.config import flat_fields
    from effkit.prune.options import Options

    out = CliRunner().invoke(cli.app, ["prune", "--help"], env={"COLUMNS": "250"})
    assert out.exit_code == 0
    line = out.output[out.output.index("--width-multiple"):]
    assert "[default: 32]" in line[:line.index("│ --")]  # on its own help, before the next flag's
    param = next(p for p in typer.main.get_command(cli.app).commands["prune"].params if p.name == "width_multiple")
    assert param.opts == ["--width-multiple"] and param.default == 32
    assert flat_fields(PruneConfig)["width_multiple"][0] is dataclasses.fields(Options)[0]  # the one declaration


def test_a_recipes_width_multiple_reaches_the_method_and_a_flag_overrides_it(tmp_path):
    from effkit.config import build_config, load_recipe
    from effkit.prune.methods import options_of
    from effkit.prune.options import Options

    recipe = tmp_path / "r.toml"
    recipe.write_text("[prune]\nmode = 'width'\nwidth_multiple = 1\n")
    assert load_recipe(recipe)["prune"] == {"mode": "width", "width_multiple": 1}
    cfg = build_config(PruneConfig, str(recipe), {})
    assert options_of(cfg, Options) == Options(width_multiple=1) and cfg.to_dict()["width_multiple"] == 1
    assert options_of(build_config(PruneConfig, str(recipe), {"width_multiple": 64}), Options).width_multiple == 64
    assert options_of(PruneConfig(), Options).width_multiple == 32  # the default, where nothing sets it
    assert PruneConfig.from_dict(cfg.to_dict()) == cfg  # saved flat in the artifact and the report, read back


def test_the_width_multiple_flag_reaches_the_row_pruner(trained, capsys, monkeypatch):
    """30% off gpt2-nano's 256 MLP channels: 179 kept with --width-multiple 1 (no multiple of 32), 192 by default."""
    tmp, artifact = trained
    base = ["--from", artifact, "--mode", "row", "--target", "0.3", "--rounds", "1", "--finetune-steps", "0",
            "--no-control", "--no-distill", "--fixed-rounds", "--latency-rounds", "2", "--latency-repeats", "1",
            "--runs-dir", str(tmp / "runs"), "--reports-dir", str(tmp / "reports")]
    for extra, n_inner in ((["--width-multiple", "1"], 179), ([], 192)):
        code, err = run_cli([*base, *extra], capsys, monkeypatch)
        assert code in (0, None), err
        report = json.loads((tmp / "reports" / "p" / "prune-row.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(report["curve"][-1]["artifact"])
        assert model.config.n_inner == n_inner and (n_inner % 32 == 0) == (not extra)
        assert report["config"]["width_multiple"] == (1 if extra else 32)


@pytest.mark.parametrize("value, needle", [
    ("0", "--width-multiple must be a whole number of channels, 1 or more (got 0)"),
    ("-1", "--width-multiple must be a whole number of channels, 1 or more (got -1)"),
    ("true", "Invalid value for '--width-multiple'"),
    ("2.5", "Invalid value for '--width-multiple'"),
])
def test_a_bad_width_multiple_flag_is_one_line_and_exit_2(value, needle, tmp_path, capsys, monkeypatch):
    """Refused with the config, before the source is even looked at."""
    code, err = run_cli(["--from", str(tmp_path / "missing"), "--width-multiple", value, "--runs-dir",
                         str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("effkit: error:") and needle in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value, needle", [
    ("0", "[prune]: --width-multiple must be a whole number of channels, 1 or more (got 0)"),
    ("-1", "[prune]: --width-multiple must be a whole number of channels, 1 or more (got -1)"),
    ("true", "[prune]: width_multiple must be int (got True)"),
    ("2.5", "[prune]: width_multiple must be int (got 2.5)"),
])
def test_a_bad_width_multiple_in_a_recipe_is_one_line_and_exit_2(value, needle, tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[prune]\nwidth_multiple = {value}\n")
    code, err = run_cli(["--recipe", str(recipe), "--from", str(tmp_path / "missing")], capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and str(recipe) in err, err


def test_the_registry_names_each_builtin_methods_own_options_without_importing_it():
    """`PRUNERS.options` reads a built-in method's options from the registry's table, without the method's module
    (torch): the same class the method names as its `options` (None for those with none); the config's section,
    its flags and recipe validation import no torch."""
    import subprocess

    from effkit.registry import PRUNERS

    for name in PRUNERS.builtin:
        assert PRUNERS.options(name) is getattr(methods.get(name), "options", None), name
    code = ("import sys\nfrom effkit.config import PruneConfig, flat_fields\nfrom effkit.registry import PRUNERS\n"
            "assert flat_fields(PruneConfig)['width_multiple'][0].default == 32\n"
            "assert PruneConfig.from_flat(width_multiple=1).options.width_multiple == 1\n"
            "assert [n for n in PRUNERS.builtin if PRUNERS.options(n)] == ['row', 'width', 'draft']\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "NO-TORCH", out.stderr[-2000:]


def test_a_registered_methods_options_are_flat_keys_of_the_prune_config():
    """A method registered at run time names its options as a built-in one does; its module is read for them."""
    from dataclasses import dataclass, field

    from effkit.config import flat_fields
    from effkit.prune.methods import options_of

    @dataclass(frozen=True)
    class EveryNth:
        every: int = field(default=2, metadata={"help": "keep every n-th channel"})

    class Nth(RowPruner):
        name = "fake-nth"
        options = EveryNth

    methods.register(Nth())
    try:
        assert flat_fields(PruneConfig)["every"][0].default == 2
        cfg = PruneConfig.from_flat(mode="fake-nth", every=3, width_multiple=64)
        assert options_of(cfg, EveryNth) == EveryNth(3) and cfg.options.width_multiple == 64
    finally:
        methods.unregister("fake-nth")
    assert "every" not in flat_fields(PruneConfig)


def test_the_memory_plan_is_made_before_anything_and_one_that_does_not_fit_stops_the_stage(trained, capsys,
                                                                                          monkeypatch):
    """#47: `prune --plan` prints the predicted peak with its parts and writes nothing; a plan that does not fit
    stops the stage in one line, exit 2, before anything is written, unless --force; a run reports the plan it made
    beside the peak it measured."""
    from effkit import memplan

    tmp, artifact = trained
    runs, reports = tmp / "plan-runs", tmp / "plan-reports"
    base = ["--from", artifact, "--mode", "row", "--target", "0.3", "--rounds", "1", "--finetune-steps", "2",
            "--batch-size", "2", "--fixed-rounds", "--latency-rounds", "2", "--latency-repeats", "1",
            "--runs-dir", str(runs), "--reports-dir", str(reports)]
    monkeypatch.setattr(sys, "argv", ["effkit", "prune", "--plan", *base])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr().out
    assert exc.value.code in (0, None) and "memory plan: effkit prune" in out and "plan: fits" in out
    assert "teacher: the dense parent" in out and "fine-tuning (the control arm's): optimizer" in out
    assert not runs.exists() and not reports.exists()
    monkeypatch.setattr(memplan, "device_memory", lambda device: ("a 1 MiB machine", 2**20))
    code, err = run_cli(base, capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("effkit: error: prune: predicted peak"), err
    assert "does not fit: not even with --no-control --optim adamw8bit --batch-size 1" in err, err
    assert "--force runs it anyway" in err
    assert not runs.exists() and not reports.exists()  # nothing written
    code, err = run_cli([*base, "--force"], capsys, monkeypatch)
    assert code in (0, None), err
    report = json.loads((reports / "p" / "prune-row-distill.json").read_text())
    mem = report["memory"]
    assert mem["plan"]["fits"] is False and mem["plan"]["verdict"].startswith("does not fit")
    assert mem["measured_peak_bytes"] > 0 and mem["measured_how"].startswith("cpu RSS")
    parts = mem["plan"]["parts_bytes"]
    assert parts["teacher: the dense parent (frozen, fp32)"] == parts["fine-tuning (the control arm's): parameters"]
    assert sum(parts.values()) == mem["plan"]["total_bytes"]
    # the student after round 1's cut, from the shapes alone: the size the round reports
    assert parts["student: its copy after round 1's cut"] == 4 * report["curve"][1]["params"]
    mapped = [k for k in parts if k.startswith("the weights' file, mapped")]  # clean pages: not what must fit
    assert mem["plan"]["reclaimable_parts"] == mapped and len(mapped) == 1
    assert mem["plan"]["required_bytes"] == mem["plan"]["total_bytes"] - parts[mapped[0]]
    # a machine between the plan with every trick and the plan as asked: the plan names the tricks that fit
    monkeypatch.setattr(memplan, "device_memory",
                        lambda device: ("this machine", int(mem["plan"]["required_bytes"] / 0.9 * 0.8)))
    cfg = PruneConfig.from_flat(source=artifact, mode="row", target=0.3, rounds=1, finetune_steps=2, batch_size=2,
                                runs_dir=str(runs), reports_dir=str(reports))
    from effkit.prune.stage import prune_plan

    verdict = prune_plan(cfg.validate()).verdict()
    assert verdict.startswith("does not fit: it would with --no-control") and "GiB predicted" in verdict, verdict


def test_the_plan_refuses_a_folder_of_pickled_weights_as_prune_does(trained, capsys, monkeypatch, tmp_path):
    """A folder holding only pickled weights: `prune --plan` says what `prune` says (one line, exit 2), never
    "fits" for a folder the stage will refuse."""
    import shutil

    from safetensors.torch import load_file

    _, artifact = trained
    folder = tmp_path / "pickled"
    shutil.copytree(artifact, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    base = ["--from", str(folder), "--runs-dir", str(tmp_path / "runs"), "--reports-dir", str(tmp_path / "reports")]
    for args in (["--plan", *base], base):
        code, err = run_cli(args, capsys, monkeypatch)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "holds no .safetensors weights; effkit never loads pickled weights" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "reports").exists()
