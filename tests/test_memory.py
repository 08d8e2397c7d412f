"""zerompi.memory: the estimator against the optimizer's own accounting, and the paper.

The central test builds real ``ZeroOptimizer`` s on every communicator of the ``comm``
fixture (sizes 1 to 4 under ``mpiexec -n 4``, some uneven) for assorted layouts,
bucket sizes and all four stages, and checks that ``estimate`` for that world size
and rank gives ``memory_usage()`` and ``memory_buffers()`` to the byte (buffer order
included). The other tests are pure: they build layouts for any world size in one
process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.buffers import CATEGORIES
from zerompi.memory import (
    estimate,
    estimate_max,
    flat_specs,
    mlp_specs,
    paper_bytes,
)
from zerompi.memory.cli import main
from zerompi.partition import DEFAULT_BUCKET_ELEMS, STAGES

ROOT = Path(__file__).resolve().parent.parent
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)

#: Layouts: (name, shape, dtype) in the model's order.
LAYOUTS: dict[str, list[tuple[str, tuple[int, ...], np.dtype]]] = {
    # Tiny groups of a few parameters, a scalar and one-element parameters: with small
    # buckets some ranks own nothing of some buckets, or nothing at all.
    "tiny": [
        ("a.w", (7, 5), F32),
        ("a.b", (5,), F32),
        ("b.w", (2,), F32),
        ("b.s", (), F32),
        ("c.w", (3, 4, 2), F32),
        ("d", (1,), F32),
        ("e.x", (13,), F32),
    ],
    # float32 and float64 interleaved in one model.
    "mixed": [
        ("l0.w", (6, 4), F32),
        ("l0.d", (9,), F64),
        ("l1.b", (3,), F32),
        ("l1.s", (), F64),
        ("l2.t", (1,), F32),
        ("l3.w", (4, 5), F64),
    ],
    "mlp": mlp_specs(5, 7, 2, 3, F64),
    "flat": flat_specs(101, 9, F32),
}

BUCKETS = (1, 3, DEFAULT_BUCKET_ELEMS)


def _optimizer(specs, comm: MPI.Intracomm, stage: int, bucket_elems: int) -> ZeroOptimizer:
    params = {name: np.zeros(shape, dtype) for name, shape, dtype in specs}
    return ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=bucket_elems)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimate_equals_the_optimizer(comm: MPI.Intracomm, layout: str) -> None:
    specs = LAYOUTS[layout]
    size, rank = comm.Get_size(), comm.Get_rank()
    problems: list[str] = []
    for stage in STAGES:
        for bucket_elems in BUCKETS:
            what = f"{layout}, W={size}, rank {rank}, stage {stage}, bucket_elems {bucket_elems}"
            opt = _optimizer(specs, comm, stage, bucket_elems)
            est = estimate(specs, size, rank, stage, bucket_elems,
                           ranks_per_node=max(map(len, opt.nodes.members)))  # fmt: skip
            if est["usage"] != opt.memory_usage():
                problems.append(f"{what}: usage {est['usage']} != {opt.memory_usage()}")
            if list(est["buffers"].items()) != list(opt.memory_buffers().items()):
                problems.append(f"{what}: buffers {est['buffers']} != {opt.memory_buffers()}")
            if est["total_bytes"] != sum(opt.memory_usage().values()):
                problems.append(f"{what}: total_bytes {est['total_bytes']}")
            if est["buckets"] != len(opt.layout.buckets):
                problems.append(
                    f"{what}: {est['buckets']} buckets, optimizer has {len(opt.layout.buckets)}"
                )
            if stage == 2:  # opt.grads allocates the full gradient buffer on first use
                opt.grads  # noqa: B018
                full = estimate(specs, size, rank, stage, bucket_elems, full_grads=True,
                                ranks_per_node=max(map(len, opt.nodes.members)))  # fmt: skip
                if full["buffers"] != opt.memory_buffers():
                    problems.append(
                        f"{what}: full_grads buffers {full['buffers']} != {opt.memory_buffers()}"
                    )
    assert_all(not problems, "\n".join(problems[:10]))


def test_estimate_with_group_of(comm: MPI.Intracomm) -> None:
    """A custom group_of: every parameter its own group (stage 3: its own bucket)."""
    specs = LAYOUTS["tiny"]
    size, rank = comm.Get_size(), comm.Get_rank()
    params = {name: np.zeros(shape, dtype) for name, shape, dtype in specs}
    problems = []
    for stage in (2, 3):
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=8, group_of=str)
        per_node = max(map(len, opt.nodes.members))
        est = estimate(specs, size, rank, stage, 8, str, ranks_per_node=per_node)
        if est["buffers"] != opt.memory_buffers():
            problems.append(f"stage {stage}: {est['buffers']} != {opt.memory_buffers()}")
    assert_all(not problems, "\n".join(problems))


# -- pure tests: no communication ---------------------------------------------------


def _all_figures(est: dict[str, Any]) -> dict[str, int]:
    figures = {f"usage.{k}": v for k, v in est["usage"].items()}
    figures.update({f"buffer.{k}": v for k, v in est["buffers"].items()})
    figures.update({k: est[k] for k in ("exact_bytes", "buffers_bytes", "total_bytes")})
    return figures


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_zero_holds_the_most(layout: str) -> None:
    specs = LAYOUTS[layout]
    for world in range(1, 8):
        for stage in STAGES:
            for bucket_elems in BUCKETS:
                top = _all_figures(estimate_max(specs, world, stage, bucket_elems))
                for rank in range(world):
                    figures = _all_figures(estimate(specs, world, rank, stage, bucket_elems))
                    assert figures.keys() == top.keys()
                    worse = {k: v for k, v in figures.items() if v > top[k]}
                    assert not worse, (world, stage, bucket_elems, rank, worse)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_exact_matches_the_paper_for_large_models(world: int, dtype: np.dtype) -> None:
    """The layout's four arrays differ from the paper's real-valued formula only by
    the ceil-division of each bucket: < 1 element per bucket and sharded array."""
    params = 50_000_017
    specs = flat_specs(params, 1 << 20, dtype)  # 48 parameters, one per bucket
    for stage in STAGES:
        est = estimate_max(specs, world, stage, shared_memory=False)  # a copy per rank
        paper = paper_bytes({dtype: params}, world, stage)
        assert est["paper_bytes"] == paper
        sharded = (0, 2, 3, 4)[stage]
        slack = sharded * est["buckets"] * dtype.itemsize
        assert 0 <= est["exact_bytes"] - paper <= slack, (stage, est["exact_bytes"], paper)
        if world == 1 or stage == 0:
            assert est["exact_bytes"] == paper
        assert abs(est["exact_bytes"] / paper - 1) < 1e-5
        # The staging buffers are the only difference between total and exact.
        extra = est["buffers"].get(f"grad_bucket.{dtype.name}", 0)
        extra += est["buffers"].get(f"param_bucket.{dtype.name}", 0)
        extra += est["buffers"][f"scratch.{dtype.name}"]
        assert est["buffers_bytes"] == extra


def test_paper_formula_by_stage() -> None:
    p, w = 1_000_000, 4
    assert paper_bytes({F32: p}, w, 0) == 16 * p
    assert paper_bytes({F32: p}, w, 1) == 8 * p + 8 * p / w
    assert paper_bytes({F32: p}, w, 2) == 4 * p + 12 * p / w
    assert paper_bytes({F32: p}, w, 3) == 16 * p / w
    assert paper_bytes({F64: p}, w, 3) == 32 * p / w
    assert paper_bytes({F32: p, F64: p}, 1, 2) == 4 * (4 + 8) * p  # all 4 arrays at W=1


def test_known_figures() -> None:
    """1M float32 parameters in one bucket at W=4, stage 3: a quarter of each array,
    two buckets of staging and two of gathering (overlap), one scratch block; on one
    node with shared memory (the default), a quarter of the node's parameter copy and
    no gathering buffers instead."""
    est = estimate(flat_specs(1_000_000, 1 << 22), 4, 3, 3, shared_memory=False)
    node = estimate(flat_specs(1_000_000, 1 << 22), 4, 3, 3)
    flat = {k: v for k, v in est["buffers"].items() if k != "param_bucket.float32"}
    assert node["buffers"] == flat
    assert est["buffers"] == {
        "params.float32": 1_000_000,
        "grads.float32": 1_000_000,
        "grad_bucket.float32": 8_000_000,
        "param_bucket.float32": 8_000_000,
        "exp_avg.float32": 1_000_000,
        "exp_avg_sq.float32": 1_000_000,
        "scratch.float32": 4 * (1 << 15),
    }
    assert est["exact_bytes"] == 4_000_000 == est["paper_bytes"]
    assert list(est["usage"]) == list(CATEGORIES)


def test_mlp_specs_are_the_driver_model() -> None:
    from zerompi import mlp

    sizes = mlp.layer_sizes(6, 5, 3, 4)
    params = mlp.init_params(sizes, seed=0, dtype=np.float64)
    assert mlp_specs(6, 5, 3, 4, np.float64) == [
        (name, value.shape, value.dtype) for name, value in params.items()
    ]
    assert sum(int(np.prod(s)) for _, s, _ in mlp_specs(6, 5, 3, 4)) == mlp.count_params(sizes)


def test_flat_specs() -> None:
    specs = flat_specs(10, 4)
    assert [s for _, s, _ in specs] == [(4,), (4,), (2,)]
    assert [s for _, s, _ in flat_specs(8, 4)] == [(4,), (4,)]
    with pytest.raises(ValueError):
        flat_specs(0, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 4}, ValueError, "stage must be one of"),
        ({"bucket_elems": 0}, ValueError, "bucket_elems must be >= 1"),
        ({"bucket_elems": 2.0}, TypeError, "bucket_elems must be an integer"),
        ({"specs": []}, ValueError, "nothing to optimize"),
        ({"specs": [("x", (3,), np.int32)]}, TypeError, "float32 or float64"),
        ({"specs": [("x", (0, 3), F32)]}, ValueError, "no elements"),
        ({"specs": [("x", (3,), F32), ("x", (2,), F32)]}, ValueError, "appears twice"),
        ({"rank": 4}, ValueError, "out of range"),
    ],
)
def test_estimate_rejects_bad_input(kwargs: dict[str, Any], error: type, match: str) -> None:
    args = {"specs": LAYOUTS["tiny"], "world_size": 4, "rank": 0, "stage": 1, **kwargs}
    with pytest.raises(error, match=match):
        estimate(**args)


def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mlp", "8,16,2,4", "--world", "3", "--stage", "2", "--per-rank",
                 "--no-shared-memory"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "MLP 8-16-16-4" in out and "paper formula" in out and "grad_bucket.float32" in out
    assert main(["--params", "100", "--world", "2", "--stage", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_over_ranks"]["usage"] == estimate_max(flat_specs(100, 1 << 22), 2, 1)["usage"]
    with pytest.raises(SystemExit):
        main(["--mlp", "8,16,2,4", "--world", "2", "--stage", "1", "--layer-elems", "3"])
    with pytest.raises(SystemExit):
        main(["--mlp", "8,16", "--world", "2", "--stage", "1"])


@pytest.mark.mpi_skip
def test_cli_json() -> None:
    cmd = [sys.executable, "-m", "zerompi.memory", "--params", "1000000", "--world", "4"]
    cmd += ["--stage", "3", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    result = data["max_over_ranks"]
    assert result["exact_bytes"] == 4_000_000
    assert result["paper_bytes"] == 4_000_000.0
    assert result["usage"] == estimate_max(flat_specs(1_000_000, 1 << 22), 4, 3)["usage"]
    assert result["world_size"] == 4 and result["stage"] == 3


@pytest.mark.mpi_skip
def test_bfloat16_is_sized_without_ml_dtypes() -> None:
    """The estimator needs only a bfloat16's size: with ``ml_dtypes`` unimportable,
    ``--param-dtype bfloat16 --reduce-dtype bfloat16`` answers as it does with it
    (every buffer and dtype named bfloat16), and never imports it."""
    code = ("import sys; sys.modules['ml_dtypes'] = None  # import ml_dtypes raises\n"
            "from zerompi.memory.cli import main\n"
            "main(sys.argv[1:])\n")  # fmt: skip
    args = ["--params", "2.5e6", "--world", "4", "--stage", "2", "--param-dtype", "bfloat16",
            "--reduce-dtype", "bfloat16", "--json"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["max_over_ranks"]
    want = estimate_max(flat_specs(2_500_000, 1 << 22), 4, 2, param_dtype="bfloat16",
                        reduce_dtype="bfloat16")  # fmt: skip
    assert result["usage"] == want["usage"] and result["buffers"] == want["buffers"]
    assert result["precision"] == {"float32": ["bfloat16", "bfloat16"]}
    assert "params.float32.bfloat16" in result["buffers"]
    assert not any("int16" in name for name in result["buffers"])
    code = ("import sys, zerompi.memory.cli as c\n"
            "c.main(sys.argv[1:]); print('ml_dtypes' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *args[:-1]], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "False", proc.stderr


@pytest.mark.mpi_skip
def test_piped_into_head_it_ends_quietly() -> None:
    """``python -m zerompi.memory ... | head -1``: the reader leaves early; the
    estimator ends with status 0 and no traceback (a broken pipe is no error here)."""
    cmd = (f"{sys.executable} -m zerompi.memory --params 1e6 --world 4 --stage 3 --per-rank"
           " | head -1; exit ${PIPESTATUS[0]}")  # fmt: skip
    proc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("zerompi.memory: ")


def test_counts_take_the_notation_of_the_other_tools(capsys: pytest.CaptureFixture[str]) -> None:
    """``--params 7e9`` is 7,000,000,000 (as ``--sizes 1.6e7`` is in the bench); a
    count that is no whole number is refused, naming it."""
    outputs = []
    for params in ("2.5e6", "2500000"):
        assert main(["--params", params, "--world", "3", "--stage", "1", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and outputs[0]["max_over_ranks"]["params"] == 2_500_000
    for bad in ("7.5", "1e-3", "x"):
        with pytest.raises(SystemExit):
            main(["--params", bad, "--world", "3", "--stage", "1"])
        assert repr(bad) in capsys.readouterr().err


def test_many_ranks_share_one_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's sum and the maximum over every rank (8-bit Adam's per-block states)
    build the buckets once, then each rank's layout from them (what makes an estimate
    at 2048 ranks answer in a second, ``python -m zerompi.memory --params 7e9 --nodes
    256 --ranks-per-node 8 --stage 3``), with the figures each rank's own layout gives."""
    import zerompi.memory as memory

    built = []
    real = memory.optimizer_layout

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(args[1:4])
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "optimizer_layout", counting)
    memory._last_layout.clear()
    specs = flat_specs(1000, 70)
    options = {"ranks_per_node": 4, "optimizer": "adam8bit"}
    top = memory.estimate_max(specs, 12, 3, 70, **options)
    node = memory.estimate_node(specs, 12, 1, 3, 70, **options)
    assert built == [(12, 0, 3)]  # once, for rank 0, whatever ranks were asked
    monkeypatch.setattr(memory, "optimizer_layout", real)
    for rank in range(12):  # the maximum holds every rank's figures, each estimated afresh
        memory._last_layout.clear()
        one = memory.estimate(specs, 12, rank, 3, 70, **options)
        for key in ("usage", "buffers"):
            for name, value in one[key].items():
                assert top[key][name] >= value
    memory._last_layout.clear()
    own = [memory.estimate(specs, 12, r, 3, 70, **options)["usage"] for r in range(4, 8)]
    assert node == {c: sum(u[c] for u in own) for c in node}


