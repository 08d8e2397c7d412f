"""safetensors in and out: the numpy-only format (:mod:`zerompi.checkpoint.safetensors`)
read and written alike by the ``safetensors`` package, ``python -m zerompi.checkpoint
export PATH --safetensors DIR`` (one file or numbered files with an index), and
``opt.load_safetensors`` at every stage and world size, each rank reading its own
shards, refusing a file that does not fit on every rank with the state untouched.

Files of the collective tests live in pytest-mpi's ``mpi_tmp_path``, named per
communicator (``shared_path``, as in ``tests/test_checkpoint.py``); the format tests
run serially in ``tmp_path``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import F32, MIXED, SHAPES, Spec, assert_all, assert_raises_all, make_params, spec_of
from mpi4py import MPI
from test_checkpoint import make_opt, on_rank0, shared_path, train

from zerompi import ZeroOptimizer
from zerompi.checkpoint import CheckpointError
from zerompi.checkpoint import safetensors as st
from zerompi.checkpoint.__main__ import main as checkpoint_main

STAGES = [0, 1, 2, 3]


def arrays_of_every_dtype() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((5, 3)).astype(np.float32),
        "d": rng.standard_normal(7),
        "h": rng.standard_normal((2, 2)).astype(np.float16),
        "bf": rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def read_all(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor through zerompi's reader, whole."""
    found = st.entries(path)
    return {n: st.read_range(e, 0, e.size, n).reshape(e.shape) for n, e in found.items()}


# -- the format, against the safetensors package ---------------------------------------------


@pytest.mark.mpi_skip
def test_what_zerompi_writes_the_safetensors_package_reads(tmp_path: Path) -> None:
    numpy_io = pytest.importorskip("safetensors.numpy")
    arrays = arrays_of_every_dtype()
    path = tmp_path / "a.safetensors"
    size = st.write_file(path, arrays)
    assert size == path.stat().st_size
    loaded = numpy_io.load_file(str(path))
    assert sorted(loaded) == sorted(arrays)
    for name, want in arrays.items():
        assert same(loaded[name], want), name
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert (8 + n) % 8 == 0 and header["__metadata__"] == {"format": "pt"}


@pytest.mark.mpi_skip
def test_what_the_safetensors_package_writes_zerompi_reads(tmp_path: Path) -> None:
    numpy_io = pytest.importorskip("safetensors.numpy")
    arrays = arrays_of_every_dtype()
    path = tmp_path / "b.safetensors"
    numpy_io.save_file(arrays, str(path))
    got = read_all(path)
    assert sorted(got) == sorted(arrays)
    for name, want in arrays.items():
        assert same(got[name], want), name
    entry = st.entries(path)["w"]
    for lo, hi in [(0, 0), (0, 1), (3, 11), (14, 15), (0, 15)]:
        assert same(st.read_range(entry, lo, hi), arrays["w"].reshape(-1)[lo:hi])


