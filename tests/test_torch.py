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
from zerompi.checkpoint.safetensors import write_file  # noqa: E402
from zerompi.torch import shard  # noqa: E402
from zerompi.torch.parity import (  # noqa: E402
    batch,
    compare,
    compare_low,
    loss_of,
    make_model,
)

torch.set_num_threads(1)  # one core per rank: the ranks share the machine

#: stage, shared_memory: "3" on one node holds the node's one copy (W > 1), "3s"
#: gathers each module's parameters into storages freed after use (FSDP's way).
MODES = {"0": (0, None), "1": (1, None), "2": (2, None), "3": (3, None), "3s": (3, False)}


@pytest.mark.parametrize(
    ("decoupled", "groups"), [(True, False), (False, False), (True, True)],
    ids=["adamw", "adam_l2", "adamw_2_groups"],
)
@pytest.mark.parametrize("mode", MODES)
def test_matches_single_process_torch(
    comm: MPI.Intracomm, mode: str, decoupled: bool, groups: bool
) -> None:
    """Parameters within 1e-5 of the reference (relative to each one's magnitude),
    the scheduler's learning rates in effect (per group), buffers from rank 0
    (:func:`zerompi.torch.parity.compare`)."""
    stage, shared = MODES[mode]
    result = compare(comm, stage, decoupled, groups=groups, shared_memory=shared)
    problems = [f"{name} differs by {a:.3g} (relative {r:.3g})"
                for name, (a, r) in result["diffs"].items() if not r <= 1e-5]  # fmt: skip
    if result["lrs"][0] != result["lrs"][1]:
        problems.append(f"learning rates {result['lrs']}")
    if not result["buffers_from_rank_0"]:
        problems.append("buffers are not rank 0's")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("overlap", [None, True, False])
@pytest.mark.parametrize("mode", ["2", "3", "3s"])
def test_staging_slots_by_default_and_on_request(
    comm: MPI.Intracomm, mode: str, overlap: bool | None
) -> None:
    """``overlap``: two staging slots by default at stage 2, one at stage 3 (its
    slots are the largest module's size); either on request, with the same results."""
    stage, shared = MODES[mode]
    result = compare(comm, stage, True, steps=3, shared_memory=shared, overlap=overlap)
    problems = [f"{name} differs by {a:.3g} (relative {r:.3g})"
                for name, (a, r) in result["diffs"].items() if not r <= 1e-5]  # fmt: skip
    _, opt = shard(make_model(0), stage=stage, comm=comm, shared_memory=shared,
                   overlap=overlap)  # fmt: skip
    want = stage < 3 if overlap is None else overlap
    slot = 4 * opt.zero.layout.max_bucket(np.dtype(np.float32))  # bytes
    slots = opt.zero.memory_buffers().get("grad_bucket.float32", 0) // slot
    overlap = opt.zero.config.overlap.enabled
    if overlap is not want or slots != 1 + want:
        problems.append(f"overlap {overlap}, {slots} staging slots; want {want}")
    opt.close()
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize(
    ("decoupled", "reduce_dtype"), [(True, None), (False, None), (True, "bfloat16")],
    ids=["adamw", "adam_l2", "adamw_bf16_reduce"],
)
@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_params_match_mixed_precision_torch(
    comm: MPI.Intracomm, mode: str, decoupled: bool, reduce_dtype: str | None
) -> None:
    """``param_dtype=torch.bfloat16``: the float32 masters within 1e-5 of FSDP2's
    mixed-precision semantics computed in one process (bfloat16 forward/backward of
    each rank's slice, float32 sums, AdamW/Adam + L2 on the master:
    :func:`zerompi.torch.parity.compare_low`), and the module's parameters exactly
    the masters rounded to bfloat16. With bfloat16 gradients too (``reduce_dtype``)
    nothing is summed in 16 bits: the same reference holds, over two backward calls
    per step (at stages 0-1 too, where each backward is folded)."""
    stage, shared = MODES[mode]
    reduce = getattr(torch, reduce_dtype) if reduce_dtype else None
    result = compare_low(comm, stage, torch.bfloat16, shared_memory=shared,
                         decoupled=decoupled, reduce_dtype=reduce)  # fmt: skip
    problems = [f"{name} master differs by {a:.3g} (relative {r:.3g})"
                for name, (a, r) in result["diffs"].items() if not r <= 1e-5]  # fmt: skip
    if not result["rounded"]:
        problems.append("the module's parameters are not the masters rounded to bfloat16")
    assert_all(not problems, "\n".join(problems[:6]))


