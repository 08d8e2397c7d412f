"""Where a rank is, and Lightning's collectives, over zerompi's communicator.

:class:`ZeroMPIEnvironment` is the Lightning ``ClusterEnvironment`` of a job that
``mpiexec``/``srun`` started: rank and world size are the communicator's, node and
local rank come from one exchange of host names at construction (collective, so
never asked lazily by one rank alone). :func:`reduce_tensor` and
:func:`gather_tensor` are ``Strategy.reduce`` / ``all_gather`` without
``torch.distributed``: small control messages (logged metrics, decisions), moved
with :meth:`zerompi.mpi.collectives.Comm.allgather_float64` /
:meth:`~zerompi.mpi.collectives.Comm.allgather`, so every rank computes the same
result from the same rows, in rank order.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

from ..mpi.collectives import Comm

log = logging.getLogger(__name__)

#: Lightning's reduce operations (``"mean"``, ``ReduceOp.SUM``, ...) by name.
_OPS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}


class ZeroMPIEnvironment(ClusterEnvironment):
    """A job whose processes the launcher (``mpiexec``, ``srun``) created: ranks are
    ``comm``'s, nothing is spawned and no address or port is needed (zerompi talks
    MPI, not ``torch.distributed``). Collective to build (one host-name exchange)."""

    def __init__(self, comm: Comm) -> None:
        self._rank, self._size = comm.rank, comm.size
        hosts = comm.allgather(socket.gethostname())
        nodes = list(dict.fromkeys(hosts))  # in order of their first rank
        mine = hosts[comm.rank]
        self._node_rank = nodes.index(mine)
        self._local_rank = hosts[: comm.rank].count(mine)
        self._first_host = hosts[0]
        #: How many nodes the job's ranks are on.
        self.nodes = len(nodes)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self._first_host

    @property
    def main_port(self) -> int:
        return 0  # (no rendezvous: MPI already connects the ranks)

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._size

    def set_world_size(self, size: int) -> None:
        log.debug("ZeroMPIEnvironment: the world size is the communicator's; %s ignored", size)

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        log.debug("ZeroMPIEnvironment: the rank is the communicator's; %s ignored", rank)

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank


def op_name(reduce_op: Any) -> str:
    """``"sum"``, ``"mean"``, ``"max"`` or ``"min"`` for Lightning's ``reduce_op`` (a
    string, ``torch.distributed.ReduceOp``, or ``None``: mean)."""
    if reduce_op is None:
        return "mean"
    name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    found = _OPS.get(str(name).lower().rpartition(".")[2])
    if found is None:
        raise ValueError(f"zerompi.lightning: reduce_op {reduce_op!r} is not supported "
                         "(sum, mean, max, min)")  # fmt: skip
    return found


def reduce_tensor(comm: Comm, tensor: torch.Tensor, reduce_op: Any) -> torch.Tensor:
    """Collective: ``tensor`` (the same shape on every rank) reduced over ranks, a new
    tensor, identical on every rank (the rows are combined in rank order, in float64).
    A mean of an integer tensor is a floating one, as in Lightning's DDP."""
    op = op_name(reduce_op)
    rows = comm.allgather_float64(tensor.detach().cpu().reshape(-1).double().numpy())
    combined = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op](rows, axis=0)
    dtype = tensor.dtype
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        dtype = torch.get_default_dtype()
    return torch.from_numpy(np.ascontiguousarray(combined)).reshape(tensor.shape).to(dtype)


def gather_tensor(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    """Collective: every rank's ``tensor`` stacked in rank order, shape ``(W, *shape)``
    (any dtype: the tensors are pickled)."""
    tensors = comm.allgather(tensor.detach().cpu().contiguous())
    return torch.stack(tensors)