def test_files_are_planned_as_transformers_shards() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 0)]
    assert st.plan_files(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert st.plan_files(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert st.plan_files(sizes, 1) == [["a"], ["b"], ["c"], ["d", "e"]]
    assert st.plan_files([], 8) == [[]]
    with pytest.raises(ValueError, match="max_bytes must be positive, got 0"):
        st.plan_files(sizes, 0)


def _overwrite_header(path: Path, edit) -> None:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.mpi_skip
def test_broken_files_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    st.write_file(good, {"a": np.ones(4, np.float32), "b": np.ones(2, np.float32)})
    cases = {}
    cases["short"] = (b"\x01\x02", "shorter than 8 bytes")
    cases["huge header"] = ((10**9).to_bytes(8, "little") + b"{}", "a header of 1000000000")
    cases["not json"] = ((4).to_bytes(8, "little") + b"{{{{", "not a readable safetensors")
    cases["truncated"] = (good.read_bytes()[:-3], "truncated")
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=message):
            st.entries(path)
    hole = tmp_path / "hole.safetensors"
    hole.write_bytes(good.read_bytes())
    _overwrite_header(hole, lambda h: h["b"].update(data_offsets=[20, 28]))
    with pytest.raises(CheckpointError, match="hole or an overlap"):
        st.entries(hole)
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(good.read_bytes())
    _overwrite_header(wrong, lambda h: h["a"].update(shape=[5]))
    with pytest.raises(CheckpointError, match=r"tensor 'a' of shape \[5\] F32 has 16 bytes"):
        st.entries(wrong)
    integers = tmp_path / "int.safetensors"
    integers.write_bytes(good.read_bytes())
    _overwrite_header(integers, lambda h: h["a"].update(dtype="I32"))
    with pytest.raises(CheckpointError, match="has dtype I32; zerompi reads floating-point"):
        st.read_range(st.entries(integers)["a"], 0, 4, "a")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors\.index\.json nor"):
        st.entries(empty)


# -- export from a checkpoint -------------------------------------------------------------------


def _checkpoint(directory: Path, spec: Spec = MIXED) -> tuple[str, dict[str, np.ndarray]]:
    """A checkpoint saved by a one-rank optimizer after two steps, and its parameters."""
    opt = make_opt(MPI.COMM_SELF, 2, spec)
    train(opt, spec, 0, 2)
    path = str(directory / "c.ckpt")
    opt.save(path)
    return path, {n: a.copy() for n, a in opt.full_params().items()}


@pytest.mark.mpi_skip
def test_export_writes_one_file_or_numbered_files_with_an_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    numpy_io = pytest.importorskip("safetensors.numpy")
    path, params = _checkpoint(tmp_path)
    one = tmp_path / "one"
    assert checkpoint_main(["export", path, "--safetensors", str(one)]) == 0
    assert os.listdir(one) == ["model.safetensors"]
    assert f"wrote {len(params)} parameters to {one}/model.safetensors" in capsys.readouterr().out
    loaded = numpy_io.load_file(str(one / "model.safetensors"))
    assert list(loaded) == list(params)  # the model's order
    assert all(same(loaded[n], params[n]) for n in params)
    many = tmp_path / "many"
    assert checkpoint_main(["export", path, "--safetensors", str(many),
                            "--max-shard-size", "100B"]) == 0  # fmt: skip
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(many)) == sorted([*files, "model.safetensors.index.json"])
    merged = {}
    for file in files:
        part = numpy_io.load_file(str(many / file))
        assert all(index["weight_map"][n] == file for n in part)
        merged.update(part)
    assert sorted(merged) == sorted(params) and all(same(merged[n], params[n]) for n in params)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in params.values())
    got = read_all(many)
    assert all(same(got[n], params[n]) for n in params)
    (many / "notes.txt").write_text("kept")
    assert checkpoint_main(["export", path, "--safetensors", str(many)]) == 0  # one file now
    assert sorted(os.listdir(many)) == ["model.safetensors", "notes.txt"]  # no stale index
    got = read_all(many)
    assert all(same(got[n], params[n]) for n in params)


