"""The torch peers, where torch is installed (and not ``--no-torch``): two
torch.distributed (gloo) optimizers on the same tensors and gradients as ours, one
thread per rank:

* a flat-buffer DDP: ``all_reduce`` of one flat gradient, then fused Adam on every
  parameter;
* ``ZeroRedundancyOptimizer``: the same ``all_reduce``, then its sharded Adam step,
  which broadcasts the updated parameters;

and torch's fused Adam on one core, next to our kernel. torch is never a dependency
of zerompi: everything here takes the imported module as an argument.
"""

from __future__ import annotations

import argparse
import gc
import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..mpi.collectives import Comm
from ..runtime import clock
from .model import GRAD_SCALE, LR, init_tensor
from .timing import slowest_median_ms


def load_torch(comm: Comm, wanted: bool) -> Any | None:
    """Collective: ``torch`` with a gloo process group over this MPI world, or ``None``
    unless every rank could import it (and ``wanted``)."""
    torch = None
    if wanted:
        try:
            import torch
            import torch.distributed
            import torch.distributed.optim
        except Exception:  # not installed, or broken: run without it
            torch = None
    if not all(comm.allgather(torch is not None)):
        return None
    torch.set_num_threads(1)  # one core per rank, like ours
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.allgather(port)[0]  # rank 0's; comm is the MPI world in main()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )
    return torch


class TorchModel:
    """The model as torch tensors: views of one flat parameter and one flat gradient."""

    def __init__(self, torch: Any, sizes: Sequence[int], seed: int, dtype: np.dtype) -> None:
        total = sum(sizes)
        self.flat_param = torch.empty(total, dtype=getattr(torch, dtype.name))
        self.flat_grad = torch.zeros(total, dtype=getattr(torch, dtype.name))
        self.params = []
        self.grad_views: list[np.ndarray] = []
        grad_np = self.flat_grad.numpy()
        offset = 0
        for i, n in enumerate(sizes):
            view = self.flat_param[offset : offset + n]
            view.numpy()[...] = init_tensor(seed, i, n, dtype)
            param = torch.nn.Parameter(view)
            param.grad = self.flat_grad[offset : offset + n]
            self.params.append(param)
            self.grad_views.append(grad_np[offset : offset + n])
            offset += n

    def load_grads(self, grads: dict[str, np.ndarray]) -> None:
        """The backward: this rank's gradients into the flat gradient."""
        for view, grad in zip(self.grad_views, grads.values(), strict=True):
            np.copyto(view, grad.reshape(-1))


def bench_torch(
    torch: Any,
    comm: Comm,
    sizes: Sequence[int],
    grads: dict[str, np.ndarray],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Median ms of the flat-buffer DDP + fused Adam step and of the
    ZeroRedundancyOptimizer step (each after the same all_reduce), slowest rank."""
    dist = torch.distributed
    dtype = np.dtype(args.dtype)
    world = comm.size

    def timed(model: TorchModel, optimizer: Any) -> tuple[list[float], list[float]]:
        reduce_s, step_s = [], []
        for i in range(args.warmup + args.steps):
            model.load_grads(grads)
            comm.barrier()
            t0 = clock()
            dist.all_reduce(model.flat_grad)
            model.flat_grad.div_(world)
            t1 = clock()
            optimizer.step()
            t2 = clock()
            if i >= args.warmup:
                reduce_s.append(t1 - t0)
                step_s.append(t2 - t1)
        return reduce_s, step_s

    model = TorchModel(torch, sizes, args.seed, dtype)
    ddp = torch.optim.Adam(model.params, lr=LR, fused=True)
    reduce_s, adam_s = timed(model, ddp)
    del ddp, model
    gc.collect()
    model = TorchModel(torch, sizes, args.seed, dtype)
    zero_cls = torch.distributed.optim.ZeroRedundancyOptimizer
    try:
        zero = zero_cls(model.params, optimizer_class=torch.optim.Adam, lr=LR, fused=True)
        fused_ok = True
    except (TypeError, ValueError, RuntimeError):
        fused_ok = False
    fused = all(comm.allgather(fused_ok))
    if not fused:
        zero = zero_cls(model.params, optimizer_class=torch.optim.Adam, lr=LR)
    zero_reduce_s, zero_step_s = timed(model, zero)
    del zero, model
    gc.collect()
    total = [a + b for a, b in zip(reduce_s, adam_s, strict=True)]
    zero_total = [a + b for a, b in zip(zero_reduce_s, zero_step_s, strict=True)]
    return {
        "ddp_fused_ms": slowest_median_ms(comm, total),
        "ddp_phase_ms": {
            "all_reduce": slowest_median_ms(comm, reduce_s),
            "adam": slowest_median_ms(comm, adam_s),
        },
        "zero_ms": slowest_median_ms(comm, zero_total),
        "zero_phase_ms": {
            "all_reduce": slowest_median_ms(comm, zero_reduce_s),
            "step": slowest_median_ms(comm, zero_step_s),
        },
        "zero_fused": fused,
        "backend": "gloo",
        "torch_version": str(torch.__version__),
        "threads": int(torch.get_num_threads()),
    }



def torch_fused_adam(torch: Any, n: int, dtype: np.dtype, seed: int) -> Callable[[], None]:
    """``step()`` of torch's fused Adam on one parameter of ``n`` elements."""
    rng = np.random.default_rng([seed, 7])
    param = torch.nn.Parameter(torch.from_numpy(init_tensor(seed, 0, n, dtype)))
    grad = rng.standard_normal(n, dtype=dtype)
    grad *= GRAD_SCALE
    param.grad = torch.from_numpy(grad)
    optimizer = torch.optim.Adam([param], lr=LR, fused=True)
    return optimizer.step


