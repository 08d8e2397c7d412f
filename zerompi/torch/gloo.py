"""A torch.distributed gloo process group over the ranks of an MPI communicator.

torch's own data-parallel trainers (``DistributedDataParallel``,
``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``) need torch's default process
group; zerompi runs on MPI. :func:`init_gloo` starts the default group with the
communicator's ranks and size, so the two can be compared in the same processes
(:mod:`zerompi.torch.ddp_parity`, :mod:`zerompi.bench.gpt`) without a second
launcher or ``MASTER_ADDR``/``MASTER_PORT`` in the environment:

* rank 0 starts a ``torch.distributed.TCPStore`` on a port the kernel picks (port 0:
  no race with another job choosing "a free port" at the same moment) and the port
  goes to the other ranks through MPI (:meth:`zerompi.mpi.collectives.Comm.allgather`;
  every MPI call stays in :mod:`zerompi.mpi`);
* the store's address is ``127.0.0.1`` when every rank is on rank 0's host, else rank
  0's hostname (across nodes gloo may need ``GLOO_SOCKET_IFNAME``, as torch says);
* idempotent: a second call for the same communicator returns the same group. torch
  has one default group per process, so a group made for another communicator, or
  by someone else, is refused on every rank (call :func:`destroy_gloo` first).

:func:`destroy_gloo` ends the group :func:`init_gloo` made (nothing else).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch.distributed as dist

from ..mpi.collectives import Comm

#: The communicator the active group was made for (``None``: none made here).
_ACTIVE: Any = None


def _status(mpi: Any) -> str:
    """This rank's state: ``"same"`` (our group for ``mpi`` is active), ``"other"``
    (a default group for something else is), ``"none"``."""
    if not dist.is_initialized():
        return "none"
    return "same" if _ACTIVE is not None and _ACTIVE == mpi else "other"


def init_gloo(comm: Any = None, timeout: float = 120.0) -> Any:
    """Collective over ``comm`` (an mpi4py intracommunicator, default
    ``COMM_WORLD``): start torch's default process group (gloo) with ``comm``'s rank
    and size, and return it. ``timeout``: seconds torch waits for a peer (store,
    collectives). Raises the same ``RuntimeError`` on every rank when another default
    group is active on any rank or rank 0's store could not start."""
    global _ACTIVE
    c = Comm(comm, timeout=0)
    states = c.allgather((_status(c.mpi), socket.gethostname()))
    kinds = {kind for kind, _ in states}
    if kinds == {"same"}:
        return dist.group.WORLD
    if kinds != {"none"}:
        ranks = [r for r, (kind, _) in enumerate(states) if kind != "none"]
        raise RuntimeError(
            f"init_gloo: a torch.distributed default process group is already active on "
            f"rank(s) {ranks} of this communicator, not made by init_gloo for it on every "
            "rank; call zerompi.torch.gloo.destroy_gloo() (or torch's "
            "destroy_process_group()) first"
        )
    host = "127.0.0.1" if len({h for _, h in states}) == 1 else states[0][1]
    wait = datetime.timedelta(seconds=timeout)
    store: Any = None
    port: int | str = 0
    if c.rank == 0:
        try:
            store = dist.TCPStore(host, 0, c.size, True, timeout=wait, wait_for_workers=False)
            port = int(store.port)
        except Exception as exc:  # reported on every rank below
            port = f"{type(exc).__name__}: {exc}"
    port = c.allgather(port)[0]
    if isinstance(port, str):
        raise RuntimeError(f"init_gloo: rank 0 could not start a TCPStore on {host}: {port}")
    if c.rank != 0:
        store = dist.TCPStore(host, port, c.size, False, timeout=wait)
    dist.init_process_group("gloo", store=store, rank=c.rank, world_size=c.size, timeout=wait)
    _ACTIVE = c.mpi
    return dist.group.WORLD


def destroy_gloo() -> None:
    """End the default process group :func:`init_gloo` started, if one is active
    (call it on every rank of its communicator); a group started otherwise is left
    alone. Idempotent."""
    global _ACTIVE
    if _ACTIVE is not None and dist.is_initialized():
        dist.destroy_process_group()
    _ACTIVE = None


def active() -> bool:
    """Whether a group started by :func:`init_gloo` is active in this process."""
    return _ACTIVE is not None and dist.is_initialized()
