"""Train the numpy MLP of :mod:`zerompi.mlp` with :class:`zerompi.ZeroOptimizer`.

Run as ``mpiexec -n W python -m zerompi.driver [options]`` (``--help`` lists them).
Every global batch is split into micro-batches with :func:`zerompi.shard_range`, and
each micro-batch's rows are split over the ranks the same way. Every stage (0-3) runs
the same code: the forward layer by layer inside ``opt.gathered(layer)``, the
backward in reverse inside ``opt.gathered(layer)`` and ``opt.gradients(layer)``
(stages 2-3 reduce-scatter a bucket as soon as its gradients are handed over), then
``opt.accumulate()`` after each micro-batch and ``opt.step()``. Rank 0 prints
progress and a summary and, with ``--json``, writes the figures to a file.

``--verify`` then copies the parameters out with ``opt.full_params()`` (collective),
retrains the same model unsharded in rank 0 alone, with
:class:`zerompi.reference.ReferenceAdam` on the same batches, and compares the
parameters and every step's gradient norm: the exit status is 1 on every rank if
they differ by more than a tolerance for the dtype.

An exception on one rank reaches zerompi's abort hook: ``zerompi: rank R of W
failed: ...`` and its traceback (once, from rank 0, when every rank raised it), then
the whole MPI job is aborted, so that ``mpiexec`` never hangs waiting for the others.

Modules: :mod:`.cli` (options, :func:`main`), :mod:`.training` (the loop),
:mod:`.checkpoints` (``--save``, ``--resume``, the ``--elastic`` fall back),
:mod:`.verify` (the reference check), :mod:`.run` (one run, its summary and JSON).
What the driver shares with :mod:`zerompi.bench` is in :mod:`zerompi.runtime`.
"""

from .checkpoints import checkpoint_path, resume_path, save_checkpoint, saved_checkpoints
from .cli import build_parser, main, parse_args
from .run import finish, run, summary
from .training import COMM_FACTOR, COMM_OPS, micro_batch, micro_batch_rows, train, warm_up
from .verify import NORM_TOLERANCE, TOLERANCE, reference_params, verify

__all__ = [
    "COMM_FACTOR",
    "COMM_OPS",
    "NORM_TOLERANCE",
    "TOLERANCE",
    "build_parser",
    "checkpoint_path",
    "finish",
    "main",
    "micro_batch",
    "micro_batch_rows",
    "parse_args",
    "reference_params",
    "resume_path",
    "run",
    "save_checkpoint",
    "saved_checkpoints",
    "summary",
    "train",
    "verify",
    "warm_up",
]
