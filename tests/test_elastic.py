"""Surviving a lost rank (``elastic=True``, :mod:`zerompi.elastic`, :mod:`zerompi.recovery`).

The pure parts (the snapshot layout, the re-shard moves, the choice of the step to go
back to, the buddies, the memory estimate) run everywhere. The real thing needs
Open MPI with ULFM (scripts/test_openmpi): a W = 4 driver run under
``mpiexec --with-ft ulfm`` whose rank is SIGKILLed by PID from outside, at a moment
tests/elastic_script.py pauses at (mid-step, mid-snapshot, mid-save), must finish on
the survivors, pass ``--verify`` and report the recovery; those run in the serial
pytest run only (an mpiexec inside an mpiexec'd test is not portable), and skip
under MPICH, whose optimizer refuses ``elastic=True`` (tested here too).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI
from test_harness import mpiexec

from zerompi import RankLost, ZeroOptimizer, checkpoint, mlp
from zerompi.elastic import buddy_ranks, choose, moves, pieces, snapshot_bytes, snapshot_plan
from zerompi.memory import estimate, estimate_max
from zerompi.mpi.agreement import CollectiveError
from zerompi.partition import default_group, optimizer_layout
from zerompi.rules import rule_of

#: The states of the default rule (Adam's moments), whose snapshots these tests lay out.
ADAM = rule_of("adam").states

HERE = Path(__file__).parent
SCRIPT = HERE / "elastic_script.py"
SPECS = [("l0.w", (7, 5), np.dtype(np.float32)), ("l0.b", (5,), np.dtype(np.float32)),
         ("l1.w", (5, 3), np.dtype(np.float64)), ("l1.b", (3,), np.dtype(np.float64))]  # fmt: skip


def layout(world: int, rank: int = 0, bucket_elems: int = 16, stage: int = 1, specs=SPECS):
    return optimizer_layout(specs, world, rank, stage, bucket_elems, default_group)


# -- the pure parts ------------------------------------------------------------------


def reshard_on_paper(rule: str, stage: int, old_size: int, new_size: int, bucket_elems: int,
                     specs=SPECS) -> None:  # fmt: skip
    """Every element (or entry, for a state held per unit) of every section reaches
    every new rank that holds it, from an old rank that held it, once."""
    states = rule_of(rule).states
    old = layout(old_size, bucket_elems=bucket_elems, stage=stage, specs=specs)
    new = layout(new_size, bucket_elems=bucket_elems, stage=stage, specs=specs)
    state: dict[str, np.ndarray] = {}  # section -> global values, distinct everywhere
    for r in range(old_size):
        for section, first, count, _ in pieces(old, r, states, stage):
            size = max(first + count, state[section].shape[0] if section in state else 0)
            state[section] = np.arange(size, dtype=np.float64) + 1e6 * len(state)
    held = {r: {i for i, (_, _, c, _) in enumerate(pieces(old, r, states, stage)) if c}
            for r in range(old_size)}  # fmt: skip
    targets = {n: [np.full(c, np.nan) for _, _, c, _ in pieces(new, n, states, stage)]
               for n in range(new_size)}  # fmt: skip
    for m in moves(old, old_size, new, new_size, states, stage):
        assert m.old_piece in held[m.old]
        section, first, count, _ = pieces(old, m.old, states, stage)[m.old_piece]
        assert 0 <= m.old_at and m.old_at + m.count <= count  # within what it holds
        src = state[section][first + m.old_at : first + m.old_at + m.count]
        out = targets[m.new][m.new_piece][m.new_at : m.new_at + m.count]
        assert np.isnan(out).all()  # written once
        out[...] = src
    for n in range(new_size):
        for (section, first, count, _), got in zip(pieces(new, n, states, stage), targets[n],
                                                   strict=True):  # fmt: skip
            want = state.get(section, np.zeros(0))[first : first + count]
            np.testing.assert_array_equal(got, want)


@pytest.mark.mpi_skip
@pytest.mark.parametrize(
    "old_size, new_size", list(itertools.product([1, 2, 3, 4, 5, 9], [1, 2, 3, 4]))
)
def test_the_reshard_moves_every_element_once(old_size: int, new_size: int) -> None:
    """Adam's states, including worlds where trailing ranks own nothing (9 ranks,
    16-element buckets); every element is moved once in all (a state per element)."""
    reshard_on_paper("adam", 1, old_size, new_size, 16)
    old, new = layout(old_size), layout(new_size)
    moved = sum(m.count for m in moves(old, old_size, new, new_size, ADAM))
    assert moved == 3 * sum(old.sizes.values())


#: Matrices that 10-element buckets and shards cut (a 3-D stack among them), vectors
#: and a float64 dtype: Adafactor's rows and columns shared between ranks.
UNIT_SPECS = [("a", (7, 5), np.dtype(np.float32)), ("b", (5,), np.dtype(np.float32)),
              ("c", (2, 3, 4), np.dtype(np.float32)), ("d", (5, 3), np.dtype(np.float64)),
              ("e", (600,), np.dtype(np.float32))]  # fmt: skip


@pytest.mark.mpi_skip
@pytest.mark.parametrize("rule", ["adam8bit", "adafactor", "muon"])
@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("old_size, new_size", [(2, 1), (3, 2), (4, 3), (9, 4), (4, 2)])
def test_the_reshard_moves_states_held_per_unit(
    rule: str, stage: int, old_size: int, new_size: int
) -> None:  # fmt: skip
    """8-bit Adam's codes and block scales (blocks of 256 cut by shards), Adafactor's
    rows, columns and vectors (matrices cut by buckets and shards), Muon's moments: a
    shared unit's entries come from one old holder, and every holder in the new world
    gets them; at stage 0 every rank holds every unit of every bucket."""
    reshard_on_paper(rule, stage, old_size, new_size, 10, UNIT_SPECS)


@pytest.mark.mpi_skip
def test_an_empty_shard_has_a_snapshot_of_counters_only() -> None:
    # 40 + 3 elements over 9 ranks: rank 8 owns nothing of either bucket
    lay = layout(9, specs=[*SPECS[:2], ("c", (3,), np.dtype(np.float32))])
    empty = [r for r in range(9) if not any(c for _, _, c, _ in pieces(lay, r, ADAM))]
    assert empty, "the layout was meant to leave some ranks empty"
    assert all(snapshot_bytes(lay, r, ADAM) == 64 for r in empty)
    assert 8 in empty and 0 not in empty
    own = snapshot_plan(lay, 0, 8, ADAM)
    assert [b.kind.label for b in own] == ["snapshot_own", "snapshot_held", "snapshot_next"]
    assert [b.count for b in own] == [snapshot_bytes(lay, 0, ADAM), 64, 64]


@pytest.mark.mpi_skip
def test_buddies_are_on_the_next_node() -> None:
    assert buddy_ranks(4, 1) == (2, 0)
    assert buddy_ranks(1, 0) == (0, 0)
    nodes = [(0, 1), (2, 3), (4, 5)]
    assert buddy_ranks(6, 1, nodes) == (3, 5)  # same local index, next node
    assert buddy_ranks(6, 4, nodes) == (0, 2)
    holders = [buddy_ranks(6, r, nodes)[0] for r in range(6)]
    sources = [buddy_ranks(6, r, nodes)[1] for r in range(6)]
    assert all(sources[holders[r]] == r for r in range(6))  # a permutation, inverted


def holder(rank: int) -> int:
    return buddy_ranks(4, rank)[0]


@pytest.mark.mpi_skip
@pytest.mark.parametrize(
    "statuses, expected",
    [
        # committed 10 everywhere, nothing pending: back to 10; rank 1's copy is held by 2
        ([(0, 10, -1, True), (2, 10, -1, True), (3, 10, -1, True)],
         (10, {0: (0, "own"), 1: (1, "held"), 2: (1, "own"), 3: (2, "own")})),
        # snapshot 15 sent, not committed, the dead rank's copy arrived: 15 from live
        ([(0, 10, 15, True), (2, 10, 15, True), (3, 10, 15, True)],
         (15, {0: (0, "live"), 1: (1, "next"), 2: (1, "live"), 3: (2, "live")})),
        # ... its copy did not arrive: the last committed one
        ([(0, 10, 15, True), (2, 10, 15, False), (3, 10, 15, True)],
         (10, {0: (0, "own"), 1: (1, "held"), 2: (1, "own"), 3: (2, "own")})),
        # one survivor committed 15 (its agreement passed: every copy arrived), others not
        ([(0, 15, -1, True), (2, 10, 15, True), (3, 10, 15, True)],
         (15, {0: (0, "own"), 1: (1, "next"), 2: (1, "live"), 3: (2, "live")})),
        # a rank and its holder both lost: no step
        ([(0, 10, -1, True), (3, 10, -1, True)], None),
        # a survivor whose live state moved past every snapshot it has: older one
        ([(0, 10, -1, True), (2, 10, 15, True), (3, 10, 15, True)],
         (10, {0: (0, "own"), 1: (1, "held"), 2: (1, "own"), 3: (2, "own")})),
    ],
)  # fmt: skip
def test_the_survivors_choose_the_newest_complete_step(statuses, expected) -> None:
    assert choose(statuses, 4, holder) == expected


@pytest.mark.mpi_skip
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "adafactor"])
def test_the_estimate_counts_three_snapshot_buffers(stage: int, optimizer: str) -> None:
    states = rule_of(optimizer).states
    for world, rank in ((4, 1), (9, 8), (4, 3)):
        plain = estimate(SPECS, world, rank, stage, 16, shared_memory=False,
                         optimizer=optimizer)  # as elastic  # fmt: skip
        elastic = estimate(SPECS, world, rank, stage, 16, elastic=True, optimizer=optimizer)
        lay = layout(world, rank, 16, stage)
        source = buddy_ranks(world, rank)[1]
        extra = (snapshot_bytes(lay, rank, states, stage)
                 + 2 * snapshot_bytes(lay, source, states, stage))  # fmt: skip
        assert elastic["usage"]["snapshots"] == extra
        assert elastic["total_bytes"] - plain["total_bytes"] == extra


class _Stand:
    """A communicator's stand-in for :func:`zerompi.mpi.ulfm.failure_known`: ULFM's
    two local questions, answered as told."""

    def __init__(self, revoked: bool, failed: int, has_ulfm: bool = True) -> None:
        class Mpi:
            def __eq__(self, other: object) -> bool:
                return False

            def Is_revoked(self) -> bool:
                return revoked

            def Get_failed(self) -> MPI.Group:
                if not failed:
                    return MPI.GROUP_EMPTY  # (as ULFM answers: the predefined group)
                return MPI.COMM_WORLD.Get_group().Range_incl([(0, failed - 1, 1)])

        self.mpi = Mpi()
        if not has_ulfm:
            self.mpi = type("NoUlfm", (), {"__eq__": lambda s, o: False})()


def test_mpi_err_other_is_a_failure_only_where_ulfm_knows_of_one() -> None:
    """Open MPI's nonblocking collectives report a failed peer as MPI_ERR_OTHER: a
    failure when the communicator is revoked or has a known failed process, not
    otherwise (a real MPI_ERR_OTHER is raised as it is); the failure classes always;
    anything but an MPI error never. Local: no communication."""
    from zerompi.mpi.ulfm import is_failure

    other = MPI.Exception(MPI.ERR_OTHER)
    assert not is_failure(other)
    assert not is_failure(other, [_Stand(revoked=False, failed=0)])
    assert is_failure(other, [_Stand(revoked=True, failed=0)])
    assert is_failure(other, [_Stand(revoked=False, failed=1)])
    assert not is_failure(other, [_Stand(revoked=True, failed=1, has_ulfm=False)])
    assert is_failure(MPI.Exception(MPI.ERR_IN_STATUS))
    assert not is_failure(MPI.Exception(MPI.ERR_TRUNCATE), [_Stand(revoked=True, failed=1)])
    assert not is_failure(RuntimeError("MPI_ERR_OTHER"), [_Stand(revoked=True, failed=1)])


def test_elastic_is_refused_without_ulfm(comm: MPI.Intracomm) -> None:
    """Where the MPI library or the launcher lacks ULFM (MPICH; Open MPI without
    --with-ft ulfm), every rank gets the same clear error naming the fix."""
    if os.environ.get("OMPI_MCA_mpi_ft_enable"):
        pytest.skip("this job has fault tolerance on")
    params = {"w": np.ones(5)}
    try:
        ZeroOptimizer(params, comm=comm, elastic=True)
        message = None
    except CollectiveError as exc:  # agreed: the same on every rank
        message = str(exc)
    assert_all(message is not None and "--with-ft ulfm" in message, repr(message))
    try:
        ZeroOptimizer(params, comm=comm, snapshot_every=0)
        message = None
    except CollectiveError as exc:
        message = str(exc)
    assert_all(message is not None and "snapshot_every" in message and "0" in message)
    assert issubclass(RankLost, RuntimeError)


# -- under Open MPI with ULFM ---------------------------------------------------------


#: This Python's MPI is Open MPI, whose mpiexec has --with-ft ulfm.
ULFM = "Open MPI" in MPI.Get_library_version()
ulfm_only = pytest.mark.skipif(not ULFM, reason="needs Open MPI's ULFM (scripts/test_openmpi)")
DRIVER = ["--steps", "40", "--batch", "64", "--hidden", "32", "--in-dim", "16",
          "--log-every", "10", "--verify", "--elastic", "--snapshot-every", "5"]  # fmt: skip


class Job:
    """A ``mpiexec --with-ft ulfm`` run of tests/elastic_script.py in its own session."""

    def __init__(self, tmp: Path, ranks: int, args: list[str], pauses: str = "",
                 script: Path = SCRIPT, wait: float = 60, run: float = 120) -> None:  # fmt: skip
        """``script`` under ``ranks`` ranks; ``wait`` and ``run``: the default
        seconds of :meth:`wait_marker` and :meth:`finish` (tests/test_torch_elastic.py
        runs its own script, which imports torch, with more)."""
        self.wait, self.run = wait, run
        self.control = tmp / "control"
        self.control.mkdir()
        self.json = tmp / "out.json"
        # PRRTE's session directory ($TMPDIR/ompi.<launcher's PID>) in a fresh, short
        # folder of the job's own: a launcher killed by a test leaves its folder
        # behind, and a later launcher that gets the same PID (pid_max is 32768 on a
        # small machine) then cannot start its PMIx server ("The PMIx server's
        # listener thread failed to start"); short, for the PMIx sockets' paths.
        self.session = tempfile.mkdtemp(prefix="zp")
        env = dict(os.environ, ZEROMPI_TEST_CONTROL=str(self.control),
                   ZEROMPI_TEST_PAUSE=pauses, ZEROMPI_TIMEOUT="60", TMPDIR=self.session)
        env.pop("ZEROMPI_NO_ABORT_HOOK", None)
        cmd = [mpiexec(), "--with-ft", "ulfm", "--oversubscribe", "-n", str(ranks),
               sys.executable, str(script), *args, "--json", str(self.json)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=HERE.parent, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # fmt: skip
        self.started = time.monotonic()

    def wait_marker(self, moment: str, ranks: int, timeout: float | None = None) -> dict[int, int]:
        """The PIDs of the ranks paused at ``moment`` (rank -> PID), once all are."""
        deadline = time.monotonic() + (self.wait if timeout is None else timeout)
        while time.monotonic() < deadline:
            found = {int(p.name.rpartition(".")[2]): int(p.read_text() or 0)
                     for p in self.control.glob(f"{moment}.*")}  # fmt: skip
            if len(found) >= ranks and all(found.values()):
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"no {ranks} rank(s) reached {moment}:\n{self.output()}")

    def finish(self, timeout: float | None = None) -> tuple[int, str, dict]:
        try:
            out, _ = self.proc.communicate(timeout=self.run if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        shutil.rmtree(self.session, ignore_errors=True)
        results = json.loads(self.json.read_text()) if self.json.exists() else {}
        return self.proc.returncode, out, results

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.session, ignore_errors=True)

    def output(self) -> str:
        self.kill()
        return self.proc.communicate()[0]


def finished(job: Job, world: int, recoveries: int) -> dict:
    status, out, results = job.finish()
    assert results, f"no JSON (exit {status}):\n{out[-4000:]}"
    assert results["world_size"] == world, out[-4000:]
    assert len(results["recoveries"]) == recoveries, results["recoveries"]
    assert results["verify_ok"], out[-4000:]
    assert "zerompi.driver: lost rank" in out
    return results


@pytest.mark.mpi_skip
@ulfm_only
@pytest.mark.parametrize("stage", [1, 3])
def test_a_rank_killed_mid_step_is_survived(tmp_path: Path, stage: int) -> None:
    job = Job(tmp_path, 4, [*DRIVER, "--stage", str(stage)], pauses="step:13")
    pids = job.wait_marker("step:13", 4)
    os.kill(pids[2], signal.SIGKILL)
    results = finished(job, 3, 1)
    (rec,) = results["recoveries"]
    assert rec["step"] == 10 and rec["lost"] == [2]
    assert (rec["world_size_before"], rec["world_size_after"]) == (4, 3)
    assert 0 < rec["seconds"] < 10
    # memory_usage() (max over the survivors) is what the estimator says for W = 3
    sizes = mlp.layer_sizes(16, 32, 2, 10)
    specs = [(n, d.shape, d.dtype) for n, d in mlp.deferred_params(sizes, 0, np.float32).items()]
    want = estimate_max(specs, 3, stage, elastic=True)["usage"]
    assert results["memory_bytes"] == want and want["snapshots"] > 0



@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_killed_under_nonblocking_reductions_is_survived(tmp_path: Path) -> None:
    """Stage 2 without overlap, buckets of 500: the survivors wait in Open MPI's
    nonblocking reduce-scatters (libnbc), which abort their schedule on a failed
    peer or a revoked communicator and report only ``MPI_ERR_OTHER`` (in about a
    third of such kills here); with ULFM knowing of the failure that is a failure
    too (:func:`zerompi.mpi.ulfm.is_failure`), and the job goes on."""
    job = Job(tmp_path, 4, [*DRIVER, "--stage", "2", "--no-overlap", "--bucket-elems", "500"],
              pauses="step:13")  # fmt: skip
    pids = job.wait_marker("step:13", 4)
    os.kill(pids[2], signal.SIGKILL)
    (rec,) = finished(job, 3, 1)["recoveries"]
    assert rec["lost"] == [2] and rec["world_size_after"] == 3


@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_killed_mid_snapshot_is_survived(tmp_path: Path) -> None:
    """Killed after the snapshot of batch 10 was sent, before it was committed: the
    survivors go back to batch 10 if the lost rank's copy arrived (its buddy says so),
    else to 5; never to a mix."""
    job = Job(tmp_path, 4, [*DRIVER, "--stage", "2"], pauses="snapshot:10")
    pids = job.wait_marker("snapshot:10", 4)
    os.kill(pids[1], signal.SIGKILL)
    results = finished(job, 3, 1)
    assert results["recoveries"][0]["step"] in (5, 10)


@pytest.mark.mpi_skip
@ulfm_only
def test_two_ranks_lost_one_after_the_other(tmp_path: Path) -> None:
    """4 -> 3 -> 2, the second time rank 0 (which prints and writes the JSON): the loss
    curve after each recovery is the uninterrupted one's (--verify checks every step's
    gradient norm and the final parameters against one process)."""
    job = Job(tmp_path, 4, [*DRIVER, "--stage", "1"], pauses="step:13,step:27")
    os.kill(job.wait_marker("step:13", 4)[3], signal.SIGKILL)
    os.kill(job.wait_marker("step:27", 3)[0], signal.SIGKILL)
    results = finished(job, 2, 2)
    first, second = results["recoveries"]
    assert (first["step"], first["world_size_before"], first["world_size_after"]) == (10, 4, 3)
    assert (second["step"], second["world_size_before"], second["world_size_after"]) == (25, 3, 2)
    assert first["lost"] == [3] and second["lost"] == [0]  # ranks of the world of the time


@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_lost_with_its_buddy_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    """Ranks 1 and 2 die together: rank 1's snapshot was on rank 2. The survivors say
    so and load the newest --save checkpoint at world size 2."""
    prefix = tmp_path / "ck"
    args = [*DRIVER, "--stage", "2", "--save", str(prefix), "--save-every", "8"]
    job = Job(tmp_path, 4, args, pauses="step:13")
    pids = job.wait_marker("step:13", 4)
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[2], signal.SIGKILL)
    _, out, results = job.finish()
    assert results, out[-4000:]
    (rec,) = results["recoveries"]
    assert rec["checkpoint"].endswith("ck.00000008") and rec["step"] == 8, rec
    assert results["world_size"] == 2 and results["verify_ok"], out[-4000:]
    assert "no in-memory snapshot holds their state" in out and "fell back to" in out


@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_lost_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """Killed while the checkpoint of batch 20 is being written: the one of batch 10
    is intact, no temporary is left behind, and after the recovery batch 20's
    checkpoint is written by the survivors."""
    prefix = tmp_path / "ck"
    args = [*DRIVER, "--stage", "3", "--save", str(prefix), "--save-every", "10", "--keep", "5"]
    job = Job(tmp_path, 4, args, pauses="save:20")
    pids = job.wait_marker("save:20", 4)
    os.kill(pids[2], signal.SIGKILL)
    results = finished(job, 3, 1)
    assert results["recoveries"][0]["step"] in (15, 20)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck"))
    assert names == ["ck.00000010", "ck.00000020", "ck.00000030", "ck.00000040"], names
    for name in names:
        checkpoint.verify(tmp_path / name)


@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_lost_while_a_checkpoint_is_written_again_is_survived(tmp_path: Path) -> None:
    """Rank 2 dies in the save of batch 20, then rank 3 (of the first world) in the
    next save of batch 20, the one the survivors write after going back (or reach
    again): the second loss is survived too, and the job finishes at W = 2."""
    prefix = tmp_path / "ck"
    args = [*DRIVER, "--stage", "2", "--save", str(prefix), "--save-every", "10", "--keep", "5"]
    job = Job(tmp_path, 4, args, pauses="save:20,save:20:again")
    pids = job.wait_marker("save:20", 4)
    os.kill(pids[2], signal.SIGKILL)
    os.kill(job.wait_marker("save:20:again", 3)[3], signal.SIGKILL)
    results = finished(job, 2, 2)
    assert [r["world_size_after"] for r in results["recoveries"]] == [3, 2]
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck"))
    assert names == ["ck.00000010", "ck.00000020", "ck.00000030", "ck.00000040"], names
    for name in names:
        checkpoint.verify(tmp_path / name)


@pytest.mark.mpi_skip
@ulfm_only
@pytest.mark.timeout(180)  # (the job's own limit, 120 s, ends it first)
@pytest.mark.parametrize("optimizer, stage", [("adam", 2), ("adam8bit", 1), ("adafactor", 3),
                                              ("muon", 2), ("adafactor", 0)])  # fmt: skip
def test_recovery_equals_a_resume_at_the_smaller_world(
    tmp_path: Path, optimizer: str, stage: int
) -> None:  # fmt: skip
    """A run that loses a rank after batch 12 (snapshot 10) ends where a run that saved
    at batch 10 and resumed at world size 3 ends, bit for bit: parameters and every
    state of the rule (the snapshot and the re-shard copy bits; both then run the same
    W = 3 steps, without node shared memory). 8-bit Adam's block scales and
    Adafactor's rows and columns are held per unit, several ranks holding a unit their
    parts share (at stage 0 every rank holds all); Muon's step exchanges matrices."""
    common = ["--steps", "30", "--batch", "64", "--hidden", "32", "--in-dim", "16",
              "--stage", str(stage), "--log-every", "10", "--optimizer", optimizer]  # fmt: skip
    (tmp_path / "a").mkdir()
    elastic = ["--elastic", "--snapshot-every", "5", "--save", str(tmp_path / "elastic")]
    job = Job(tmp_path / "a", 4, [*common, *elastic], pauses="step:13")
    os.kill(job.wait_marker("step:13", 4)[2], signal.SIGKILL)
    _, out, results = job.finish()
    assert [r["step"] for r in results.get("recoveries", ())] == [10], out[-4000:]
    base = [mpiexec(), "--oversubscribe", "-n"]
    driver = [sys.executable, "-m", "zerompi.driver", *common, "--no-shared-memory"]  # as elastic
    plain = str(tmp_path / "plain")
    for ranks, extra in ((4, ["--steps", "10", "--save", plain]),
                         (3, ["--resume", plain, "--save", plain])):  # fmt: skip
        proc = subprocess.run([*base, str(ranks), *driver, *extra], cwd=HERE.parent,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = checkpoint.read(tmp_path / "elastic.00000030")
    want = checkpoint.read(tmp_path / "plain.00000030")
    assert got["optimizer"]["step"] == want["optimizer"]["step"] == 30
    kinds = ["params", *(k.label for k in rule_of(optimizer).states)]
    for kind in kinds:
        assert want[kind], kind
        for name, array in want[kind].items():
            np.testing.assert_array_equal(got[kind][name], array, err_msg=f"{kind} {name}")


@pytest.mark.mpi_skip
@ulfm_only
@pytest.mark.timeout(180)  # (the job's own limit, 120 s, ends it first)
def test_elastic_without_the_launchers_fault_tolerance_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [mpiexec(), "--oversubscribe", "-n", "2", sys.executable, "-m", "zerompi.driver",
         "--elastic", "--steps", "2"],
        cwd=HERE.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "mpiexec --with-ft ulfm" in proc.stdout + proc.stderr


@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_lost_during_a_recovery_ends_the_job(tmp_path: Path) -> None:
    """Not survivable, but never a hang: rank 3 dies in batch 13, rank 2 while the
    others recover; the survivors' recovery fails, each says so and exits, and
    mpiexec ends (with MPI_Abort instead, it deadlocked in 2 runs of 6)."""
    job = Job(tmp_path, 4, [*DRIVER, "--stage", "2"], pauses="step:13,recover")
    os.kill(job.wait_marker("step:13", 4)[3], signal.SIGKILL)
    os.kill(job.wait_marker("recover", 3)[2], signal.SIGKILL)
    start = time.monotonic()
    status, out, results = job.finish(timeout=60)
    assert status != 0 and not results, out[-3000:]
    assert "the recovery from a lost rank failed" in out, out[-3000:]
    assert "not survivable" in out
    assert time.monotonic() - start < 30


@pytest.mark.mpi_skip
@ulfm_only
def test_a_rank_lost_with_its_buddy_and_no_checkpoint_ends_the_job(tmp_path: Path) -> None:
    job = Job(tmp_path, 4, [*DRIVER, "--stage", "1"], pauses="step:13")
    pids = job.wait_marker("step:13", 4)
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[2], signal.SIGKILL)
    status, out, results = job.finish(timeout=60)
    assert status != 0 and not results, out[-3000:]
    assert "there is no checkpoint to fall back to" in out, out[-3000:]
