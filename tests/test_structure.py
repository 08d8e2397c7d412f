"""The engine's structure, as the README's layout table states it: every MPI call in
``zerompi/mpi/``, small modules, and a step that does not branch on the stage."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import zerompi
from zerompi.optimizer import ZeroOptimizer

pytestmark = pytest.mark.mpi_skip
PACKAGE = Path(zerompi.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_only_the_mpi_layer_imports_mpi4py() -> None:
    imports = re.compile(r"^(from|import)\s+mpi4py", re.M)  # top level, not TYPE_CHECKING
    outside = [
        str(path.relative_to(PACKAGE))
        for path in MODULES
        if path.parent.name != "mpi" and imports.search(path.read_text())
    ]
    assert not outside, f"mpi4py imported outside zerompi/mpi/: {outside}"


def test_no_module_over_about_400_lines() -> None:
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in MODULES}
    assert not {name: n for name, n in sizes.items() if n > 430}


@pytest.mark.parametrize("name", ["step", "_reduce", "_agree", "_skip", "_adam", "_end_step"])
def test_the_step_does_not_branch_on_the_stage(name: str) -> None:
    """What differs between stages is data (the plan, the reducer, the gatherer)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(ZeroOptimizer, name))))
    body = tree.body[0].body  # type: ignore[attr-defined]
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    code = "\n".join(ast.unparse(node) for node in body)
    assert "stage" not in code and "plan." not in code, code
