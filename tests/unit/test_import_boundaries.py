"""Import boundaries of the package.

- ``lightning_sync``, ``lightning_sync.comms`` and ``lightning_sync.sync`` (and every module under the last
  two) import no Lightning: checked in a fresh interpreter, from its ``sys.modules`` after each import.
- The package root exports its public names lazily, and the strategy names still reach Lightning's
  ``StrategyRegistry`` whichever of Lightning and lightning_sync is imported first.
- No import cycles among lightning_sync's modules, counting the imports inside functions too
  (:func:`test_no_import_cycles`), and every import points down the layers of :data:`LAYERS`
  (:func:`test_imports_point_down_the_layers`).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_sync

PACKAGE = Path(lightning_sync.__file__).resolve().parent
LIGHTNING_ROOTS = ("lightning", "lightning_fabric", "pytorch_lightning")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
LIGHTNING_FREE = ["lightning_sync"] + [
    name
    for name in MODULES
    if name.split(".")[:2]
    in (["lightning_sync", "comms"], ["lightning_sync", "sync"], ["lightning_sync", "checkpoint"])
]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240, env=env
    )


def _imported_in_turn(steps: dict[str, list[str]]) -> dict[str, tuple[list[str], list[str]]]:
    """In one fresh interpreter, import each step's modules in turn; after each step, the Lightning modules and
    the ``lightning_sync`` modules loaded so far."""
    result = _run(
        f"""
        import importlib, json, sys
        roots, seen = {LIGHTNING_ROOTS!r}, {{}}
        for label, modules in {steps!r}.items():
            for module in modules:
                importlib.import_module(module)
            seen[label] = (
                sorted(n for n in sys.modules if n.split(".")[0] in roots),
                sorted(n for n in sys.modules if n.startswith("lightning_sync")),
            )
        print(json.dumps(seen))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


SBATCH_STEP = "the sbatch renderer"
# one fresh interpreter imports the three packages, then every module under comms/ and sync/, checking after each
# step: a step that pulls Lightning in is named (what they import together is the union of what each imports, so
# a module that pulls Lightning in shows in the last step; the static test below names it)
FRESH_IMPORTS = {
    "lightning_sync": ["lightning_sync"],
    "lightning_sync.comms": ["lightning_sync.comms"],
    "lightning_sync.sync": ["lightning_sync.sync"],
    "every module under comms/ and sync/": LIGHTNING_FREE[1:],
    # ``lightning-sync sbatch`` renders a script on a login node: it must not wait for Lightning's import
    SBATCH_STEP: ["lightning_sync.launch", "lightning_sync.launch.sbatch"],
}


def test_lightning_free_modules_import_no_lightning() -> None:
    """Nothing of Lightning, and none of the adapter layers (strategies, diagnostics, launch, models, bench,
    cli) that would pull it in."""
    allowed = {"lightning_sync", "lightning_sync._checks", "lightning_sync._registration"}
    for label, (lightning, ours) in _imported_in_turn(FRESH_IMPORTS).items():
        assert not lightning, f"importing {label} (after the steps before it) imports Lightning: {lightning[:8]}"
        if label == SBATCH_STEP:  # an adapter itself, under launch/
            continue
        adapters = [n for n in ours if n not in allowed and n.split(".")[1] not in ("comms", "sync", "checkpoint")]
        assert not adapters, f"importing {label} imports lightning_sync modules outside comms/sync: {adapters}"


def test_lightning_free_modules_name_no_lightning_anywhere() -> None:
    """The static side of the check above, covering imports inside functions too: no module under comms/ or
    sync/ names Lightning in any import statement."""
    offenders = []
    for name in LIGHTNING_FREE:
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            offenders += [f"{name}:{node.lineno} {t}" for t in targets if t.split(".")[0] in LIGHTNING_ROOTS]
    assert not offenders, offenders


