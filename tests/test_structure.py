"""The package's structure as docs/design.md states it, checked from the code:

* only ``zerompi/mpi/`` imports mpi4py, and ``import zerompi`` imports neither mpi4py
  nor torch;
* the import graph has no cycle (type-only and function-level imports included);
* ownership: only the engine touches the buffer pool, only the plan decides what a
  stage keeps, and the hot path (step, reducers, backends, hand-over, gathers) never
  asks which stage it runs;
* every collective that a public method of ``ZeroOptimizer`` starts is started inside a
  guarded call (:func:`zerompi.guard.communicates`): the list of guarded methods is
  derived by running every public method, not kept by hand, and a new public method
  without a recipe here, or one that communicates unguarded, fails.
"""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import zerompi
from zerompi.checkpoint.safetensors import write_file
from zerompi.guard import GUARD_CODE, is_guarded
from zerompi.mpi.collectives import Comm
from zerompi.mpi.requests import Planned
from zerompi.optimizer import ZeroOptimizer

pytestmark = pytest.mark.mpi_skip
PACKAGE = Path(zerompi.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TREES = {_module_name(p): ast.parse(p.read_text()) for p in MODULES}


def _names_defined(module: str) -> set[str]:
    out: set[str] = set()
    for node in TREES[module].body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere (top level, functions,
    ``TYPE_CHECKING`` blocks): ``from . import x`` counts as importing ``x``, ``from
    . import name`` as importing the package that defines ``name``."""
    graph: dict[str, set[str]] = {}
    for module, tree in TREES.items():
        package = module.split(".")
        if not (PACKAGE.parent / Path(*package) / "__init__.py").exists():
            package = package[:-1]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in TREES:
                        edges.add(sub)
                    elif target in TREES and alias.name in _names_defined(target):
                        edges.add(target)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in TREES)
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (strongly connected components of 2+ modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_only_the_mpi_layer_imports_mpi4py() -> None:
    outside = [
        name for name, tree in TREES.items() if not name.startswith("zerompi.mpi")
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any((getattr(node, "module", None) or a.name).startswith("mpi4py") for a in node.names)
        and not _type_checking_only(tree, node)
    ]  # fmt: skip
    assert not outside, f"mpi4py imported outside zerompi/mpi/: {sorted(set(outside))}"


def _type_checking_only(tree: ast.Module, node: ast.AST) -> bool:
    """Whether ``node`` sits in an ``if TYPE_CHECKING:`` block (a type hint only)."""
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING":
            if any(node is inner for stmt in block.body for inner in ast.walk(stmt)):
                return True
    return False


def test_import_zerompi_imports_neither_mpi4py_nor_torch() -> None:
    code = ("import sys, zerompi; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('mpi4py', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _identifiers(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every name and attribute the code uses (not strings, not docstrings)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno


#: Owner -> the modules allowed to use it.
OWNERS: dict[str, set[str]] = {
    # The pool: allocated from in one place, the engine (defined in buffers).
    "BufferPool": {"zerompi.buffers", "zerompi.engine"},
    "pool": {"zerompi.engine"},
    # What a stage keeps is the plan's to decide (the estimator builds the same plan).
    "stage_plan": {"zerompi.plan", "zerompi.engine", "zerompi.memory"},
}


@pytest.mark.parametrize("owned", sorted(OWNERS))
def test_ownership(owned: str) -> None:
    users = {name for name, tree in TREES.items()
             if any(ident == owned for ident, _ in _identifiers(tree))}  # fmt: skip
    others = sorted(users - OWNERS[owned])
    assert not others, f"{owned} used outside its owners: {others}"


#: The hot path: what runs per step and per layer.
HOT_PATH = ("zerompi.step", "zerompi.reducer", "zerompi.reduction", "zerompi.handover",
            "zerompi.gather", "zerompi.prefetch", "zerompi.nodesum")  # fmt: skip


@pytest.mark.parametrize("module", HOT_PATH)
def test_the_hot_path_does_not_ask_for_the_stage(module: str) -> None:
    """What differs between stages is data: the strategies the engine chose."""
    asked = [f"{ident} (line {line})" for ident, line in _identifiers(TREES[module])
             if ident in ("stage", "plan", "StagePlan")]  # fmt: skip
    assert not asked, f"{module} reads {asked}"


# -- the guard ----------------------------------------------------------------------------


@contextmanager
def watched_collectives() -> Iterator[list[tuple[str, bool]]]:
    """Every collective started (a blocking call, or a prepared one's start or run)
    while the block runs, and whether a guarded call was on the stack."""
    seen: list[tuple[str, bool]] = []
    blocking, books = Comm._blocking, Planned._books

    def guarded_now() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is GUARD_CODE:
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False

    def _blocking(self: Comm, op: str, tag: int, call: Callable[[], Any]) -> Any:
        seen.append((op, guarded_now()))
        return blocking(self, op, tag, call)

    def _books(self: Planned) -> int:
        seen.append((self.op, guarded_now()))
        return books(self)

    Comm._blocking = _blocking  # type: ignore[method-assign]
    Planned._books = _books  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Comm._blocking = blocking  # type: ignore[method-assign]
        Planned._books = books  # type: ignore[method-assign]


def _hand_over(opt: ZeroOptimizer, names: tuple[str, ...] = ("a", "b")) -> None:
    for name in names:  # (without gather buffers the caller gathers: gather_into)
        read = opt.gathered(name) if opt.config.gather_buffers else contextlib.nullcontext()
        with read, opt.gradients(name) as g:
            for view in g.values():
                view += 1.0


#: How to call every public member of ZeroOptimizer (``tmp``: a temporary folder).
#: A member missing here fails the test: say how it is called.
RECIPES: dict[str, Callable[[ZeroOptimizer, Path], object]] = {
    "add_gradients": lambda opt, tmp: ([opt.add_gradients({n: np.ones(s, np.float32)}) for n, s in (
        ("a.w", (3, 4)), ("a.b", 4), ("b.w", 5))], opt.step()),
    "accumulate": lambda opt, tmp: (_hand_over(opt), opt.accumulate()),
    "close": lambda opt, tmp: opt.close(),
    "comm": lambda opt, tmp: opt.comm,
    "config": lambda opt, tmp: opt.config,
    "engine": lambda opt, tmp: opt.engine,
    "fold": lambda opt, tmp: (_hand_over(opt), opt.fold()),
    "full_params": lambda opt, tmp: opt.full_params(),
    "gather_into": lambda opt, tmp: opt.gather_into(
        0, np.empty(opt.layout.buckets[0].size, opt.layout.buckets[0].dtype)),
    "start_gather_into": lambda opt, tmp: opt.start_gather_into(
        0, np.empty(opt.layout.buckets[0].size, opt.layout.buckets[0].dtype)).wait(),
    "gather_state": lambda opt, tmp: opt.gather_state(),
    "gathered": lambda opt, tmp: _hand_over(opt),
    "gradients": lambda opt, tmp: _hand_over(opt),
    "grads": lambda opt, tmp: opt.grads if opt.stage < 3 else None,
    "hyperparameters": lambda opt, tmp: opt.hyperparameters(),
    "last_grad_norm": lambda opt, tmp: opt.last_grad_norm,
    "layout": lambda opt, tmp: opt.layout,
    "load": lambda opt, tmp: (opt.save(str(tmp / "c.zmpi")), opt.load(str(tmp / "c.zmpi"))),
    "load_safetensors": lambda opt, tmp: (
        write_file(tmp / "w.safetensors", opt.full_params()),
        opt.load_safetensors(str(tmp / "w.safetensors"))),
    "loss_scale": lambda opt, tmp: opt.loss_scale,
    "memory_buffers": lambda opt, tmp: opt.memory_buffers(),
    "memory_usage": lambda opt, tmp: opt.memory_usage(),
    "nodes": lambda opt, tmp: opt.nodes,
    "param_group": lambda opt, tmp: opt.param_group("a.w"),
    "params": lambda opt, tmp: opt.params if opt.stage < 3 else None,
    "pop_timings": lambda opt, tmp: opt.pop_timings(),
    "recoveries": lambda opt, tmp: opt.recoveries,
    "resident_params": lambda opt, tmp: opt.resident_params,
    "save": lambda opt, tmp: opt.save(str(tmp / "c.zmpi")),
    "set_hyperparameters": lambda opt, tmp: opt.set_hyperparameters(lr=1e-3),
    "shared_memory": lambda opt, tmp: opt.shared_memory,
    "skipped_steps": lambda opt, tmp: opt.skipped_steps,
    "stage": lambda opt, tmp: opt.stage,
    "step": lambda opt, tmp: (_hand_over(opt), opt.step()),
    "step_count": lambda opt, tmp: opt.step_count,
    "survive": lambda opt, tmp: opt.survive(),
    "zero_grad": lambda opt, tmp: (_hand_over(opt), opt.zero_grad()),
    "__exit__": lambda opt, tmp: opt.__exit__(None, None, None),
}

#: Optimizers the recipes run on: every stage, with and without node memory, and
#: stage 3 without gather buffers (``gather_into``'s caller).
SETTINGS = [dict(stage=s, shared_memory=m) for s in range(4) for m in (True, False)] + [
    dict(stage=3, shared_memory=False, gather_buffers=False)]  # fmt: skip


def public_members(cls: type) -> list[str]:
    """Every public method and property of ``cls`` (and ``__exit__``), from the code."""
    names = {n for c in cls.__mro__ if c is not object for n in vars(c) if not n.startswith("_")}
    return sorted(names | {"__exit__"})


def unguarded_collectives(cls: type, tmp: Path, recipes: dict[str, Callable[..., object]],
                          settings: list[dict[str, Any]]) -> list[str]:  # fmt: skip
    """Problems: public members without a recipe, and collectives that a member's recipe
    started outside a guarded call."""
    members = public_members(cls)
    problems = [f"{m}: no recipe in tests/test_structure.py" for m in members if m not in recipes]
    params = {"a.w": np.ones((3, 4), np.float32), "a.b": np.zeros(4, np.float32),
              "b.w": np.ones(5, np.float32)}  # fmt: skip
    for setting in settings:
        for member in members:
            if member not in recipes or (member in ("gather_into", "start_gather_into")
                                         and setting.get("gather_buffers", True)):
                continue  # (gather_into: for the caller that has no gather buffers)
            if member == "gathered" and not setting.get("gather_buffers", True):
                continue  # (refused there)
            opt = cls(params, comm=MPI.COMM_SELF, bucket_elems=8, **setting)
            with watched_collectives() as seen:
                recipes[member](opt, tmp)
            bad = sorted({op for op, guarded in seen if not guarded})
            if bad:
                problems.append(f"{member} {setting}: {', '.join(bad)} started unguarded")
            opt.engine.close()
    return problems


def test_every_collective_of_a_public_method_is_guarded(tmp_path: Path) -> None:
    problems = unguarded_collectives(ZeroOptimizer, tmp_path, RECIPES, SETTINGS)
    assert not problems, "\n".join(problems)
    communicating = [m for m in public_members(ZeroOptimizer) if is_guarded(
        getattr(ZeroOptimizer, m))]  # fmt: skip
    assert {"step", "gathered", "gradients", "save", "load", "close"} <= set(communicating)


class _Leaky(ZeroOptimizer):
    """A public method that communicates without the guard."""

    def barrier(self) -> None:
        self.comm.barrier()


class _NoRecipe(ZeroOptimizer):
    def ranks(self) -> int:
        return self.comm.size


def test_the_guard_check_fails_an_unguarded_method(tmp_path: Path) -> None:
    recipes = {**RECIPES, "barrier": lambda opt, tmp: opt.barrier()}
    leaky = unguarded_collectives(_Leaky, tmp_path, recipes, SETTINGS[:1])
    assert any(p.startswith("barrier ") and "barrier started unguarded" in p for p in leaky), leaky
    missing = unguarded_collectives(_NoRecipe, tmp_path, RECIPES, SETTINGS[:1])
    assert missing == ["ranks: no recipe in tests/test_structure.py"], missing
