"""The driver's checkpoints: ``--save PREFIX`` files, ``--resume``, and the fall back
to the newest of them when ``--elastic`` loses a rank together with its snapshot."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..elastic import RankLost
from ..mpi.collectives import Comm
from ..mpi.launch import end_process

if TYPE_CHECKING:
    from ..optimizer import ZeroOptimizer


def checkpoint_path(prefix: str, step: int) -> str:
    """The checkpoint of ``--save PREFIX`` after ``step`` batches: PREFIX.<8 digits>."""
    return f"{prefix}.{step:08d}"


def saved_checkpoints(prefix: str) -> list[str]:
    """The checkpoints PREFIX.<8 digits> that exist, oldest first."""
    folder = os.path.dirname(prefix) or "."
    base = os.path.basename(prefix) + "."
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    steps = sorted(
        n
        for n in names
        if n.startswith(base) and n[len(base) :].isdigit() and len(n) == len(base) + 8
    )
    return [os.path.join(folder, n) for n in steps]


def save_checkpoint(opt: ZeroOptimizer, args: argparse.Namespace) -> str:
    """Collective: checkpoint at the current step, then (rank 0) drop all but the
    newest --keep checkpoints of the prefix. Only complete files are ever deleted."""
    path = checkpoint_path(args.save, opt.step_count + opt.skipped_steps)  # batches seen
    opt.save(path)
    if opt.comm.rank == 0:
        for old in saved_checkpoints(args.save)[: -args.keep]:
            os.remove(old)
    opt.comm.barrier()
    return path


def resume_path(path: str, comm: Comm) -> str:
    """Rank 0's choice (every rank gets the same): the file itself, or the newest
    checkpoint of a --save prefix."""
    choice = path
    if comm.rank == 0 and not os.path.isfile(path):
        found = saved_checkpoints(path)
        choice = found[-1] if found else path
    return comm.allgather(choice)[0]


def survived(opt: ZeroOptimizer, args: argparse.Namespace, lost: RankLost) -> int:
    """After a lost rank (``--elastic``): the batch to go back to, the snapshot's, or,
    when the snapshot was lost with it, the newest ``--save`` checkpoint's (loaded at
    the new world size). With neither, every survivor says so and exits with status 1.
    A rank lost while this runs (the fallback's load, a checkpoint written again) is
    survived the same way: the recovery this raises is taken in turn."""
    while True:
        try:
            with opt.survive():
                return _go_back(opt, args, lost)
        except RankLost as again:
            lost = again


def _go_back(opt: ZeroOptimizer, args: argparse.Namespace, lost: RankLost) -> int:
    """Collective: one pass of :func:`survived`."""
    comm = opt.comm
    comm.pop_traffic()  # the recovery's messages are not a step's
    if comm.rank == 0:
        print(f"zerompi.driver: {lost}", flush=True)
    if lost.step is not None:
        resave(opt, args, lost.step)
        return lost.step
    found = resume_path(args.save, comm) if args.save else None
    # Rank 0's verdict on every rank: whether to end must not differ between ranks.
    if not found or not comm.allgather(os.path.isfile(found) if comm.rank == 0 else None)[0]:
        # Every survivor is here alike; each ends itself (not MPI_Abort, which can
        # leave Open MPI's mpiexec deadlocked once ranks have died).
        end_process(f"zerompi.driver: {lost}; there is no checkpoint to fall back to (--save)")
    opt.load(found)
    opt.recoveries[-1]["checkpoint"] = found
    step = opt.step_count + opt.skipped_steps
    opt.recoveries[-1]["step"] = step
    if comm.rank == 0:
        print(f"zerompi.driver: fell back to {found} at step {step}, world size "
              f"{comm.size}", flush=True)  # fmt: skip
    return step


def resave(opt: ZeroOptimizer, args: argparse.Namespace, step: int) -> None:
    """Collective: after going back to ``step``, write its checkpoint if it is one the
    run was to write and it is missing (a rank lost while it was being saved: the
    loop goes on after it)."""
    every = args.save_every
    if not (args.save and every and step and step % every == 0):
        return
    exists = os.path.isfile(checkpoint_path(args.save, step)) if opt.comm.rank == 0 else None
    if not opt.comm.allgather(exists)[0]:
        with opt.survive():
            path = save_checkpoint(opt, args)
        opt.comm.pop_traffic()
        if opt.comm.rank == 0:
            print(f"zerompi.driver: saved {path}", flush=True)
