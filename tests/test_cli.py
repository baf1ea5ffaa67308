"""Bad input ends in one line on stderr, exit code 2, no traceback, and no half-written artifact."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from effkit import cli
from effkit.errors import EffkitError


def run_cli(args, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["effkit", *args])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


def tiny(tmp_path, corpus_dir, *extra):
    return ["train", "--model", "gpt2-nano", "--data", str(corpus_dir), "--vocab-size", "512", "--block-size", "32",
            "--eval-blocks", "4", "--batch-size", "4", "--max-steps", "2", "--warmup-steps", "1",
            "--runs-dir", str(tmp_path / "runs"), "--reports-dir", str(tmp_path / "reports"),
            "--run-name", "bad", *extra]


def assert_clean_failure(code, err, tmp_path, needle):
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("effkit: error:") and needle in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "bad" / "train").exists()
    assert not list((tmp_path / "runs").glob("bad/.tmp-*")) if (tmp_path / "runs").exists() else True


@pytest.mark.parametrize("extra, needle", [
    (["--model", "gpt2-huge"], "unknown model preset 'gpt2-huge'"),
    (["--block-size", "256"], "larger than the model's context (128)"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--max-steps", "-3"], "--max-steps must be >= 0"),
    (["--parallel", "pipeline"], "unknown --parallel 'pipeline'"),
    (["--batch-size", "999999999999"], "fewer than one global batch"),  # before the precision probe allocates it
    (["--amp", "--amp-dtype", "fp16"], "fp16 autocast does nothing on CPU"),
    (["--checkpoint-interval", "-1"], "--checkpoint-interval must be >= 0 (got -1)"),
    (["--heldout-fraction", "1"], "--heldout-fraction must be between 0 and 1, both excluded (got 1.0)"),
    (["--amp-dtype", "fp8"], "unknown --amp-dtype 'fp8'; choose one of bf16, fp16"),
    (["--microbatches", "0"], "--microbatches must be at least 1"),
    (["--optim", "sgd"], "unknown --optim 'sgd'; choose one of adamw, adamw-fused, adamw8bit"),
    (["--fit"], "--fit goes with --plan"),
])
def test_bad_options(extra, needle, tmp_path, corpus_dir, capsys, monkeypatch):
    code, err = run_cli(tiny(tmp_path, corpus_dir, *extra), capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, needle)


def test_missing_data_path(tmp_path, corpus_dir, capsys, monkeypatch):
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--data", str(tmp_path / "nope")), capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, "does not exist")


def test_empty_data_folder(tmp_path, corpus_dir, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--data", str(tmp_path / "empty")), capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, "holds no .txt files")


def test_file_without_text(tmp_path, corpus_dir, capsys, monkeypatch):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n \n")
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--data", str(blank)), capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, "contains no text")


def test_recipe_with_unknown_key(tmp_path, corpus_dir, capsys, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nmodel = 'gpt2-nano'\nlearning_rate = 0.1\n")
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--recipe", str(recipe)), capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, "unknown key 'learning_rate' in [train]")
    assert str(recipe) in err


def test_recipe_values_apply_and_flags_override(tmp_path, corpus_dir, monkeypatch):
    from effkit.config import TrainConfig, build_config

    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nmodel = 'gpt2-nano'\nlr = 0.01\nbatch_size = 3\n")
    cfg = build_config(TrainConfig, str(recipe), {"batch_size": 5})
    assert (cfg.model.name, cfg.optim.lr, cfg.optim.batch_size, cfg.data.block_size) == ("gpt2-nano", 0.01, 5, 128)


@pytest.mark.slow
def test_truncated_checkpoint_on_resume(tmp_path, corpus_dir, capsys, monkeypatch):
    code, _ = run_cli(tiny(tmp_path, corpus_dir, "--checkpoint-interval", "1", "--run-name", "ck"),
                      capsys, monkeypatch)
    assert code in (0, None)
    last = tmp_path / "runs" / "ck" / "checkpoints" / "last"
    state = (last / "state.json").read_text()
    (last / "state.json").write_text("{}")  # readable, but holds nothing to resume from
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--resume", "--run-name", "ck"), capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "state.json has no step, optimizer" in err, err
    (last / "state.json").write_text(state)
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--resume", "--run-name", "ck"), capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "nothing to resume: run 'ck' finished its 2 steps" in err, err
    weights = last / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--resume", "--run-name", "ck"), capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "unreadable or truncated" in err, err


def test_a_wrong_type_in_the_recipe_is_refused_even_when_a_flag_overrides_it(tmp_path, corpus_dir, capsys,
                                                                              monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nmodel = 'gpt2-nano'\nmax_steps = 'five'\n")
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--recipe", str(recipe), "--max-steps", "2"), capsys,
                        monkeypatch)
    assert_clean_failure(code, err, tmp_path, "max_steps must be int (got 'five')")


def test_entry_point_exit_code_and_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "effkit", "train", "--model", "nope", "--runs-dir",
                          str(tmp_path / "runs")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "effkit: error: unknown model preset 'nope'; choose one of gpt2-nano, gpt2-micro, gpt2-mini, gpt2, "
        "gpt2-medium, gpt2-large, gpt2-xl, or give a Hugging Face model folder"]


def test_help_lists_every_command():
    from typer.testing import CliRunner

    out = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0
    for command in ("train", "prune", "quantize", "bench", "report", "generate", "run", "study", "doctor"):
        assert f" {command} " in out.output, command


def test_train_help_shows_defaults():
    from typer.testing import CliRunner

    out = CliRunner().invoke(cli.app, ["train", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0
    assert "gpt2-mini" in out.output and "--activation-checkpointing" in out.output and "--parallel" in out.output


def test_doctor_reports_this_machine():
    from typer.testing import CliRunner

    out = CliRunner().invoke(cli.app, ["doctor"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "gloo" in out.output and "int8 backend dynamic" in out.output and "GFLOP/s" in out.output


@pytest.mark.parametrize("name", ["../x", "/abs/path", "latest", "a/b", "..", ".hidden", ""])
def test_run_names_cannot_leave_the_runs_folder(name, tmp_path, corpus_dir, capsys, monkeypatch):
    args = tiny(tmp_path, corpus_dir)
    args[args.index("--run-name") + 1] = name
    if name == "":  # an empty name means: make one up; refused only as a recipe value of `effkit run`
        recipe = tmp_path / "r.toml"
        recipe.write_text('[run]\nrun_name = ""\n')
        args = ["run", str(recipe)]
    code, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and "not a plain name" in err, err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def test_a_recipe_run_name_outside_runs_is_refused_before_anything_is_deleted(tmp_path, capsys, monkeypatch):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[run]\nrun_name = "../victim"\nruns_dir = "{tmp_path / "runs"}"\n')
    code, err = run_cli(["run", "--force", str(recipe)], capsys, monkeypatch)
    assert code == 2 and "not a plain name" in err
    assert (victim / "precious.txt").read_text() == "keep me"


def test_output_folder_that_is_a_file_fails_before_training(tmp_path, corpus_dir, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    code, err = run_cli(tiny(tmp_path, corpus_dir, "--reports-dir", str(afile)), capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, "is a file, not a folder")


@pytest.mark.slow
def test_one_process_per_run_and_a_stale_lock_is_taken_over(tmp_path, corpus_dir, capsys, monkeypatch):
    args = tiny(tmp_path, corpus_dir)
    args[args.index("--run-name") + 1] = "busy"
    # the lock's owner is another process; the later invocations run here (the lock, not a launch, is what is tested)
    first = subprocess.Popen([sys.executable, "-m", "effkit", *args, "--max-steps", "100000"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = tmp_path / "runs" / "busy" / ".lock"
    deadline = time.monotonic() + 120
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        code, err = run_cli(args, capsys, monkeypatch)
    finally:
        first.kill()
        first.wait()
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and f"in use by process {first.pid}" in lines[0], lines
    assert lock.exists()  # left behind by the killed process: stale
    (tmp_path / "runs" / "busy" / ".tmp-train-killedwrite").mkdir()
    code, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err[-1500:]
    assert not lock.exists() and not list((tmp_path / "runs" / "busy").glob(".tmp-*"))


@pytest.mark.parametrize("delay", [0.0, 1.2])
def test_ctrl_c_while_libraries_load_ends_in_one_line(delay, tmp_path, corpus_dir):
    import signal

    # a child inherits an ignored SIGINT (a background job, nohup): give it the default, as a terminal would
    proc = subprocess.Popen([sys.executable, "-m", "effkit", *tiny(tmp_path, corpus_dir, "--max-steps", "500")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # count from torch's first mapped library (the guard is installed before it) so a loaded machine's slow
    # interpreter start-up cannot move the signal before effkit's guard; the imports take longer than `delay`
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 60
    while maps.exists() and "torch" not in maps.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("effkit: interrupted"), err[-2000:]


def test_ctrl_c_while_torch_imports_waits_for_the_import_to_finish(tmp_path):
    """A KeyboardInterrupt raised inside torch's import can abort the process (SIGABRT) from torch's C++: effkit's
    handler holds it until the import is over. A stand-in package named torch sleeps in its import."""
    import signal

    (tmp_path / "pkg" / "torch").mkdir(parents=True)
    (tmp_path / "pkg" / "torch" / "__init__.py").write_text(
        "import time\nopen(__file__ + '.started', 'w').close()\ntime.sleep(1.0)\nFINISHED = True\n")
    script = ("import sys\nsys.path.insert(0, sys.argv[1])\n"
              "from effkit.errors import watch_interrupts\nwatch_interrupts()\n"
              "try:\n    import torch\n    import time\n    time.sleep(30)\n"
              "except KeyboardInterrupt:\n    print('finished' if getattr(sys.modules.get('torch'), 'FINISHED', 0) "
              "else 'cut short')\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "pkg")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    started = tmp_path / "pkg" / "torch" / "__init__.py.started"
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "finished", (out, err)


def test_nested_stage_configs_keep_their_flat_keys_and_every_one_is_a_flag():
    import typer.main

    from effkit.config import STAGES, PruneConfig, QuantizeConfig, TrainConfig

    group = typer.main.get_command(cli.app)
    for stage, cls in STAGES.items():
        keys = set(cls.flat_defaults())
        if stage in ("run", "train"):  # `effkit run`'s table is recipe-only; train has recipe-only keys too
            continue
        params = {p.name for p in group.commands[stage].params}  # options, and bench's paths argument
        assert keys <= params, (stage, keys - params)
    cfg = PruneConfig.from_flat(mode="width", target=0.25, finetune_steps=3, runs_dir="elsewhere")
    assert (cfg.method.mode, cfg.method.target, cfg.finetune.finetune_steps, cfg.folders.runs_dir) == \
        ("width", 0.25, 3, "elsewhere")
    assert PruneConfig.from_dict(cfg.to_dict()) == cfg and "method" not in cfg.to_dict()  # saved flat, as before
    assert cfg.replace(rounds=5).method.rounds == 5 and cfg.method.rounds == 3
    q = QuantizeConfig.from_flat(backend="dynamic", compile=True)
    assert (q.method.backend, q.measure.compile) == ("dynamic", True)
    with pytest.raises(EffkitError, match="unknown quantize option 'mode'"):
        q.replace(mode="row")
    assert set(TrainConfig.flat_defaults()) >= {"lr", "parallel", "optim"}
    # train's sections on the same mechanism: flat keys (a renamed field's among them), saved by section
    t = TrainConfig.from_flat(data="corpus", model="gpt2-nano", parallel="ddp", lr=0.01)
    assert (t.data.source, t.model.name, t.parallel.mode, t.optim.lr) == ("corpus", "gpt2-nano", "ddp", 0.01)
    assert t.to_dict()["data"]["source"] == "corpus" and TrainConfig.from_dict(t.to_dict()) == t
    assert t.replace(optim=t.optim.replace(lr=0.5)).optim.lr == 0.5 == t.with_flat(lr=0.5).optim.lr
    with pytest.raises(EffkitError, match="unknown train option 'source'"):
        t.with_flat(source="x")


def _outside(f):
    """A value outside a field's declared range, or None where it declares none."""
    m = f.metadata
    if "ge" in m or "gt" in m:
        return m.get("ge", m.get("gt")) - (1 if "ge" in m else 0)
    if "le" in m or "lt" in m:
        return m.get("le", m.get("lt")) + (1 if "le" in m else 0)
    return None


