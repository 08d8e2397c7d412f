"""``zerompi.torch.shard`` against torch's own DistributedDataParallel, and the gloo
group that puts DDP on the ranks of an MPI communicator (:mod:`zerompi.torch.gloo`).

Every test takes the ``comm`` fixture, so ``mpiexec -n 4`` runs it on communicators
of sizes 1 to 4 (some uneven). torch allows one default process group per process,
so each test starts a gloo group of exactly its communicator's ranks
(:func:`zerompi.torch.gloo.init_gloo`: rank 0 of ``comm`` starts a store on a port the
kernel picks and sends the port over ``comm``; concurrent groups of a split world use
different ports), kept for the tests on the same communicator and ended when the
communicator changes and after the module (the ``gloo`` fixture). The parity setting is
:mod:`zerompi.torch.ddp_parity`'s: the parity model, each rank's slice of every
global micro-batch, two ``backward()`` per step, a ``StepLR`` schedule; DDP on one
side, ``shard`` at each stage on the other, in the same processes. Skipped without
torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import assert_all
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from zerompi.torch.ddp_parity import STAGES, compare_ddp, train_ddp  # noqa: E402
from zerompi.torch.gloo import active, destroy_gloo, init_gloo  # noqa: E402

torch.set_num_threads(1)  # one core per rank: the ranks share the machine


#: The communicator whose group is active (the tests on one communicator share it).
_CURRENT: dict[str, MPI.Intracomm] = {}
#: DDP's final parameters and losses per (communicator, variant), for every stage.
_DDP: dict[tuple[int, bool, bool], tuple[dict, list[float]]] = {}


@pytest.fixture(scope="module", autouse=True)
def _no_group_left_behind() -> Iterator[None]:
    """The other test modules run in the same processes: end the group afterwards."""
    yield
    destroy_gloo()
    _CURRENT.clear()
    _DDP.clear()


@pytest.fixture
def gloo(comm: MPI.Intracomm) -> object:
    """torch's default process group over ``comm``'s ranks. Started when the
    communicator changes (every rank steps through the same tests, so all change
    together) and kept for the tests that follow on the same one: starting a group
    costs a TCPStore connection, and one in a few dozen of those takes 5 s here."""
    if _CURRENT.get("comm") is not comm or not active():
        destroy_gloo()
        _CURRENT.clear()
        _DDP.clear()  # (keyed by id(comm): a new communicator may reuse an old one's id)
        init_gloo(comm, timeout=60.0)
        _CURRENT["comm"] = comm
    return init_gloo(comm)  # idempotent: the active group


@pytest.mark.parametrize(
    ("decoupled", "groups"),
    [(True, False), (False, False), (True, True)],
    ids=["adamw", "adam_l2", "adamw_2_groups"],
)
@pytest.mark.parametrize("stage", STAGES)
def test_matches_torch_ddp(
    comm: MPI.Intracomm, gloo: object, stage: int, decoupled: bool, groups: bool
) -> None:
    """Every final parameter within 1e-5 of DDP's (relative to its largest
    magnitude), every micro-batch's loss within 1e-5 of DDP's (relative)."""
    key = (id(comm), decoupled, groups)  # DDP's run does not depend on the stage
    if key not in _DDP:
        _DDP[key] = train_ddp(comm, decoupled, groups)
    result = compare_ddp(comm, stage, decoupled, groups, ddp=_DDP[key])
    problems = [f"{name} differs by {a:.3g} (relative {r:.3g})"
                for name, (a, r) in result["diffs"].items() if not r <= 1e-5]  # fmt: skip
    if not result["loss_rel"] <= 1e-5:
        problems.append(f"losses differ by {result['loss_rel']:.3g} (relative): {result['losses']}")
    assert_all(not problems, "\n".join(problems[:6]))


def test_the_group_is_the_communicators_ranks(comm: MPI.Intracomm, gloo: object) -> None:
    """Rank and size are ``comm``'s, an all_reduce over gloo sums ``comm``'s ranks,
    and a second ``init_gloo`` for the same communicator returns the same group."""
    problems = []
    if (dist.get_rank(), dist.get_world_size()) != (comm.rank, comm.size):
        problems.append(f"gloo rank/size {dist.get_rank()}/{dist.get_world_size()}")
    total = torch.tensor([float(comm.rank)])
    dist.all_reduce(total)
    if total.item() != comm.size * (comm.size - 1) / 2:
        problems.append(f"all_reduce of the ranks gave {total.item()}")
    if init_gloo(comm) is not gloo or not active():
        problems.append("a second init_gloo for the same communicator made a new group")
    assert_all(not problems, "\n".join(problems))


def test_a_group_for_another_communicator_is_refused(comm: MPI.Intracomm, gloo: object) -> None:
    """torch has one default group per process: asking for one over another
    communicator (a duplicate of ``comm``: the same ranks, another communicator)
    while ``comm``'s is active raises on every rank, naming the way out;
    ``destroy_gloo`` ends the group and is idempotent."""
    other = comm.Dup()
    problems = []
    try:
        init_gloo(other)
        problems.append("accepted")
    except RuntimeError as exc:
        if "destroy_gloo" not in str(exc):
            problems.append(str(exc))
    finally:
        other.Free()
    destroy_gloo()
    destroy_gloo()
    _CURRENT.clear()
    if active() or dist.is_initialized():
        problems.append("destroy_gloo left a group")
    assert_all(not problems, "\n".join(problems))
