"""Checkpoints: ``opt.save`` / ``opt.load`` with MPI-IO (:mod:`zerompi.checkpoint.collective`),
the numpy-only reader and command line (:mod:`zerompi.checkpoint.format`, ``__main__``).

Collective tests run on the ``comm`` fixture's communicators (and, for the
cross-world-size test, on sub-communicators they build themselves), every rank
running the same collectives in the same order; verdicts go through
:func:`helpers.assert_all`. Files live in pytest-mpi's ``mpi_tmp_path`` (the same
directory on every rank); a test whose communicator may be a sub-communicator
names its files after the sub-communicator's size and rank 0's world rank, so
concurrently saving groups never share a path. The model has small buckets
(``bucket_elems=3``), so on 2 to 4 ranks some ranks own nothing of some buckets.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MIXED,
    SHAPES,
    Spec,
    assert_all,
    assert_raises_all,
    backward,
    make_params,
    rank_grads,
    spec_of,
)
from mpi4py import MPI

import zerompi.mpi.collectives
from zerompi import ZeroOptimizer, checkpoint, state
from zerompi.checkpoint import CheckpointError, collective

WORLD = MPI.COMM_WORLD
STAGES = [0, 1, 2, 3]
SPECS: dict[str, Spec] = {
    "float32": spec_of(SHAPES, F32),
    "float64": spec_of(SHAPES, F64),
    "mixed": MIXED,
}
HYPER = {"lr": 1e-2, "weight_decay": 0.05}
BUCKET = 3
REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "zerompi" / "checkpoint"


def make_opt(comm: MPI.Intracomm, stage: int, spec: Spec = MIXED, seed: int = 0) -> ZeroOptimizer:
    return ZeroOptimizer(
        make_params(spec, seed), comm=comm, stage=stage, bucket_elems=BUCKET, **HYPER
    )


def train(opt: ZeroOptimizer, spec: Spec, first: int, steps: int) -> None:
    """Steps ``first .. first + steps - 1`` on deterministic per-rank gradients."""
    api = "grads" if opt.stage < 2 else "streamed"
    for step in range(first, first + steps):
        backward(opt, rank_grads(spec, step, opt.comm.rank, exact=False), api)
        opt.step()


def snapshot(opt: ZeroOptimizer) -> dict[str, Any]:
    """Collective: the full state as plain arrays."""
    state = opt.gather_state()
    return {
        "params": {n: a.copy() for n, a in opt.full_params().items()},
        "exp_avg": state["exp_avg"],
        "exp_avg_sq": state["exp_avg_sq"],
        "step": opt.step_count,
    }


def differences(actual: Mapping[str, Any], expected: Mapping[str, Any], what: str) -> list[str]:
    """Bitwise comparison of two snapshots (or a snapshot and ``checkpoint.read``)."""
    problems = []
    for kind in ("params", "exp_avg", "exp_avg_sq"):
        if list(actual[kind]) != list(expected[kind]):
            problems.append(f"{what}: {kind} names {list(actual[kind])} != {list(expected[kind])}")
            continue
        for name, want in expected[kind].items():
            got = actual[kind][name]
            if (
                got.dtype != want.dtype
                or got.shape != want.shape
                or got.tobytes() != want.tobytes()
            ):
                problems.append(f"{what}: {kind}[{name!r}] differs")
    return problems


def shared_path(directory: Path, comm: MPI.Intracomm, name: str) -> str:
    """A path identical on the ranks of ``comm`` and distinct from other groups'."""
    root = comm.bcast(WORLD.rank, root=0)
    return str(directory / f"{name}-w{comm.Get_size()}-r{root}.ckpt")


def temporaries(path: str) -> list[str]:
    """Temporary files of saves to ``path`` (other groups may be saving elsewhere)."""
    prefix = os.path.basename(path) + ".tmp-"
    return [f for f in os.listdir(os.path.dirname(path)) if f.startswith(prefix)]