def test_every_declared_choice_and_range_is_checked_in_one_line_naming_the_flag():
    """A stage's `validate` refuses a value outside its field's `choices` or range (`ge`, `gt`, `le`, `lt` in the
    metadata), for every field of every stage, naming the flag and what it accepts."""
    from effkit.config import STAGES, check_fields, field_choices, flat_fields

    checked = 0
    for stage, cls in STAGES.items():
        for key, (f, kind) in flat_fields(cls).items():
            flag = "--" + key.replace("_", "-")
            if field_choices(f):
                bad = "no-such-choice"
                says = f"unknown {flag} 'no-such-choice'; choose one of {', '.join(map(str, field_choices(f)))}"
            elif (bad := _outside(f)) is not None:
                bad = float(bad) if kind is float else bad
                says = f"{flag} must be "
            else:
                continue
            for validate in (check_fields, lambda cfg: cfg.validate()):
                with pytest.raises(EffkitError) as e:
                    validate(cls.from_flat(**{key: bad}))
                assert str(e.value).startswith(says), (stage, key, str(e.value))
                assert "choose" in says or str(e.value).endswith(f"(got {bad})"), (stage, key, str(e.value))
            checked += 1
    assert checked >= 40  # train's ranges and choices among them, not only the plug-ins'


def test_ranges_read_as_the_flag_and_the_bounds():
    from effkit.config import PruneConfig, QuantizeConfig, TrainConfig

    for cfg, says in [(TrainConfig.from_flat(batch_size=0), "--batch-size must be at least 1 (got 0)"),
                      (TrainConfig.from_flat(lr=0.0), "--lr must be a finite number > 0 (got 0.0)"),
                      (TrainConfig.from_flat(vocab_size=10), "--vocab-size must be between 300 and 1000000 (got 10)"),
                      (TrainConfig.from_flat(dropout=1.0), "--dropout must be between 0 and 1, 1 excluded (got 1.0)"),
                      (PruneConfig.from_flat(precision=float("nan")), "--precision must be between 0 and 1, both "
                       "excluded (got nan)"),
                      (PruneConfig.from_flat(scope="rows"), "unknown --scope 'rows'; choose one of global, layer"),
                      (QuantizeConfig.from_flat(latency_rounds=1), "--latency-rounds must be at least 2 (got 1)")]:
        with pytest.raises(EffkitError) as e:
            cfg.validate()
        assert str(e.value) == says