def test_stage_3_holds_a_module_s_parameters_only_while_it_runs(comm: MPI.Intracomm) -> None:
    """Stage 3 without a node copy: between steps every trainable parameter is an
    empty tensor and no bucket storage is allocated; inside a module's forward its
    parameters (and the tied weight, in both modules that register it) are full and
    equal the master; after the forward every storage is freed again (the backward
    re-gathers: the parity tests check its values), and after the backward too;
    ``full_parameters()`` gathers all (``state_dict()`` inside is the masters) and
    frees them on exit."""
    model, opt = shard(make_model(0), stage=3, comm=comm, shared_memory=False,
                       bucket_elems=40)  # fmt: skip
    units, problems = opt.units, []
    masters = opt.zero.full_params()

    def allocated() -> list[int]:
        return [i for i, f in enumerate(units.flats) if f.untyped_storage().nbytes()]

    def check(module: torch.nn.Module, args: object) -> None:
        for p in module.parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = dict(model.named_parameters())
            key = next(n for n, q in full.items() if q is p)
            if tuple(p.shape) != masters[key].shape or not np.array_equal(
                p.detach().clone().numpy(), masters[key]  # (.numpy() pins a storage)
            ):
                problems.append(f"{key} in {type(module).__name__}'s forward: {p.shape}")

    for module in (model.emb, model.up, model.down, model.norm, model.head):
        module.register_forward_pre_hook(check, prepend=False)
    for step in range(2):
        if any(p.numel() for p in model.parameters() if p.requires_grad) or allocated():
            problems.append(f"step {step}: parameters are held between steps {allocated()}")
        idx, target = batch(step, 0, 1)
        loss = loss_of(model, idx, target)
        # from the second step on, the forward's last module's bucket may stay for the
        # backward, which gathers it first (the order learned in step 0)
        if allocated() and (step == 0 or allocated() != [units.kept]):
            problems.append(f"step {step}: buckets {allocated()} held after the forward")
        loss.backward()
        if allocated():
            problems.append(f"step {step}: buckets {allocated()} held after the backward")
        if any(p.grad is not None for p in model.parameters()):
            problems.append(f"step {step}: torch kept a gradient")
        opt.step()
        masters = opt.zero.full_params()
    with opt.full_parameters():
        state = model.state_dict()
        for name, want in masters.items():
            if not np.array_equal(state[name].clone().numpy(), want):
                problems.append(f"state_dict()[{name!r}] inside full_parameters()")
    if allocated():
        problems.append("full_parameters() left buckets allocated")
    opt.close()
    assert_all(not problems, "\n".join(problems[:6]))


