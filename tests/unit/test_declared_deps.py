"""Every third-party module the package imports is a declared dependency, with a lower bound.

An import that works here only because something else pulled its package in (tqdm through Lightning, numpy through
scikit-learn) breaks the day that other package drops it. The package's source is scanned for imports (in
functions too: tqdm is imported where the bench's progress bar starts); each import name is mapped to its
distribution with ``importlib.metadata.packages_distributions()`` and must be in pyproject's ``dependencies``
or one of its extras. An import that runs when its module is imported must be a core dependency: an extra may
be missing, and then ``import lightning_sync...`` itself would fail.
"""

from __future__ import annotations

import ast
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_sync"


def _requirements() -> tuple[dict[str, Requirement], dict[str, dict[str, Requirement]]]:
    """(core, {extra: requirements}) of pyproject.toml, keyed by canonical distribution name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def parse(specs: list[str]) -> dict[str, Requirement]:
        return {canonicalize_name(r.name): r for r in map(Requirement, specs)}

    extras = {name: parse(specs) for name, specs in project.get("optional-dependencies", {}).items()}
    return parse(project["dependencies"]), extras


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(top-level module name, line, runs at module import) of every absolute import in ``tree``, skipping
    ``if TYPE_CHECKING:`` blocks (they never run)."""
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, at_import: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, at_import)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name.split(".")[0], node.lineno, at_import) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno, at_import))
        inner = at_import and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return found


def _third_party() -> dict[str, list[tuple[str, bool]]]:
    """import name -> [(``path:line``, runs at module import)] for every module outside the stdlib and ours."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, line, at_import in _imports(ast.parse(path.read_text(), str(path))):
            if name in sys.stdlib_module_names or name in ("__future__", "lightning_sync"):
                continue
            out.setdefault(name, []).append((f"{path.relative_to(ROOT)}:{line}", at_import))
    return out


@pytest.fixture(scope="module")
def imports() -> dict[str, list[tuple[str, bool]]]:
    return _third_party()


def test_every_imported_distribution_is_declared(imports) -> None:
    core, extras = _requirements()
    declared = set(core).union(*extras.values())
    mapping = packages_distributions()
    unknown = {name: sites[0][0] for name, sites in imports.items() if name not in mapping}
    assert not unknown, f"imports no installed distribution provides: {unknown}"
    undeclared = {
        name: sites[0][0]
        for name, sites in imports.items()
        if not {canonicalize_name(d) for d in mapping[name]} & declared
    }
    assert not undeclared, (
        f"imported but not in pyproject's dependencies or extras (import name: first use): {undeclared}"
    )


def test_imports_at_module_import_are_core_dependencies(imports) -> None:
    core, _ = _requirements()
    mapping = packages_distributions()
    optional = {
        name: [site for site, at_import in sites if at_import]
        for name, sites in imports.items()
        if not {canonicalize_name(d) for d in mapping.get(name, [])} & set(core)
    }
    eager = {name: sites for name, sites in optional.items() if sites}
    assert not eager, (
        "imported when a lightning_sync module is imported, but not a core dependency (declare it, or import it "
        f"lazily if it belongs to an extra): {eager}"
    )


def test_every_requirement_has_a_lower_bound() -> None:
    core, extras = _requirements()
    for where, reqs in [("dependencies", core), *((f"extra {e!r}", r) for e, r in extras.items())]:
        for req in reqs.values():
            assert any(s.operator in (">=", "==", "~=", ">") for s in req.specifier), (
                f"{where}: {req} has no lower bound"
            )


def test_the_scan_sees_lazy_and_eager_imports(imports) -> None:
    """The scan is only as good as what it finds: a function-level import (tqdm, the bench's progress bar) and a
    module-level one (torch)."""
    assert ("tqdm" in imports) and not any(at_import for _, at_import in imports["tqdm"]), imports.get("tqdm")
    assert any(at_import for _, at_import in imports["torch"])
