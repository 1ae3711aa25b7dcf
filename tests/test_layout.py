"""The package's layout holds: one room per feature, layers whose imports point down, no
import cycles, no heavy imports.

These read the source (``ast``) and import each room in a fresh interpreter, so a change that
breaks the layout fails here rather than in a user's ``pytest --co``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pytest_ctresources"
#: The modules at the top of the package: the wiring, the public API, and what users import.
TOP_LEVEL = {"__init__", "plugin", "per_test", "exceptions", "testing", "units", "reading"}
#: What no module may import when it is imported (the plugin loads at every pytest start-up).
HEAVY = ("torch", "matplotlib", "nbformat", "nbclient", "circuit_tracer", "transformers", "nnsight")
#: Modules imported only once the feature that needs the library runs: the notebook runner is
#: imported by a notebook item's ``runtest`` under ``--nbmake``, where nbformat is installed.
ALLOWED = {"pytest_ctresources.notebooks.run": {"nbformat", "nbclient"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
ROOMS = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file())


#: The layers, bottom first: a room (a folder) or top-level module imports only from the
#: layers below its own, never from its own layer's other members nor from above. Every
#: import counts, under ``if TYPE_CHECKING:`` and inside functions too (a type is a dependency).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("units", "exceptions", "reading"),
    ("bundled", "gpu"),
    ("xdist",),
    ("settings",),
    ("estimator",),
    ("session",),
    ("core",),
    ("leases", "notebooks", "report"),
    ("per_test",),
    ("plugin", "testing", "__init__"),
)
"""What each layer may import, from the bottom:

- ``units``, ``exceptions``, ``reading``: nothing of the package (units, quoting, warning
  classes, reading a file that may be hostile);
- ``bundled``, ``gpu``: the layer above; the outside world (the bundled models' shapes and
  builders; GPU detection, CUDA figures, cleanup, the allocator);
- ``xdist``: GPUs (binding a worker, placing tests by VRAM, the scheduler and the plan);
- ``settings``: the option values' parsers below (allocator, plan, shard); declaring options
  and resolving settings, configs, experiment YAML, markers, activation, report paths;
- ``estimator``: settings and models; the memory estimate, auto's arithmetic, the CLI;
- ``session``: the estimator; ``CtSession`` and the model cache, usable without pytest;
- ``core``: everything below; the run's state, each test's state and record, learned needs,
  the accounting, the fixtures;
- ``leases``, ``notebooks``, ``report``: the features, on core; never each other;
- ``per_test``: the hooks around each test the plugin acts for, on the features;
- ``plugin``, ``testing``, ``__init__``: the wiring and the public modules, on anything.
"""


def layer_unit(module: str) -> str:
    """The layer member a module belongs to: its room, or the top-level module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_nodes(source: str, name: str = PACKAGE.name) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``source``: at module level, inside functions, under ``if
    TYPE_CHECKING:``, and in a string of code that imports package ``name`` to run it in
    another process (a notebook kernel's start-up file), given the string's lines."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (f"import {name}" in node.value or f"from {name}" in node.value)
        ):
            try:
                inner = list(import_nodes(node.value, name))
            except SyntaxError:  # prose that names the package, not code
                continue
            for found in inner:
                found.lineno += node.lineno - 1
                yield found