class ReadsOutside(torch.nn.Module):
    """Reads parameters outside the forward of the modules that register them: the
    output head is the embedding's weight used by the top module (nanoGPT-style tying
    without a second registration), and ``mix`` is never called, its weight and bias
    go to ``F.linear`` from the top forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(self.emb(idx), self.mix.weight, self.mix.bias)
        return self.norm(torch.tanh(h)) @ self.emb.weight.t()


@pytest.mark.parametrize("bucket_elems", [40, 10_000])
def test_stage_3_gathers_a_parameter_read_outside_its_module(
    comm: MPI.Intracomm, bucket_elems: int
) -> None:
    """Stage 3 without a node copy, a model that reads parameters outside their
    modules' forwards: the same losses and parameters as stage 2 (where every
    parameter is always full), nothing left gathered after the forward of a no-grad
    call or after the backward, and the same greedy outputs under ``no_grad``."""
    results, problems = [], []
    for stage, shared in ((2, None), (3, False)):
        torch.manual_seed(0)
        model, opt = shard(ReadsOutside(), stage=stage, comm=comm, shared_memory=shared,
                           bucket_elems=bucket_elems, lr=1e-2)  # fmt: skip
        losses = []
        for step in range(3):
            idx, target = batch(step, 0, comm.size)
            mine = slice(comm.rank * 3, (comm.rank + 1) * 3)
            loss = loss_of(model, idx[mine], target[mine])
            loss.backward()
            if opt.units is not None and any(opt.units.resident):
                problems.append(f"step {step}: buckets still gathered after the backward")
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            logits = model(torch.arange(13))
        if opt.units is not None and any(opt.units.resident):
            problems.append("buckets still gathered after a no-grad forward")
        results.append((losses, opt.zero.full_params(), logits))
        opt.close()
    (losses2, params2, logits2), (losses3, params3, logits3) = results
    if not np.allclose(losses3, losses2, rtol=1e-6, atol=0):
        problems.append(f"losses {losses3} != stage 2's {losses2}")
    for name, want in params2.items():
        if not np.allclose(params3[name], want, rtol=0, atol=1e-6):
            problems.append(f"{name}: differs from stage 2")
    if not torch.allclose(logits3, logits2, rtol=0, atol=1e-5):
        problems.append("no-grad forward differs from stage 2's")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("shared", [None, False], ids=["node-memory", "mpi"])
def test_one_backward_per_step_gives_the_same_bits_at_stages_1_to_3(
    comm: MPI.Intracomm, shared: bool | None
) -> None:
    """With one ``backward()`` per step stages 1-3 sum the same gradients with the same
    reduction (through node memory, the default on one node, or MPI's
    ``Reduce_scatter`` with ``shared_memory=False``: the two may add the ranks in
    different orders), so their parameters agree bit for bit (with two, stages 2-3
    reduce each backward's gradients as they come: docs/torch.md says what differs).
    Stage 0's ``Allreduce`` may add them in yet another order (MPICH does at 4
    ranks): within 1e-6 of stage 1's."""
    results = {}
    for stage in (0, 1, 2, 3):
        model, opt = shard(make_model(comm.rank), stage=stage, comm=comm, shared_memory=shared,
                           bucket_elems=40, lr=1e-2, max_norm=0.5)  # fmt: skip
        for step in range(3):
            idx, target = batch(step, 0, comm.size)
            mine = slice(comm.rank * 3, (comm.rank + 1) * 3)
            loss_of(model, idx[mine], target[mine]).backward()
            opt.step()
            opt.zero_grad()
        results[stage] = opt.zero.full_params()
        opt.close()
    first, problems = results.pop(1), []
    for stage, params in results.items():
        for name, want in first.items():
            same = (np.allclose(params[name], want, rtol=0, atol=1e-6) if stage == 0
                    else np.array_equal(params[name], want))  # fmt: skip
            if not same:
                problems.append(f"stage {stage}: {name}")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("mode", MODES)
