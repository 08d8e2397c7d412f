"""The memory-bandwidth floor of a step: how fast the step could be if it only moved
the bytes its data flow must move, at the bandwidth the machine's memory gives all
ranks streaming together.

Every phase of a step on one node (reduce, gradient statistics, Adam, gather) is a
stream over arrays far larger than the cache, so its time is bounded below by the
bytes it must read and write divided by the memory bandwidth. Two parts:

* :func:`stream_bandwidth` measures that bandwidth in the benchmark's own run, right
  before each stage is timed: every rank at once (after a barrier) runs
  ``np.add(a, b, out=a)`` over float32 arrays far larger than the cache (read ``a``,
  read ``b``, write ``a``: 3 x nbytes per pass); a pass takes as long as its slowest
  rank, and the aggregate is the bytes of all ranks over the best pass's time. It is
  the bandwidth the ranks share, since they run the step's phases at once too.
* :func:`floor_bytes` is the byte model: the bytes one rank must move per element of
  its shard (per model element at stage 0), itemized per phase, from a benchmark
  row's fields. :func:`floor_fields` turns it into ``floor_ms`` and
  ``step_per_floor = step_ms / floor_ms`` (how many times the floor the step takes;
  below 1 when the arrays fit in the cache, where the floor does not hold).

The floor counts what the data flow must read and write, not the copies a transport
adds: a reduction through MPI messages (``shared_memory`` false) moves each byte
through MPI's shared cells more than once, and that extra is part of what
``step/floor`` shows, so ``shared_memory`` does not change the floor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..mpi.collectives import Comm
from ..runtime import clock
from .timing import ADAM_ARRAYS, ratio

#: Elements of each of the probe's two float32 arrays: 128 MiB each, 4x the L3 of
#: the development machine, so every pass streams from memory.
STREAM_ELEMS = 1 << 25
#: Timed passes of the probe (the first one pays nothing extra: the arrays' pages
#: are touched when they are filled).
STREAM_REPS = 5
#: Bytes one pass of ``np.add(a, b, out=a)`` moves per element of ``a``, in units of
#: ``a``'s itemsize: read a, read b, write a.
STREAM_ARRAYS = 3


def stream_bandwidth(
    comm: Comm, elems: int = STREAM_ELEMS, reps: int = STREAM_REPS
) -> dict[str, Any]:
    """Collective: the memory bandwidth all ranks reach streaming together, in GB/s
    (1e9 B/s), and how it was measured.

    Every rank fills two float32 arrays of ``elems`` elements once, then ``reps``
    times: a barrier, one timed ``np.add(a, b, out=a)``, whose time is the slowest
    rank's. The aggregate is the sum over ranks of the bytes of one pass over the best
    pass's time: all ranks' bytes moved while all of them stream (a rank's best pass
    taken while another rank was not streaming does not count)."""
    a = np.full(elems, 1.0, np.float32)  # filled: every page is touched before timing
    b = np.full(elems, 0.5, np.float32)
    nbytes = STREAM_ARRAYS * a.nbytes
    slowest = math.inf
    for _ in range(reps):
        comm.barrier()
        start = clock()
        np.add(a, b, out=a)
        slowest = min(slowest, comm.max(clock() - start))
    del a, b
    total = comm.sum(nbytes)
    return {
        "stream_gbps": total / slowest / 1e9,
        "elems": elems,
        "reps": reps,
        "ranks": comm.size,
        "bytes_per_pass": total,
        "pass_ms": 1e3 * slowest,
    }


def itemsize(name: str) -> int:
    """Bytes per element of a dtype named in a row (``"bfloat16"`` needs no
    ``ml_dtypes`` here)."""
    return 2 if name == "bfloat16" else np.dtype(name).itemsize


def _sizes(row: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """``(W, s, r, p)``: world size and the master, reduce and param itemsizes."""
    return (
        int(row["world_size"]),
        itemsize(row["dtype"]),
        itemsize(row["reduce_dtype"]),
        itemsize(row["param_dtype"]),
    )


def floor_bytes(row: Mapping[str, Any]) -> dict[str, int]:
    """Bytes one rank must read and write per element of its shard (per model element
    at stage 0) in one step of ``row``'s data flow, per phase.

    With W ranks and itemsizes s (master ``dtype``), r (``reduce_dtype``) and p
    (``param_dtype``):

    * ``reduce``: stages 1-3 read the W ranks' parts of the gradient and write the
      reduced shard, ``W*r + s``. Stage 0 (an Allreduce, every rank ends with the
      whole sum) is counted as one in-place add per model element: read this rank's
      gradient, read what arrives from the others, write the sum, ``2*r + s``, at
      every W. That is an assumption, not a proven minimum: it ignores how the
      others' sum is formed (a reduce-scatter plus a copy back costs a little less
      per rank at W > 2), and at W = 1 nothing arrives.
    * ``stats``: the non-finite count and sum of squares read the reduced gradient,
      ``s``; 0 where the reduction's pass computes them (``stats_fused``: one node,
      the reduction through node memory, :mod:`zerompi.nodesum`).
    * ``adam`` (the update): read param, grad, m, v and write param, m, v, ``7*s``
      for Adam (``update_arrays``: ``3 + 2 * states``, 5 for SGD and Lion, plus the
      arrays a rule must read again: 6 for Adafactor, which reads the gradient three
      times and the parameters twice), plus ``p`` when the update also writes the
      16-bit copy of the parameters (``p != s``).
    * ``zero``: the gradient buffers left zero for the next step's gradients (the
      gradients API adds into them), ``r`` per element zeroed: stage 0 zeroes its
      whole buffer after the update, ``r``; stage 1 every element of every rank's
      full buffer once (the within-node sum clears the other ranks' parts as it
      reads them and the rank its own shard after the update, or the whole buffer
      after an MPI reduction), ``W*r``; stages 2-3 through ``opt.gradients``
      blocks, whose sum clears the staging it reads, ``W*r``, and nothing through
      ``opt.add_gradients`` (``hand_over`` ``"add"``: a hand-over overwrites).
    * ``gather``: stages 1-2 copy the other ranks' parts into this rank's full copy,
      ``(W-1) * (p + p)`` (read and write); 0 with ``node_shared`` (one copy per
      node, Adam writes it in place), and 0 at stage 0 (no gather) and stage 3
      (it gathers layer by layer when they are used, in the forward and backward,
      not in ``step()``; the benchmark's stage-3 ``step_ms`` does time those two
      gathers, in its ``allgather`` phase, so its ``step/floor`` includes them).
    """
    stage = int(row["stage"])
    w, s, r, p = _sizes(row)
    gathers = stage in (1, 2) and not row.get("node_shared", False)
    zeroed = {0: r, 1: w * r}.get(stage, 0 if row.get("hand_over", "add") == "add" else w * r)
    return {
        "reduce": 2 * r + s if stage == 0 else w * r + s,
        "stats": 0 if row.get("stats_fused", False) else s,
        "adam": row.get("update_arrays", ADAM_ARRAYS) * s + (p if p != s else 0),
        "zero": zeroed,
        "gather": (w - 1) * 2 * p if gathers else 0,
    }


def fused_floor_bytes(row: Mapping[str, Any]) -> int:
    """Bytes per element of a fused design's minimum: the peers' gradients summed
    inside the Adam pass (read W gradients, read and write param, m, v: ``W*r + 6*s``,
    plus ``p`` for the 16-bit copy when ``p != s``) and no gather copy (one
    node-shared copy of the parameters). A bound for comparison, not a design the
    step can run as is: the statistics (the skip on a non-finite gradient, clipping)
    need the whole reduced gradient before the first update."""
    w, s, r, p = _sizes(row)
    # the update without its gradient: read param and the states, write them (Adam: 6)
    state_arrays = row.get("update_arrays", ADAM_ARRAYS) - 1
    return w * r + state_arrays * s + (p if p != s else 0)


def _ms(nbytes: float, gbps: float | None) -> float | None:
    """Milliseconds to move ``nbytes`` at ``gbps`` GB/s (None without a bandwidth)."""
    return 1e3 * nbytes / (gbps * 1e9) if gbps else None


def floor_fields(row: Mapping[str, Any], stream_gbps: float | None) -> dict[str, Any]:
    """The floor fields of ``row`` at ``stream_gbps``: the bytes per element
    (:func:`floor_bytes`), ``floor_ms`` (those bytes for the busiest rank's elements,
    ``adam_elems``, times the W ranks, all streaming at once, over the aggregate
    bandwidth), ``step_per_floor = step_ms / floor_ms``, and the fused design's
    ``fused_floor_ms``."""
    per_elem = floor_bytes(row)
    elems = int(row["adam_elems"]) * int(row["world_size"])
    floor_ms = _ms(sum(per_elem.values()) * elems, stream_gbps)
    fused = fused_floor_bytes(row)
    paired = {}
    if row.get("paired"):  # --paired-floor: each step over its own floor
        total = sum(per_elem.values()) * elems
        paired = {
            "step_per_floor_paired": float(np.median(
                [1e3 * step / _ms(total, gbps) for step, gbps in row["paired"]])),  # type: ignore[operator]
            "stream_gbps_steps": float(np.median([gbps for _, gbps in row["paired"]])),
        }  # fmt: skip
    return {
        **paired,
        "stream_gbps": stream_gbps,
        "floor_bytes_per_elem": per_elem,
        "floor_ms": floor_ms,
        "step_per_floor": ratio(row["step_ms"], floor_ms),
        "fused_floor_bytes_per_elem": fused,
        "fused_floor_ms": _ms(fused * elems, stream_gbps),
    }


def describe(per_elem: Mapping[str, int]) -> str:
    """``{"reduce": 12, "stats": 4}`` -> ``"reduce 12 + stats 4 = 16"``."""
    parts = " + ".join(f"{k} {v:g}" for k, v in per_elem.items())
    return f"{parts} = {sum(per_elem.values()):g}"
