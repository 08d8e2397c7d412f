"""The benchmark's memory-bandwidth floor (:mod:`zerompi.bench.floor`): the byte model
for known cases, the arithmetic of ``floor_ms`` and ``step_per_floor``, the table's
cells, and the stream probe's shape. Nothing here asserts a timing: only counts,
identities and signs. (The end-to-end rows are checked in ``test_bench.py``.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from zerompi.bench.floor import (
    describe,
    floor_bytes,
    floor_fields,
    fused_floor_bytes,
    stream_bandwidth,
)
from zerompi.bench.report import _floor_cells, floor_bytes_lines, floor_header
from zerompi.mpi.collectives import Comm


def row(stage: int = 2, world: int = 2, **fields: Any) -> dict[str, Any]:
    """A benchmark row with the fields the byte model reads (float32 throughout)."""
    out: dict[str, Any] = {
        "stage": stage,
        "world_size": world,
        "dtype": "float32",
        "param_dtype": "float32",
        "reduce_dtype": "float32",
        "shared_memory": True,
        "adam_elems": 1000,
        "step_ms": 1.0,
    }
    out.update(fields)
    return out


def test_stage_2_at_two_ranks_in_float32_is_52_bytes() -> None:
    assert floor_bytes(row(2)) == {"reduce": 12, "stats": 4, "adam": 28, "zero": 0, "gather": 8}
    assert fused_floor_bytes(row(2)) == 32  # 2*4 read + 6*4 param, m, v


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, {"reduce": 12, "stats": 4, "adam": 28, "zero": 4, "gather": 0}),  # 2r + s
        (1, {"reduce": 12, "stats": 4, "adam": 28, "zero": 8, "gather": 8}),
        (3, {"reduce": 12, "stats": 4, "adam": 28, "zero": 0, "gather": 0}),  # on use
    ],
)
def test_each_stage_at_two_ranks(stage: int, expected: dict[str, int]) -> None:
    assert floor_bytes(row(stage)) == expected


@pytest.mark.parametrize("stage", [1, 2])
def test_a_node_shared_copy_removes_the_gather(stage: int) -> None:
    shared = floor_bytes(row(stage, node_shared=True))
    assert shared == {"reduce": 12, "stats": 4, "adam": 28, "zero": 8 * (stage == 1),
                      "gather": 0}  # fmt: skip
    assert floor_bytes(row(stage, node_shared=False))["gather"] == 8


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_statistics_from_the_reduction_pass_cost_no_bytes(stage: int) -> None:
    fused = floor_bytes(row(stage, node_shared=True, stats_fused=True))
    assert fused == {"reduce": 12, "stats": 0, "adam": 28, "zero": 8 * (stage == 1),
                     "gather": 0}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zeroing_follows_the_hand_over(world: int) -> None:
    """Stages 2-3 zero nothing through ``opt.add_gradients`` (a hand-over overwrites)
    and every rank's staging through blocks (the sum clears what it reads), W*r;
    stage 1 always W*r, stage 0 its own buffer, r, in the gradients' dtype."""
    for stage in (2, 3):
        assert floor_bytes(row(stage, world, hand_over="add"))["zero"] == 0
        assert floor_bytes(row(stage, world, hand_over="blocks"))["zero"] == 4 * world
    low = {"reduce_dtype": "bfloat16"}
    assert floor_bytes(row(1, world, **low))["zero"] == 2 * world
    assert floor_bytes(row(0, world, **low))["zero"] == 2


def test_bfloat16_params_and_gradients() -> None:
    """r = p = 2: the reduction reads 2-byte parts, Adam also writes the 2-byte copy,
    the gather copies 2-byte elements; the master stays 4 bytes."""
    mixed = row(2, param_dtype="bfloat16", reduce_dtype="bfloat16")
    assert floor_bytes(mixed) == {"reduce": 8, "stats": 4, "adam": 30, "zero": 0, "gather": 4}
    assert fused_floor_bytes(mixed) == 2 * 2 + 6 * 4 + 2
    # One at a time: each changes only its own terms.
    assert floor_bytes(row(2, reduce_dtype="bfloat16")) == {
        "reduce": 8, "stats": 4, "adam": 28, "zero": 0, "gather": 8,
    }  # fmt: skip
    assert floor_bytes(row(2, param_dtype="float16")) == {
        "reduce": 12, "stats": 4, "adam": 30, "zero": 0, "gather": 4,
    }  # fmt: skip
    # Stage 0 counts 2r + s whatever W, and never gathers.
    assert floor_bytes(row(0, param_dtype="bfloat16", reduce_dtype="bfloat16")) == {
        "reduce": 8, "stats": 4, "adam": 30, "zero": 2, "gather": 0,
    }  # fmt: skip


