"""Nodes: the node layout, one parameter copy per node, the hierarchical reduction,
and when node shared memory is used by default.

Every test runs on the ``comm`` fixture's communicators; ``scripts/test`` also runs
the whole suite as two emulated nodes of two ranks (``ZEROMPI_NODE_SIZE=2``), where
these checks (and every reference comparison of the suite) cross nodes.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.buffers import Kind
from zerompi.mpi import shm
from zerompi.mpi.collectives import Comm
from zerompi.mpi.nodes import NODE_SIZE_ENV, nodes_of
from zerompi.reduction import NodeReduce
from zerompi.reference import ReferenceAdam

F32 = np.dtype(np.float32)


def _params(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)  # the same on every rank
    return {
        "a.w": rng.standard_normal((7, 3)).astype(np.float32),
        "a.b": rng.standard_normal(3).astype(np.float32),
        "b.w": rng.standard_normal(10).astype(np.float32),
        "c.w": rng.standard_normal(2).astype(np.float64),
    }


@pytest.mark.parametrize("node_size", [None, 1, 2])
def test_regions_cover_every_bucket_once(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, node_size: int | None
) -> None:
    """The ranks of a node serve disjoint regions of every bucket that together are
    the whole bucket: each element is summed within its node by exactly one rank and
    sent across nodes by exactly that rank; a rank's region holds its own shard."""
    if node_size is not None:
        monkeypatch.setenv(NODE_SIZE_ENV, str(node_size))
    wrapped = Comm(comm, timeout=0)
    nodes = nodes_of(wrapped)
    problems = []
    if sorted(r for m in nodes.members for r in m) != list(range(comm.size)):
        problems.append(f"members {nodes.members} are not the ranks 0..{comm.size - 1}")
    opt = ZeroOptimizer(_params(), comm=comm, stage=2, bucket_elems=5, shared_memory=False)
    mine = wrapped.allgather(
        [nodes.region(b.counts, b.displs) if nodes.uniform else [] for b in opt.layout.buckets]
    )
    for index, bucket in enumerate(opt.layout.buckets if nodes.uniform else ()):
        for node in nodes.members:
            covered = np.zeros(bucket.size, int)
            for r in node:
                for lo, hi in mine[r][index]:
                    covered[lo:hi] += 1
            if not (covered == 1).all():
                problems.append(f"bucket {index}, node {node}: covered {covered.tolist()}")
        lo, hi = bucket.local(comm.rank)
        if hi > lo and (lo, hi) not in mine[comm.rank][index]:
            problems.append(f"bucket {index}: own shard {(lo, hi)} not in the region")
    assert_all(not problems, "\n".join(problems[:5]))


