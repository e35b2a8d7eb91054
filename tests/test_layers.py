"""The import-layer contract of ``pathways_jax/_src`` (see its ``__init__`` docstring).

Imports run one way: api -> compat -> runtime -> backends -> compile -> ir -> wire -> core. A
module may import its own layer and those below, never above; no import
cycle exists, lazy (function-level) imports included. ``views`` may import
anything, and is imported only lazily inside ``_repr_*`` methods (and
``GraphView.to_dot``, the DOT text of the picture). ``pipeline`` sits on the public
API. Imports under ``if TYPE_CHECKING:`` (annotations) count too, for the
layers and for cycles: a type named from a layer above is a dependency on it,
and two modules that name each other's types are one concept, or need a
protocol between them.
"""

import ast
import functools
import pathlib
import re
import shutil

import pytest
from helpers import modules_of_a_fresh_import

import pathways_jax

ORDER = ("core", "wire", "ir", "compile", "backends", "runtime", "compat", "api")
PACKAGE = pathlib.Path(pathways_jax.__file__).parent
# Functions that may import a view lazily: notebook hooks, and GraphView.to_dot.
VIEW_ENTRIES = ("_repr_",)
VIEW_METHODS = {("api.graph_view", "to_dot")}


def _imports(path: pathlib.Path, annotations: bool = False):
    """(imported module, enclosing function or None, line) for every pathways_jax import.

    ``annotations``: the imports under ``if TYPE_CHECKING:`` instead, and those alone.
    """
    return _imports_in(path.read_text(), annotations)


@functools.cache
def _imports_in(text: str, annotations: bool) -> tuple:
    """:func:`_imports` of a module's source: a scratch copy's unchanged files are parsed once."""
    found = []

    def visit(node, function, typing):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for body in child.body:
                    visit_node(body, function, True)
                for orelse in child.orelse:
                    visit_node(orelse, function, typing)
                continue
            visit_node(child, function, typing)

    def visit_node(child, function, typing):
        inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
        if typing == annotations:
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module.startswith("pathways_jax"):
                    for alias in child.names:
                        found.append((f"{child.module}.{alias.name}", child.module, inner, child.lineno))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("pathways_jax"):
                        found.append((alias.name, alias.name, inner, child.lineno))
        visit(child, inner, typing)

    visit(ast.parse(text), None, False)
    return tuple(found)


def violations(package: pathlib.Path) -> list[str]:
    """Every upward or cyclic import (and view import) in ``package/_src``, as readable lines."""
    src = package / "_src"
    modules: dict[str, pathlib.Path] = {}
    for path in src.rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path

    def layer(name: str) -> str:
        return name.split(".")[0]

    problems: list[str] = []
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in sorted(modules.items()):
        if not name:  # _src/__init__.py: the overview
            continue
        mine = layer(name)
        for full, module, function, line in _imports(path):
            where = f"_src/{path.relative_to(src)}:{line}"
            target = None
            for candidate in (full, module):
                if candidate.startswith("pathways_jax._src."):
                    short = candidate[len("pathways_jax._src.") :]
                    if short in modules:
                        target = short
                        break
            if target is None:
                if not module.startswith("pathways_jax._src") and mine not in ("pipeline", "views"):
                    problems.append(f"{where}: imports the public package ({module}) from inside _src")
                continue
            if target == name or layer(target) == name:  # itself, or its own package's __init__
                continue
            theirs = layer(target)
            if theirs == "views" and mine != "views":
                lazy_view = function is not None and (
                    function.startswith(VIEW_ENTRIES) or (name, function) in VIEW_METHODS
                )
                if not lazy_view:
                    problems.append(f"{where}: imports the view {target} outside a _repr_* method")
                continue
            edges[name].add(target)
            if mine in ("views", "pipeline"):
                continue
            if theirs == "pipeline" or (theirs in ORDER and ORDER.index(theirs) > ORDER.index(mine)):
                problems.append(f"{where}: {name} ({mine}) imports {target} ({theirs}), a layer above it")
    # Annotations (imports under `if TYPE_CHECKING:`) count too: a type named from a layer
    # above is a dependency on it, and an edge of the import graph.
    for name, path in sorted(modules.items()):
        if not name:
            continue
        mine = layer(name)
        for full, module, _function, line in _imports(path, annotations=True):
            target = next(
                (
                    c[len("pathways_jax._src.") :]
                    for c in (full, module)
                    if c.startswith("pathways_jax._src.") and c[len("pathways_jax._src.") :] in modules
                ),
                None,
            )
            if target is None or target == name or layer(target) == name:
                continue
            edges[name].add(target)
            if mine in ("views", "pipeline"):
                continue
            theirs = layer(target)
            upward = theirs == "pipeline" or (theirs in ORDER and ORDER.index(theirs) > ORDER.index(mine))
            if upward:
                where = f"_src/{path.relative_to(src)}:{line}"
                problems.append(
                    f"{where}: {name} ({mine}) imports {target} ({theirs}) for annotations, a layer above it"
                )
    # Cycles, over every counted edge (lazy ones too).
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                problems.append("import cycle: " + " -> ".join(cycle))
            elif target not in state:
                walk(target)
        stack.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            walk(name)
    return problems