def test_float64_master() -> None:
    wide = row(2, dtype="float64", param_dtype="float64", reduce_dtype="float64")
    assert floor_bytes(wide) == {"reduce": 24, "stats": 8, "adam": 56, "zero": 0, "gather": 16}


def test_one_rank() -> None:
    """W = 1: the reduction reads one part, there is nothing to gather."""
    assert floor_bytes(row(2, world=1)) == {"reduce": 8, "stats": 4, "adam": 28, "zero": 0,
                                            "gather": 0}  # fmt: skip
    assert floor_bytes(row(1, world=1))["gather"] == 0
    assert floor_bytes(row(0, world=1))["reduce"] == 12  # stage 0: 2r + s at every W
    assert fused_floor_bytes(row(2, world=1)) == 28


def test_four_ranks() -> None:
    assert floor_bytes(row(2, world=4)) == {"reduce": 20, "stats": 4, "adam": 28, "zero": 0,
                                            "gather": 24}  # fmt: skip
    assert floor_bytes(row(1, world=4))["zero"] == 16  # every rank's full buffer, once
    assert floor_bytes(row(0, world=4))["reduce"] == 12
    assert fused_floor_bytes(row(2, world=4)) == 40


def test_floor_ms_is_the_bytes_of_all_ranks_over_the_bandwidth() -> None:
    r = row(2, adam_elems=1000, step_ms=1.0)
    out = floor_fields(r, 10.0)  # 10 GB/s
    assert out["floor_bytes_per_elem"] == floor_bytes(r)
    assert out["floor_ms"] == pytest.approx(1e3 * 52 * 1000 * 2 / 10e9)
    assert out["fused_floor_ms"] == pytest.approx(1e3 * 32 * 1000 * 2 / 10e9)
    assert out["step_per_floor"] == r["step_ms"] / out["floor_ms"]
    assert out["stream_gbps"] == 10.0


def test_without_a_bandwidth_there_is_no_floor() -> None:
    out = floor_fields(row(2), None)
    assert out["floor_ms"] is None and out["step_per_floor"] is None
    assert out["fused_floor_ms"] is None
    assert out["floor_bytes_per_elem"]["reduce"] == 12  # the model still says its bytes


def test_the_table_states_the_bytes_and_tolerates_old_results() -> None:
    assert describe({"reduce": 12, "stats": 4}) == "reduce 12 + stats 4 = 16"
    r = row(2)
    r.update(floor_fields(r, 10.0))
    [line] = floor_bytes_lines([r])
    assert "stage 2" in line and "reduce 12 + stats 4 + adam 28 + zero 0 + gather 8 = 52" in line
    assert "fused design 32" in line
    assert _floor_cells(r).split()[1] == f"{r['step_per_floor']:.2f}"
    # A JSON written before the floor existed: no header, no bytes, '-' cells.
    assert floor_header({"world_size": 2}) == []
    assert floor_bytes_lines([row(2)]) == []
    assert _floor_cells(row(2)).split() == ["-", "-"]


def test_stream_probe_reports_every_ranks_bytes(comm: MPI.Intracomm) -> None:
    """Collective: the probe's shape (every value is reduced over ranks, so the same
    on every rank); its bandwidth is only checked to be positive."""
    c = Comm(comm)
    out = stream_bandwidth(c, elems=4096, reps=2)
    assert out["bytes_per_pass"] == 3 * 4 * 4096 * c.size
    assert out["ranks"] == c.size and out["elems"] == 4096 and out["reps"] == 2
    assert out["stream_gbps"] > 0 and out["pass_ms"] > 0


@pytest.mark.mpi_skip
def test_each_rules_update_bytes() -> None:
    """The update's arrays per element of each rule (float32): Adam 7, SGD and Lion 5
    (one state), 8-bit Adam 3 and two quarter-size codes plus the block scales,
    Adafactor 3 and what it must read again (the gradient twice more, the parameters
    once: its passes need sums over whole parameters first), Muon Adam's."""
    from zerompi.bench.timing import update_arrays
    from zerompi.rules import rule_of

    got = {name: update_arrays(rule_of(name).states, np.dtype(np.float32), rule_of(name).rereads)
           for name in ("adam", "sgd", "lion", "adam8bit", "adafactor", "muon")}  # fmt: skip
    assert got == {"adam": 7, "sgd": 5, "lion": 5, "adam8bit": 3 + 2 * (0.5 + 2 / 256),
                   "adafactor": 6, "muon": 7}, got  # fmt: skip
