"""The package layering stays true (issue 12, deliver 8): no import cycle between packages, no upward import.

Every module under dreamp2p/ is parsed with `ast` (nothing is imported) and each import is mapped to a
*unit*: a first-level subpackage (``dreamp2p.sync``, ``dreamp2p.transport``, ...), a top-level module
(``dreamp2p.peer``, ``dreamp2p.node``, ...) or the package root itself (``dreamp2p``, its ``__init__``:
the public facade). Imports inside a unit are ignored; every other one is an edge of the unit graph.
All imports count: module level, inside functions (lazy) and under ``TYPE_CHECKING``, because each one
ties the two units together. Module paths that are only strings (``importlib`` job specs) are not imports.

The order, highest first (a unit may import its own tier or any tier below it, never one above):

    devtools -> service, cli, dreamp2p -> node -> sync -> schedule -> peer
             -> collective, compression, state -> transport -> leaves

The leaves (messages, errors, config, v1, settings, manifest, statemeta, logformat) are what anyone may import. Today's
violations are listed in ALLOWED, each with why it exists; issue 12 removes them, and an entry whose edge
is gone or no longer breaks a rule must leave the list (test_every_allowed_violation_still_exists).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "dreamp2p"

# Highest first. A unit may import a unit of its own tier or of any tier below it.
TIERS: tuple[frozenset[str], ...] = (
    frozenset({"devtools"}),  # dev tools and benchmarks: nothing a running node imports
    # a node; the console script (the cli package: its subcommands and their arg types); root
    frozenset({"service", "cli", "__main__", "dreamp2p"}),
    frozenset({"node"}),  # what the user's training loop holds (Node, attach, join)
    frozenset({"sync"}),  # the torch side: strategies, comm thread, layer buffers
    frozenset({"schedule"}),  # pure plans that the strategies follow (the planner)
    frozenset({"peer"}),  # the asyncio peer and its membership views
    frozenset({"collective", "compression", "state"}),  # ring protocol, codecs, state transfer
    frozenset({"transport"}),  # the only code touching gRPC
    # leaves anyone may import
    frozenset({"messages", "errors", "config", "v1", "settings", "manifest", "statemeta", "logformat"}),
)

Edge = tuple[str, str]

# Today's violations, (importer, imported). Each exists for the reason given and goes with issue 12.
ALLOWED: frozenset[Edge] = frozenset()


@dataclass(frozen=True)
class Import:
    """One import statement that crosses units: where it is and what it names."""

    src: str
    dst: str
    path: str  # relative to the repository root
    line: int
    target: str  # the dotted module it imports

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


Graph = Mapping[Edge, list[Import]]


def module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` names its package)."""
    out: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def unit_of(module: str) -> str:
    """``dreamp2p.sync.base`` -> ``sync``; ``dreamp2p.peer`` -> ``peer``; ``dreamp2p`` -> ``dreamp2p``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imported_modules(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> Iterator[tuple[str, int]]:
    """(dotted module, line) for every import in the tree; ``from X import name`` names X.name when that
    is a module, else X. Relative imports are resolved against ``module``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield (sub if sub in known else source), node.lineno


def import_graph(package_dir: Path = PACKAGE_DIR) -> tuple[set[str], dict[Edge, list[Import]]]:
    """Every unit of the package, and the imports between units grouped by (importer, imported)."""
    files = module_files(package_dir)
    name = package_dir.name
    units = {unit_of(m) for m in files}
    known = set(files)
    graph: dict[Edge, list[Import]] = defaultdict(list)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, line in imported_modules(tree, module, path.name == "__init__.py", known):
            if target != name and not target.startswith(name + "."):
                continue  # third-party or standard library
            src, dst = unit_of(module), unit_of(target)
            if src != dst:
                rel = path.relative_to(package_dir.parent).as_posix()
                imp = Import(src, dst, rel, line, target)
                if imp not in graph[(src, dst)]:  # `from X import a, b` is one import of X
                    graph[(src, dst)].append(imp)
    return units, {edge: sorted(imps, key=lambda i: (i.path, i.line)) for edge, imps in graph.items()}


def tier_of(unit: str) -> int:
    for i, tier in enumerate(TIERS):
        if unit in tier:
            return i
    raise KeyError(unit)