def test_zero_grad_discards_what_was_written_after_the_step(comm: MPI.Intracomm, mode: str) -> None:
    """``zero_grad()`` right after ``step()`` finds the gradients already zero (the step
    consumed them) and skips the zero-fill; what was written after the step, by a
    backward or in place into ``.grad``, is discarded all the same. Three steps with a
    discarded backward and in-place edit before each give the same bits as without."""
    stage, shared = MODES[mode]
    mine = slice(comm.rank * 3, (comm.rank + 1) * 3)
    results = []
    for detour in (False, True):
        model, opt = shard(make_model(0), stage=stage, comm=comm, shared_memory=shared,
                           bucket_elems=40, lr=1e-2)  # fmt: skip
        for step in range(3):
            opt.zero_grad()
            opt.zero_grad()
            if detour:
                idx, target = batch(100 + step, 0, comm.size)
                loss_of(model, idx[mine], target[mine]).backward()
                opt.zero_grad()
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.add_(1.0)  # an in-place write, no backward
                opt.zero_grad()
            idx, target = batch(step, 0, comm.size)
            loss_of(model, idx[mine], target[mine]).backward()
            opt.step()
        results.append(opt.zero.full_params())
        opt.close()
    problems = [name for name, want in results[0].items()
                if not np.array_equal(results[1][name], want)]  # fmt: skip
    assert_all(not problems, f"the discarded gradients reached {problems[:6]}")


