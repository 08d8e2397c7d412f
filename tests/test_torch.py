"""The torch adapter (``zerompi.torch.shard``) against single-process torch AdamW/Adam.

Every test takes the ``comm`` fixture, so ``mpiexec -n 4`` runs it on communicators
of sizes 1 to 4 (some uneven). The parity model
(:mod:`zerompi.torch.parity`) has what real models have: an embedding whose weight is
tied to the output head (one parameter used twice), a frozen layer, a buffer, a
LayerNorm; each rank of ``comm`` gets its slice of every global micro-batch, and the
reference trains a copy of the model on the whole global batch in one process with
``torch.optim.AdamW`` (or ``Adam`` with L2), the same learning rate schedule
(``torch.optim.lr_scheduler``), two ``backward()`` calls per step (gradients summed,
as DDP sums them). Skipped without torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI

torch = pytest.importorskip("torch")
from zerompi import checkpoint  # noqa: E402
from zerompi.torch import shard  # noqa: E402
from zerompi.torch.parity import batch, compare, loss_of, make_model  # noqa: E402

torch.set_num_threads(1)  # one core per rank: the ranks share the machine


@pytest.mark.parametrize(
    ("decoupled", "groups"), [(True, False), (False, False), (True, True)],
    ids=["adamw", "adam_l2", "adamw_2_groups"],
)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_matches_single_process_torch(
    comm: MPI.Intracomm, stage: int, decoupled: bool, groups: bool
) -> None:
    """Parameters within 1e-5 of the reference (relative to each one's magnitude),
    the scheduler's learning rates in effect (per group), buffers from rank 0
    (:func:`zerompi.torch.parity.compare`)."""
    result = compare(comm, stage, decoupled, groups=groups)
    problems = [f"{name} differs by {a:.3g} (relative {r:.3g})"
                for name, (a, r) in result["diffs"].items() if not r <= 1e-5]  # fmt: skip
    if result["lrs"][0] != result["lrs"][1]:
        problems.append(f"learning rates {result['lrs']}")
    if not result["buffers_from_rank_0"]:
        problems.append("buffers are not rank 0's")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_are_views_and_gradients_land_in_zerompi(
    comm: MPI.Intracomm, stage: int
) -> None:
    """Zero copy: every trainable parameter's data is zerompi's buffer (one tensor for
    the tied weight); at stages 0-1 ``.grad`` is zerompi's gradient buffer before
    and after a backward; at stage 2 the hook leaves ``.grad`` empty and the
    gradient in zerompi's staging. A ``model.zero_grad()`` (``.grad = None``) still
    reaches the buffer."""
    model, opt = shard(make_model(0), stage=stage, comm=comm, bucket_elems=40)
    problems = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        array = opt.zero.params[name]
        if param.data_ptr() != array.ctypes.data:
            problems.append(f"{name} is not a view of zerompi's parameters")
    idx, target = batch(0, 0, 1)
    model.zero_grad()  # set_to_none: the hook must fold the next gradient in
    loss_of(model, idx, target).backward()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if stage < 2:
            grads = opt.zero.grads[name]
            if param.grad is None or param.grad.data_ptr() != grads.ctypes.data:
                problems.append(f"{name}: .grad is not zerompi's buffer")
            elif not np.any(grads):
                problems.append(f"{name}: no gradient in zerompi's buffer")
        elif param.grad is not None:
            problems.append(f"{name}: stage 2 left torch's gradient")
    opt.step()
    opt.close()
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoints_are_keyed_by_the_module_names(
    comm: MPI.Intracomm, stage: int, mpi_tmp_path: Path
) -> None:
    """``optimizer.save`` writes zerompi's file under the module's parameter names
    (``zerompi.checkpoint.read`` sees ``model.state_dict()``'s keys); ``load`` into
    a fresh module (its initial values) at another stage restores its trainable
    parameters (views of the same buffers) and Adam state, so the next steps match
    (within float32 rounding: the two stages may sum the ranks' gradients in another
    order)."""
    root = comm.bcast(MPI.COMM_WORLD.rank, root=0)
    path = str(mpi_tmp_path / f"torch-{stage}-w{comm.size}-r{root}.zmpi")
    runs = []
    for restart in (False, True):
        model, opt = shard(make_model(0), stage=stage, comm=comm, bucket_elems=40)
        steps = range(2) if restart else range(4)
        for step in steps:
            if restart and step == 0:
                model2, opt2 = shard(make_model(0), stage=3 - stage, comm=comm)
                opt2.load(path)  # at the other stage
                model, opt = model2, opt2
            if not restart and step == 2:
                opt.save(path)
            idx, target = batch(step + (2 if restart else 0), 0, 1)
            loss_of(model, idx, target).backward()
            opt.step()
            opt.zero_grad()
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.close()
    problems = []
    saved = checkpoint.read(path)["params"]
    state = make_model(0).state_dict()
    if sorted(saved) != sorted(n for n, p in make_model(0).named_parameters() if p.requires_grad):
        problems.append(f"saved names {sorted(saved)}")
    if set(saved) - set(state):
        problems.append("saved names are not state_dict() keys")
    for name, want in runs[0].items():
        if not torch.allclose(runs[1][name], want, rtol=1e-5, atol=1e-7):
            problems.append(f"{name}: resumed run differs by {(runs[1][name] - want).abs().max()}")
    assert_all(not problems, "\n".join(problems[:6]))


def test_bad_models_are_refused_on_every_rank(comm: MPI.Intracomm) -> None:
    """A half-precision trainable parameter, a meta-device parameter, a group that
    lists a frozen parameter or is no dict, a module whose parameters or buffers
    differ between ranks, an unsupported stage: the same error on every
    rank of ``comm`` (raised where only one rank is wrong, too)."""
    problems = []
    last = comm.rank == comm.size - 1

    def expect(what: str, build, kind: type[BaseException], match: str) -> None:
        try:
            build()
            problems.append(f"{what}: accepted")
        except kind as exc:
            if match not in str(exc):
                problems.append(f"{what}: {exc}")
        except Exception as exc:  # the wrong error on this rank
            problems.append(f"{what}: {type(exc).__name__}: {exc}")

    def half() -> None:
        m = make_model(0)
        if last:
            m.up.half()
        shard(m, comm=comm)

    def meta() -> None:
        m = torch.nn.Linear(2, 2, device="meta" if last else "cpu")
        shard(m, comm=comm)

    def differ() -> None:
        shard(torch.nn.Linear(2, 3 if last else 2), comm=comm)

    expect("float16", half, TypeError, "float32 or float64")
    expect("meta", meta, ValueError, "CPU models")
    def frozen_in_a_group() -> None:
        m = make_model(0)
        shard(m, comm=comm, param_groups=[{"params": [m.frozen.weight]}])

    def extra_buffer() -> None:
        m = make_model(0)
        if last:
            m.register_buffer("extra", torch.zeros(2))
        shard(m, comm=comm)

    expect("group", frozen_in_a_group, ValueError, "not a trainable parameter")
    if comm.size > 1:
        expect("buffers", extra_buffer, Exception, "frozen parameters and buffers")
    expect("group dict", lambda: shard(make_model(0), comm=comm, param_groups=[["x"]]),
           TypeError, "must be a dict with a 'params' list")  # fmt: skip
    if comm.size > 1:
        expect("shapes", differ, Exception, "differ")
    expect("stage 3", lambda: shard(make_model(0), stage=3, comm=comm), NotImplementedError,
           "stage 3")  # fmt: skip
    assert_all(not problems, "\n".join(problems))


@pytest.mark.mpi_skip  # a subprocess: in the serial run (it would inherit mpiexec's PMI)
def test_import_zerompi_never_imports_torch() -> None:
    code = "import sys, zerompi, zerompi.optimizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
