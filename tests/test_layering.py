# Copyright (c) the fairscale-maintained contributors. Licensed under the BSD license in LICENSE.
"""The layer order of the package, checked statically on the source (nothing of fairscale is imported).

Every ``import`` / ``from ... import`` of a fairscale module counts, wherever it is written: at module level,
inside a function (a function-local import still ties the two modules together, it only hides the circle until
run time) and under ``if TYPE_CHECKING:`` (the types still couple the modules). Rules:

* no import cycle anywhere in ``fairscale`` (the three packages of the FSDP stack are also checked on their own,
  for shorter messages);
* ``fairscale.internal`` is the lowest layer: it imports nothing from ``nn``, ``optim``, ``experimental`` or
  ``fair_dev``;
* private machinery imports only downward: ``fairscale.nn.data_parallel._fsdp`` never imports the FSDP fronts,
  and ``fairscale.nn.misc._flatten`` never imports ``flatten_params_wrapper``; the fronts import the machinery
  (a package ``__init__`` re-exporting its fronts is fine).

Modules are named by their dotted path; a package's ``__init__.py`` is ``<package>.__init__``.
"""

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fairscale"

CYCLE_FREE_PACKAGES = ("fairscale.internal", "fairscale.nn.data_parallel", "fairscale.nn.misc", "fairscale")
LOWEST_LAYER = "fairscale.internal"
ABOVE_LOWEST_LAYER = ("fairscale.nn", "fairscale.optim", "fairscale.experimental", "fairscale.fair_dev")
FSDP_MACHINERY = "fairscale.nn.data_parallel._fsdp"
FSDP_FRONTS = (
    "fairscale.nn.data_parallel.fully_sharded_data_parallel",
    "fairscale.nn.data_parallel.__init__",
    "fairscale.nn.data_parallel.fsdp_optim_utils",
    "fairscale.nn.data_parallel.consolidate",
    "fairscale.nn.__init__",
)
FLATTEN_MACHINERY = "fairscale.nn.misc._flatten"
FLATTEN_FRONTS = (
    "fairscale.nn.misc.flatten_params_wrapper",
    "fairscale.nn.misc.__init__",
    "fairscale.nn.__init__",
)


@dataclass(frozen=True)
class ImportEdge:
    """One import statement's dependency of ``importer`` on ``imported`` (both dotted module names)."""

    importer: str
    imported: str
    path: str  # the importing file, relative to the tree's root
    line: int

    @property
    def pair(self) -> Tuple[str, str]:
        return (self.importer, self.imported)

    def describe(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


@dataclass
class ImportGraph:
    modules: Dict[str, Path]  # dotted name -> file; packages appear as "<package>.__init__"
    edges: List[ImportEdge]

    def is_package(self, dotted: str) -> bool:
        return dotted + ".__init__" in self.modules

    def node(self, dotted: str) -> Optional[str]:
        """The graph node that importing ``dotted`` loads, or ``None`` when it is not a module of the tree."""
        if self.is_package(dotted):
            return dotted + ".__init__"
        return dotted if dotted in self.modules else None


# ----------------------------------------------------------------------------------------------- graph builder


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts)  # "pkg/__init__.py" -> "pkg.__init__"


def _current_package(module: str) -> str:
    """The package relative imports of ``module`` start from (for an ``__init__`` it is the package itself)."""
    return module.rsplit(".", 1)[0]