@pytest.mark.parametrize("stage", [1, 2])
def test_one_parameter_copy_per_node(comm: MPI.Intracomm, stage: int) -> None:
    """Stages 1-2 with node shared memory (the default with more than one rank): the
    parameters are one copy per node, which every rank of the node maps (a write by
    one rank is what the others read) and whose bytes ``memory_usage()`` shares out
    (the node's ranks add up to the model's bytes once), and which training updates
    as the reference."""
    params = _params()
    total = sum(p.nbytes for p in params.values())
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=6, lr=0.1)
    nodes, problems = opt.nodes, []
    if opt.shared_memory != (comm.size > 1 and nodes.uniform and nodes.size > 1):
        problems.append(f"shared_memory {opt.shared_memory} with {nodes}")
    node = nodes.node.mpi
    if opt.shared_memory:
        share = node.allreduce(opt.memory_usage()["parameter_partitions"])
        if share != total:
            problems.append(f"the node holds {share} bytes of parameters, want {total}")
        if nodes.local == 0:
            opt.params["b.w"][...] = 42.0
        node.Barrier()
        if not (opt.params["b.w"] == 42.0).all():
            problems.append(f"local rank {nodes.local} does not see the node copy's write")
        node.Barrier()
        opt.params["b.w"] = params["b.w"]  # every rank: the same values back
        node.Barrier()
    ref = ReferenceAdam(params, lr=0.1)
    for step in range(2):
        grads = {n: np.full(p.shape, 0.125 * (step + 1), p.dtype) for n, p in params.items()}
        for name in params:
            with opt.gradients(name) as g:
                g[name][...] += grads[name]
        opt.step()
        ref.step(grads)
    for name in params:
        if not np.array_equal(opt.params[name], ref.params[name]):
            problems.append(f"{name}: {opt.params[name].ravel()[:3]} != reference")
    assert_all(not problems, "\n".join(problems[:5]))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_node_reduction_matches_the_mpi_one(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    """With node shared memory every rank sums its region of the node's gradient
    buffers in place (stage 1's full buffers too, not only stages 2-3's staging);
    on one node the same pass gives the step's statistics (no second pass over the
    reduced gradient). The parameters, the gradient norm and clipping equal the MPI
    path's (up to the order of the sums), and a non-finite gradient on one rank
    skips the step on every rank, state untouched. The sum leaves the staging slots
    of stages 2-3 zero (it clears what it read), ready for the next step's
    gradients without a zeroing pass."""
    import zerompi.nodesum as nodesum

    passes = []
    real = nodesum.grad_stats
    monkeypatch.setattr(nodesum, "grad_stats", lambda *a: passes.append(1) or real(*a))
    params = _params(7)
    opts = [ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=6, lr=0.05,
                          max_norm=0.5, shared_memory=shared) for shared in (True, False)]
    problems = []
    shared = opts[0].shared_memory
    summed = [b for b in opts[0].engine.reducer.backends if isinstance(b, NodeReduce)]
    if shared and stage == 1 and not summed:
        problems.append("stage 1 with shared memory does not reduce in node shared memory")
    rng = np.random.default_rng(11 + comm.rank)
    for step in range(4):
        grads = {n: rng.standard_normal(p.shape).astype(p.dtype) for n, p in params.items()}
        if step == 2 and comm.rank == comm.size - 1:
            grads["b.w"][3] = np.nan
        for opt in opts:
            passes.clear()
            for name in reversed(list(params)):
                with opt.gathered(name), opt.gradients(name) as g:
                    g[name][...] += grads[name]
            opt.step()
            if opt is opts[0] and shared and opt.nodes.count == 1 and passes:
                problems.append(f"step {step}: {len(passes)} statistics pass(es) after the "
                                "node reduction")  # fmt: skip
            if opt is opts[0] and shared and stage > 1:
                views = opt.engine.reducer.views
                dirty = [(s, i) for s, row in enumerate(views) for i, v in enumerate(row)
                         if v.any()]  # fmt: skip
                if dirty:
                    problems.append(f"step {step}: staging (slot, bucket) {dirty} not zero")
        a, b = opts[0].last_grad_norm, opts[1].last_grad_norm
        if step != 2 and not np.isclose(a, b, rtol=1e-6):
            problems.append(f"step {step}: norm {a} with shared memory, {b} without")
    for name in params:
        a, b = opts[0].full_params()[name], opts[1].full_params()[name]
        if not np.allclose(a, b, rtol=1e-5, atol=1e-7):
            problems.append(f"{name}: differs by {np.max(np.abs(a - b))}")
    skipped = [opt.skipped_steps for opt in opts]
    if skipped != [1, 1]:
        problems.append(f"skipped steps {skipped}, want [1, 1]")
    assert_all(not problems, "\n".join(problems[:5]))