def test_the_tree_keeps_the_layers():
    assert violations(PACKAGE) == []


def test_every_layer_is_a_package_that_says_what_it_owns_and_may_import():
    for name in (*ORDER, "views"):
        init = PACKAGE / "_src" / name / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"{init} needs a docstring saying what it owns and may import"


SUBPACKAGES = sorted(
    str(path.parent.relative_to(PACKAGE / "_src")) for path in (PACKAGE / "_src").glob("*/*/__init__.py")
)


@pytest.mark.parametrize("name", (*ORDER, "views", "pipeline", *SUBPACKAGES))
def test_every_package_docstring_names_its_modules(name):
    """A package's docstring is current: it names every module (or sub-package) it has, and no other."""
    folder = PACKAGE / "_src" / name
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    listed = doc.partition("Modules:")[2]
    modules = {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}
    modules |= {path.parent.name for path in folder.glob("*/__init__.py")}
    named = {m for m in modules if f"``{m}``" in listed}
    assert named == modules, f"{folder}/__init__.py does not name {sorted(modules - named)} under Modules:"
    stale = [word for word in re.findall(r"``(\w+)`` \(", listed) if word not in modules]
    assert stale == [], f"{folder}/__init__.py names modules that do not exist: {stale}"


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("core/errors.py", "from pathways_jax._src.runtime import clusters", "a layer above it"),
        ("ir/graph.py", "from pathways_jax._src.compile.lowering import Plan", "a layer above it"),
        ("compile/lowering.py", "from pathways_jax._src.views import render", "outside a _repr_* method"),
        ("core/counts.py", "from pathways_jax._src.core import readiness", "import cycle"),
        ("backends/base.py", "from pathways_jax._src.runtime.submission import Run", "for annotations"),
        # runs naming submission's StagedBytes, which imports runs: a cycle through annotations.
        (
            "runtime/runs.py",
            "from pathways_jax._src.runtime.submission import StagedBytes",
            "annotation cycle",
        ),
    ],
)
def test_the_check_fails_on_a_bad_import_in_a_scratch_copy(tmp_path, module, line, expected):
    copy = tmp_path / "pathways_jax"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "_src" / module
    text = target.read_text()
    if expected in ("for annotations", "annotation cycle"):  # under `if TYPE_CHECKING:`
        target.write_text(text + f"\n\nif TYPE_CHECKING:\n    {line}\n")
        if expected == "annotation cycle":
            cycles = [p for p in violations(copy) if "import cycle" in p]
            assert any("runtime.runs" in p and "runtime.submission" in p for p in cycles), cycles
            return
    elif expected == "import cycle":
        # readiness importing counts, and counts importing readiness (lazily).
        (copy / "_src/core/readiness.py").write_text(
            (copy / "_src/core/readiness.py").read_text()
            + "\n\ndef _x():\n    from pathways_jax._src.core import counts\n"
        )
        target.write_text(text + f"\n\ndef _y():\n    {line}\n")
    else:
        target.write_text(text + f"\n\ndef _z():\n    {line}\n")
    assert violations(PACKAGE) == []  # the tree itself is untouched
    found = violations(copy)
    assert any(expected in problem for problem in found), found


@pytest.mark.timeout(120)
def test_importing_the_package_imports_no_view():
    loaded = modules_of_a_fresh_import()["pipeline"]  # pathways_jax and pathways_jax.pipeline
    assert "pathways_jax.pipeline" in loaded
    views = [m for m in loaded if m.startswith("pathways_jax._src.views.")]
    assert views == [], views