def _resolve_relative(module: str, level: int, name: Optional[str]) -> str:
    base = _current_package(module).split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _targets(graph: ImportGraph, module: str, node: ast.AST) -> Iterable[str]:
    """The fairscale modules an import statement depends on (see the module docstring for the rules)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _longest_module_prefix(graph, alias.name)
            if target is not None:
                yield target
    elif isinstance(node, ast.ImportFrom):
        source = _resolve_relative(module, node.level, node.module) if node.level else (node.module or "")
        for alias in node.names:
            # "from pkg import name": the submodule when name is one, else the package (its __init__) or module.
            target = graph.node(f"{source}.{alias.name}") or _longest_module_prefix(graph, source)
            if target is not None:
                yield target


def _longest_module_prefix(graph: ImportGraph, dotted: str) -> Optional[str]:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        target = graph.node(".".join(parts[:end]))
        if target is not None:
            return target
    return None


def build_graph(root: Path, package: str) -> ImportGraph:
    """Parse every ``.py`` file of ``root/package`` and collect its imports of modules of that tree."""
    files = sorted((root / package).rglob("*.py"))
    graph = ImportGraph(modules={_module_name(root, f): f for f in files}, edges=[])
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                # dict.fromkeys: one edge per imported module and statement, in the statement's order.
                for target in dict.fromkeys(_targets(graph, module, node)):
                    if target != module:
                        graph.edges.append(ImportEdge(module, target, rel, node.lineno))
    graph.edges.sort(key=lambda e: (e.path, e.line, e.imported))
    return graph


@functools.lru_cache(maxsize=None)
def package_graph() -> ImportGraph:
    return build_graph(ROOT, PACKAGE)


# ------------------------------------------------------------------------------------------------------- rules


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycles(edges: Sequence[ImportEdge], package: str, limit: int = 200) -> List[List[ImportEdge]]:
    """Elementary import cycles among the modules of ``package``, each as its edges in order.

    Each cycle is reported once, starting at its alphabetically first module.
    """
    succ: Dict[str, Dict[str, ImportEdge]] = {}
    for e in edges:
        if _in(e.importer, package) and _in(e.imported, package):
            succ.setdefault(e.importer, {}).setdefault(e.imported, e)
    cycles: List[List[ImportEdge]] = []
    for start in sorted(succ):
        # Only visit modules after `start`, so that each cycle is found from its smallest module only.
        stack: List[Tuple[str, List[ImportEdge]]] = [(start, [])]
        while stack and len(cycles) < limit:
            node, path = stack.pop()
            for nxt, edge in sorted(succ.get(node, {}).items(), reverse=True):
                if nxt == start:
                    cycles.append(path + [edge])
                elif nxt > start and nxt not in {e.imported for e in path}:
                    stack.append((nxt, path + [edge]))
    return cycles


def describe_cycle(cycle: Sequence[ImportEdge]) -> str:
    chain = " -> ".join([cycle[0].importer] + [e.imported for e in cycle])
    where = "; ".join(f"{e.path}:{e.line}" for e in cycle)
    return f"{chain}  ({where})"


def forbidden_imports(
    edges: Sequence[ImportEdge], importer_package: str, is_forbidden: Callable[[str], bool]
) -> List[ImportEdge]:
    return [e for e in edges if _in(e.importer, importer_package) and is_forbidden(e.imported)]


def _report(title: str, lines: List[str]) -> str:
    return title + ":\n  " + "\n  ".join(lines)


# ------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("package", CYCLE_FREE_PACKAGES)
def test_no_import_cycles(package: str) -> None:
    cycles = find_cycles(package_graph().edges, package)
    assert not cycles, _report(f"import cycles in {package}", [describe_cycle(c) for c in cycles])


def test_internal_is_the_lowest_layer() -> None:
    bad = forbidden_imports(
        package_graph().edges, LOWEST_LAYER, lambda m: any(_in(m, upper) for upper in ABOVE_LOWEST_LAYER)
    )
    assert not bad, _report("fairscale.internal imports from a higher layer", [e.describe() for e in bad])


def test_fsdp_machinery_does_not_import_its_fronts() -> None:
    bad = forbidden_imports(package_graph().edges, FSDP_MACHINERY, lambda m: m in FSDP_FRONTS)
    assert not bad, _report("fairscale.nn.data_parallel._fsdp imports a front", [e.describe() for e in bad])


def test_flatten_machinery_does_not_import_its_front() -> None:
    bad = forbidden_imports(package_graph().edges, FLATTEN_MACHINERY, lambda m: m in FLATTEN_FRONTS)
    assert not bad, _report("fairscale.nn.misc._flatten imports a front", [e.describe() for e in bad])


def test_graph_covers_the_package() -> None:
    # No timing assertion: a loaded CI machine is slower by any factor (speed is not what this test is for).
    graph = build_graph(ROOT, PACKAGE)
    assert "fairscale.nn.misc.flatten_params_wrapper" in graph.modules
    assert ("fairscale.nn.misc.__init__", "fairscale.nn.misc.flatten_params_wrapper") in {e.pair for e in graph.edges}


# ---------------------------------------------------------------------------------------------------- self-test


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_builder_detects_cycles_and_upward_imports(tmp_path: Path) -> None:
    """The rules fail on a tree that breaks them (so a passing run means something)."""
    _write(tmp_path, "pkg/__init__.py", "from . import low\n")
    _write(tmp_path, "pkg/low/__init__.py", "")
    _write(tmp_path, "pkg/low/a.py", "from . import b\n")  # a -> b (submodule via "from . import")
    _write(tmp_path, "pkg/low/b.py", "def f():\n    from pkg.low.c import g\n")  # b -> c, function-local
    _write(  # c -> a under TYPE_CHECKING closes the circle; c -> pkg.up is an upward import
        tmp_path,
        "pkg/low/c.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\nimport pkg.up.front\n",
    )
    _write(tmp_path, "pkg/up/__init__.py", "")
    _write(tmp_path, "pkg/up/front.py", "from ..low import a\nfrom pkg.low import helper_name\n")
    graph = build_graph(tmp_path, "pkg")
    pairs = {e.pair for e in graph.edges}
    assert ("pkg.up.front", "pkg.low.a") in pairs
    assert ("pkg.up.front", "pkg.low.__init__") in pairs  # a name that is not a submodule: the package
    assert ("pkg.__init__", "pkg.low.__init__") in pairs

    cycles = find_cycles(graph.edges, "pkg.low")
    assert [[e.importer for e in c] for c in cycles] == [["pkg.low.a", "pkg.low.b", "pkg.low.c"]]
    assert describe_cycle(cycles[0]).startswith("pkg.low.a -> pkg.low.b -> pkg.low.c -> pkg.low.a  (pkg/low/a.py:1;")
    assert [c.line for c in cycles[0]] == [1, 2, 3]

    upward = forbidden_imports(graph.edges, "pkg.low", lambda m: _in(m, "pkg.up"))
    assert [e.describe() for e in upward] == ["pkg/low/c.py:4: pkg.low.c imports pkg.up.front"]
    assert not find_cycles(graph.edges, "pkg.up")
