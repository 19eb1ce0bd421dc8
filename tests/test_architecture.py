"""The house rules of ARCHITECTURE.md, checked on the source: floors (no upward import) and no import loops.

A module's length is not checked: a concern stays in one module, organised by sections.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diffexp"

# bottom to top; a module may import from its own floor or below, never above
FLOORS = [
    ("foundation", ["diffexp.errors", "diffexp.secrets", "diffexp.checkpoint_io", "diffexp.gpu_peaks",
                    "diffexp.lightning_internals"]),
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


# ----------------------------------------------------------------------------- Lightning's private members

LIGHTNING_INTERNALS = "diffexp.lightning_internals"  # the one module allowed to touch them (each one tested)


def _lightning_class_privates(cls: type) -> set[str]:
    """The private members (one leading underscore) of a class's Lightning ancestors: their attributes and what
    their methods assign to self."""
    import inspect
    import re

    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith(("lightning", "pytorch_lightning")):
            continue
        names |= {name for name in vars(base) if name.startswith("_") and not name.startswith("__")}
        try:
            names |= set(re.findall(r"self\.(_[A-Za-z]\w*)", inspect.getsource(base)))
        except (OSError, TypeError):
            pass
    return {name for name in names if not name.startswith("__")}


def _lightning_private_names() -> set[str]:
    """Every private name Lightning's own source defines or assigns (`def _x`, `self._x`)."""
    import re

    import lightning

    root = Path(lightning.__file__).parent
    found: set[str] = set()
    for path in root.rglob("*.py"):
        found |= set(re.findall(r"(?:def |self\.)(_[A-Za-z]\w*)", path.read_text(errors="ignore")))
    return found


def _is_super_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_lightning_uses(source: str, module: str, lightning_names: set[str] | None = None) -> list[str]:
    """Each private Lightning member a module imports, reads, calls or overrides:
    - `from lightning... import _x`, or an import from a private Lightning module;
    - `obj._x` on anything but `self`/`cls` where Lightning has a member `_x` (`trainer._logger_connector`,
      `super()._save_checkpoint`);
    - in a class deriving from a Lightning class: `self._x` and `def _x` where its Lightning ancestors have `_x`."""
    import importlib

    lightning_names = _lightning_private_names() if lightning_names is None else lightning_names
    tree = ast.parse(source)
    imported: dict[str, str] = {}  # local name -> dotted origin
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module.startswith(("lightning", "pytorch_lightning")):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") for part in node.module.split(".")) or private:
                    found.append(f"line {node.lineno}: from {node.module} import "
                                 + ", ".join(a.name for a in node.names))

    def resolve(expr: ast.expr):
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        origin = imported.get(expr.id) or (f"{module}.{expr.id}" if expr.id in local_classes else None)
        if origin is None:
            return None
        dotted = ".".join([origin, *reversed(parts)])
        module_name, _, attr = dotted.rpartition(".")
        for _ in range(4):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(module_name)
                for name in (dotted[len(module_name) + 1:]).split("."):
                    obj = getattr(obj, name)
                return obj
            except (ImportError, AttributeError):
                module_name = module_name.rpartition(".")[0]
                if not module_name:
                    return None
        return None

    local_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    lightning_classes: dict[int, set[str]] = {}  # id of a ClassDef deriving from Lightning -> its privates
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            privates: set[str] = set()
            for base in node.bases:
                obj = resolve(base)
                if isinstance(obj, type):
                    privates |= _lightning_class_privates(obj)
            if privates:
                lightning_classes[id(node)] = privates
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in privates:
                        found.append(f"line {item.lineno}: overrides {node.name}.{item.name}")
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
                            and sub.attr in privates):
                        found.append(f"line {sub.lineno}: self.{sub.attr} in {node.name}")
                    elif isinstance(sub, ast.Attribute) and _is_super_call(sub.value) and sub.attr in privates:
                        found.append(f"line {sub.lineno}: super().{sub.attr}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr in lightning_names and not _is_super_call(node.value)
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda use: int(use.split()[1].rstrip(":")))


def test_no_private_lightning_member_is_used_outside_lightning_internals():
    names = _lightning_private_names()
    uses = [f"{path.relative_to(PACKAGE.parent)} {use}" for module, path in MODULES.items()
            if module != LIGHTNING_INTERNALS for use in private_lightning_uses(path.read_text(), module, names)]
    assert uses == [], ("private Lightning members used outside diffexp/lightning_internals.py (move each there, "
                        "with its test in tests/test_lightning_internals.py):\n" + "\n".join(uses))


def test_private_lightning_uses_are_found():
    source = '''
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

class Saver(ModelCheckpoint):
    def _save_checkpoint(self, trainer, filepath):
        super()._save_checkpoint(trainer, filepath)
        self._last_global_step_saved = 0
        self._mine = 1

def steps(trainer):
    return trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.global_step
'''
    uses = private_lightning_uses(source, "toy")
    assert [use.split(": ", 1)[1] for use in uses] == [
        "from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype",
        "overrides Saver._save_checkpoint", "super()._save_checkpoint", "self._last_global_step_saved in Saver",
        "trainer.fit_loop.epoch_loop._batches_that_stepped"]
    assert private_lightning_uses("import lightning as L\n\nclass Own:\n    def _x(self):\n        self._trainer = 1\n",
                                  "toy") == []


def _tensorboard_private_names() -> set[str]:
    """Every private name torch.utils.tensorboard's source defines or assigns (`def _x`, `self._x`): the
    SummaryWriter's `_get_file_writer` and the like, which a torch release may rename without notice."""
    import re

    import torch.utils.tensorboard

    root = Path(torch.utils.tensorboard.__file__).parent
    found: set[str] = set()
    for path in root.rglob("*.py"):
        found |= set(re.findall(r"(?:def |self\.)(_[A-Za-z]\w*)", path.read_text(errors="ignore")))
    return found


def private_tensorboard_uses(source: str, names: set[str]) -> list[str]:
    """Each `obj._x` a module reads or calls, on anything but `self`/`cls`, where torch.utils.tensorboard has a
    private member `_x` (`logger.experiment._get_file_writer()`)."""
    return [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_no_private_tensorboard_writer_member_is_used():
    """TensorBoard's writers are used through their public members (SummaryWriter, its `file_writer` and
    `get_logdir`, FileWriter): diffexp/training/hparams.py's write_summaries writes the HParams row that way."""
    names = _tensorboard_private_names()
    assert "_get_file_writer" in names  # the scan reads torch's source
    uses = [f"{path.relative_to(PACKAGE.parent)} {use}" for path in MODULES.values()
            for use in private_tensorboard_uses(path.read_text(), names)]
    assert uses == [], "private torch.utils.tensorboard members used:\n" + "\n".join(uses)


def test_private_tensorboard_uses_are_found():
    source = ("writer = logger.experiment._get_file_writer()\nself._get_file_writer()\n"
              "logger.experiment.file_writer.add_summary(summary)\n")
    assert private_tensorboard_uses(source, {"_get_file_writer"}) == [
        "line 1: logger.experiment._get_file_writer"]