class Stack(torch.nn.Module):
    """Linear layers run in order, or in reverse when asked (a changed order)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        for layer in reversed(self.layers) if reverse else self.layers:
            x = torch.tanh(layer(x))
        return x


def test_stage_3_prefetch_learns_the_order_and_survives_a_change(comm: MPI.Intracomm) -> None:
    """Stage 3 without a node copy, every bucket prefetched (the size threshold
    lowered): from the second step on gathers are served by the prefetch, at most one
    is ahead of the one waited for, a step that runs the layers in another order (and
    the step after it, which learns it) gives stage 2's losses and parameters, and
    nothing is left in flight or allocated after a step."""
    results, problems, served, reused = [], [], [], []
    for stage, shared in ((2, None), (3, False)):
        torch.manual_seed(0)
        model, opt = shard(Stack(), stage=stage, comm=comm, shared_memory=shared,
                           bucket_elems=1, lr=1e-2)  # fmt: skip
        units = opt.units
        if units is not None:
            units.worth = [True] * len(units.worth)

            def count_ahead(module: torch.nn.Module, args: object, units: object = units) -> None:
                if len(units.ahead) > 1:  # type: ignore[attr-defined]
                    problems.append(f"{len(units.ahead)} gathers ahead")  # type: ignore[attr-defined]

            for layer in model.layers:
                layer.register_forward_pre_hook(count_ahead)
        losses = []
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(2 * comm.size, 6, generator=g)[2 * comm.rank : 2 * comm.rank + 2]
            before = units.prefetched if units is not None else 0
            kept_before = units.reused if units is not None else 0
            loss = model(x, reverse=step == 3).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if units is not None:
                served.append(units.prefetched - before)
                reused.append(units.reused - kept_before)
                if units.ahead or any(f.untyped_storage().nbytes() for f in units.flats):
                    problems.append(f"step {step}: gathers in flight or storages after step()")
                if not 0 < units.spares.nbytes <= units.spares.limit:
                    problems.append(f"step {step}: {units.spares.nbytes} bytes of spares, "
                                    f"limit {units.spares.limit}")  # fmt: skip
        results.append((losses, opt.zero.full_params()))
        if units is not None:
            filled = (units.spares.served, units.gathers)
        opt.close()
    (losses2, params2), (losses3, params3) = results
    if not np.allclose(losses3, losses2, rtol=1e-6, atol=0):
        problems.append(f"losses {losses3} != stage 2's {losses2}")
    for name, want in params2.items():
        if not np.allclose(params3[name], want, rtol=0, atol=1e-6):
            problems.append(f"{name}: differs from stage 2")
    # step 0 learns the order of its 8 gathers (4 layers, forward and backward); 1-2
    # follow it, every gather but the first of the forward and of the backward served
    # ahead (the last layer is still running when the forward's last gather ends); 3
    # departs at once (another first layer); 4 departs from step 3's order; 5 follows
    if served != [0, 6, 6, 0, 0, 6]:
        problems.append(f"gathers served by the prefetch per step: {served}")
    # and the last layer's bucket, released by the forward and first gathered by the
    # backward, is kept for it in the steps that follow the order
    if reused != [0, 1, 1, 0, 0, 1]:
        problems.append(f"gathers saved by keeping a bucket per step: {reused}")
    # the released buckets' memory (two of the four equal buckets fit the spares) is
    # what later gathers get: all but the first two of the 45 gathers
    if filled != (43, 45):
        problems.append(f"gathers given a spare's memory, of all: {filled}")
    assert_all(not problems, "\n".join(problems[:6]))


def test_spares_keep_released_memory_up_to_their_limit() -> None:
    """Stage 3's spares (no MPI): a released storage's memory is kept (the storage
    left empty, the same object), the next fill of a size it holds (up to twice as
    large) gets that very memory, the oldest go beyond the limit, a larger storage
    is never kept, and with no limit (a torch without ``_swap_data_ptr_``) storages
    are resized as before."""
    from zerompi.torch._units import Spares

    spares = Spares(1000)
    a, b, c = (torch.UntypedStorage(n) for n in (400, 400, 300))
    spares.empty(a)
    assert a.nbytes() == 0 and spares.nbytes == 400
    spares.empty(b)
    spares.empty(c)  # 1100 > 1000: the oldest (a's memory) goes
    assert spares.nbytes == 700 and [s.nbytes() for s in spares.kept] == [400, 300]
    fresh = torch.UntypedStorage(0)
    spares.fill(fresh, 250)  # the smallest that holds 250 bytes: c's 300
    assert fresh.nbytes() == 300 and spares.nbytes == 400 and spares.served == 1
    tiny = torch.UntypedStorage(0)
    spares.fill(tiny, 100)  # b's 400 is more than twice 100: new memory
    assert tiny.nbytes() == 100 and spares.nbytes == 400 and spares.served == 1
    again = torch.UntypedStorage(0)
    spares.fill(again, 400)
    assert again.nbytes() == 400 and spares.nbytes == 0 and spares.served == 2
    spares.empty(torch.UntypedStorage(2000))  # beyond the limit: freed
    assert spares.nbytes == 0
    reused, address = torch.UntypedStorage(0), again.data_ptr()
    spares.empty(again)
    spares.fill(reused, 400)
    assert reused.data_ptr() == address and spares.served == 3  # the very memory
    off = Spares(0)
    d = torch.UntypedStorage(64)
    off.empty(d)
    off.fill(d, 32)
    assert d.nbytes() == 32 and off.nbytes == 0 and off.served == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_are_views_and_gradients_land_in_zerompi(
    comm: MPI.Intracomm, stage: int
) -> None:
    """Zero copy: every trainable parameter's data is zerompi's buffer (one tensor for
    the tied weight); at stages 0-1 ``.grad`` is zerompi's gradient buffer before
    and after a backward; at stages 2-3 the hook leaves ``.grad`` empty and the
    gradient in zerompi's staging (stage 3 here: the node's copy, at W > 1). A
    ``model.zero_grad()`` (``.grad = None``) still reaches the buffer."""
    model, opt = shard(make_model(0), stage=stage, comm=comm, bucket_elems=40)
    resident = opt.zero.resident_params  # (None: stage 3 with no node copy at W = 1,
    problems = []  # tested by test_stage_3_holds_...; a skip here would not be collective)
    for name, param in model.named_parameters():
        if not param.requires_grad or resident is None:
            continue
        array = resident[name]
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
            problems.append(f"{name}: stage {stage} left torch's gradient")
    opt.step()
    opt.close()
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("mode", MODES)
def test_the_module_s_own_copy_is_freed_before_zerompi_fills_its_state(
    comm: MPI.Intracomm, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peak memory: ``shard()`` hands each parameter over as a ``Deferred`` whose
    release drops the module's storage once zerompi holds the value, so when the
    optimizer touches its moment and gradient buffers (``BufferPool.touch``) no
    trainable parameter of the module holds memory of its own, on any rank. The
    values are still rank 0's (the parity tests), and the storages really die: no
    tensor still refers to them."""
    from zerompi.buffers import BufferPool

    model = make_model(comm.rank)  # different values per rank: rank 0's must win
    trainable = [p for p in model.parameters() if p.requires_grad]
    old = [p.detach() for p in trainable]  # (sharing the storages only)
    storages = [t.untyped_storage()._weak_ref() for t in old]
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    want = comm.bcast(want if comm.rank == 0 else None)
    del old
    seen: list[str] = []
    touch = BufferPool.touch

    def checked(pool: BufferPool) -> None:
        held = [tuple(p.shape) for p in trainable if p.numel()]
        live = sum(not torch.UntypedStorage._expired(ref) for ref in storages)
        seen.append(f"shapes {held}, {live} storages alive" if held or live else "")
        touch(pool)

    monkeypatch.setattr(BufferPool, "touch", checked)
    stage, shared = MODES[mode]
    model, opt = shard(model, stage=stage, comm=comm, shared_memory=shared, bucket_elems=40)
    problems = [f"at the touch: {s}" for s in seen if s]
    if len(seen) != 1:
        problems.append(f"BufferPool.touch ran {len(seen)} times, not once")
    with opt.full_parameters():
        for name, param in model.named_parameters():
            if name in want and not torch.equal(param.detach(), want[name]):
                problems.append(f"{name} is not rank 0's initial value")
    for ref in storages:
        torch.UntypedStorage._free_weak_ref(ref)
    opt.close()
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("mode", MODES)
def test_load_safetensors_sets_the_module_s_parameters(
    comm: MPI.Intracomm, mode: str, mpi_tmp_path: Path
) -> None:
    """A safetensors file of another model's trainable parameters (keyed by
    ``named_parameters()``, the tied weight once) becomes the module's parameters at
    every stage, read inside ``full_parameters()``; a training step still runs."""
    source = make_model(1)
    want = {n: p.detach().numpy().copy() for n, p in source.named_parameters()
            if p.requires_grad}  # fmt: skip
    root = comm.bcast(MPI.COMM_WORLD.rank, root=0)
    path = str(mpi_tmp_path / f"torch-weights-{mode}-w{comm.size}-r{root}.safetensors")
    if comm.rank == 0:
        write_file(path, want)
    comm.barrier()
    stage, shared = MODES[mode]
    model, opt = shard(make_model(0), stage=stage, comm=comm, bucket_elems=40,
                       shared_memory=shared)  # fmt: skip
    opt.load_safetensors(path)
    with opt.full_parameters():
        got = {n: p.detach().clone().numpy() for n, p in model.named_parameters()
               if p.requires_grad}  # fmt: skip (a clone: stage 3 frees the storage)
    problems = [n for n in want if not np.array_equal(got[n], want[n])]
    idx, target = batch(0, 0, 1)
    loss_of(model, idx, target).backward()
    opt.step()
    opt.close()
    assert_all(not problems and sorted(got) == sorted(want), f"differs: {problems}")