# what a stage command declares besides its config's fields (typer's --help aside)
NON_STAGE_PARAMS = {"train": {"recipe", "plan", "fit"}, "prune": {"recipe", "plan"}, "quantize": {"recipe", "plan"},
                    "export": {"recipe", "plan"}, "bench": {"recipe", "json_out", "plan"}}


def test_every_stage_flag_is_its_config_field_declared_once():
    """#43: a stage command's flags are its config's fields, made by `with_stage_options`: the same keys as the
    recipe's (`flat_defaults`), the flag names and boolean forms the field declares, its default and its help
    (never empty), and nothing else but the declared extras."""
    import typer.main

    from effkit.config import STAGES, bool_field, field_help, flat_defaults, flat_fields

    group = typer.main.get_command(cli.app)
    assert set(STAGES) - {"run"} == set(NON_STAGE_PARAMS)  # `effkit run`'s table is recipe-only
    for stage, extras in NON_STAGE_PARAMS.items():
        cls, params = STAGES[stage], {p.name: p for p in group.commands[stage].params}
        fields = flat_fields(cls)
        assert set(fields) == set(flat_defaults(cls)), stage  # recipe keys and fields agree
        flags = {key for key, (f, _) in fields.items() if f.metadata.get("cli", True)}
        assert set(params) == flags | extras, (stage, set(params) ^ (flags | extras))
        for key in flags:
            (f, kind), p = fields[key], params[key]
            assert field_help(f).strip() and p.help == field_help(f), (stage, key)
            if f.metadata.get("argument"):
                assert p.opts == [key] and p.nargs == -1, (stage, key)
                continue
            dashed = key.replace("_", "-")
            declared = f.metadata.get("flag") or (f"--{dashed}/--no-{dashed}" if bool_field(kind) else f"--{dashed}")
            assert "/".join([*p.opts, *p.secondary_opts]) == declared, (stage, key)
            assert p.default == flat_defaults(cls)[key] == f.default, (stage, key)
            assert p.show_default == f.metadata.get("show_default", True), (stage, key)
        recipe_only = set(fields) - flags
        assert recipe_only == ({"warmup_steps_excluded", "profile"} if stage == "train" else set()), stage
    train, bench = group.commands["train"].params, group.commands["bench"].params
    opts = {p.name: [*p.opts, *p.secondary_opts] for p in [*train, *bench, *group.commands["prune"].params]}
    assert opts["resume"] == ["--resume"] and opts["cpu_offload"] == ["--cpu-offload"]  # no --no- form
    assert opts["amp"] == ["--amp", "--no-amp"] and opts["fixed_rounds"] == ["--fixed-rounds", "--sequential"]
    assert opts["source"] == ["--from"] and opts["model"] == ["--model"] and opts["parallel"] == ["--parallel"]


