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
from ..reference import ReferenceAdam, average
from ..runtime import clock
from .training import micro_batch_rows

if TYPE_CHECKING:
    from .. import ZeroOptimizer

#: Largest accepted ``max_abs_diff / max|reference param|`` of ``--verify``.
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}

#: Largest accepted relative difference between a step's gradient norm and the
#: reference's (the largest over the steps run).
NORM_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def reference_params(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Train the same model unsharded, in this process alone, on the same batches
    (steps 0 .. --steps - 1): the gradient of a micro-batch is the mean over its
    rows, and a step's gradient the average of its micro-batches'
    (``zerompi.reference.average``). Returns the final parameters and every step's
    global L2 gradient norm before clipping (computed in float64)."""
    dtype = np.dtype(args.dtype)
    sizes = mlp.layer_sizes(args.in_dim, args.hidden, args.depth, args.classes)
    ref = ReferenceAdam(
        mlp.init_params(sizes, args.seed, dtype),
        lr=args.lr,
        weight_decay=args.weight_decay,
        decoupled_weight_decay=args.adamw,
    )
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
    if opt.comm.rank == 0:
        start = clock()
        ref, ref_norms = reference_params(args)
        max_abs = max(float(np.max(np.abs(full[n] - ref[n]))) for n in ref)
        scale = max(float(np.max(np.abs(p))) for p in ref.values())
        ours = np.asarray(grad_norms, dtype=np.float64)
        theirs = ref_norms[first_step:]
        norm_diff = (
            float(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-300)))
            if ours.size == theirs.size
            else float("inf")
        )
        result = {
            "max_abs_diff": max_abs,
            "max_rel_diff": max_abs / scale if scale else max_abs,
            "tolerance": TOLERANCE[args.dtype],
            "grad_norm_rel_diff": norm_diff,
            "grad_norm_tolerance": NORM_TOLERANCE[args.dtype],
            "reference_s": clock() - start,
        }
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