@pytest.mark.parametrize(("saved", "loaded"), [("1", "2"), ("2", "1"), ("3s", "1"), ("1", "3s")])
def test_checkpoints_are_keyed_by_the_module_names(
    comm: MPI.Intracomm, saved: str, loaded: str, mpi_tmp_path: Path
) -> None:
    """``optimizer.save`` writes zerompi's file under the module's parameter names
    (``zerompi.checkpoint.read`` sees ``model.state_dict()``'s keys); ``load`` into
    a fresh module (its initial values) at another stage restores its trainable
    parameters (views of the same buffers, or gathered from the restored shards at
    stage 3) and Adam state, so the next steps match (within float32 rounding: the
    two stages may sum the ranks' gradients in another order)."""
    root = comm.bcast(MPI.COMM_WORLD.rank, root=0)
    path = str(mpi_tmp_path / f"torch-{saved}-{loaded}-w{comm.size}-r{root}.zmpi")
    runs = []
    for restart in (False, True):
        stage, shared = MODES[saved]
        model, opt = shard(make_model(0), stage=stage, comm=comm, bucket_elems=40,
                           shared_memory=shared)  # fmt: skip
        steps = range(2) if restart else range(4)
        for step in steps:
            if restart and step == 0:
                stage, shared = MODES[loaded]
                model2, opt2 = shard(make_model(0), stage=stage, comm=comm,
                                     shared_memory=shared)  # fmt: skip
                opt2.load(path)  # at the other stage
                model, opt = model2, opt2
            if not restart and step == 2:
                opt.save(path)
            idx, target = batch(step + (2 if restart else 0), 0, 1)
            loss_of(model, idx, target).backward()
            opt.step()
            opt.zero_grad()
        with opt.full_parameters():
            runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.close()
    problems = []
    saved_params = checkpoint.read(path)["params"]
    state = make_model(0).state_dict()
    trainable = sorted(n for n, p in make_model(0).named_parameters() if p.requires_grad)
    if sorted(saved_params) != trainable:
        problems.append(f"saved names {sorted(saved_params)}")
    if set(saved_params) - set(state):
        problems.append("saved names are not state_dict() keys")
    for name, want in runs[0].items():
        if not torch.allclose(runs[1][name], want, rtol=1e-5, atol=1e-7):
            problems.append(f"{name}: resumed run differs by {(runs[1][name] - want).abs().max()}")
    assert_all(not problems, "\n".join(problems[:6]))


