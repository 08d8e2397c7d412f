#!/usr/bin/env python3
"""An update rule's whole step at this checkout against the same rule's module at
another revision, alternated step by step in one process, at each stage.

    mpiexec -n 2 python scripts/rule_rev_ab.py --rule adafactor --rev REV [--rev-kernels]
        [--sizes 16e6] [--stages 0,1,2,3] [--steps 20] [--matrix-cols 1024]

``zerompi/rules/RULE.py`` of ``REV`` (``git show``) is loaded next to this
checkout's as a module of the same package, and a second optimizer runs its rule
(its class's methods on a copy of this checkout's rule object, so the module's own
functions are ``REV``'s; the compiled loops are this checkout's, which must still
take ``REV``'s calls, or with ``--rev-kernels`` ``REV``'s own: its
``zerompi/_kernels.c`` built with the flags of this checkout's ``pyproject.toml``,
where a change of the loops changed what they are called with). Both optimizers hold
the bench's model and gradients (``zerompi.bench``: four 4096 x 1024 matrices at 16M
with ``--matrix-cols 1024``), their steps taken in turn (the order reversed every
other round) so that the machine's drift falls on both alike. Prints per stage each
one's median ``step_ms`` (the optimizer's own time, slowest rank), new / old, and
the median of the per-round ratios; and whether both ended with the same parameters,
bit for bit.
"""

import argparse
import copy
import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.bench.model import deferred_model, make_grads, tensor_sizes
from zerompi.bench.timing import run_iteration
from zerompi.runtime import count

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rule", default="adafactor", help="a module of zerompi/rules")
parser.add_argument("--rev", required=True, help="the revision to compare against")
parser.add_argument("--sizes", default="16e6", help="parameters (1e6 notation)")
parser.add_argument("--stages", default="0,1,2,3")
parser.add_argument("--steps", type=int, default=20, help="timed steps of each")
parser.add_argument("--matrix-cols", type=int, default=1024)
parser.add_argument("--rev-kernels", action="store_true",
                    help="the old rule calls REV's compiled loops, built here")
args = parser.parse_args()
comm = MPI.COMM_WORLD
f32 = np.dtype(np.float32)
root = Path(__file__).resolve().parent.parent


def old_module() -> types.ModuleType:
    """``zerompi/rules/RULE.py`` at ``--rev``, as ``zerompi.rules._rev_RULE``."""
    source = subprocess.run(["git", "show", f"{args.rev}:zerompi/rules/{args.rule}.py"],
                            cwd=root, check=True, capture_output=True, text=True).stdout
    name = f"zerompi.rules._rev_{args.rule}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "zerompi.rules"
    sys.modules[name] = module
    exec(compile(source, f"{args.rev}:{args.rule}.py", "exec"), module.__dict__)
    return module


def old_kernels() -> types.ModuleType:
    """``zerompi/_kernels.c`` at ``--rev``, built (rank 0, into a temporary folder) with
    this checkout's ``pyproject.toml`` flags and loaded next to this checkout's."""
    import tempfile

    import tomllib
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    folder = comm.bcast(tempfile.mkdtemp(prefix="zerompi-rev-") if comm.rank == 0 else None)
    if comm.rank == 0:
        source = subprocess.run(["git", "show", f"{args.rev}:zerompi/_kernels.c"], cwd=root,
                                check=True, capture_output=True, text=True).stdout
        (Path(folder) / "_kernels.c").write_text(source)
        ext = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
            "ext-modules"][0]  # fmt: skip
        dist = Distribution({"ext_modules": [Extension(
            "_kernels", [str(Path(folder) / "_kernels.c")],
            extra_compile_args=ext["extra-compile-args"])]})  # fmt: skip
        build = build_ext(dist)
        build.build_lib = build.build_temp = folder
        build.ensure_finalized()
        build.run()
    comm.Barrier()
    path = next(Path(folder).glob("_kernels*.so"))
    spec = importlib.util.spec_from_file_location("zerompi._kernels", path)
    assert spec is not None and spec.loader is not None
    ext_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext_module)
    comm.Barrier()  # every rank has it mapped: the folder can go
    if comm.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return ext_module


def with_old_rule(opt: ZeroOptimizer, module: types.ModuleType) -> None:
    """``opt`` runs the old module's rule: a copy of its rule object whose class is
    the old module's class of the same name."""
    rule = opt.engine.settings.rule
    old = copy.copy(rule)
    old.__class__ = getattr(module, type(rule).__name__)
    opt.engine.settings = opt.engine.settings._replace(rule=old)


module = old_module()
if args.rev_kernels:
    rev_kernels = old_kernels()
    module._kernels = lambda: rev_kernels  # the old module's loops: REV's
for size in (count(x) for x in args.sizes.split(",")):
    sizes = tensor_sizes(size, 1 << 22)
    grads = make_grads(sizes, 0, comm.rank, f32, args.matrix_cols)
    for stage in (int(s) for s in args.stages.split(",")):
        opts = {
            which: ZeroOptimizer(deferred_model(sizes, 0, f32, args.matrix_cols), comm=comm,
                                 stage=stage, lr=1e-3, optimizer=args.rule)
            for which in ("new", "old")
        }  # fmt: skip
        with_old_rule(opts["old"], module)
        steps: dict[str, list[float]] = {which: [] for which in opts}
        for i in range(args.steps + 2):
            for which in ("new", "old") if i % 2 == 0 else ("old", "new"):
                opt = opts[which]
                comm.Barrier()
                run_iteration(opt, stage, grads, list(grads))
                took = comm.allreduce(sum(opt.pop_timings().values()), op=MPI.MAX)
                if i >= 2:  # two rounds fault in and warm up
                    steps[which].append(took)
        full = {which: opt.full_params() for which, opt in opts.items()}
        same = all(np.array_equal(full["new"][n], full["old"][n]) for n in full["new"])
        same = bool(comm.allreduce(int(same), op=MPI.MIN))
        apart = max(float(np.max(np.abs(full["new"][n] - full["old"][n]), initial=0.0))
                    for n in full["new"])  # fmt: skip
        moved = max(float(np.max(np.abs(a), initial=0.0)) for a in full["new"].values())
        for opt in opts.values():
            opt.close()
        new, old = (1e3 * float(np.median(steps[w])) for w in ("new", "old"))
        rounds = float(np.median(np.array(steps["new"]) / np.array(steps["old"])))
        if comm.rank == 0:
            print(f"rule_rev_ab: {args.rule}, {size:,} parameters, stage {stage}, "
                  f"W={comm.size}, {args.steps} steps each: this checkout {new:.2f} ms, "
                  f"{args.rev} {old:.2f} ms, new / old {new / old:.3f}, per-round median "
                  f"{rounds:.3f}; the same parameters: {same}"
                  + ("" if same else f" (largest difference {apart:.3g}, largest "
                                     f"parameter {moved:.3g})"), flush=True)  # fmt: skip
