"""No import cycles among the project's modules, of any length, counting imports inside functions
and under `TYPE_CHECKING`: a cycle hidden in a function still ties both modules into one unit that
cannot be understood, tested or changed alone. Read with `ast`, nothing imported (well under 2 s).

Also the shared, torch-free pieces (`spindle/`) import no service, except the two that sit above all
three: the `spindle` command's dispatcher and `spindle up`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model_service", "gateway", "adapter_service", "spindle")
SERVICES = ("model_service", "gateway", "adapter_service")
ABOVE_THE_SERVICES = {"spindle.cli", "spindle.local"}


def _modules() -> dict[str, Path]:
    """Every project module by dotted name (a package by its `__init__.py`); generated code excluded."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "v1" in parts[:2] and parts[0] == "spindle":  # generated from the protos
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file: for `from a import b`, the module
    `a.b` when there is one, else `a`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base + "." + alias.name for alias in node.names]
            targets = [t if t in modules else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@functools.cache  # read once for both tests
def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its modules in import order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_shared_pieces_import_no_service():
    graph = import_graph()
    wrong = {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("spindle") and name not in ABOVE_THE_SERVICES
        for target in targets
        if target.split(".")[0] in SERVICES
    }
    assert not wrong, sorted(wrong)