def test_bad_models_are_refused_on_every_rank(comm: MPI.Intracomm) -> None:
    """A half-precision trainable parameter, a meta-device parameter, a group that
    lists a frozen parameter or is no dict, a module whose parameters or buffers
    differ between ranks, an unsupported stage: the same error on every
    rank of ``comm`` (raised where only one rank is wrong, too); a ``param_dtype``
    that is not a float dtype or not a dtype at all; the step of an optimizer built
    on the module's parameters before ``shard()``."""
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
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        try:
            shard(m, comm=comm)
        finally:  # refused: the module is untouched (its storages not yet handed over)
            for n, p in m.named_parameters():
                if p.shape != before[n].shape or not torch.equal(p.detach(), before[n]):
                    problems.append(f"a refused shard() changed {n}")

    expect("group", frozen_in_a_group, ValueError, "not a trainable parameter")
    if comm.size > 1:
        expect("buffers", extra_buffer, Exception, "frozen parameters and buffers")
    expect("group dict", lambda: shard(make_model(0), comm=comm, param_groups=[["x"]]),
           TypeError, "must be a dict with a 'params' list")  # fmt: skip
    if comm.size > 1:
        expect("shapes", differ, Exception, "differ")
    def optimizer_before() -> None:
        m = make_model(0)
        other = torch.optim.AdamW(m.parameters())
        m, opt = shard(m, comm=comm, stage=2)
        idx, target = batch(0, 0, 1)
        loss_of(m, idx, target).backward()
        try:
            other.step()
        finally:
            opt.close()

    expect("optimizer built before shard()", optimizer_before, RuntimeError,
           "step the optimizer shard() returned instead")  # fmt: skip
    expect("stage 4", lambda: shard(make_model(0), stage=4, comm=comm), ValueError,
           "stage must be 0, 1, 2 or 3, got 4")  # fmt: skip
    expect("param_dtype", lambda: shard(make_model(0), comm=comm, param_dtype=torch.int8),
           Exception, "param_dtype")  # fmt: skip
    expect("param_dtype kind", lambda: shard(make_model(0), comm=comm, param_dtype=3),
           TypeError, "param_dtype must be a torch dtype")  # fmt: skip
    assert_all(not problems, "\n".join(problems))


@pytest.mark.mpi_skip  # a subprocess: in the serial run (it would inherit mpiexec's PMI)
def test_import_zerompi_never_imports_torch() -> None:
    code = "import sys, zerompi, zerompi.optimizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
