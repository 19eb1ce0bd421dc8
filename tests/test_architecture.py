"""The house rules of ARCHITECTURE.md, checked on the source: floors (no upward import) and no import loops.

A module's length is not checked: a concern stays in one module, organised by sections.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diffexp"

# bottom to top; a module may import from its own floor or below, never above
FLOORS = [
    ("foundation", ["diffexp.errors", "diffexp.secrets", "diffexp.checkpoint_io", "diffexp.gpu_peaks"]),
    ("data", ["diffexp.data"]),
    ("kernels", ["diffexp.kernels"]),
    ("model", ["diffexp.model", "diffexp.hf"]),
    ("parallel", ["diffexp.parallel"]),
    ("training", ["diffexp.training"]),
    ("inference", ["diffexp.generate", "diffexp.export"]),
    ("evals", ["diffexp.evals"]),
    ("sweep", ["diffexp.sweep"]),
    ("reports", ["diffexp.compare", "diffexp.bench"]),
    ("entry points", ["diffexp.cli", "diffexp.__main__", "diffexp"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """diffexp modules imported anywhere in the file (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {name for name in found if name in MODULES}


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def floor_of(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is on no floor: add it to FLOORS and to ARCHITECTURE.md"
    return best[1]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_imports_upward():
    upward = [f"{module} ({FLOORS[floor_of(module)][0]}) imports {target} ({FLOORS[floor_of(target)][0]})"
              for module, targets in GRAPH.items() for target in sorted(targets)
              if floor_of(target) > floor_of(module)]
    assert upward == []



PRIVATE_TORCH = ("torch._dynamo", "torch._inductor")


def private_torch_uses(source: str) -> list[str]:
    """Each `torch._dynamo...` / `torch._inductor...` a source imports or reads (their private APIs change between
    releases without notice)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            names = [f"torch.{node.attr}"]
        found += [f"line {node.lineno}: {name}" for name in names
                  if any(name == p or name.startswith(p + ".") for p in PRIVATE_TORCH)]
    return found


def test_no_private_torch_compiler_api_is_used():
    uses = [f"{path.relative_to(PACKAGE.parent)} {use}" for path in MODULES.values()
            for use in private_torch_uses(path.read_text())]
    assert uses == []


def test_private_torch_uses_are_found():
    source = "import torch._dynamo\nfrom torch._inductor import config\ntorch._dynamo.mark_static_address(x)\n"
    assert [use.split(": ")[1] for use in private_torch_uses(source)] == ["torch._dynamo", "torch._inductor",
                                                                         "torch._dynamo"]
    assert private_torch_uses("torch.compiler.reset()\nimport torch.nn\n") == []


def test_test_modules_share_helpers_through_tests_helpers_only():
    """A test module imports no other test module (pytest would collect the imported tests twice over, and a
    helper would move with its tests): what several modules use lives in tests/helpers.py."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {name}" for name in names if name.startswith("tests.test_")]
    assert not found, found