@pytest.mark.mpi_skip
def test_export_refuses_a_corrupted_checkpoint_and_bad_arguments(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[-5] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    assert checkpoint_main(["export", path, "--safetensors", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    for argv in (["export", path], ["export", path, "--npz", "x", "--safetensors", "y"],
                 ["export", path, "--safetensors", "y", "--max-shard-size", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            checkpoint_main(argv)
        assert exit_info.value.code == 2


# -- opt.load_safetensors -----------------------------------------------------------------------


def _write_on_rank0(comm: MPI.Intracomm, path: str, arrays: dict[str, np.ndarray]) -> None:
    on_rank0(comm, lambda: st.write_file(path, arrays))


@pytest.mark.parametrize("precision", ["master", "bfloat16"])
@pytest.mark.parametrize("stage", STAGES)
def test_load_safetensors_at_every_stage(
    comm: MPI.Intracomm, stage: int, precision: str, mpi_tmp_path: Path
) -> None:
    spec = MIXED if precision == "master" else spec_of(SHAPES, F32)
    keywords = {} if precision == "master" else {"param_dtype": "bfloat16"}
    want = make_params(spec, seed=5)
    path = shared_path(mpi_tmp_path, comm, f"weights-{stage}-{precision}") + ".safetensors"
    _write_on_rank0(comm, path, {n: want[n] for n in reversed(list(want))})  # other order
    opt = ZeroOptimizer(make_params(spec, 0), comm=comm, stage=stage, bucket_elems=3,
                        lr=1e-2, **keywords)  # fmt: skip
    opt.load_safetensors(path)
    got = opt.full_params()
    problems = [n for n in want if not same(got[n], want[n])]
    moments = opt.gather_state()
    if any(np.any(a) for kind in moments.values() for a in kind.values()) or opt.step_count:
        problems.append("moments or step changed")
    if opt.resident_params is not None:  # the model's copy (bfloat16: rounded)
        problems += [f"resident {n}" for n in want if not np.array_equal(
            opt.resident_params[n], want[n].astype(opt.resident_params[n].dtype))]  # fmt: skip
    assert_all(not problems, f"differs after load_safetensors: {problems}")
    opt.step()  # still trains (zero gradient: an AdamW step with weight decay only)


def test_a_checkpoint_exported_loads_at_another_world_size_and_stage(
    comm: MPI.Intracomm, mpi_tmp_path: Path
) -> None:
    """Saved at stage 2 on ``comm``, exported to several files, loaded at stage 3 on
    one rank (every rank alone) and at stage 1 on ``comm``: the parameters bit for bit."""
    ckpt = shared_path(mpi_tmp_path, comm, "export-src")
    out = ckpt + ".st"
    opt = make_opt(comm, 2)
    train(opt, MIXED, 0, 2)
    opt.save(ckpt)
    want = opt.full_params()
    on_rank0(comm, lambda: st.export(ckpt, out, max_bytes=64))
    problems = []
    for sub, stage in ((MPI.COMM_SELF, 3), (comm, 1)):
        other = ZeroOptimizer(make_params(MIXED, 9), comm=sub, stage=stage, bucket_elems=2)
        other.load_safetensors(out)
        got = other.full_params()
        problems += [f"stage {stage} on {sub.Get_size()}: {n}"
                     for n in want if not same(got[n], want[n])]  # fmt: skip
    assert_all(not problems, f"differs: {problems}")


def test_load_safetensors_refuses_what_does_not_fit(
    comm: MPI.Intracomm, mpi_tmp_path: Path
) -> None:
    numpy_io = pytest.importorskip("safetensors.numpy")
    base = shared_path(mpi_tmp_path, comm, "refuse")
    params = make_params(MIXED, 5)
    opt = make_opt(comm, 3)
    before = opt.full_params()
    cases = {
        "missing": ({n: a for n, a in params.items() if n != "d"}, "missing ['d']"),
        "shape": ({**params, "w": np.zeros((4, 6), np.float32)},
                  "shapes differ (w: [4, 6] in the file, [6, 4] here)"),
        "extra": ({**params, "head": np.zeros(3, np.float32)},
                  "not parameters of this optimizer ['head'] (strict=False ignores them)"),
    }  # fmt: skip
    for name, (arrays, message) in cases.items():
        path = f"{base}-{name}.safetensors"
        _write_on_rank0(comm, path, arrays)
        assert_raises_all(CheckpointError, message, lambda p=path: opt.load_safetensors(p))
    integers = f"{base}-integers.safetensors"
    on_rank0(comm, lambda: numpy_io.save_file({**params, "t": np.ones(1, np.int32)}, integers))
    assert_raises_all(CheckpointError, "not floating-point (t: I32)",
                      lambda: opt.load_safetensors(integers))  # fmt: skip
    assert_raises_all(CheckpointError, "cannot load", lambda: opt.load_safetensors(base + "-none"))
    after = opt.full_params()
    assert_all(all(same(after[n], before[n]) for n in before), "the state changed")
    opt.load_safetensors(f"{base}-extra.safetensors", strict=False)
    got = opt.full_params()
    assert_all(all(same(got[n], params[n]) for n in params), "strict=False did not load")
