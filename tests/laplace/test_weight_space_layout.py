"""The floor plan of ``ntkgp.laplace.weight_space``: one folder per approximation (its curvature and its posterior),
below them what several approximations share (``posterior``, ``layers``), above them the front door
(``structures``, ``laplace_posterior``, the package's ``__init__``).

The checks read the package's source (``ast``, the reader of ``test_space_choice``), so they fail as soon as a module
adds an import that runs up the plan or closes a circle."""

from __future__ import annotations

from pathlib import Path

import pytest

import ntkgp.laplace.weight_space
from tests.laplace.test_space_choice import _imports

WING = Path(ntkgp.laplace.weight_space.__file__).parent
PACKAGE = "ntkgp.laplace.weight_space"
APPROXIMATIONS = ("full", "kfac", "diagonal", "subnetwork", "last_layer")
SHARED = ("posterior", "layers")
FRONT = ("structures", "laplace_posterior")


def _module(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package: its ``__init__``)."""
    parts = path.relative_to(WING).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


MODULES = {_module(path): path for path in sorted(WING.rglob("*.py"))}


def _wing_imports(path: Path) -> set[str]:
    """The modules of the wing that ``path`` imports (a name imported from a module counts as that module)."""
    return {name for name in _imports(path) if name in MODULES}


def _under(module: str, folders: tuple[str, ...]) -> bool:
    return any(module == f"{PACKAGE}.{f}" or module.startswith(f"{PACKAGE}.{f}.") for f in folders)


def test_the_plan_names_every_folder_of_the_wing():
    folders = {p.name for p in WING.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(APPROXIMATIONS + SHARED)
    tops = {p.stem for p in WING.glob("*.py")} - {"__init__"}
    assert tops == set(FRONT)


@pytest.mark.parametrize("shared", SHARED)
def test_the_shared_floor_imports_no_approximation_and_no_front_door(shared):
    """Above all, ``posterior`` (the base of every posterior and its state dict) names no curvature class of an
    approximation: each posterior class names its own."""
    files = [p for m, p in MODULES.items() if _under(m, (shared,))]
    assert files
    found = {str(p.relative_to(WING)): sorted(m for m in _wing_imports(p)
                                              if _under(m, APPROXIMATIONS + FRONT) or m == PACKAGE)
             for p in files}
    assert not {name: hits for name, hits in found.items() if hits}


@pytest.mark.parametrize("approximation", APPROXIMATIONS)
def test_an_approximation_imports_no_front_door(approximation):
    files = [p for m, p in MODULES.items() if _under(m, (approximation,))]
    assert files
    found = {str(p.relative_to(WING)): sorted(m for m in _wing_imports(p) if _under(m, FRONT) or m == PACKAGE)
             for p in files}
    assert not {name: hits for name, hits in found.items() if hits}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first search meets: a module met again on the current path closes one."""
    state, circles = {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return circles


def test_the_wing_has_no_import_circle():
    graph = {m: _wing_imports(p) - {m} for m, p in MODULES.items()}
    # the reader sees the imports across folders
    assert graph[f"{PACKAGE}.kfac.laplace"] >= {f"{PACKAGE}.kfac.curvature", f"{PACKAGE}.posterior.weight_posterior"}
    assert not _circles(graph)


def test_the_circle_search_finds_a_circle():
    """The search on a graph with a circle (a → b → c → a, d → a) reports it: the test above can fail."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
