"""``zerompi.torch.shard(model, elastic=True)``: a torch loop that survives a lost rank.

Everywhere (MPICH too, serial and under ``mpiexec -n W``): ``shard()`` accepts
``elastic=True`` exactly where :class:`zerompi.ZeroOptimizer` does, and refuses it
with the same message on every rank where it does not (MPICH; Open MPI without
``--with-ft ulfm``), leaving the module as it was.

Under Open MPI with ULFM (scripts/test_openmpi, serial run only: an mpiexec inside an
mpiexec'd test is not portable): a W = 4 run of tests/torch_elastic_script.py whose
rank 2 is SIGKILLed by PID from outside, at a moment the script pauses at, finishes on
the 3 survivors, having gone back to the snapshot's batch (``RankLost.step``) with the
same module and optimizer, and its final parameters equal those of one process that
trained the same batches with ``torch.optim.AdamW`` (float64, relative 1e-6), at
stages 1, 2 and 3 (stage 3 gathers per module: ``elastic`` turns node memory off).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI
from test_elastic import Job as ElasticJob
from test_elastic import ulfm_only

from zerompi import ZeroOptimizer
from zerompi.mpi.agreement import CollectiveError

torch = pytest.importorskip("torch")
from zerompi.torch import shard  # noqa: E402

HERE = Path(__file__).parent
SCRIPT = HERE / "torch_elastic_script.py"


def _refusal(build) -> str | None:  # type: ignore[no-untyped-def]
    try:
        build()
    except CollectiveError as exc:  # agreed: the same on every rank
        return str(exc)
    return None


def test_shard_takes_elastic_where_the_optimizer_does(comm: MPI.Intracomm) -> None:
    """The same verdict as the numpy API's, with its message, on every rank; a refused
    ``shard()`` leaves the module's parameters untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    numpy_says = _refusal(lambda: ZeroOptimizer({"w": np.ones(5)}, comm=comm, elastic=True))
    torch_says = _refusal(lambda: shard(model, comm=comm, stage=2, elastic=True))
    assert_all(torch_says == numpy_says, f"{torch_says!r} != {numpy_says!r}")
    if not os.environ.get("OMPI_MCA_mpi_ft_enable"):  # no fault tolerance: refused
        assert_all(torch_says is not None and "--with-ft ulfm" in torch_says, repr(torch_says))
    if torch_says is not None:
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), before[name]), name


# -- under Open MPI with ULFM ---------------------------------------------------------


STEPS = 12


def Job(tmp: Path, ranks: int, args: list[str], pauses: str) -> ElasticJob:
    """tests/test_elastic.py's ``mpiexec --with-ft ulfm`` job, running
    tests/torch_elastic_script.py (torch's import: longer waits)."""
    return ElasticJob(tmp, ranks, args, pauses, script=SCRIPT, wait=90, run=150)


@pytest.mark.mpi_skip
@ulfm_only
@pytest.mark.parametrize(
    "stage, moment, out_of",
    [
        (1, "step:5", "step"),  # the step's agreement
        (2, "step:5", "step"),
        # this model's buckets are too small to prefetch: every stage-3 gather is a
        # blocking one, the first collective after the pause
        (3, "forward:5", "forward"),  # the first module's gather, in its pre-hook
        (3, "backward:5", "backward"),  # the last module's, in a tensor hook
    ],
)  # fmt: skip
def test_a_torch_loop_survives_a_lost_rank(
    tmp_path: Path, stage: int, moment: str, out_of: str
) -> None:  # fmt: skip
    args = ["--stage", str(stage), "--steps", str(STEPS)]
    job = Job(tmp_path, 4, args, pauses=moment)
    os.kill(job.wait_marker(moment, 4)[2], signal.SIGKILL)
    status, out, results = job.finish()
    assert results, f"no JSON (exit {status}):\n{out[-4000:]}"
    (rec,) = results["recoveries"]
    assert rec["lost"] == [2] and (rec["world_size_before"], rec["world_size_after"]) == (4, 3)
    # batch 4's snapshot was sent, not yet committed: 4 if rank 2's copy arrived, else 3
    assert rec["step"] in (3, 4), rec
    assert results["world_size"] == 3 and results["step_count"] == STEPS, results
    # RankLost reached the loop (out of torch's hooks too), which went back to lost.step
    assert results["where"] == [out_of], results["where"]
    assert results["runs"] == STEPS + 4 - rec["step"], results
    assert results["max_rel_diff"] <= 1e-6, results["diffs"]
