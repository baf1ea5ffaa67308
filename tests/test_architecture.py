"""The shape of the package: imports only point down (cli -> stages -> core), no import cycles (function-level
imports counted), `effkit --help` stays free of torch, and every tensor effkit creates for a model lands on
that model's device (checked on the `meta` device, the closest a GPU-less machine comes to a CPU/GPU mix-up)."""

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

import effkit
from effkit.measure import evaluation, hardware, timing
from effkit.model import build_model
from effkit.prune.row import prune_mlp_channels
from effkit.prune.weight import apply_masks, compute_masks
from effkit.registry import BACKENDS, ENGINES, PRUNERS, STUDIES
from effkit.registry import STAGES as STAGES_REG

PACKAGE = Path(effkit.__file__).parent
# The layers, bottom up: a module imports only from its own layer or a lower one (module level or inside a
# function). A plug-in (engine, backend, pruning method, optimizer, stage) is reached from below only through
# `effkit.registry`, which imports it by name when asked for it.
LAYERS = [
    ("base", {"effkit", "effkit.errors", "effkit.registry", "effkit.workloads", "effkit.quiet"}),
    ("config", {"effkit.config"}),
    ("core", {"effkit.artifacts", "effkit.data", "effkit.model", "effkit.parallel", "effkit.measure", "effkit.report",
              "effkit.checkpoint", "effkit.child", "effkit.optim", "effkit.memplan", "effkit.stageplan",
              "effkit.stage"}),
    ("engines", {"effkit.engines"}),
    ("plug-ins", {"effkit.quantize", "effkit.quantize.backends", "effkit.prune"}),
    ("stages", {"effkit.train", "effkit.prune.stage", "effkit.quantize.stage", "effkit.export", "effkit.bench",
                "effkit.studies", "effkit.worker"}),
    ("run", {"effkit.pipeline", "effkit.runplan"}),
    ("console", {"effkit.console"}),  # what the commands print (reads the stages' reports and formatters)
    ("entry", {"effkit.cli", "effkit.__main__"}),
]
ENTRY = LAYERS[-1][1]
STAGES = LAYERS[5][1]  # a stage is a module or a package (effkit.studies: its shared module and one per study)
# the one stage a stage may call: prune fine-tunes with train's loop; studies and the training worker run training
MAY_CALL = {"effkit.prune.stage": {"effkit.train"}, "effkit.studies": {"effkit.train"},
            "effkit.worker": {"effkit.train"}}


def layer(name: str) -> int:
    """The rank of a module: its own entry or that of the longest package that holds it."""
    best, rank = "", None
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (name == m or name.startswith(m + ".")) and len(m) > len(best):
                best, rank = m, i
    if rank is None:
        raise KeyError(f"{name} is in no layer: add it to LAYERS")
    return rank


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """module -> the effkit modules it imports, anywhere in the file (module level or inside functions)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.split(".")[0] == "effkit"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                if base.split(".")[0] != "effkit":
                    continue
                edges.add(base)
                edges |= {f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}")}
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_module" and node.args
                  and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("effkit")):
                edges.add(node.args[0].value)  # effkit.registry.lazy_module("effkit....") imports on first use
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def stage_of(name: str) -> str | None:
    """The stage a module is or belongs to (a module of a stage package), else None."""
    return next((s for s in STAGES if name == s or name.startswith(s + ".")), None)


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {e}" for m, edges in graph.items() for e in edges if layer(e) > layer(m)]


def sideways(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one stage into another (other than MAY_CALL's)."""
    return [f"{m} -> {e}" for m, edges in graph.items() if (own := stage_of(m)) for e in sorted(edges)
            if (other := stage_of(e)) not in (None, own) and other not in MAY_CALL.get(own, set())]


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "effkit.train" in graph["effkit.worker"]  # imported inside train_rank()
    assert "effkit.quiet" in graph["effkit.cli"]  # imported inside a function
    assert "effkit.engines.onnxruntime" in graph["effkit.quantize.backends.onnxruntime"]  # a lazy_module


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_only_the_entry_points_import_the_cli():
    offenders = [m for m, edges in import_graph().items() if "effkit.cli" in edges and m not in ENTRY]
    assert offenders == []


def test_no_import_points_up():
    assert upward(import_graph()) == []


