"""The shape of the package: imports only point down (cli -> stages -> core), no import cycles (function-level
imports counted), `effkit --help` stays free of torch, and every tensor effkit creates for a model lands on
that model's device (checked on the `meta` device, the closest a GPU-less machine comes to a CPU/GPU mix-up)."""

import ast
import os
import subprocess
import sys
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
    assert "effkit.engines.decoder_step" in graph["effkit.engines.openvino"]
    assert [f"{m} -> {e}" for m in sorted(graph) if (own := plugin_of(m, engines)) for e in sorted(graph[m])
            if plugin_of(e, engines) not in (None, own)] == []


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
    assert "its [train] table" in out.stdout


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