def on_rank0(comm: MPI.Intracomm, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on rank 0 of ``comm`` (a file edit), then synchronise ``comm``."""
    error = None
    if comm.Get_rank() == 0:
        try:
            fn()
        except Exception as exc:
            error = repr(exc)
    error = comm.bcast(error, root=0)
    if error is not None:
        raise RuntimeError(error)


def section_bytes(path: str) -> dict[str, bytes]:
    """Each section's bytes: the payload, independent of the header's length."""
    header = checkpoint.read_header(path)
    with open(path, "rb") as f:
        data = f.read()
    return {s["name"]: data[s["offset"] : checkpoint.section_end(s)] for s in header["sections"]}


# -- the checksum ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F64])
def test_checksum_is_a_sum_over_any_split(dtype: np.dtype) -> None:
    values = np.random.default_rng(3).standard_normal(1000).astype(dtype)
    whole = checkpoint.checksum(values)
    for cuts in ([0, 1000], [0, 1, 500, 999, 1000], [0, 0, 333, 1000]):
        parts = [checkpoint.checksum(values[a:b], a) for a, b in itertools.pairwise(cuts)]
        combined = tuple(sum(p[i] for p in parts) % 2**64 for i in range(2))
        assert combined == whole
    flipped = values.copy()
    flipped.view(np.uint8)[17] ^= 1
    assert checkpoint.checksum(flipped) != whole
    swapped = values.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert checkpoint.checksum(swapped) != whole  # position-sensitive


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("stage", STAGES)
def test_save_load_round_trip(
    comm: MPI.Intracomm, stage: int, spec_name: str, mpi_tmp_path: Path
) -> None:
    spec = SPECS[spec_name]
    path = shared_path(mpi_tmp_path, comm, f"rt-{stage}-{spec_name}")
    opt = make_opt(comm, stage, spec)
    train(opt, spec, 0, 2)
    opt.save(path)
    want = snapshot(opt)
    fresh = make_opt(comm, stage, spec, seed=1)
    header = fresh.load(path)
    got = snapshot(fresh)
    problems = differences(got, want, "loaded")
    problems += differences(checkpoint.read(path), want, "checkpoint.read")
    if got["step"] != 2 or header["optimizer"]["step"] != 2:
        problems.append(f"step {got['step']} / header {header['optimizer']['step']}, expected 2")
    if header["world_size"] != comm.Get_size() or header["stage"] != stage:
        problems.append(f"header world_size/stage {header['world_size']}/{header['stage']}")
    leftovers = temporaries(path)
    if leftovers:
        problems.append(f"temporary files left: {leftovers}")
    assert_all(not problems, "; ".join(problems))


@pytest.mark.parametrize("stage", STAGES)
def test_resume_is_bit_identical(comm: MPI.Intracomm, stage: int, mpi_tmp_path: Path) -> None:
    path = shared_path(mpi_tmp_path, comm, f"resume-{stage}")
    uninterrupted = make_opt(comm, stage)
    train(uninterrupted, MIXED, 0, 3)
    uninterrupted.save(path)
    train(uninterrupted, MIXED, 3, 2)
    resumed = make_opt(comm, stage, seed=1)
    resumed.load(path)
    train(resumed, MIXED, 3, 2)
    problems = differences(snapshot(resumed), snapshot(uninterrupted), "resumed")
    if resumed.step_count != 5:
        problems.append(f"resumed.step_count is {resumed.step_count}, expected 5")
    assert_all(not problems, "; ".join(problems))


def test_load_across_world_sizes_and_stages(mpi_tmp_path: Path) -> None:
    """Saved by the world at stage 2; loaded by sub-communicators of every size at every
    stage; saved again there: the same state and byte-identical sections. Then the
    world loads what a single rank saved."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    subs = {
        "self": MPI.COMM_SELF,
        "split": WORLD.Split(int(rank == size - 1) if size > 1 else 0, rank),
        "reversed": WORLD.Split(0, size - 1 - rank),
    }
    problems: list[str] = []
    try:
        source = shared_path(mpi_tmp_path, WORLD, "source")
        opt = make_opt(WORLD, 2)
        train(opt, MIXED, 0, 2)
        opt.save(source)
        want = snapshot(opt)
        single = ""
        for name, sub in subs.items():
            for stage in STAGES:
                other = make_opt(sub, stage, seed=1)
                other.load(source)
                got = snapshot(other)
                what = f"{name} (W={sub.Get_size()}) stage {stage}"
                problems += differences(got, want, what)
                again = shared_path(mpi_tmp_path, sub, f"again-{name}-{stage}")
                other.save(again)
                if sub.Get_rank() == 0 and section_bytes(again) != section_bytes(source):
                    problems.append(f"{what}: re-saved sections differ from the original")
                if name == "self" and stage == 1 and rank == 0:
                    single = again
        single = WORLD.bcast(single, root=0)  # saved by world rank 0 alone
        back = make_opt(WORLD, 3, seed=2)
        back.load(single)
        problems += differences(snapshot(back), want, "world loading a W=1 checkpoint")
    finally:
        for name in ("split", "reversed"):
            subs[name].Free()
    assert_all(not problems, "; ".join(problems))