def test_the_layer_check_finds_an_upward_import():
    """The check is not vacuous: the import `effkit.config` had of the pruning registry (and the loader of the
    quantization backends) would each be caught."""
    graph = {"effkit.config": {"effkit.prune.methods", "effkit.measure.results"},
             "effkit.artifacts.loader": {"effkit.quantize.backends", "effkit.engines.onnxruntime"},
             "effkit.pipeline": {"effkit.train", "effkit.registry"}}
    assert sorted(upward(graph)) == ["effkit.artifacts.loader -> effkit.engines.onnxruntime",
                                     "effkit.artifacts.loader -> effkit.quantize.backends",
                                     "effkit.config -> effkit.measure.results", "effkit.config -> effkit.prune.methods"]


def test_every_module_has_a_layer():
    for m in import_graph():
        layer(m)


def test_no_stage_imports_another_stage():
    assert sideways(import_graph()) == []


def test_the_stage_check_sees_a_stage_packages_modules():
    """A study's module importing another stage is caught; the studies' shared module running training is not."""
    assert stage_of("effkit.studies.sync") == "effkit.studies" and stage_of("effkit.trainer") is None
    graph = {"effkit.studies.sync": {"effkit.bench", "effkit.studies.common"},
             "effkit.studies.common": {"effkit.train"}}
    assert sideways(graph) == ["effkit.studies.sync -> effkit.bench"]


def plugin_of(name: str, plugins) -> str | None:
    """The plug-in module `name` is, or the plug-in package that holds it (an engine is one package)."""
    return next((p for p in plugins if name == p or name.startswith(p + ".")), None)


def test_plugins_come_only_from_their_registries():
    """Only a registry imports its plug-ins' modules (backends, pruning methods, engines, studies): nothing else
    can switch on their names. Engines may be imported by the backends that write their format."""
    graph = import_graph()
    plugins = {path.partition(":")[0]: reg for reg in (BACKENDS, PRUNERS, ENGINES, STUDIES)
               for path in reg.builtin.values()}
    helpers = {"effkit.quantize.backends.rowwise",  # shared by backends, imported by backends only
               "effkit.engines.decoder_step", "effkit.engines.shared"}  # shared by engines, imported by plug-ins only
    engines = {m for m, reg in plugins.items() if reg is ENGINES}
    leaks = [f"{m} -> {e}" for m, edges in graph.items() for e in edges
             if (plugin_of(e, plugins) or e in helpers) and not plugin_of(m, plugins) and m not in helpers
             and not (plugin_of(e, plugins) in engines and m.startswith("effkit.quantize.backends."))]
    assert leaks == []
    assert set(plugins) <= set(graph)  # the registries name real modules
    stage_modules = {path.partition(":")[0] for path in STAGES_REG.builtin.values()}
    assert stage_modules <= set(graph)


def test_no_engine_imports_another_engine():
    """Engines share what they share through a public helper (`effkit.engines.decoder_step`), never through one
    another's modules: an engine's private names stay its own."""
    graph = import_graph()
    engines = {path.partition(":")[0] for path in ENGINES.builtin.values()}

    def engine_of(m: str) -> str | None:  # an engine is a module or a package of modules
        return next((e for e in engines if m == e or m.startswith(e + ".")), None)

    openvino = set().union(*(edges for m, edges in graph.items() if engine_of(m) == "effkit.engines.openvino"))
    assert "effkit.engines.decoder_step" in openvino
    assert [f"{m} -> {e}" for m in sorted(graph) if (own := engine_of(m)) for e in sorted(graph[m])
            if engine_of(e) not in (None, own)] == []


def test_the_run_loop_imports_no_stage():
    """`effkit run` reaches its stages through the registry only: adding a stage touches no line of it."""
    stage_modules = {path.partition(":")[0] for path in STAGES_REG.builtin.values()}
    assert import_graph()["effkit.pipeline"] & (stage_modules | STAGES) == set()