def test_public_names_are_lazy_and_importable() -> None:
    result = _run(
        """
        import sys
        import lightning_sync
        assert "lightning_sync.strategies" not in sys.modules and "lightning" not in sys.modules
        assert set(lightning_sync.__all__) <= set(dir(lightning_sync)), dir(lightning_sync)
        from lightning_sync import *  # noqa: F403
        from lightning_sync import ShardedStrategy, comms
        import lightning_sync.strategies as strategies
        assert ShardedStrategy is strategies.ShardedStrategy and comms is sys.modules["lightning_sync.comms"]
        for name in lightning_sync.__all__:
            assert getattr(lightning_sync, name) is not None, name
        try:
            lightning_sync.NoSuchName
        except AttributeError as error:
            assert "NoSuchName" in str(error)
        else:
            raise AssertionError("lightning_sync.NoSuchName did not raise AttributeError")
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.parametrize("lightning_first", [False, True], ids=["lightning_sync-first", "lightning-first"])
def test_strategy_names_resolve_after_import_lightning_sync(lightning_first: bool) -> None:
    """``import lightning_sync`` then ``Trainer(strategy="zero3")`` works in either import order, without
    importing the strategies before a Trainer asks for one."""
    imports = ["import lightning_sync", "from lightning.pytorch import Trainer"]
    result = _run(
        f"""
        import sys
        {imports[1] if lightning_first else imports[0]}
        {imports[0] if lightning_first else imports[1]}
        import lightning
        assert "lightning_sync.strategies" not in sys.modules
        assert type(lightning.__loader__).__name__ != "_ThenRegister"  # the import hook left no trace
        from lightning_sync._registration import _Hook
        assert not any(isinstance(f, _Hook) for f in sys.meta_path)
        trainer = Trainer(strategy="zero3", accelerator="cpu", devices=1, logger=False, barebones=True)
        from lightning_sync import ShardedStrategy
        assert type(trainer.strategy) is ShardedStrategy and trainer.strategy.stage == 3, trainer.strategy
        trainer = Trainer(strategy="local_sgd", accelerator="cpu", devices=1, logger=False, barebones=True)
        assert type(trainer.strategy).__name__ == "LocalSGDStrategy", trainer.strategy
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_placeholder_names_are_the_registered_names() -> None:
    """:data:`lightning_sync._registration.STRATEGY_NAMES` lists exactly what the strategy classes register."""
    import lightning_sync.strategies as strategies
    from lightning_sync._registration import STRATEGY_NAMES

    class Recorder(dict):
        def register(self, name: str, strategy: object, description: str | None = None, **params: object) -> None:
            self[name] = strategy

    recorder = Recorder()
    for name in strategies.__all__:
        getattr(strategies, name).register_strategies(recorder)
    assert set(recorder) == set(STRATEGY_NAMES)

    from lightning.pytorch.strategies import StrategyRegistry

    for name in STRATEGY_NAMES:  # the real classes replaced the placeholders
        assert isinstance(StrategyRegistry[name]["strategy"], type), name


# ---------------------------------------------------------------------------------------------- import graph
def import_statements(modules: dict[str, Path] = MODULES) -> list[tuple[str, str, int]]:
    """``(importer, imported, line)`` for every import statement of one lightning_sync module by another.

    Counted: every ``import``/``from ... import`` statement wherever it stands (module level, class bodies,
    ``try``/``if`` blocks, inside functions: an import that runs at call time is still a dependency, and a
    circle through it is still a circle; and ``if TYPE_CHECKING:`` blocks: two modules that need each other's
    names, if only to annotate, are one idea split in two), relative ones resolved. Not counted: names loaded
    through ``importlib`` (the package root's and ``launch``'s lazy PEP 562 exports). ``from pkg import name``
    points to ``pkg.name`` when that is a module, else to ``pkg``. Parent packages are not targets: Python
    completes a package's ``__init__`` before its submodules run, and a package re-exporting its submodules is
    no cycle.
    """
    found: list[tuple[str, str, int]] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node: ast.AST, name: str = name, package: str = package) -> None:
            if isinstance(node, ast.Import):
                found.extend((name, alias.name, node.lineno) for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        found.append((name, f"{base}.{alias.name}", node.lineno))
                    elif base in modules:
                        found.append((name, base, node.lineno))
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text()))
    return list(dict.fromkeys(found))  # ``from m import a, b`` is one statement


