"""The import graph of autoshard, passes and solver (every import, module level or in a function):
no circles, and the layers kept: the core imports only the core; the compiler passes and the
solver never import the API, the runtime or the reports; the runtime never imports a compiler pass."""

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autoshard": ROOT / "autoshard", "autoshard.passes": ROOT / "passes", "autoshard.solver": ROOT / "solver"}

# Circles in the tree: none. One that appears is broken by moving what both sides need into a
# module below them (as passes/graph.py and passes/dtensor_rules.py sit below the strategy and
# region passes), not listed here.
KNOWN_CIRCLES: set[frozenset[str]] = set()
# Layer breaks still in the tree, each to be mended by moving code, never to grow.
KNOWN_LAYER_BREAKS: set[tuple[str, str]] = set()

ABOVE_PASSES = {"autoshard", "autoshard.api", "autoshard.cli", "autoshard.planning.baselines", "autoshard.planning.meshes"}
RUNTIME_PACKAGE, REPORT_PACKAGE = "autoshard.runtime", "autoshard.report"
# Below the passes, the cluster and the runtime alike: what both the compiler and the program use.
CORE = {"autoshard._torch", "autoshard.errors", "autoshard.notation", "autoshard.precision", "autoshard.progress",
        "autoshard.collectives"}


def above_passes(module: str) -> bool:
    return module in ABOVE_PASSES or module.startswith((RUNTIME_PACKAGE, REPORT_PACKAGE))


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((package, *parts))] = path
    return out


def import_graph() -> nx.DiGraph:
    mods = modules()
    graph = nx.DiGraph()
    for name, path in mods.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # "from package import module" imports the module; any other name, the package
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t if t in mods else node.module for t in subs]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return graph


def test_the_graph_sees_the_tree():
    graph = import_graph()
    assert CORE <= set(graph)
    assert {"autoshard.api", "autoshard.passes.strategies", "autoshard.solver.solve", "autoshard.notation"} <= set(graph)
    assert graph.has_edge("autoshard.planning.driver", "autoshard.passes.strategies")   # a module-level import
    assert graph.has_edge("autoshard.planning.baselines", "autoshard.api")   # one inside a function


def test_no_new_import_circles():
    circles = {frozenset(c) for c in nx.simple_cycles(import_graph())}
    assert circles <= KNOWN_CIRCLES, f"new import circles: {[sorted(c) for c in circles - KNOWN_CIRCLES]}"
    assert KNOWN_CIRCLES <= circles, f"broken, so drop from KNOWN_CIRCLES: {[sorted(c) for c in KNOWN_CIRCLES - circles]}"


def test_layers():
    graph = import_graph()
    breaks = {(m, t) for m, t in graph.edges
              if (m.startswith(("autoshard.passes", "autoshard.solver")) and above_passes(t))
              or (m.startswith(RUNTIME_PACKAGE) and t.startswith("autoshard.passes"))
              or (m in CORE and t not in CORE)}
    assert breaks == KNOWN_LAYER_BREAKS, f"layer breaks: {sorted(breaks - KNOWN_LAYER_BREAKS)}; " \
                                         f"no longer broken: {sorted(KNOWN_LAYER_BREAKS - breaks)}"


_NO_ORTOOLS = r'''
import sys

class NoOrtools:   # as on a GPU machine without OR-Tools: any import of it fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ortools":
            raise ImportError("OR-Tools is not installed here")

sys.meta_path.insert(0, NoOrtools())
import torch, torch.distributed as dist
import autoshard
from autoshard.zoo import GPT, GPTConfig

plan_path, store = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
try:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    ids = torch.randint(0, GPTConfig.tiny().vocab, (2, GPTConfig.tiny().seq), generator=torch.Generator().manual_seed(1))
    plan = autoshard.Plan.load(plan_path)
    dm = autoshard.compile(model, autoshard.Cluster.local(1), (ids, ids), plan=plan)
    loss = dm(*dm.shard_inputs(ids, ids))
    loss.backward()
    print("solver imported:", "autoshard.solver.solve" in sys.modules, "loss:", loss.item())
finally:
    dist.destroy_process_group()
'''


def test_a_saved_plan_runs_without_ortools(tmp_path):
    """Running a plan made elsewhere (``compile(plan=...)``) needs no ILP solver: a process where
    OR-Tools cannot be imported builds the module and takes a step whose loss is the model's."""
    import subprocess
    import sys

    import torch

    import autoshard
    from autoshard.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    ids = torch.randint(0, GPTConfig.tiny().vocab, (2, GPTConfig.tiny().seq), generator=torch.Generator().manual_seed(1))
    autoshard.plan(model, autoshard.Cluster.local(1), (ids, ids)).save(tmp_path / "plan.json")
    want = model(ids, ids).item()
    script = tmp_path / "run.py"
    script.write_text(_NO_ORTOOLS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "plan.json"), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    solver, loss = done.stdout.split("solver imported: ")[1].split(" loss: ")
    assert solver == "False"
    assert abs(float(loss) - want) < 1e-5, (loss, want)


_PUBLIC_PATHS = r'''
import autoshard.checkpoint as ckpt
from autoshard.launch import run_local
from autoshard.baselines import compare
from autoshard.memtrack import PeakMemory
from autoshard.simulate import run_ranks
from autoshard.cluster import PRESETS, Cluster
from autoshard.zoo import GPT, get
import autoshard
from autoshard.runtime import checkpoint, launch
assert ckpt is checkpoint and run_local is launch.run_local, (ckpt, run_local)
assert callable(autoshard.plan) and callable(autoshard.compile) and autoshard.Plan.__name__ == "Plan"
assert "dgx-h100" in PRESETS and callable(compare) and callable(run_ranks)
print("ok")
'''


def test_documented_module_paths_import_in_a_fresh_interpreter():
    """The module paths the guide gives (``import autoshard.checkpoint``, ``autoshard.launch``,
    ``autoshard.baselines``, ``autoshard.memtrack``, ``autoshard.simulate``) are the subpackages'
    modules themselves, and ``autoshard.plan`` is the function: no module shadows it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PUBLIC_PATHS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