def test_help_does_not_import_torch():
    commands = ["", "train", "prune", "quantize", "bench", "generate", "report", "run", "doctor", "study"]
    code = ("import sys\nfrom effkit.cli import main\nfor cmd in sys.argv[1:]:\n"
            "    sys.argv = ['effkit', *cmd.split(), '--help']\n"
            "    try:\n        main()\n    except SystemExit:\n        pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *commands], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "NO-TORCH", out.stderr[-2000:]
    assert "Usage: effkit train" in out.stdout


def test_the_study_names_import_no_torch():
    """`effkit.studies.names()` (what `effkit study --help` lists) reads the registry's table alone."""
    code = ("import sys\nimport effkit.studies as s\nassert s.names()[0] == 'sync'\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "NO-TORCH", out.stderr[-2000:]


def test_a_registered_backend_and_pruner_appear_in_help():
    """A plug-in defined outside effkit's files, registered before the CLI is imported, is offered by --help."""
    code = ("import sys\nfrom effkit.prune import methods\nfrom effkit.quantize import backends\n"
            "class B: name = 'fakeq'\nclass P: name = 'fakep'\n"
            "backends.register(B()); methods.register(P())\nfrom effkit.cli import main\n"
            "sys.argv = ['effkit', sys.argv[1], '--help']\ntry:\n    main()\nexcept SystemExit:\n    pass\n")
    env = {**os.environ, "COLUMNS": "250"}
    for command, name in (("quantize", "fakeq"), ("prune", "fakep")):
        out = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=60,
                             env=env)
        assert name in out.stdout, out.stdout + out.stderr


def test_help_shows_the_recipe_table_names():
    out = subprocess.run([sys.executable, "-m", "effkit", "train", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert "its [train] table" in out.stdout and out.returncode == 0  # `__main__.leave`: said, flushed, exit 0


@pytest.fixture
def meta_model():
    return build_model("gpt2-nano", vocab_size=512).to("meta")


def test_masks_live_on_the_weights_device(meta_model):
    masks = compute_masks(meta_model, 0.5)
    assert masks and all(m.device.type == "meta" for m in masks.values())
    grown = compute_masks(meta_model, 0.7, scope="layer", previous=masks)
    assert all(m.device.type == "meta" for m in grown.values())
    apply_masks(meta_model, grown)
    assert all(p.device.type == "meta" for p in meta_model.parameters())


def test_row_pruning_keeps_the_device(meta_model):
    prune_mlp_channels(meta_model, 32)
    mlp = meta_model.transformer.h[0].mlp
    assert mlp.c_fc.out_features == 32 and mlp.c_fc.weight.device.type == "meta"
    assert mlp.c_proj.weight.device.type == "meta"


def test_measurement_inputs_land_on_the_models_device(meta_model):
    assert hardware.model_device(meta_model).type == "meta"
    assert timing.random_tokens(meta_model, 2, 16).device.type == "meta"
    held_out = torch.zeros(5, 16, dtype=torch.long)  # the cached blocks live on the CPU
    batches = list(evaluation.eval_batches(meta_model, held_out, 2))
    assert [b.shape[0] for b in batches] == [2, 2, 1] and all(b.device.type == "meta" for b in batches)


# ------------------------------------------------------------------------------ the shape of the code, held by tests
# Each check takes a root folder, so that a planted violation in a temporary tree shows it is not vacuous.
FUNCTION_LINES = 80
MODULE_LINES = 500
# modules allowed over MODULE_LINES, each with the reason it stays whole
LARGE_MODULES = {
    "config.py": "every stage's options dataclasses and the one mechanism that validates them, read by the CLI",
    "train.py": "the one training loop (Trainer) and the stage that runs it: step, evaluation, checkpoints and the "
                "run's hooks share the Trainer's state",
    "prune/stage.py": "the prune stage: rounds, their dense controls and the paired comparisons that judge each round",
    "quantize/stage.py": "the quantize stage: auto's choice among the backends, best-pruned, and the stage's plan",
    "pipeline.py": "the run loop and the one time budget it fits before training and re-fits from training's steps "
                   "(the cost model the estimate uses)",
}
FIGURE = re.compile(r"\d[\d,.]*\s*(MiB|GiB|KiB|GB|MB|ms|tok/s|tokens/s|x\b|%)")
HISTORY = re.compile(r"(?i)\bsession \d|(?<![\w/])#\d+\b|\bissue \d")
OPTION_LIMIT = 12


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def long_functions(root: Path) -> list[str]:
    out = []
    for path in python_files(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def large_modules(root: Path) -> list[str]:
    out = []
    for path in python_files(root):
        rel = path.relative_to(root).as_posix()
        n = len(path.read_text().splitlines())
        if n > MODULE_LINES and rel not in LARGE_MODULES:
            out.append(f"{rel} ({n} lines)")
    return out


def comments(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


def figure_comments(root: Path) -> list[str]:
    """Comment lines carrying a measured figure or a piece of the work's history: figures belong in
    docs/benchmarks.md or a data file a benchmarks/ script writes; comments say why."""
    return [f"{path.relative_to(root)}:{line} {text.strip()[:70]}" for path in python_files(root)
            for line, text in comments(path) if FIGURE.search(text) or HISTORY.search(text)]


def _decorating_config(fn: ast.AST) -> str | None:
    """The config class a command's `@with_stage_options(Config, ...)` names, if any."""
    for d in getattr(fn, "decorator_list", []):
        if (isinstance(d, ast.Call) and getattr(d.func, "id", "") == "with_stage_options" and d.args
                and isinstance(d.args[0], ast.Name)):
            return d.args[0].id
    return None


def option_flags(root: Path) -> list[tuple[str, str, str | None]]:
    """(where, flag, the config its command takes its stage flags from) of every `typer.Option(...)` written with a
    literal `--flag` (the generic one that makes a stage field's flag from its metadata names none)."""
    out = []
    for path in python_files(root):
        tree = ast.parse(path.read_text())
        owner_of = {id(n): _decorating_config(fn) for fn in ast.walk(tree)
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(fn.args)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Option"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "typer"):
                flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                         and a.value.startswith("--")]
                out += [(f"{path.relative_to(root)}:{node.lineno}", f, owner_of.get(id(node)))
                        for f in flags or ["(from a field)"]]
    return out


def stage_field_flags(config: str | None = None) -> set[str]:
    """The flags of a config's fields (every stage config's where `config` is None)."""
    from effkit import config as configs
    from effkit.config import STAGES as CONFIGS
    from effkit.config import flat_fields

    classes = [getattr(configs, config)] if config else list(CONFIGS.values())
    return {"--" + key.replace("_", "-") for cls in classes for key in flat_fields(cls)}


def engine_words() -> set[str]:
    """Every engine's name and export format: the words a module would switch on."""
    return set(ENGINES.names()) | {f for n in ENGINES.names() if (f := getattr(ENGINES.get(n), "format", None))}


def owner(rel: str, words: set[str]) -> str | None:
    """The engine a module belongs to: its package under engines/, or the quantize backend of its format."""
    parts = rel.removesuffix(".py").split("/")
    if parts[0] == "engines" and len(parts) > 1:
        return parts[1]
    if parts[:2] == ["quantize", "backends"] and len(parts) > 2:
        return next((w for w in words if parts[2].startswith(w)), None)
    return None


def name_switches(root: Path, words: set[str]) -> list[str]:
    """Places outside an engine's own package (and the registry's tables) that compare with, key a table by, or
    match on an engine's name or format."""
    out = []
    for path in python_files(root):
        rel = path.relative_to(root).as_posix()
        if rel == "registry.py":
            continue
        mine = owner(rel, words)
        for node in ast.walk(ast.parse(path.read_text())):
            consts: list[ast.AST] = []
            if isinstance(node, ast.Compare):
                for c in [node.left, *node.comparators]:
                    consts += c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
            elif isinstance(node, ast.Dict):
                consts = [k for k in node.keys if k is not None]
            elif isinstance(node, ast.MatchValue):
                consts = [node.value]
            hits = {c.value for c in consts if isinstance(c, ast.Constant) and c.value in words}
            if mine is not None:
                hits = {h for h in hits if not (h.startswith(mine) or mine.startswith(h))}
            out += [f"{rel}:{node.lineno} {sorted(hits)}"] if hits else []
    return out


def _calls(node: ast.AST | None, name: str) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def report_rewrites(root: Path) -> list[str]:
    """Places that write a stage report other than built once as a `StageReport`: a `write_stage_report` call whose
    report is not a `StageReport` made in the same function (and bound to nothing else there but None), and a
    function that writes into a report it was handed (`report[...] = ...`, `report.update(...)`: a report patched
    after it was built)."""
    out = []
    for path in python_files(root):
        rel = path.relative_to(root).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            bound: dict[str, list[ast.AST]] = {}
            for n in ast.walk(fn):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []:
                    if isinstance(t, ast.Name):
                        bound.setdefault(t.id, []).append(n.value)
            built = {k for k, values in bound.items()  # None: not built yet (a rank that writes no report)
                     if all(_calls(v, "StageReport") or isinstance(v, ast.Constant) and v.value is None
                            for v in values)}
            handed = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs] if "report" in a.arg}
            for n in ast.walk(fn):
                if _calls(n, "write_stage_report"):
                    r = n.args[1] if len(n.args) > 1 else next((k.value for k in n.keywords if k.arg == "report"), None)
                    if not (_calls(r, "StageReport") or isinstance(r, ast.Name) and r.id in built):
                        out.append(f"{rel}:{n.lineno} {fn.name}: write_stage_report of a report not built here")
                targets = (n.targets if isinstance(n, ast.Assign) else [n.target]
                           if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else [])
                written = [_root_name(t) for t in targets if isinstance(t, ast.Subscript)]
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in (
                        "update", "setdefault", "pop", "__setitem__"):
                    written.append(_root_name(n.func.value))
                if hit := sorted(handed & set(written)):
                    out.append(f"{rel}:{n.lineno} {fn.name}: rewrites the report it was handed ({hit[0]})")
    return out


def test_no_function_is_over_80_lines():
    assert long_functions(PACKAGE) == []


def test_no_module_is_over_its_size_unless_listed_with_a_reason():
    assert large_modules(PACKAGE) == []
    assert all(len(why) > 20 and (PACKAGE / rel).is_file() for rel, why in LARGE_MODULES.items())


def test_no_comment_carries_a_measured_figure_or_history():
    assert figure_comments(PACKAGE) == []


def test_options_are_declared_once():
    """Few `typer.Option`s, and none for a stage field: a stage's flags come from its config's fields."""
    flags = option_flags(PACKAGE)
    assert len(flags) <= OPTION_LIMIT, flags
    assert [(w, f) for w, f, config in flags if f in stage_field_flags(config)] == []


def test_no_module_outside_an_engine_switches_on_its_name():
    assert name_switches(PACKAGE, engine_words()) == []


def test_stage_reports_are_built_once_and_never_rewritten():
    """Every stage report is a `StageReport` built where it is written; no function patches one it is handed."""
    assert report_rewrites(PACKAGE) == []


def test_the_shape_checks_find_planted_violations(tmp_path):
    """Each check flags what it is for in a planted tree, and only that."""
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    (tmp_path / "figures.py").write_text("# the write took 1,337 MiB on gpt2\ny = 2  # 1.55x faster\n"
                                         "# measured in session 22\n# why: ONNX Runtime's threads spin\n")
    (tmp_path / "cli.py").write_text('import typer\ndef c(plan: bool = typer.Option(False, "--plan"), '
                                     'lr: float = typer.Option(0.1, "--lr")): ...\n')
    engines_dir = tmp_path / "engines" / "onnxruntime"
    engines_dir.mkdir(parents=True)
    switch = 'def g(e):\n    return 1 if e.name == "onnxruntime" else {"openvino": 2}\n'
    (engines_dir / "x.py").write_text(switch)
    (tmp_path / "bench.py").write_text(switch)
    assert [s.split(" ")[0] for s in long_functions(tmp_path)] == ["long.py:1"]
    assert large_modules(tmp_path) == [f"big.py ({MODULE_LINES + 1} lines)"]
    assert [s.split(" ")[0] for s in figure_comments(tmp_path)] == ["figures.py:1", "figures.py:2", "figures.py:3"]
    flags = [f for _, f, config in option_flags(tmp_path) if f in stage_field_flags(config)]
    assert flags == ["--lr"] and len(option_flags(tmp_path)) == 2
    assert [s.split(" ")[0] for s in name_switches(tmp_path, {"onnxruntime", "openvino"})] == [
        "bench.py:2", "bench.py:2", "engines/onnxruntime/x.py:2"]
    (tmp_path / "reports.py").write_text(
        "def attach_plan(report, plan):\n    report['memory_plan'] = plan\n    report['protocol']['plan'] = 'x'\n"
        "    write_stage_report(plan['out'], report)\n    return report\n"
        "def written(out):\n    report = StageReport(stage='train')\n    write_stage_report(out, report)\n"
        "    write_stage_report(out, {'stage': 'train'})\n    write_stage_report(out, StageReport(stage='x'))\n"
        "def patched(out, train_report):\n    train_report.update(schedule={})\n")
    assert [s.split(" ")[0] for s in report_rewrites(tmp_path)] == [
        "reports.py:2", "reports.py:3", "reports.py:4", "reports.py:9", "reports.py:12"]


def interface_getattrs(source: str) -> list[str]:
    """The string getattrs in `source` of an attribute the engine models declare (`EngineModel`)."""
    from effkit.measure.engine_model import EngineModel

    names = "|".join(EngineModel.__annotations__)
    return re.findall(rf'getattr\([^,()]+, "({names})"', source)


def test_the_engine_model_interface_is_read_through_its_declaration():
    """What an engine's model declares (`EngineModel`: settle_s, compilable, ...) is read with its declared default
    (`model_attr`), never through a string getattr carrying a default of its own."""
    assert interface_getattrs('pause = getattr(fn, "settle_s", 0.0)') == ["settle_s"]  # the check sees one
    found = {str(p.relative_to(PACKAGE)): hits for p in PACKAGE.rglob("*.py")
             if (hits := interface_getattrs(p.read_text()))}
    assert found == {}, found
