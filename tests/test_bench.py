"""``python -m zerompi.bench`` end to end: a tiny run under a subprocess mpiexec.

Serial only (``mpi_skip``): launching mpiexec from inside an mpiexec'd test is not
portable. Only the JSON's shape is checked, never a timing. The optimizer's
shared-memory reduction is left out (``--no-shared-memory``): it is not what these
tests are about.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_harness import mpiexec

from zerompi.bench.floor import floor_bytes

ROOT = Path(__file__).parent.parent


@pytest.mark.mpi_skip
def test_tiny_bench_writes_one_row_per_stage_and_size(tmp_path: Path) -> None:
    out = tmp_path / "missing" / "dir" / "bench.json"  # folders made before measuring
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.bench"]
    cmd += ["--sizes", "1000,5", "--steps", "2", "--warmup", "1", "--no-torch"]
    cmd += ["--tensors", "40", "--tensor-size", "16", "--no-shared-memory"]
    cmd += ["--json", str(out), "--blas-threads", "1", "--stream-elems", "65536"]
    cmd += ["--paired-floor"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    results = json.loads(out.read_text())
    assert results["world_size"] == 2
    assert results["stream_gbps"] > 0  # measured first, before the sizes
    assert results["stream"]["bytes_per_pass"] == 2 * 3 * 4 * 65536
    assert {"mpi_library", "kernel", "roofline", "argv", "rows"} <= set(results)
    assert results["kernel"]["n"] == 1000  # the largest kernel measurement
    assert results["kernel"]["elems_per_s"] > 0
    assert results["roofline"]["adam_roofline_elems_per_s"] > 0
    rows = results["rows"]
    assert sorted((r["params"], r["stage"]) for r in rows) == [
        (p, s) for p in (5, 1000) for s in range(4)
    ]
    for row in rows:
        assert row["world_size"] == 2
        assert row["step_ms"] > 0 and row["baseline_ms"] > 0
        assert set(row["phase_ms"]) == {"reduce_scatter", "adam", "allgather"}
        assert row["hand_over"] == ("add" if row["stage"] >= 2 else None)  # the default
        assert {"impl", "elems_per_s", "torch_fused_elems_per_s", "ratio"} <= set(row["kernel"])
        assert "torch" not in row  # --no-torch
        # The floor: positive, with its own stage's bandwidth and the bytes it assumes.
        assert row["dtype"] == "float32"
        assert row["stream_gbps"] > 0
        assert row["floor_ms"] > 0 and row["fused_floor_ms"] > 0
        assert row["step_per_floor"] == row["step_ms"] / row["floor_ms"]
        assert row["floor_bytes_per_elem"] == floor_bytes(row)
        assert set(row["floor_bytes_per_elem"]) == {"reduce", "stats", "adam", "zero", "gather"}
        # --paired-floor: every timed step over the floor at its own probe's bandwidth
        assert len(row["paired"]) == 2 and all(s > 0 and g > 0 for s, g in row["paired"])
        nbytes = sum(row["floor_bytes_per_elem"].values()) * row["adam_elems"] * 2
        each = sorted(s / (nbytes / (g * 1e9)) for s, g in row["paired"])
        assert row["step_per_floor_paired"] == pytest.approx((each[0] + each[1]) / 2)
        assert row["stream_gbps_steps"] > 0
    assert {r["stage"]: sum(r["floor_bytes_per_elem"].values()) for r in rows} == {
        0: 48, 1: 60, 2: 52, 3: 44,  # stage 0 zeroes its buffer, 1 every rank's
    }  # fmt: skip
    assert "step/floor" in proc.stdout
    assert "paired floor, stage 2, 1,000 params: each step over the floor" in proc.stdout
    assert "reduce 12 + stats 4 + adam 28 + zero 0 + gather 8 = 52" in proc.stdout
    # The many-tensor row: one per stage, with the per-tensor figures.
    many = results["many_tensors"]
    assert [r["stage"] for r in many] == [0, 1, 2, 3]
    for row in many:
        assert row["tensors"] == 40 and row["tensor_elems"] == 16 and row["params"] == 640
        assert row["wall_ms"] > 0 and row["bare_ms"] > 0 and row["us_per_tensor"] > 0
        assert row["overhead_us_per_tensor"] == pytest.approx(
            1e3 * (row["wall_ms"] - row["bare_ms"]) / 40
        )
    assert many[3]["buckets"] == 40  # stage 3: one bucket per one-tensor layer
    assert any(t["key"] == "overhead_us_per_tensor" for t in results["targets"])
    assert "many tensors: 40 one-tensor layers" in proc.stdout
    # The plot is optional: written beside the JSON, or a note that matplotlib is missing.
    assert out.with_suffix(".png").exists() or "matplotlib not installed" in text
    assert "stage" in proc.stdout and "kernel" in proc.stdout


@pytest.mark.mpi_skip
def test_stages_2_3_hand_over_through_blocks_when_asked(tmp_path: Path) -> None:
    """``--hand-over blocks``: stages 2-3 copy into ``opt.gradients`` blocks (node
    memory on, the staging zeroed by the sums) and say so in their rows."""
    out = tmp_path / "bench.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.bench", "--sizes", "1000",
           "--steps", "2", "--warmup", "1", "--no-torch", "--tensors", "0", "--stages", "2,3",
           "--hand-over", "blocks", "--json", str(out), "--stream-elems", "65536"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["stage"], r["hand_over"]) for r in rows] == [(2, "blocks"), (3, "blocks")]
    assert all(r["step_ms"] > 0 for r in rows)


@pytest.mark.mpi_skip
def test_an_unwritable_json_path_fails_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")  # a file where the folder should be
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.bench", "--no-torch"]
    cmd += ["--json", str(tmp_path / "file" / "sub" / "bench.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("error: cannot create the folder") == 1, proc.stderr
    assert "world size" not in proc.stdout  # failed before the first measurement


@pytest.mark.mpi_skip
def test_mixed_precision_rows_sit_next_to_the_float32_ones(tmp_path: Path) -> None:
    """``--param-dtype bfloat16 --reduce-dtype bfloat16``: one more row per stage and
    size, after its float32 row, tagged with its dtypes, sending half the bytes; the
    float32 table, the targets and the plot keep to the float32 rows."""
    out = tmp_path / "bench.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.bench"]
    cmd += ["--sizes", "1000", "--steps", "2", "--warmup", "1", "--no-torch", "--tensors", "0"]
    cmd += ["--param-dtype", "bfloat16", "--reduce-dtype", "bfloat16", "--json", str(out)]
    cmd += ["--blas-threads", "1", "--stream-elems", "65536"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    rows = json.loads(out.read_text())["rows"]
    same = {r["stage"]: r for r in rows if r["param_dtype"] == "float32"}
    mixed = {r["stage"]: r for r in rows if r["param_dtype"] == "bfloat16"}
    assert sorted(same) == sorted(mixed) == [0, 1, 2, 3]
    for stage in (1, 2, 3):
        for op in ("reduce_scatter", "allgather"):
            assert 2 * mixed[stage]["comm_bytes"][op] == same[stage]["comm_bytes"][op], (stage, op)
    assert all(r["reduce_dtype"] == "bfloat16" and r["vs_same_stage"] > 0 for r in mixed.values())
    # The floor counts 2-byte gradient parts, the 2-byte copy Adam writes, 2-byte gathers
    # (none with one node-shared copy of the parameters, the default at W > 1).
    gather = 0 if mixed[2]["node_shared"] else 4
    assert mixed[2]["floor_bytes_per_elem"] == {"reduce": 8, "stats": 4, "adam": 30,
                                                "zero": 0, "gather": gather}  # fmt: skip
    assert all(r["step_per_floor"] == r["step_ms"] / r["floor_ms"] for r in rows)
    assert "mixed precision" in proc.stdout and "bfloat16/bfloat16" in proc.stdout


@pytest.mark.mpi_skip
@pytest.mark.parametrize("rule", ["adam8bit", "adafactor"])
def test_another_rule_over_matrices(rule: str, tmp_path: Path) -> None:
    """``--optimizer`` with ``--matrix-cols``: the tensors are matrices where the
    columns divide them, every stage runs, and the update's bytes are the rule's
    (8-bit Adam: 16.0625 per element; Adafactor: 24, the gradient read three times,
    the parameters twice and written once, its rows and columns left out)."""
    out = tmp_path / "bench.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.bench", "--optimizer", rule]
    cmd += ["--sizes", "4096", "--tensor-elems", "1024", "--matrix-cols", "32", "--steps", "2"]
    cmd += ["--warmup", "1", "--no-torch", "--tensors", "0", "--no-shared-memory"]
    cmd += ["--json", str(out), "--blas-threads", "1", "--stream-elems", "65536"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["stage"] for r in rows) == [0, 1, 2, 3]
    assert {r["optimizer"] for r in rows} == {rule}
    adam = {"adam8bit": 16.0625, "adafactor": 24}[rule]
    assert all(r["floor_bytes_per_elem"]["adam"] == adam for r in rows), rows[0]