def upward_edges(graph: Graph) -> set[Edge]:
    """Edges whose importer sits in a lower tier than what it imports."""
    return {(src, dst) for src, dst in graph if tier_of(src) > tier_of(dst)}


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan), each sorted, sorted."""
    succ: dict[str, list[str]] = defaultdict(list)
    for src, dst in edges:
        succ[src].append(dst)
        succ.setdefault(dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(edges: Iterable[Edge], graph: Graph) -> str:
    """One block per edge: the edge, then each import statement behind it (module:line)."""
    lines = []
    for edge in sorted(edges):
        lines.append(f"  {edge[0]} -> {edge[1]}")
        lines.extend(f"      {imp}" for imp in graph.get(edge, []))
    return "\n".join(lines)


def format_graph(graph: Graph) -> str:
    """The unit graph, one line per importer, with the tier of each unit (0 = top)."""
    by_src: dict[str, list[str]] = defaultdict(list)
    for src, dst in sorted(graph):
        by_src[src].append(dst)
    return "\n".join(
        f"  [{tier_of(src)}] {src} -> {', '.join(f'{d}[{tier_of(d)}]' for d in dsts)}"
        for src, dsts in sorted(by_src.items(), key=lambda kv: (tier_of(kv[0]), kv[0]))
    )


def upward_problems(graph: Graph, allowed: frozenset[Edge] = ALLOWED) -> list[str]:
    """The upward imports not in ``allowed``, as one message (empty list: none)."""
    upward = upward_edges(graph) - allowed
    if not upward:
        return []
    return [
        "imports against the layer order (importer in a lower tier than what it imports; see TIERS):\n"
        + describe(upward, graph)
    ]


def cycle_problems(graph: Graph, allowed: frozenset[Edge] = ALLOWED) -> list[str]:
    """One message per import cycle between units left once the ``allowed`` edges are taken out."""
    kept = [edge for edge in graph if edge not in allowed]
    problems = []
    for component in cycles(kept):
        inside = [edge for edge in kept if edge[0] in component and edge[1] in component]
        problems.append(f"import cycle between {', '.join(component)}:\n" + describe(inside, graph))
    return problems


def check(graph: Graph, allowed: frozenset[Edge] = ALLOWED) -> list[str]:
    """Every failure of the rules (upward imports, then cycles) not covered by ``allowed``."""
    return upward_problems(graph, allowed) + cycle_problems(graph, allowed)


def test_every_unit_has_one_tier() -> None:
    units, _ = import_graph()
    placed = [unit for tier in TIERS for unit in tier]
    assert len(placed) == len(set(placed)), "a unit is listed in two tiers"
    missing = sorted(units - set(placed))
    assert not missing, f"units with no place in TIERS (add each where it belongs): {missing}"
    gone = sorted(set(placed) - units)
    assert not gone, f"TIERS names units that no longer exist under dreamp2p/: {gone}"


def test_no_upward_import() -> None:
    _, graph = import_graph()
    problems = upward_problems(graph)
    assert not problems, "\n\n".join([*problems, "the unit graph today, [tier]:\n" + format_graph(graph)])


def test_no_import_cycle_between_packages() -> None:
    _, graph = import_graph()
    problems = cycle_problems(graph)
    assert not problems, "\n\n".join([*problems, "the unit graph today, [tier]:\n" + format_graph(graph)])


def test_every_allowed_violation_still_exists() -> None:
    """An entry leaves ALLOWED once its edge is gone, or the rules pass without it (no longer a violation)."""
    _, graph = import_graph()
    stale = sorted(edge for edge in ALLOWED if edge not in graph or not check(graph, ALLOWED - {edge}))
    assert not stale, f"ALLOWED lists edges that no longer exist or no longer violate the layering; remove: {stale}"


def _package(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "dreamp2p" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "dreamp2p"


def test_the_check_names_a_new_upward_import_and_the_cycle_it_closes(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "node.py": "from dreamp2p.sync.base import Strategy\n",
            "sync/__init__.py": "",
            "sync/base.py": "import torch\n\nfrom dreamp2p.errors import PeerError\nfrom ..node import Node\n",
            "transport/__init__.py": "def f():\n    from dreamp2p import node\n",
        },
    )
    units, graph = import_graph(pkg)
    assert units == {"dreamp2p", "errors", "node", "sync", "transport"}
    assert set(graph) == {("node", "sync"), ("sync", "errors"), ("sync", "node"), ("transport", "node")}
    problems = check(graph, frozenset())
    assert len(problems) == 2
    upward, cycle = problems
    assert "sync -> node" in upward and "dreamp2p/sync/base.py:4 imports dreamp2p.node" in upward
    assert "transport -> node" in upward and "dreamp2p/transport/__init__.py:2 imports dreamp2p.node" in upward
    assert "node -> sync" not in upward  # downward: in order
    assert cycle.startswith("import cycle between node, sync:")
    assert "dreamp2p/node.py:1 imports dreamp2p.sync.base" in cycle and "dreamp2p/sync/base.py:4" in cycle
    assert check(graph, frozenset({("sync", "node"), ("transport", "node")})) == []


# The rooms of ``dreamp2p.sync``, highest first: a room imports its own or a lower one, never a higher one.
SYNC_ROOMS: tuple[str, ...] = ("strategies", "comm", "model")


def sync_room_imports(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    """Every import from one room of ``dreamp2p.sync`` into another (module-level, lazy or type-only)."""
    files = module_files(package_dir)
    known = set(files)
    prefix = f"{package_dir.name}.sync."
    found = []
    for module, path in files.items():
        if not module.startswith(prefix):
            continue
        src = module.removeprefix(prefix).split(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for target, line in imported_modules(tree, module, path.name == "__init__.py", known):
            if target.startswith(prefix) and (dst := target.removeprefix(prefix).split(".")[0]) != src:
                found.append(Import(src, dst, path.relative_to(package_dir.parent).as_posix(), line, target))
    return found


def test_sync_has_only_its_rooms_and_each_holds_few_modules() -> None:
    sync = PACKAGE_DIR / "sync"
    loose = sorted(p.name for p in sync.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"a module of sync/ outside its rooms {SYNC_ROOMS}: {loose}"
    rooms = sorted(p.name for p in sync.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == sorted(SYNC_ROOMS)
    for room in SYNC_ROOMS:
        modules = [p for p in (sync / room).glob("*.py") if p.name != "__init__.py"]
        assert 0 < len(modules) <= 15, f"sync/{room} holds {len(modules)} modules"


def test_sync_rooms_import_one_way() -> None:
    imports = sync_room_imports()
    assert {(i.src, i.dst) for i in imports} >= {("strategies", "comm"), ("strategies", "model"), ("comm", "model")}
    upward = [str(i) for i in imports if SYNC_ROOMS.index(i.src) > SYNC_ROOMS.index(i.dst)]
    assert upward == [], "an import up the rooms of sync/ (" + " -> ".join(SYNC_ROOMS) + "):\n" + "\n".join(upward)