def module_import_graph(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """``module -> the lightning_sync modules it imports`` (:func:`import_statements` says what counts)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for importer, imported, _ in import_statements(modules):
        graph[importer].add(imported)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:  # a path back to the group's first module, staying inside the group
        start = min(group)
        paths, seen = {start: [start]}, {start}
        frontier = [start]
        while frontier:
            v = frontier.pop(0)
            for w in sorted(graph[v] & group):
                if w == start:
                    cycles.append([*paths[v], start])
                    frontier = []
                    break
                if w not in seen:
                    seen.add(w)
                    paths[w] = [*paths[v], w]
                    frontier.append(w)
    return cycles


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_imports_inside_functions_too(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("from . import b\nA = 1\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n"
        "def late():\n    from pkg import d\nclass K:\n    from pkg.c import C\n"
    )
    (package / "c.py").write_text("import pkg.b\nC = 1\n")
    (package / "d.py").write_text("def later():\n    if True:\n        import pkg.b\n")
    modules = {"pkg": package / "__init__.py", **{f"pkg.{m}": package / f"{m}.py" for m in "abcd"}}
    assert {("pkg.d", "pkg.b", 3), ("pkg.b", "pkg.c", 3)} <= set(import_statements(modules))  # a function's, a type's
    graph = module_import_graph(modules)
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c", "pkg.d"},
        "pkg.c": {"pkg.b"},
        "pkg.d": {"pkg.b"},
    }
    assert find_cycles(graph) == [["pkg.b", "pkg.c", "pkg.b"]]  # one cycle through each circle of modules


def _imported_anywhere(path: Path) -> set[str]:
    """Every module an ``import`` statement of ``path`` names, at any level (functions, ``TYPE_CHECKING``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_context_and_algorithms_do_not_import_each_other() -> None:
    """The context holds the node groups the algorithms use, and the algorithms take a context: both depend on
    ``comms/topology.py`` instead, so neither names the other anywhere (inside a function, under
    ``TYPE_CHECKING``)."""
    context, algorithms = "lightning_sync.comms.context", "lightning_sync.comms.algorithms"
    assert context not in _imported_anywhere(MODULES[algorithms])
    assert algorithms not in _imported_anywhere(MODULES[context])


def test_no_import_cycles() -> None:
    """No cycle among lightning_sync's imports, those inside functions and for type checking included
    (:func:`import_statements`)."""
    cycles = find_cycles(module_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


# ---------------------------------------------------------------------------------------------- layers
#: Every top-level part of the package (a subpackage, or a module directly under ``lightning_sync/``; the
#: package's own ``__init__`` is ``lightning_sync``), lowest layer first. A module may import its own layer and
#: the layers below it, never one above (:func:`test_imports_point_down_the_layers`). The order:
#:
#: 1. leaf helpers: argument checks, the config's location, the optional dependencies, a child process's bond
#:    to its parent, and the global batch arithmetic; they import nothing of the package but each other;
#: 2. ``comms``, the collectives layer every byte goes through;
#: 3. ``sync`` (the algorithms) and ``checkpoint`` (reading and atomic writing of files), both free of
#:    Lightning; ``sync`` talks to ``comms`` and reads its checkpoints through ``checkpoint``;
#: 4. the Lightning glue the strategies are built from: Lightning's private internals (``_lightning``), the
#:    global sample order and exact resume;
#: 5. ``strategies``, one Lightning ``Strategy`` per synchronization method, composed of the layers below;
#: 6. the package's front: its ``__init__`` and ``_registration`` name the strategies for ``import
#:    lightning_sync`` and Lightning's ``StrategyRegistry`` (lazily, so that importing it stays cheap);
#: 7. what is used beside a strategy: callbacks (``diagnostics``, ``lr_rules``), cluster launching, the models;
#: 8. the applications: the command line, benchmarks, consolidation, and the multi-process test harness.
LAYERS: list[tuple[str, ...]] = [
    ("_checks", "_config", "_extras", "_process", "batch"),
    ("comms",),
    ("sync", "checkpoint"),
    ("_lightning", "sampler", "shares", "resume"),
    ("strategies",),
    ("lightning_sync", "_registration"),
    ("diagnostics", "launch", "lr_rules", "models"),
    ("bench", "cli", "cli_help", "consolidate", "testing", "__main__"),
]


def part_of(module: str) -> str:
    """``lightning_sync.sync.zero.engine`` -> ``sync``; the package itself is ``lightning_sync``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(
    statements: list[tuple[str, str, int]], layers: list[tuple[str, ...]], files: dict[str, Path]
) -> list[str]:
    """``file:line importer -> imported`` for each import that points to a higher layer than its importer's."""
    layer = {part: i for i, members in enumerate(layers) for part in members}
    return [
        f"{files[importer].relative_to(PACKAGE.parent)}:{line} {importer} (layer {layer[part_of(importer)] + 1}) "
        f"imports {imported} (layer {layer[part_of(imported)] + 1})"
        for importer, imported, line in statements
        if layer[part_of(imported)] > layer[part_of(importer)]
    ]


def test_every_part_of_the_package_has_one_layer() -> None:
    placed = [part for members in LAYERS for part in members]
    assert len(placed) == len(set(placed)), f"a part is in two layers: {placed}"
    assert {part_of(m) for m in MODULES} == set(placed), "give each part of the package one layer in LAYERS"


def test_layer_check_names_an_upward_import() -> None:
    files = {"lightning_sync.comms.x": PACKAGE / "comms" / "x.py", "lightning_sync.sync.y": PACKAGE / "sync" / "y.py"}
    statements = [
        ("lightning_sync.comms.x", "lightning_sync.sync.y", 7),
        ("lightning_sync.sync.y", "lightning_sync.comms.x", 3),
    ]
    assert layer_violations(statements, LAYERS, files) == [
        "lightning_sync/comms/x.py:7 lightning_sync.comms.x (layer 2) imports lightning_sync.sync.y (layer 3)"
    ]


def test_imports_point_down_the_layers() -> None:
    """No import statement, at module level or inside a function, reaches a higher layer (:data:`LAYERS`)."""
    offenders = layer_violations(import_statements(), LAYERS, MODULES)
    assert not offenders, "imports that point up a layer:\n" + "\n".join(offenders)