# the commands whose options are one dataclass's fields, and what each declares besides them
OPTION_CLASSES = {"generate": ("GenerateConfig", set()), "study": ("StudyConfig", {"name"}),
                  "report": ("Folders", {"run"})}


def test_every_option_is_declared_once():
    """`generate`, `study` and `report` take their flags from a dataclass as the stages do (default, type and help
    from its fields); `--plan` is one declaration, the same on every command that has it."""
    import typer.main

    from effkit import config
    from effkit.config import field_help, flat_fields

    group = typer.main.get_command(cli.app)
    for command, (name, extras) in OPTION_CLASSES.items():
        fields = flat_fields(getattr(config, name))
        params = {p.name: p for p in group.commands[command].params}
        flags = {key for key, (f, _) in fields.items() if f.metadata.get("cli", True)}
        assert set(params) == flags | extras, (command, set(params) ^ (flags | extras))
        for key in flags:
            f = fields[key][0]
            assert params[key].default == f.default and params[key].help == field_help(f), (command, key)
    plans = {name: p.help for name, c in group.commands.items() for p in c.params if p.name == "plan"}
    assert set(plans) == {"train", "prune", "quantize", "export", "bench", "run"} and len(set(plans.values())) == 1


def test_library_import_notices_are_silenced_at_import_and_real_errors_still_show():
    """torchao's notices about optional CUDA kernels and its enum registration (printed after effkit's last line
    when a library imported it late) are dropped when effkit is imported; anything else those loggers say shows."""
    code = ("import logging\nimport effkit\nimport torch\nimport torchao\n"
            "logging.getLogger('torchao').warning('torchao says something else')\n"
            "logging.getLogger('torchao').error('Failed to load x.so: a real error')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == ["torchao says something else", "Failed to load x.so: a real error"], out.stderr


@pytest.mark.parametrize("flags, needle", [
    # the PyTorch engine has no peer row: asking for it wrote none and passed
    (["--peers", "--peer-engines", "pytorch"],
     "engine 'pytorch' in --peer-engines has no peer row; choose among ctranslate2, onnxruntime, openvino, llamacpp"),
    # without --peers the engines were silently ignored
    (["--peer-engines", "ctranslate2"], "--peer-engines chooses among the peer rows: add --peers"),
    (["--no-peers", "--peer-engines", "onnxruntime"], "--peer-engines chooses among the peer rows: add --peers"),
])
def test_peer_engines_that_would_give_no_peer_row_are_refused(flags, needle, tmp_path, capsys, monkeypatch):
    code, err = run_cli(["bench", *flags, "--runs-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, needle)


def test_a_recipes_peer_engines_need_peers_only_where_peers_are_off(tmp_path, capsys, monkeypatch):
    """`effkit run` turns peers on when its recipe leaves them unset, so there `peer_engines` alone is valid; with
    `peers = false` (and in `effkit bench`, where unset is off) it is refused like the flag."""
    recipe = tmp_path / "r.toml"
    head = f'[run]\nruns_dir = "{tmp_path / "runs"}"\nreports_dir = "{tmp_path / "reports"}"\n[bench]\n' \
           'peer_engines = "ctranslate2"\n'
    recipe.write_text(head)
    monkeypatch.setattr(sys, "argv", ["effkit", "run", "--dry-run", str(recipe)])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out = capsys.readouterr()
    assert exc.value.code in (0, None) and "with the peer engines" in out.out, out.out + out.err
    code, err = run_cli(["bench", "--recipe", str(recipe), "--runs-dir", str(tmp_path / "runs")], capsys,
                        monkeypatch)
    assert_clean_failure(code, err, tmp_path, "--peer-engines chooses among the peer rows: add --peers")
    recipe.write_text(head + "peers = false\n")
    code, err = run_cli(["run", str(recipe), "--dry-run"], capsys, monkeypatch)
    assert_clean_failure(code, err, tmp_path, "--peer-engines chooses among the peer rows: add --peers")
