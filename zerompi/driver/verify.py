"""``--verify``: retrain the same model unsharded, in rank 0 alone, and compare.

Two comparisons, because Adam hides a wrong gradient scale: its update
``m / (sqrt(v) + eps)`` is the same for ``g`` and ``2 g`` up to ``eps``, so gradients
averaged over ``W - 1`` ranks instead of ``W``, or micro-batches summed instead of
averaged, would leave the parameters within any rounding tolerance. Hence:

* the gradient norm of every step run (``opt.last_grad_norm``: the global L2 norm
  of the averaged gradient, before clipping) against the reference's, relative,
  which sees any wrong scale of the averaged gradient directly (a factor ``W/(W-1)``
  is at least 1e-3 away for any W up to 1000);
* the parameters at the end, relative to the largest reference parameter, which see
  everything else (Adam itself, and a wrong scale only where L2 weight decay or
  ``eps`` makes Adam scale-sensitive).

The tolerances are rounding: the W-rank and the one-process runs sum gradients in
different orders, and the hidden activation is smooth (tanh), so that these
rounding differences stay rounding differences.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import mlp
from ..partition import shard_range
from ..precision import loss_scale_of, resolve_dtype
from ..reference import (
    ReferenceAdafactor,
    ReferenceAdam,
    ReferenceAdam8bit,
    ReferenceLion,
    ReferenceMuon,
    ReferenceSGD,
    average,
)
from ..runtime import clock
from .training import loss_scale_arg, micro_batch_rows

if TYPE_CHECKING:
    from ..optimizer import ZeroOptimizer

#: Largest accepted ``max_abs_diff / max|reference param|`` of ``--verify``.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}

#: Largest accepted relative difference between a step's gradient norm and the
#: reference's (the largest over the steps run).
NORM_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}

#: ``--optimizer adam8bit`` on more than one rank: (parameters, gradient norm). An
#: 8-bit code is a step function of its moment, so a gradient summed in another order
#: (the W-rank run against the one-process reference) flips a code now and then, and
#: the two runs part by a fraction of a quantization step per flip, more the longer
#: they run (measured at W = 2-4, stage 2: up to 5.8e-3 and 5.2e-4 after the default
#: 200 steps, 1.24e-2 and 2.1e-3 after 500). Both are still far below what a wrongly
#: averaged gradient does to the norm (a factor of W); on one rank the run is bit for
#: bit.
EIGHT_BIT_TOLERANCE = (5e-2, 1e-2)


def reference_optimizer(
    args: argparse.Namespace, params: dict[str, np.ndarray]
) -> ReferenceAdam | ReferenceSGD | ReferenceLion:
    """The unsharded reference of ``--optimizer`` with the run's settings."""
    if args.optimizer == "sgd":
        return ReferenceSGD(params, lr=args.lr, momentum=args.momentum, nesterov=args.nesterov,
                            weight_decay=args.weight_decay,
                            decoupled_weight_decay=args.adamw)  # fmt: skip
    if args.optimizer == "lion":
        return ReferenceLion(params, lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "muon":
        return ReferenceMuon(params, lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "adafactor":
        return ReferenceAdafactor(params, lr=args.lr, weight_decay=args.weight_decay)
    if args.optimizer == "adam8bit":
        return ReferenceAdam8bit(params, lr=args.lr, weight_decay=args.weight_decay,
                                 decoupled_weight_decay=args.adamw)  # fmt: skip
    return ReferenceAdam(params, lr=args.lr, weight_decay=args.weight_decay,
                         decoupled_weight_decay=args.adamw)  # fmt: skip


def _rounded(
    params: dict[str, np.ndarray], low: str | None, dtype: np.dtype
) -> dict[str, np.ndarray]:
    """``params`` as the model computes with them: rounded to ``low`` and upcast."""
    if low is None:
        return params
    low_dt = resolve_dtype(low, "param_dtype")
    return {n: p.astype(low_dt).astype(dtype) for n, p in params.items()}


def mixed_reference(
    args: argparse.Namespace, world: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The reference with the run's roundings (``--param-dtype``/``--reduce-dtype``):
    forward and backward from the master rounded to the parameter dtype and upcast;
    each rank's gradient (its rows, scaled as the driver scales it, loss scale
    included) rounded to the reduce dtype, summed in the master dtype in rank order
    and micro-batch order, divided as ``step()`` divides; a non-finite sum skips the
    step and moves the loss scale as :class:`zerompi.precision.LossScale` does. On
    one rank the same operations in the same order as the run: bit for bit."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    ref = reference_optimizer(args, mlp.init_params(sizes, args.seed, dtype))
    reduce = resolve_dtype(args.reduce_dtype, "reduce_dtype") if args.reduce_dtype else dtype
    scaler = loss_scale_of(loss_scale_arg(args.loss_scale), reduce if args.reduce_dtype else None)
    rows = micro_batch_rows(args.batch, args.micro_batches)
    norms = np.zeros(args.steps)
    for step in range(args.steps):
        scale = 1.0 if scaler is None else scaler.scale
        used = _rounded(ref.params, args.param_dtype, dtype)
        total = {name: np.zeros_like(p) for name, p in ref.params.items()}
        for micro, micro_rows in enumerate(rows):
            x, y = mlp.make_batch(
                args.seed, step, micro, micro_rows, args.in_dim, args.classes, dtype
            )
            for rank in range(world):
                lo, hi = shard_range(micro_rows, world, rank)
                grads = {name: np.zeros_like(p) for name, p in ref.params.items()}
                mlp.loss_and_grad(used, x[lo:hi], y[lo:hi], grads, world / micro_rows * scale)
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow: skipped below
                    for name, g in grads.items():
                        total[name] += g.astype(reduce)
        divisor = float(world * len(rows)) * scale
        with np.errstate(over="ignore", invalid="ignore"):
            sumsq = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in total.values())
        norms[step] = np.sqrt(sumsq) / divisor
        if not np.isfinite(norms[step]):
            if scaler is not None:
                scaler.update(True, step + 1)
            continue
        if scaler is not None:
            scaler.update(False, step + 1)
        if args.max_norm is not None:
            coef = args.max_norm / (norms[step] + 1e-6)
            if coef < 1.0:
                divisor /= coef
        ref.step({name: g / divisor for name, g in total.items()})
    return ref.params, norms


def reference_params(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Train the same model unsharded, in this process alone, on the same batches
    (steps 0 .. --steps - 1): the gradient of a micro-batch is the mean over its
    rows, and a step's gradient the average of its micro-batches'
    (``zerompi.reference.average``). Returns the final parameters and every step's
    global L2 gradient norm before clipping (computed in float64)."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    ref = reference_optimizer(args, mlp.init_params(sizes, args.seed, dtype))
    rows = micro_batch_rows(args.batch, args.micro_batches)
    norms = np.zeros(args.steps)
    for step in range(args.steps):
        micro_grads = []
        for micro, micro_rows in enumerate(rows):
            x, y = mlp.make_batch(
                args.seed, step, micro, micro_rows, args.in_dim, args.classes, dtype
            )
            grads = {name: np.zeros_like(p) for name, p in ref.params.items()}
            mlp.loss_and_grad(ref.params, x, y, grads, 1.0 / micro_rows)
            micro_grads.append(grads)
        grads = {name: average(g[name] for g in micro_grads) for name in ref.params}
        norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values())))
        norms[step] = norm
        if args.max_norm is not None and norm > args.max_norm:  # torch's clip_grad_norm_
            grads = {n: g * (args.max_norm / (norm + 1e-6)) for n, g in grads.items()}
        ref.step(grads)
    return ref.params, norms