def test_stage_3_gathers_each_layer_once_per_node(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 3 over several nodes with node shared memory: the gather buffers are one
    copy per node, each layer crosses between nodes once per node (a rank gathers
    its region; fewer bytes between nodes than the flat ``Allgatherv``, none more
    within), training with the prefetch on, in an order that changes, matches the
    flat path, and ``ZEROMPI_DEBUG`` does not poison the shared buffer."""
    params = _params(13)
    opts = [ZeroOptimizer(params, comm=comm, stage=3, bucket_elems=6, lr=0.05,
                          shared_memory=shared) for shared in (None, False)]  # fmt: skip
    nodes, problems = opts[0].nodes, []
    hier = opts[0].shared_memory and nodes.count > 1
    layers = getattr(opts[0].engine.access, "layers", None)  # (none on one node: read in place)
    node_gathers = layers is not None and layers.node is not None
    if hier != node_gathers:
        problems.append(f"node-shared gathers {node_gathers} with {nodes}")
    between = []
    rng = np.random.default_rng(5 + comm.rank)
    for step in range(4):
        grads = {n: rng.standard_normal(p.shape).astype(p.dtype) for n, p in params.items()}
        order = list(params) if step % 2 else list(reversed(list(params)))
        for opt in opts:
            opt.comm.pop_traffic()
            for name in order:
                with opt.gathered(name) as p:
                    _ = float(p[name].sum())
            for name in reversed(order):
                with opt.gathered(name), opt.gradients(name) as g:
                    g[name][...] += grads[name]
            opt.step()
            books = opt.comm.pop_traffic().get("allgather", {})
            between.append(books.get("received_between", 0))
    hier_bytes, flat_bytes = sum(between[0::2]), sum(between[1::2])
    if hier and nodes.size > 1 and not hier_bytes < flat_bytes:
        problems.append(f"between nodes {hier_bytes} B with the hierarchy, {flat_bytes} flat")
    for name in params:
        a, b = (opt.full_params()[name] for opt in opts)
        if not np.allclose(a, b, rtol=1e-6, atol=1e-7):
            problems.append(f"{name}: differs from the flat path by {np.max(np.abs(a - b))}")
    if node_gathers:  # ZEROMPI_DEBUG does not poison a buffer other ranks may read
        import zerompi.handover as handover

        monkeypatch.setattr(handover, "DEBUG", True)
        name = next(iter(params))
        with opts[0].gathered(name):
            pass
        index = opts[0].layout.bucket_of[name]
        if not all(np.isfinite(row[index]).all() for row in layers.bufs):  # type: ignore[union-attr]
            problems.append("ZEROMPI_DEBUG poisoned the node's shared gather buffer")
    assert_all(not problems, "\n".join(problems[:5]))


def test_16_bit_stage_1_gradients_reduce_over_mpi(comm: MPI.Intracomm) -> None:
    """Stage 1's 16-bit gradients are reduced at every micro-batch, through MPI: their
    full buffers stay private (the parameters still are one copy per node)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    del ml_dtypes
    opt = ZeroOptimizer(_params(), comm=comm, stage=1, bucket_elems=6,
                        reduce_dtype="bfloat16", shared_memory=None)  # fmt: skip
    plan = opt.engine.plan
    summed = [b for b in opt.engine.reducer.backends if isinstance(b, NodeReduce)]
    ok = not summed and Kind.GRADS not in plan.node_memory
    assert_all(ok, f"16-bit stage 1 gradients in node memory: {plan}")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_discarded_hand_over_never_reaches_a_later_step(comm: MPI.Intracomm, stage: int) -> None:
    """Part of a bucket handed over, then ``zero_grad()``: its staging slot is left
    written, and whichever bucket takes that slot next (of either dtype: each dtype
    has its own staging, the slots are numbered alike) must not see it. Against the
    reference on the steps' own gradients."""
    params = _params(9)
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=6, lr=0.05)
    ref = ReferenceAdam(params, lr=0.05)

    def grads(step: int, rank: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([step, rank])
        return {n: rng.standard_normal(p.shape).astype(p.dtype) for n, p in params.items()}

    # Two staging slots taken in turn: the discarded half-bucket (float32) leaves its
    # slot written, the float64 bucket is summed in that slot next, and in the
    # following step (no discarded hand-over) the float32 bucket "b.w" takes it.
    order = ["b.w", "c.w", "a.w", "a.b"]
    for step in range(6):
        if step % 2 == 0:
            with opt.gathered("a.w"), opt.gradients("a.w") as g:  # half of [a.w, a.b]
                g["a.w"][...] += 1000.0
            opt.zero_grad()
        mine = grads(step, comm.rank)
        for name in order:
            with opt.gathered(name), opt.gradients(name) as g:
                g[name][...] += mine[name]
        opt.step()
        every = [grads(step, r) for r in range(comm.size)]
        ref.step({n: sum(g[n] for g in every) / comm.size for n in params})
    full = opt.full_params()
    problems = [f"{n}: differs by {np.max(np.abs(full[n] - ref.params[n]))}" for n in params
                if not np.allclose(full[n], ref.params[n], rtol=1e-4, atol=1e-6)]  # fmt: skip
    assert_all(not problems, "\n".join(problems))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_streamed_sum_gives_the_same_step(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    """Where the node's reduced shards outgrow the largest cache, stages 2-3's sum
    writes the private shard with non-temporal stores (:class:`zerompi.nodesum.
    NodeSum`'s ``stream``; forced here with a cache of 0 bytes): the parameters
    equal a plainly stored run's bit for bit, over shards on and off a 64-byte
    boundary, float32 and float64 buckets, clipping included."""
    import zerompi.adam as adam
    from zerompi.nodesum import NodeSum

    rng = np.random.default_rng(21)
    params = {"w": rng.standard_normal((64, 48)).astype(np.float32),
              "v": rng.standard_normal(1000).astype(np.float32),
              "d": rng.standard_normal(512)}  # fmt: skip
    runs, streamed = [], []
    for cache in (1 << 40, 0):
        monkeypatch.setattr(adam, "CACHE_BYTES", cache)
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=2048, lr=0.01,
                            max_norm=5.0, shared_memory=True)  # fmt: skip
        sums = {id(b.node_sum): b.node_sum for b in opt.engine.reducer.backends
                if isinstance(b, NodeReduce) and isinstance(b.node_sum, NodeSum)}  # fmt: skip
        streamed.append([s.stream for s in sums.values()])
        grng = np.random.default_rng(5 + comm.rank)
        for _ in range(3):
            for name in reversed(list(params)):
                grad = grng.standard_normal(params[name].shape).astype(params[name].dtype)
                with opt.gathered(name):
                    opt.add_gradients({name: grad})
            opt.step()
        runs.append(opt.full_params())
        opt.close()
    problems = [f"{n} differs" for n in params if not np.array_equal(runs[0][n], runs[1][n])]
    if any(streamed[0]) or not all(streamed[1]):
        problems.append(f"stream flags {streamed}: want none, then all")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_results_are_the_same_run_to_run(comm: MPI.Intracomm, stage: int) -> None:
    """At a given layout (ranks, nodes), training twice from the same start gives
    bit-identical parameters, with gradients whose sums round (the order of the
    hierarchy's sums is fixed)."""

    def train() -> dict[str, np.ndarray]:
        params = _params(5)
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=6, lr=0.01)
        rng = np.random.default_rng(100 + comm.rank)
        for _ in range(3):
            for name in reversed(list(params)):
                with opt.gathered(name), opt.gradients(name) as g:
                    g[name][...] += rng.standard_normal(params[name].shape)
            opt.step()
        out = opt.full_params()
        opt.close()
        return out

    first, second = train(), train()
    same = all(np.array_equal(first[n], second[n]) for n in first)
    assert_all(same, "two identical runs differ")