def _nonzero(books: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {op: entry for op, entry in books.items() if any(entry.values())}


@pytest.mark.parametrize("precision", [(None, None), ("bfloat16", "bfloat16")])
def test_traffic_model_equals_the_books(comm: MPI.Intracomm, precision: tuple) -> None:
    """The cost model's bytes per step (``estimate(...)["traffic"]``, within and
    between nodes) are what the optimizer books in one step, to the byte, at every
    stage, with node shared memory or without (run under ``ZEROMPI_NODE_SIZE`` too,
    where the hierarchy crosses emulated nodes)."""
    specs = LAYOUTS["tiny"] + [("z.w", (11,), F32)]
    params = {name: np.ones(shape, dtype) for name, shape, dtype in specs}
    size, rank = comm.Get_size(), comm.Get_rank()
    p_dt, r_dt = precision
    problems = []
    for stage in STAGES:
        for shared in (False, None):
            opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=8,
                                shared_memory=shared, param_dtype=p_dt, reduce_dtype=r_dt,
                                loss_scale=1.0 if r_dt else None)  # fmt: skip
            low = next(iter(opt.engine.precisions.values())).reduce
            grads = {n: np.full(p.shape, 0.125, low if p.dtype == F32 else p.dtype)
                     for n, p in params.items()}  # fmt: skip
            opt.comm.pop_traffic()
            layers = [b.names for b in opt.layout.buckets]
            for names in layers if stage == 3 else ():  # the forward, one bucket at a time
                with opt.gathered(*names):
                    pass
            for names in reversed(layers):
                with opt.gathered(*names), opt.gradients(*names) as g:
                    for n in names:
                        g[n][...] += grads[n]
            opt.step()
            got = _nonzero(opt.comm.pop_traffic())
            est = estimate(specs, size, rank, stage, 8, shared_memory=opt.shared_memory,
                           ranks_per_node=max(map(len, opt.nodes.members)), param_dtype=p_dt,
                           reduce_dtype=r_dt)  # fmt: skip
            want = _nonzero(est["traffic"])
            if got != want:
                problems.append(f"stage {stage} shared {opt.shared_memory}: {got} != {want}")
            opt.close()
    assert_all(not problems, "\n".join(problems[:4]))