def mixed_tolerance(args: argparse.Namespace, world: int) -> float:
    """Bit for bit on one rank without ``--max-norm`` (whose norm the reference sums
    in another order); otherwise a rank's rounding of a gradient that the reference
    forms over the same rows in another BLAS call may land one 16-bit step apart
    (2**-8 relative for bfloat16, 2**-11 for float16), and Adam spreads that."""
    if world == 1 and args.max_norm is None:
        return 0.0
    return 1e-2 if "bfloat16" in (args.param_dtype, args.reduce_dtype) else 2e-3


def norm_difference(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The largest relative difference of two runs' gradient norms; a step skipped
    for a non-finite gradient must be non-finite in both (else ``inf``)."""
    if ours.size != theirs.size:
        return float("inf")
    finite = np.isfinite(theirs)
    if not np.array_equal(finite, np.isfinite(ours)):
        return float("inf")
    if not finite.any():
        return 0.0
    a, b = ours[finite], theirs[finite]
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b| / max |b|`` (the absolute difference if ``b`` is all zeros)."""
    diff = float(np.max(np.abs(a - b))) if b.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return diff / scale if scale else diff


def verify(
    args: argparse.Namespace, opt: ZeroOptimizer, grad_norms: list[float], first_step: int
) -> dict[str, Any]:
    """Collective: compare the sharded model (copied out with ``opt.full_params()``,
    any stage) and the gradient norms ``grad_norms`` of steps ``first_step ..
    --steps - 1`` with the reference, trained by rank 0 while the other ranks wait
    in the final allgather. Every rank gets the result, with ``ok``."""
    full = opt.full_params()
    result = None
    mixed = bool(args.param_dtype or args.reduce_dtype)
    if opt.comm.rank == 0:
        start = clock()
        ref, ref_norms = mixed_reference(args, opt.comm.size) if mixed else reference_params(args)
        max_abs = max(float(np.max(np.abs(full[n] - ref[n]))) for n in ref)
        scale = max(float(np.max(np.abs(p))) for p in ref.values())
        ours = np.asarray(grad_norms, dtype=np.float64)
        theirs = ref_norms[first_step:]
        norm_diff = norm_difference(ours, theirs)
        result = {
            "max_abs_diff": max_abs,
            "max_rel_diff": max_abs / scale if scale else max_abs,
            "tolerance": mixed_tolerance(args, opt.comm.size) if mixed else TOLERANCE[args.dtype],
            "grad_norm_rel_diff": norm_diff,
            "grad_norm_tolerance": NORM_TOLERANCE[args.dtype],
            "reference_s": clock() - start,
        }
        if args.optimizer == "adam8bit" and opt.comm.size > 1:
            result["tolerance"] = max(result["tolerance"], EIGHT_BIT_TOLERANCE[0])
            result["grad_norm_tolerance"] = EIGHT_BIT_TOLERANCE[1]
        result["ok"] = (
            result["max_rel_diff"] <= result["tolerance"]
            and norm_diff <= result["grad_norm_tolerance"]
        )
    del full
    return opt.comm.allgather(result)[0]


def failure_message(check: dict[str, Any], dtype: str) -> str:
    """What failed, for stderr."""
    parts = []
    if not check["max_rel_diff"] <= check["tolerance"]:
        parts.append(
            f"the sharded parameters differ from the unsharded reference by "
            f"{check['max_rel_diff']:.3e} relative to the largest parameter, more than "
            f"the {dtype} tolerance {check['tolerance']:g}"
        )
    if not check["grad_norm_rel_diff"] <= check["grad_norm_tolerance"]:
        parts.append(
            f"the gradient norms differ from the reference's by up to "
            f"{check['grad_norm_rel_diff']:.3e} (relative), more than the {dtype} "
            f"tolerance {check['grad_norm_tolerance']:g}: the gradient is averaged wrongly"
        )
    return "zerompi.driver: verification FAILED: " + "; ".join(parts)
