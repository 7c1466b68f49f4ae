"""The tree is the pipeline: each stage is a package, and imports run one way, down the stages.

``docs/architecture.md`` draws the stages; this file holds the layering it draws and
checks the source against it, statically (every ``import``/``from ... import``,
inside functions too):

* a module imports another stage only from a *lower* layer, and only through that
  package's own ``__init__`` (``from autopar.search import solve_dp``, never
  ``autopar.search.dp``);
* no module imports another module's private (``_name``) definitions;
* no import circles between modules, anywhere: a package ``__init__``, imports inside
  functions and imports under ``if TYPE_CHECKING:`` included (a type two modules need
  lives in a third they both import);
* every module has a docstring and stays under 600 lines;
* no function is longer than 80 lines (its docstring not counted), and none but the
  public entry points takes more than 8 parameters (options that travel together are
  one object: ``autopar.planner.PlanOptions``);
* no two modules share a file name (``__init__``/``__main__`` aside), and the top of
  ``autopar/`` holds at most 8 modules besides them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Stage -> layer.  A module may import its own stage, or a stage of a lower layer.
#: ``shared``: the small value types at the top of ``autopar/`` (mesh, placements, specs,
#: units, layouts, transitions) that every stage speaks; ``api``: the package's
#: ``__init__``, ``__main__`` and the CLI, over everything.  ``runtime`` is the support
#: library the lowered program calls: it knows the shared types only.
LAYERS = {
    "shared": 0,
    "costmodel": 0,
    "capture": 1,
    "models": 1,
    "search": 1,
    "runtime": 1,
    "strategies": 2,
    "cost": 3,
    "planner": 4,
    "lower": 5,
    "compiled": 6,
    "checkpoint": 7,
    "launch": 8,
    "measure": 9,
    "api": 10,
}
API_MODULES = {"autopar", "autopar.__main__", "autopar.cli"}
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
#: The public entry points: users read their keyword-only parameters in an editor, so each
#: keeps them explicit (checked against ``autopar.planner.PLAN_KEYWORDS`` in test_options.py).
ENTRY_POINTS = {
    "autopar.planner.driver": {"plan", "prepare", "plan_from_context"},
    "autopar.compiled.build": {"compile"},
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``), for autopar/ and costmodel/."""
    out = {}
    for top in ("autopar", "costmodel"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def stage_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "costmodel":
        return "costmodel"
    if module in API_MODULES:
        return "api"
    if len(parts) == 2 and module not in {m for m, (_, pkg) in MODULES.items() if pkg}:
        return "shared"  # a top-level module of autopar/
    return parts[1]


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import statement of ``module``."""
    path, is_pkg = MODULES[module]
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_pkg else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:  # `from pkg import submodule`
                    found.append((f"{base}.{a.name}", "", node.lineno))
                else:
                    found.append((base, a.name, node.lineno))
    return [(m, name, line) for m, name, line in found if m in MODULES]


EDGES = {m: _imports(m) for m in MODULES}


def test_every_stage_of_the_tree_has_a_layer():
    stages = {stage_of(m) for m in MODULES}
    assert stages <= set(LAYERS), f"stages without a layer in LAYERS: {sorted(stages - set(LAYERS))}"
    # the top of autopar/ holds the public surface and the shared vocabulary only
    shared = sorted(m for m in MODULES if stage_of(m) == "shared")
    assert len(shared) <= 8, f"{len(shared)} modules at the top of autopar/ (at most 8): {shared}"


def test_no_two_modules_share_a_file_name():
    by_name: dict[str, list[str]] = {}
    for path, _ in MODULES.values():
        if not path.name.startswith("__"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    same = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not same, f"modules with the same file name (name each by what it holds): {same}"


def _functions(module: str):
    """(function node, its length without the docstring, its parameter count without self/cls) per def."""
    path, _ = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = node.body[0]
        is_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
        doc = first.end_lineno - first.lineno + 1 if is_doc and isinstance(first.value.value, str) else 0
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
        count = len(params) + bool(a.vararg) + bool(a.kwarg)
        if params and params[0].arg in ("self", "cls"):
            count -= 1
        yield node, node.end_lineno - node.lineno + 1 - doc, count


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_are_short_and_take_few_parameters(module):
    long = [
        f"{n.name} (line {n.lineno}): {length} lines"
        for n, length, _ in _functions(module)
        if length > MAX_FUNCTION_LINES
    ]
    assert not long, (
        f"{module}: functions over {MAX_FUNCTION_LINES} lines (a pass or an object to name):\n  " + "\n  ".join(long)
    )
    entry = ENTRY_POINTS.get(module, set())
    wide = [
        f"{n.name} (line {n.lineno}): {count} parameters"
        for n, _, count in _functions(module)
        if count > MAX_PARAMETERS and n.name not in entry
    ]
    assert not wide, (
        f"{module}: functions over {MAX_PARAMETERS} parameters (group them in an options object):\n  "
        + "\n  ".join(wide)
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_down_the_stages_through_package_names(module):
    here = stage_of(module)
    wrong = []
    for target, _name, line in EDGES[module]:
        there = stage_of(target)
        if there == here:
            continue
        if LAYERS[there] >= LAYERS[here]:
            wrong.append(f"line {line}: {target} ({there}, layer {LAYERS[there]}) from {here} (layer {LAYERS[here]})")
        elif there != "shared" and target != (f"autopar.{there}" if there != "costmodel" else "costmodel"):
            wrong.append(f"line {line}: {target} is inside stage {there}; import it from the package")
    assert not wrong, f"{module} imports against the layering:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_private_names(module):
    private = [
        f"line {line}: {name} from {target}"
        for target, name, line in EDGES[module]
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not private, f"{module} imports private names:\n  " + "\n  ".join(private)


def test_no_import_circles():
    graph = nx.DiGraph((m, t) for m, edges in EDGES.items() for t, _, _line in edges if t != m)
    circles = [" -> ".join(c) for c in nx.simple_cycles(graph)]
    assert not circles, "import circles:\n  " + "\n  ".join(sorted(circles)[:20])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_is_small_and_says_its_job(module):
    path, _ = MODULES[module]
    text = path.read_text()
    lines = text.count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it by job"
    doc = ast.get_docstring(ast.parse(text))
    assert doc and len(doc.splitlines()[0]) >= 20, f"{path.relative_to(ROOT)} has no docstring stating its job"


def test_the_architecture_doc_names_every_stage_and_only_files_that_exist():
    """docs/architecture.md stays true to the tree: every stage package drawn, every file it names real."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted({stage_of(m) for m in MODULES} - {"shared", "api", "costmodel"})
    assert [p for p in packages if f"autopar/{p}/" not in doc] == []
    named = set(re.findall(r"`?((?:autopar|costmodel|tests|configs)/[\w/]+\.(?:py|toml))`?", doc))
    short = set(re.findall(r"\b((?:capture|strategies|cost|search|planner|lower|compiled|runtime)/\w+\.py)\b", doc))
    missing = sorted(p for p in named if not (ROOT / p).exists() and "<" not in p)
    missing += sorted(p for p in short if not (ROOT / "autopar" / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    assert len(named | short) >= 15  # the doc does name where things live