def test_load_keeps_hyperparameters_and_discards_gradients(mpi_tmp_path: Path) -> None:
    path = shared_path(mpi_tmp_path, WORLD, "hyper")
    opt = make_opt(WORLD, 1)
    train(opt, MIXED, 0, 1)
    opt.save(path)
    other = ZeroOptimizer(make_params(MIXED), comm=WORLD, stage=1, bucket_elems=BUCKET, lr=0.5)
    other.grads["w"][...] += 1.0
    other.load(path)
    ok = other.config.lr == 0.5 and not other.grads["w"].any() and other.step_count == 1
    assert_all(ok, f"lr {other.config.lr}, step {other.step_count}")


def test_skipped_steps_survive_a_checkpoint(mpi_tmp_path: Path) -> None:
    """A resumed run must know how many batches were consumed by skipped steps."""
    path = shared_path(mpi_tmp_path, WORLD, "skipped")
    opt = make_opt(WORLD, 1)
    train(opt, MIXED, 0, 1)
    opt.grads["w"][...] += np.nan  # on every rank: the next step is skipped everywhere
    opt.step()
    opt.save(path)
    other = make_opt(WORLD, 2)
    other.load(path)
    ok = other.step_count == 1 and other.skipped_steps == 1
    assert_all(ok, f"step {other.step_count}, skipped {other.skipped_steps}")


# -- invalid files: every rank raises, nothing is loaded -------------------------------------


def _flip(offset_of: Callable[[dict], int]) -> Callable[[str], None]:
    def edit(path: str) -> None:
        header = checkpoint.read_header(path)
        with open(path, "r+b") as f:
            f.seek(offset_of(header))
            byte = f.read(1)
            f.seek(offset_of(header))
            f.write(bytes([byte[0] ^ 0x10]))

    return edit


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 8)


def _garbage(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"this is not a checkpoint\n" * 20)


def _remove(path: str) -> None:
    os.unlink(path)


