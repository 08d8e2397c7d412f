"""A training script in which the ranks' collective calls part ways, for
tests/test_desync.py.

    mpiexec -n 2 python tests/desync_script.py CASE STAGE SHARED

CASE is what rank 0 (or rank 1) does differently:

* ``mix``: rank 0 hands over group ``a``, rank 1 group ``b`` (buckets of equal size);
* ``accumulate``: rank 0 calls ``accumulate()`` once more than the others;
  ``accumulate16`` the same with bfloat16 gradients, where stages 0-1 reduce at every
  ``accumulate()`` (a collective: the watchdog ends it);
* ``step0``: only rank 0 calls ``step()``;
* ``save0``: only rank 0 calls ``opt.save(...)``;
* ``full0``: only rank 0 calls ``opt.full_params()`` (a collective in stage 3);
* ``none``: every rank does the same; exits 0.

Prints ``START <time.time()>`` just before the ranks part ways.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer


def main(case: str, stage: int, shared: bool) -> int:
    rank = MPI.COMM_WORLD.Get_rank()
    params = {"a.w": np.zeros(4, np.float32), "b.w": np.zeros(4, np.float32)}
    low = {"reduce_dtype": "bfloat16"} if case.endswith("16") else {}
    opt = ZeroOptimizer(params, stage=stage, shared_memory=shared, lr=1.0, bucket_elems=4, **low)
    print(f"START {time.time():.6f}", file=sys.stderr, flush=True)
    if case in ("mix", "none"):
        name = "a" if rank == 0 or case == "none" else "b"
        with opt.gradients(name) as g:
            g[f"{name}.w"][...] += 1.0
        opt.step()
    elif case in ("accumulate", "accumulate16"):
        for name in ("a", "b"):
            with opt.gradients(name) as g:
                g[f"{name}.w"][...] += 1.0
        opt.accumulate()
        if rank == 0:
            opt.accumulate()
        opt.step()
    elif case == "step0" and rank == 0:
        opt.step()
    elif case == "save0" and rank == 0:
        opt.save(os.path.join(tempfile.mkdtemp(prefix="zerompi-desync-"), "x.ckpt"))
    elif case == "full0" and rank == 0:
        opt.full_params()
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"))