def upward_imports(package: Path, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """One line per import in ``package`` that does not point down ``layers``: the importing
    file and line, the module imported, and both layers."""
    level = {unit: index for index, members in enumerate(layers) for unit in members}
    name = package.name
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        source = layer_unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for node in import_nodes(path.read_text(encoding="utf-8"), name):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif node.module is not None:
                # ``from pkg import room`` imports the room; ``from pkg import name``, __init__.
                targets = [
                    f"{node.module}.{alias.name}"
                    if node.module == name and alias.name in level
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            for target in dict.fromkeys(targets):
                if target != name and not target.startswith(f"{name}."):
                    continue
                unit = layer_unit(target)
                if unit != source and level[unit] >= level[source]:
                    where = "beside it" if level[unit] == level[source] else "above it"
                    found.append(
                        f"{path.relative_to(package.parent)}:{node.lineno}: {source} imports "
                        f"{target}, {where} (layers: tests/test_layout.py LAYERS)"
                    )
    return found


def imported_modules(path: Path) -> set[str]:
    """The package's modules that ``path`` imports: at module level, inside functions (an
    import moved into a function still ties the two modules) and under ``if TYPE_CHECKING:``
    (a type is a dependency too)."""
    found: set[str] = set()
    for node in import_nodes(path.read_text(encoding="utf-8")):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif node.module is not None:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in MODULES}


def test_a_type_checking_import_ties_two_modules(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pytest_ctresources.report.results import TestResult\n"
        "def f():\n"
        "    from pytest_ctresources.units import GIB\n"
    )
    assert imported_modules(module) == {
        "pytest_ctresources.report.results",
        "pytest_ctresources.units",
    }


def import_graph() -> dict[str, set[str]]:
    return {name: imported_modules(path) - {name} for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the walk found the package
    assert cycles(graph) == []


def test_every_room_and_top_level_module_has_a_layer() -> None:
    members = [unit for layer in LAYERS for unit in layer]
    assert len(members) == len(set(members))
    assert set(members) == set(ROOMS) | TOP_LEVEL | {"__init__"}


def test_the_layer_check_catches_what_points_up_or_beside(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for room in ("low", "high", "side"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.high.b import B\n"
        "def later():\n"
        "    import pkg.side.c\n"
    )
    (package / "high" / "b.py").write_text(
        "from pkg.low.a import later\nfrom pkg import side\nfrom pkg.high import b\n"
    )
    (package / "side" / "c.py").write_text(
        "from pkg.low import a\n"
        "DOC = 'from pkg we take nothing'\n"
        'KERNEL = """\nimport os\nif os:\n    from pkg.high import b\n"""\n'
    )
    found = upward_imports(package, (("low",), ("high", "side")))
    assert found == [
        "pkg/high/b.py:2: high imports pkg.side, beside it (layers: tests/test_layout.py LAYERS)",
        "pkg/low/a.py:3: low imports pkg.high.b, above it (layers: tests/test_layout.py LAYERS)",
        "pkg/low/a.py:5: low imports pkg.side.c, above it (layers: tests/test_layout.py LAYERS)",
        "pkg/side/c.py:6: side imports pkg.high, beside it (layers: tests/test_layout.py LAYERS)",
    ]


def test_the_package_imports_point_down() -> None:
    found = upward_imports(PACKAGE, LAYERS)
    if found:
        pytest.fail("\n".join(found), pytrace=False)


def test_every_module_sits_in_a_room() -> None:
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL
    assert set(ROOMS) == {
        "bundled",
        "core",
        "estimator",
        "gpu",
        "leases",
        "notebooks",
        "report",
        "session",
        "settings",
        "xdist",
    }


def test_production_code_does_not_import_the_test_helpers() -> None:
    # pytest_ctresources.testing is the public module for test authors; the plugin reads the
    # bundled models' names from bundled/catalogue.py instead.
    importers = [
        name
        for name, path in MODULES.items()
        if name != "pytest_ctresources.testing"
        and "pytest_ctresources.testing" in imported_modules(path)
    ]
    assert importers == []


_IMPORT_ROOM = """
import importlib, sys
heavy = set(sys.argv[2].split(","))
allowed = dict(a.split("=") for a in sys.argv[3].split(";") if a)

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in heavy - BLOCK_EXEMPT:
            raise ImportError(f"{name} imported while importing {CURRENT}")
        return None

sys.meta_path.insert(0, Blocked())
for CURRENT in sys.argv[1].split(","):
    BLOCK_EXEMPT = set(allowed.get(CURRENT, "").split(",")) - {""}
    importlib.import_module(CURRENT)
print("imported", len(sys.argv[1].split(",")))
"""


@pytest.mark.parametrize("room", [*ROOMS, "top"])
def test_each_room_imports_in_a_fresh_interpreter_without_torch(room: str) -> None:
    if room == "top":
        names = [module_name(PACKAGE / f"{name}.py") for name in sorted(TOP_LEVEL)]
    else:
        names = sorted(name for name in MODULES if name.startswith(f"pytest_ctresources.{room}"))
    allowed = ";".join(f"{name}={','.join(sorted(libs))}" for name, libs in ALLOWED.items())
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ROOM, ",".join(names), ",".join(HEAVY), allowed],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1:]
    assert result.stdout.strip() == f"imported {len(names)}"