BAD_FILES: dict[str, tuple[Callable[[str], None], str]] = {
    "section-byte": (_flip(lambda h: h["sections"][4]["offset"] + 3), "checksum mismatch"),
    "last-byte": (_flip(lambda h: checkpoint.file_size(h) - 1), "checksum mismatch"),
    "header-byte": (_flip(lambda h: checkpoint.PREFIX.size + 40), "header is corrupted"),
    "header-length": (_flip(lambda h: 13), "truncated"),
    "magic": (_flip(lambda h: 0), "not a zerompi checkpoint"),
    "truncated": (_truncate, "truncated"),
    "garbage": (_garbage, "not a zerompi checkpoint"),
    "missing": (_remove, "cannot read checkpoint"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_invalid_file_raises_everywhere_and_loads_nothing(case: str, mpi_tmp_path: Path) -> None:
    edit, match = BAD_FILES[case]
    path = shared_path(mpi_tmp_path, WORLD, f"bad-{case}")
    opt = make_opt(WORLD, 2)
    train(opt, MIXED, 0, 1)
    opt.save(path)
    on_rank0(WORLD, lambda: edit(path))
    victim = make_opt(WORLD, 3, seed=1)
    before = snapshot(victim)
    assert_raises_all(CheckpointError, match, lambda: victim.load(path))
    problems = differences(snapshot(victim), before, "after a failed load")
    if victim.step_count != 0:
        problems.append(f"step_count became {victim.step_count}")
    try:
        checkpoint.read(path)
        problems.append("checkpoint.read accepted the file")
    except ValueError as exc:
        if match not in str(exc):
            problems.append(f"checkpoint.read: {match!r} not in {exc}")
    assert_all(not problems, "; ".join(problems))


def test_checkpoint_of_another_model_is_refused(mpi_tmp_path: Path) -> None:
    path = shared_path(mpi_tmp_path, WORLD, "other-model")
    opt = make_opt(WORLD, 1)
    opt.save(path)
    problems = []
    for label, spec in [
        ("float32 model", SPECS["float32"]),
        ("reordered", dict(reversed(list(MIXED.items())))),
        ("reshaped", {**MIXED, "w": ((4, 6), F32)}),
        ("other dtype", {**MIXED, "d": ((9,), F32)}),
        ("extra parameter", {**MIXED, "z": ((2,), F64)}),
    ]:
        victim = make_opt(WORLD, 1, spec, seed=1)
        before = snapshot(victim)
        assert_raises_all(CheckpointError, "different model", lambda v=victim: v.load(path))
        problems += differences(snapshot(victim), before, f"{label} after a refused load")
    assert_all(not problems, "; ".join(problems))


# -- failed saves: every rank raises, the previous checkpoint stays -------------------------


def _fail_in_write(monkeypatch: pytest.MonkeyPatch) -> None:
    real = zerompi.mpi.collectives.Comm.write_at_all

    def write_then_fail(self: Any, fh: Any, offset: int, array: np.ndarray) -> None:
        real(self, fh, offset, array)  # the collective completes, then reports an error
        raise OSError("simulated disk full")

    monkeypatch.setattr(zerompi.mpi.collectives.Comm, "write_at_all", write_then_fail)


def _fail_in_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    def rename_fails(src: str, dst: str) -> None:
        raise OSError("simulated rename failure")

    monkeypatch.setattr(collective.os, "replace", rename_fails)


def _fail_in_header(monkeypatch: pytest.MonkeyPatch) -> None:
    def header_fails(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("simulated header failure")

    monkeypatch.setattr(collective, "build_header", header_fails)


FAILURES: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], int, str]] = {
    # name: (fault, rank it is injected on (-1: the last), message)
    "write": (_fail_in_write, -1, "simulated disk full"),
    "rename": (_fail_in_rename, 0, "simulated rename failure"),
    "header": (_fail_in_header, -1, "simulated header failure"),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_save_raises_everywhere_and_keeps_the_previous_file(
    failure: str, mpi_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault, where, message = FAILURES[failure]
    path = shared_path(mpi_tmp_path, WORLD, f"fail-{failure}")
    opt = make_opt(WORLD, 2)
    train(opt, MIXED, 0, 1)
    opt.save(path)
    previous = snapshot(opt)
    train(opt, MIXED, 1, 1)
    if WORLD.Get_rank() == where % WORLD.Get_size():
        fault(monkeypatch)
    assert_raises_all(ValueError, message, lambda: opt.save(path))
    monkeypatch.undo()
    WORLD.Barrier()
    problems = differences(checkpoint.read(path), previous, "the previous checkpoint")
    leftovers = temporaries(path)
    if leftovers:
        problems.append(f"temporary files left: {leftovers}")
    assert_all(not problems, "; ".join(problems))
    opt.save(path)  # and the optimizer can save again
    assert_all(checkpoint.read(path)["optimizer"]["step"] == 2, "the retried save")


# -- command line and the numpy-only reader (serial) -----------------------------------------


def _serial_checkpoint(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path / "model.ckpt")
    opt = make_opt(MPI.COMM_SELF, 1)
    train(opt, MIXED, 0, 2)
    opt.save(path)
    return path, snapshot(opt)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerompi.checkpoint", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


@pytest.mark.mpi_skip
def test_cli_inspect_verify_export(tmp_path: Path) -> None:
    path, want = _serial_checkpoint(tmp_path)
    out = _cli("inspect", path)
    assert out.returncode == 0, out.stderr
    for text in ("step 2", "1 rank", "params.float32", "exp_avg_sq.float64", "float32  (6, 4)"):
        assert text in out.stdout
    out = _cli("verify", path)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    npz = str(tmp_path / "out.npz")
    out = _cli("export", path, "--npz", npz)
    assert out.returncode == 0, out.stderr
    with np.load(npz) as data:
        for name, value in want["params"].items():
            assert np.array_equal(data[name], value)
            assert np.array_equal(data[f"exp_avg/{name}"], want["exp_avg"][name])
            assert np.array_equal(data[f"exp_avg_sq/{name}"], want["exp_avg_sq"][name])
    _flip(lambda h: h["sections"][1]["offset"])(path)
    out = _cli("verify", path)
    assert out.returncode == 1 and "checksum mismatch in section exp_avg.float32" in out.stderr
    out = _cli("inspect", str(tmp_path / "out.npz"))
    assert out.returncode == 1 and "not a zerompi checkpoint" in out.stderr


@pytest.mark.mpi_skip
def test_reader_needs_no_mpi(tmp_path: Path) -> None:
    path, _ = _serial_checkpoint(tmp_path)
    code = (
        "import sys, runpy\n"
        "sys.modules['mpi4py'] = None  # any import of mpi4py now fails\n"
        f"ns = runpy.run_path({str(PACKAGE / 'format.py')!r})\n"
        f"state = ns['read']({path!r})\n"
        "assert 'mpi4py.MPI' not in sys.modules\n"
        "print(state['optimizer']['step'], sorted(state['params']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "2"


@pytest.mark.mpi_skip
def test_package_import_needs_no_mpi(tmp_path: Path) -> None:
    """``import zerompi.checkpoint`` (the reader, the CLI's code) imports no mpi4py;
    with mpi4py unimportable it still reads and verifies a checkpoint."""
    path, want = _serial_checkpoint(tmp_path)
    code = (
        "import sys\n"
        "import zerompi.checkpoint\n"
        "assert 'mpi4py' not in sys.modules, 'import zerompi.checkpoint imported mpi4py'\n"
        "sys.modules['mpi4py'] = None  # any import of mpi4py now fails\n"
        "from zerompi.checkpoint import read, verify\n"
        f"assert verify({path!r}) == []\n"
        f"print(read({path!r})['optimizer']['step'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(want["step"])]


def _package_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(PACKAGE.glob("*.py"))}


@pytest.mark.mpi_skip
def test_checkpoint_uses_only_the_public_state_interface() -> None:
    """No module of the package reads a private attribute of the optimizer (nor of
    anything else held in a variable: ``x._name``), and the format module and the
    command line import no MPI."""
    sources = _package_sources()
    assert {"__init__.py", "__main__.py", "collective.py", "format.py"} <= set(sources)
    private = re.compile(r"\b(?!self\b)[A-Za-z_][A-Za-z0-9_]*\._[A-Za-z]")
    for name, text in sources.items():
        hits = [
            f"{name}:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), 1)
            if private.search(line.split("#")[0])
        ]
        assert not hits, "private attribute access:\n" + "\n".join(hits)
        assert "opt._" not in text, name
    for name in ("format.py", "__main__.py", "__init__.py"):
        assert not re.search(r"^\s*(from|import)\s+(mpi4py|zerompi)", sources[name], re.M), name
        assert not re.search(r"^(from|import)\s+\.+(mpi|engine|optimizer)", sources[name], re.M)
    assert not file_lines_over(400), file_lines_over(400)


def file_lines_over(limit: int) -> list[str]:
    return [n for n, t in _package_sources().items() if len(t.splitlines()) > limit]


@pytest.mark.mpi_skip
def test_checkpoint_interface_of_the_engine() -> None:
    """The engine's side of the interface on one rank: shards are writable views
    that cover every section exactly once, in ``state_sections`` order."""
    opt = make_opt(MPI.COMM_SELF, 3)
    engine = opt.engine
    sections = state.state_sections(engine)
    assert sections == [f"{k}.{d}" for d in ("float32", "float64") for k in checkpoint.KINDS]
    covered: dict[str, int] = dict.fromkeys(sections, 0)
    for name, first, shard in state.state_shards(engine):
        assert shard.ndim == 1 and shard.flags.writeable and first == covered[name]
        covered[name] += shard.size
    sizes = {d.name: n for d, n in opt.layout.sizes.items()}
    assert covered == {s: sizes[s.rpartition(".")[2]] for s in sections}
    entries = state.param_entries(engine)
    assert [e[0] for e in entries] == list(MIXED)
    assert all(tuple(e[1]) == MIXED[e[0]][0] and e[2] == MIXED[e[0]][1] for e in entries)
    assert set(opt.hyperparameters()) == {
        "rule", "states", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled"
    }  # fmt: skip
    state.set_counters(engine, 7, 2)
    assert (opt.step_count, opt.skipped_steps) == (7, 2)
