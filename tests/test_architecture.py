"""The house rules, measured on the code: imports between folders go one way, action kinds are never compared as
strings, and the only replay loops are the engine and the test oracle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("simulator", "topologies", "calibration", "executor", "experiments", "pipescope")
# Who may import whom (docs/architecture.md): one way, no cycles.
ALLOWED = {
    "simulator": set(),
    "topologies": {"simulator"},
    "calibration": {"simulator"},
    "executor": {"simulator", "calibration"},
    "pipescope": {"simulator", "topologies", "calibration"},
    "experiments": {"simulator", "topologies", "calibration", "executor", "pipescope"},
}


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def imported_folders(path: Path) -> set[str]:
    """Project folders a file imports, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        if isinstance(node, ast.ImportFrom) and node.module == "pipescope":  # from pipescope import experiments
            names = [f"pipescope.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pipescope":
                found.add(parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "pipescope")
    return found


def import_graph() -> dict[str, set[str]]:
    return {folder: {f for path in sources(folder) for f in imported_folders(path)} - {folder} for folder in FOLDERS}


def test_imports_between_folders_go_one_way() -> None:
    """Each folder imports only the folders below it; the graph has no cycle."""
    graph = import_graph()
    for folder, uses in graph.items():
        assert uses <= ALLOWED[folder], f"{folder} imports {uses - ALLOWED[folder]}"


def string_kind_comparisons(path: Path) -> list[int]:
    """Lines comparing something called ``kind`` with a string literal (or a tuple/set of them)."""
    def is_kind(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "kind") or (isinstance(node, ast.Name)
                                                                             and node.id == "kind")

    def is_text(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, (ast.Tuple, ast.Set, ast.List)) and any(is_text(e) for e in node.elts)

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_kind(a) for a in sides) and any(is_text(b) for b in sides):
                lines.append(node.lineno)
    return lines


def test_no_module_compares_action_kinds_as_strings() -> None:
    """Kinds are ActionKind members, compared as such; per-kind facts live in tables keyed by the enum."""
    offenders = {str(p.relative_to(ROOT)): string_kind_comparisons(p)
                 for folder in FOLDERS for p in sources(folder) if string_kind_comparisons(p)}
    assert offenders == {}


def test_the_replay_loops_are_the_engine_and_the_oracle() -> None:
    """Only simulator/engine.py (SimPy) and simulator/oracle.py (heapq) run an event loop over a program; routed.py's
    IdleClock runs the network alone (one collective, no program). routing.py's heap is Dijkstra's, of distances;
    flows.py's holds the times its flows will have drained, which it reads at the clock's one wake-up."""
    loops = set()
    for folder in FOLDERS:
        for path in sources(folder):
            text = path.read_text()
            if "heapq.heappop" in text or "env.run(" in text or ".env.run()" in text:
                loops.add(str(path.relative_to(ROOT)))
    assert loops == {"simulator/engine.py", "simulator/oracle.py", "simulator/routed.py", "simulator/routing.py",
                     "simulator/flows.py"}


def test_nothing_in_the_repository_points_outside_it() -> None:
    """Docs, code, configs and notebooks name files inside the repository only: no absolute path of the machine it
    was written on (or of its scratch folders), no ``../shared`` beside the checkout."""
    suffixes = {".py", ".md", ".yaml", ".yml", ".ipynb", ".toml", ".cfg"}
    offenders = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if path.suffix not in suffixes or not path.is_file() or parts[0].startswith(".") or "sweeps" in parts or \
                path == Path(__file__).resolve():  # this test names what it looks for
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in ("/work/", "../shared", "/tmp/", "/home/")
                      if needle in text]
    assert offenders == []
