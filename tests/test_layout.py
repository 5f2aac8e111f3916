"""The package's import direction, read from the source (AST; imports inside functions count too):
`launch.py` -> `bebop.stages.pipeline` -> the stages (`bebop.stages.*`) -> RL machinery
(`bebop.rl.*`) -> the core library (every other `bebop` module). No stage imports another stage,
nothing below the stages imports one, the core library imports no RL machinery, and the import
graph of `bebop` has no cycle. The scripts (`benchmarks/`, `experiments/`) run as modules from the
repository root: none touches `sys.path`, they import each other as packages, and no benchmark
imports another."""

import ast

from .conftest import REPO

# One module per stage of `config.STAGES`; `pipeline` (which runs them in order) is the only
# module of the package that may import them.
STAGES = {"bebop.stages.sft", "bebop.stages.distill", "bebop.stages.mtp", "bebop.stages.rl"}
RUNNERS = {"bebop.stages.pipeline"}


def layer(mod: str) -> int:
    """3: launch.py, 2: `bebop.stages`, 1: `bebop.rl`, 0: the core library."""
    if mod == "launch":
        return 3
    if mod == "bebop.stages" or mod.startswith("bebop.stages."):
        return 2
    if mod == "bebop.rl" or mod.startswith("bebop.rl."):
        return 1
    return 0


def _module(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    base = REPO / name.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    """{module: the bebop modules it imports}, for every module of `bebop` and `launch.py`;
    `from bebop import x` counts as `bebop.x` when `x` is a module."""
    graph = {}
    for path in [*sorted((REPO / "bebop").rglob("*.py")), REPO / "launch.py"]:
        mod, deps = _module(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("bebop")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against the importing package
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if not base.startswith("bebop"):
                    continue
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if _exists(f"{base}.{a.name}") else base)
        graph[mod] = deps - {mod, "bebop"}
    return graph


def test_stages_import_no_stage_and_the_library_imports_no_stage():
    graph = import_graph()
    assert STAGES <= set(graph), sorted(STAGES - set(graph))
    bad = [
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        if mod not in RUNNERS
        for dep in sorted(deps & STAGES)
    ]
    assert not bad, bad


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod, path):
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, mod, dep]))
            if dep not in state:
                visit(dep, [*path, mod])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])


def test_imports_run_down_the_layers():
    graph = import_graph()
    assert {"launch", "bebop.stages.pipeline", "bebop.rl.grpo", "bebop.model"} <= set(graph)
    up = [
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        for dep in sorted(deps)
        if layer(dep) > layer(mod)
    ]
    assert not up, up


def test_launch_reaches_the_stages_through_the_pipeline_only():
    graph = import_graph()
    assert "bebop.stages.pipeline" in graph["launch"]
    assert not graph["launch"] & STAGES, sorted(graph["launch"] & STAGES)


# ----------------------------------------------------------------------------- the scripts

SCRIPT_DIRS = ("benchmarks", "experiments")


def _script_files():
    return [p for d in SCRIPT_DIRS for p in sorted((REPO / d).rglob("*.py"))]


def _is_script(path) -> bool:
    """A module with a `__main__` guard: a benchmark or a study's script."""
    return 'if __name__ == "__main__":' in path.read_text()


def _imported(path) -> set[str]:
    """The absolute module names `path` imports; `from pkg import x` counts as `pkg.x` when `x`
    is a module of the repository."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                names.add(full if _exists(full) else node.module)
    return names


def test_no_script_touches_sys_path():
    """Benchmarks and experiments run as modules from the repository root (`python -m
    benchmarks.rollout`) and import each other as packages: none reads or edits `sys.path`."""
    bad = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in _script_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    ]
    assert not bad, bad


def test_scripts_import_each_other_as_packages():
    """No flat import of a sibling file (`import shapes`: it only resolves with the script's own
    folder on `sys.path`)."""
    flat = {p.stem for p in _script_files()} - {"__init__"}
    bad = [
        f"{path.relative_to(REPO)}: import {name}"
        for path in _script_files()
        for name in sorted(_imported(path))
        if name.split(".")[0] in flat
    ]
    assert not bad, bad


def test_no_benchmark_imports_another():
    """What several benchmarks share is in modules without a `__main__` guard
    (`benchmarks.common`, `benchmarks.shapes`, ...); no benchmark imports a benchmark."""
    benchmarks = {_module(p) for p in (REPO / "benchmarks").glob("*.py") if _is_script(p)}
    assert {"benchmarks.rollout", "benchmarks.tail", "benchmarks.phases"} <= benchmarks
    bad = [
        f"{_module(path)} -> {dep}"
        for path in sorted((REPO / "benchmarks").glob("*.py"))
        for dep in sorted(_imported(path) & benchmarks)
        if dep != _module(path)
    ]
    assert not bad, bad
