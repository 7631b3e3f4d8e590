"""The tree's shape: imports run one way, read from every import statement of megazero with ``ast``.

Function-level and ``TYPE_CHECKING`` imports count: an import inside a function is still a dependency, and a
type-only one still ties the two modules' designs together. Checked:

* no cycle between modules;
* no cycle between subpackages (a top-level module counts as its own), and more strictly every import goes
  down :data:`LAYERS`: a package imports only itself and packages listed before it, so the runtime never imports
  the planning package;
* at most six modules directly in ``megazero/`` beside ``__init__.py``, and no file over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "megazero"

# bottom to top: each package may import only packages before it (and itself)
LAYERS = [
    "config",  # typed settings, resolution, CLI, DeepSpeed JSON
    "distributed",  # start-up, rank grid and context, checked collectives, ledger, device reads
    "observe",  # logging, FLOPs, memory tracking, metrics sinks: called by the runtime, never calls it
    "data",  # corpus, tokenizers, datasets, sampler, loader
    "tensor_parallel",  # TP mappings and layers, vocab-parallel CE, RNG tracker, recompute
    "context_parallel",  # sequence sharding over the CP group, ring and all-gather attention
    "model",  # model families built from TP layers; HF mapping; kernels
    "pipeline",  # partition, schedules, p2p, executor, replay
    "zero",  # ZeRO stages 0-3, offload, loss scaling
    "checkpoint",  # save, load and reshard, safetensors I/O
    "generate",  # sampling with the model's own blocks and a KV cache
    "train",  # the recipe, the engine (one step), the loop
    "plan",  # estimator, roofline, layout search, dry run: imports the runtime, never imported by it
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the megazero modules it imports (a ``from package import name`` names the submodule when
    ``name`` is one)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in files else stem for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # import megazero.a.b.c -> the longest module prefix
                    t = t.rpartition(".")[0]
                if t.startswith("megazero") and t != mod:
                    deps.add(t)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def package_of(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "megazero"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        if mod == "megazero":
            continue
        out.setdefault(package_of(mod), set()).update(
            package_of(d) for d in deps if d != "megazero" and package_of(d) != package_of(mod))
    return out


def downward_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod == "megazero":
            continue
        for d in sorted(deps):
            src, dst = package_of(mod), package_of(d)
            if d != "megazero" and src != dst and rank[dst] > rank[src]:
                bad.append(f"{mod} imports {d}: {src} sits below {dst} in LAYERS")
    return bad


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in import_graph() if m != "megazero"}
    assert packages == set(LAYERS), f"add new packages to LAYERS: {sorted(packages ^ set(LAYERS))}"


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None


def test_no_import_cycle_between_packages():
    assert find_cycle(package_graph(import_graph())) is None


def test_imports_run_down_the_layers():
    assert downward_violations(import_graph()) == []


def test_the_checks_can_fail(tmp_path):
    """The checker on a small tree with a cycle between two modules and an upward import."""
    pkg = tmp_path / "megazero"
    (pkg / "model").mkdir(parents=True)
    (pkg / "plan").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "model" / "a.py").write_text("def f():\n    from megazero.model import b\n")  # function-level
    (pkg / "model" / "b.py").write_text("from .a import f\nfrom megazero.plan.search import g\n")
    (pkg / "plan" / "search.py").write_text("def g(): ...\n")
    graph = import_graph(pkg)
    assert graph["megazero.model.a"] == {"megazero.model.b"}
    assert find_cycle(graph) == ["megazero.model.a", "megazero.model.b", "megazero.model.a"]
    assert downward_violations(graph) == [
        "megazero.model.b imports megazero.plan.search: model sits below plan in LAYERS"]


def test_top_level_stays_small_and_files_short():
    top = [p.name for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 6, top
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split by role: {long}"


@pytest.mark.parametrize("package", [p for p in LAYERS if (ROOT / p).is_dir()])
def test_packages_state_their_api(package):
    init = ROOT / package / "__init__.py"
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"megazero/{package}/__init__.py: say what the package is for"
    assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
               or isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "__all__"
               for n in tree.body), f"megazero/{package}/__init__.py has no __all__"