def test_uneven_nodes_fall_back_with_a_notice(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nodes with different numbers of ranks: the MPI collectives, and rank 0 says why
    in one line (not a hang, not an error); the result is the reference's."""
    monkeypatch.setenv(NODE_SIZE_ENV, "2")
    groups = Comm(comm, timeout=0).allgather(MPI.COMM_WORLD.Get_rank() // 2)
    uneven = len({groups.count(g) for g in set(groups)}) > 1
    params = _params()
    opt = ZeroOptimizer(params, comm=comm, stage=2, lr=0.1)
    out = capsys.readouterr().out
    problems = []
    if opt.shared_memory != (not uneven and comm.size > 1):
        problems.append(f"shared_memory {opt.shared_memory}, uneven nodes {uneven}")
    said = "not using node shared memory: the nodes have different numbers" in out
    if said != (uneven and comm.rank == 0):
        problems.append(f"notice {said!r} on rank {comm.rank}: {out!r}")
    assert_all(not problems, "\n".join(problems))


def test_no_room_in_dev_shm_falls_back_by_default(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Too little room in ``/dev/shm`` (containers often cap it at 64 MiB): by default
    the MPI collectives and one notice naming the directory and the bytes needed;
    ``shared_memory=True`` insists (and would fail with a clear error if the room
    really were missing); ``shared_memory=False`` says nothing."""
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 4096)
    params = _params()
    default = ZeroOptimizer(params, comm=comm, stage=2)
    said = capsys.readouterr().out
    insisted = ZeroOptimizer(params, comm=comm, stage=2, shared_memory=True)
    capsys.readouterr()  # (uneven nodes: a notice again)
    off = ZeroOptimizer(params, comm=comm, stage=2, shared_memory=False)
    quiet = capsys.readouterr().out
    problems = []
    if default.shared_memory or off.shared_memory:
        problems.append("shared memory in use without room, or when refused")
    if insisted.shared_memory != insisted.nodes.uniform:
        problems.append("shared_memory=True did not insist")
    nodes = default.nodes  # (one rank per node shares nothing by default: no notice)
    expected = comm.size > 1 and comm.rank == 0 and not (nodes.uniform and nodes.size == 1)
    why = "too little room" if nodes.uniform else "different numbers of ranks"
    if ("not using node shared memory" in said and why in said) != expected:
        problems.append(f"notice on rank {comm.rank}: {said!r}")
    if quiet:
        problems.append(f"unexpected output {quiet!r}")
    assert_all(not problems, "\n".join(problems))


def test_one_rank_and_one_rank_per_node_share_nothing_by_default(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stage 0 (plain data parallelism) sums its gradients in node shared memory on any
    number of nodes of equal size, and by default neither a single rank nor one rank
    per node uses it (there is nothing to share); ``shared_memory=True`` still takes
    the hierarchical path there, at stage 0 too."""
    params = _params()
    zero = ZeroOptimizer(params, comm=comm, stage=0)
    shares = zero.nodes.uniform and zero.nodes.size > 1
    alone = ZeroOptimizer(params, comm=MPI.COMM_SELF, stage=2)
    monkeypatch.setenv(NODE_SIZE_ENV, "1")
    spread = ZeroOptimizer(params, comm=comm, stage=2)
    spread_zero = ZeroOptimizer(params, comm=comm, stage=0, shared_memory=True)
    insisted = ZeroOptimizer(params, comm=comm, stage=2, shared_memory=True)
    ok = zero.shared_memory == shares and not (alone.shared_memory or spread.shared_memory)
    insisted_ok = insisted.shared_memory and spread_zero.shared_memory
    assert_all(ok and insisted_ok, "shared memory in use, or not where insisted")


def test_a_bad_node_size_is_an_error_on_every_rank(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ZEROMPI_NODE_SIZE`` that is not a positive integer, or that differs between
    ranks (they would split into different nodes and wait in different collectives):
    a clear error on every rank, naming the value, not a hang."""
    from zerompi.mpi.agreement import CollectiveError

    problems = []
    for value, error, match in (("0", ValueError, "positive integer, got '0'"),
                                ("two", ValueError, "got 'two'")):  # fmt: skip
        monkeypatch.setenv(NODE_SIZE_ENV, value)
        try:
            ZeroOptimizer(_params(), comm=comm, stage=2)
            problems.append(f"{value!r}: no error")
        except error as exc:
            if match not in str(exc):
                problems.append(f"{value!r}: {exc}")
    if comm.size > 1:
        monkeypatch.setenv(NODE_SIZE_ENV, "1" if comm.rank == 0 else "2")
        try:
            ZeroOptimizer(_params(), comm=comm, stage=2)
            problems.append("node sizes that differ: no error")
        except CollectiveError as exc:
            if "ZEROMPI_NODE_SIZE differs between ranks" not in str(exc):
                problems.append(f"differing node sizes: {exc}")
    assert_all(not problems, "\n".join(problems))


def test_stage_0_sums_in_node_memory_as_allreduce_does(comm: MPI.Intracomm) -> None:
    """Stage 0 in node memory (its default with more than one rank per node): each rank
    sums its region in node memory (over several nodes, then reduce-scatters the node
    sums with the ranks of its local index and gathers their results back), then
    copies the others' regions (``NodeCopies``). With gradients whose sums
    are exact (multiples of 1/8), its parameters after steps of one and of two
    micro-batches are the ``Allreduce`` path's bit for bit, every rank's gradient
    buffer is zero after each step (the next one starts from zero), and the reduced
    gradient every rank stepped with is the same on all (the norm agreed)."""
    params = _params(seed=11)
    node = ZeroOptimizer(params, comm=comm, stage=0, bucket_elems=7)
    mpi = ZeroOptimizer(params, comm=comm, stage=0, bucket_elems=7, shared_memory=False)
    problems = []
    if node.engine.plan.shared_memory != (node.nodes.uniform and node.nodes.size > 1):
        problems.append(f"node memory {node.engine.plan.shared_memory} on {node.nodes}")
    for step, micro in enumerate((1, 2, 1)):
        for k in range(micro):
            for opt in (node, mpi):
                for name, p in params.items():
                    g = (np.arange(p.size, dtype=p.dtype).reshape(p.shape) % 5 - 2) / 8
                    opt.grads[name][...] += g * (comm.rank + 1 + k + step)
                if micro > 1:
                    opt.accumulate()
        node.step()
        mpi.step()
        for name in params:
            if not np.array_equal(node.params[name], mpi.params[name]):
                problems.append(f"step {step}: {name} differs from the Allreduce path")
            if node.grads[name].any():
                problems.append(f"step {step}: {name}'s gradient buffer is not zero")
        norms = comm.allgather(node.last_grad_norm)
        if len(set(norms)) != 1 or node.last_grad_norm != mpi.last_grad_norm:
            problems.append(f"step {step}: norms {norms} vs {mpi.last_grad_norm}")
    node.close()
    mpi.close()
    assert_all(not problems, "\n".join(problems[:6]))