def test_cost_model_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    """``--nodes N --ranks-per-node L``: per-rank and per-node memory (a node-shared
    copy once per node: the node's stage-2 parameters are the model's 4P bytes, not
    4P x L) and the step's bytes between nodes, hierarchical against flat: the
    hierarchy sends N - 1 pieces of 1/W of each bucket per rank where flat MPI
    sends W - L."""
    args = ["--params", "1200", "--bucket-elems", "400", "--stage", "2", "--json"]
    assert main([*args, "--nodes", "3", "--ranks-per-node", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    rank, node = data["max_over_ranks"], data["node"]
    assert rank["world_size"] == 12 and rank["nodes"] == 3 and rank["shared_memory"]
    assert node["parameter_partitions"] == 1200 * 4  # one copy per node
    ours, flat = rank["traffic"]["reduce_scatter"], data["flat_traffic"]["reduce_scatter"]
    # rank 0 owns 34 of each 400-element bucket (ceil 400/12): it receives the node sums
    # of its shard from 2 other nodes; flat MPI, every rank of the 2 other nodes' (8).
    assert ours["received_between"] == 3 * 2 * 34 * 4
    assert flat["received_between"] == 3 * 8 * 34 * 4
    assert main([*args, "--nodes", "1", "--ranks-per-node", "4"]) == 0
    one = json.loads(capsys.readouterr().out)["max_over_ranks"]["traffic"]
    assert all(e["sent_between"] == e["received_between"] == 0 for e in one.values())
    for bad in (["--world", "5", "--nodes", "2"], ["--nodes", "2", "--ranks-per-node", "2",
                                                    "--world", "6"]):  # fmt: skip
        with pytest.raises(SystemExit):
            main([*args, *bad])
