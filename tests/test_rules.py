"""Update rules beyond Adam (:mod:`zerompi.rules`): SGD (momentum, dampening, Nesterov,
L2 or decoupled weight decay) and Lion, each against its own unsharded reference
written from its paper (:mod:`zerompi.reference`), at every stage and layout, both
dtypes, on every communicator of the ``comm`` fixture (so at every world size the
suite runs at, with empty shards: ``bucket_elems=1`` gives trailing ranks nothing);
their parameter groups, schedules, checkpoints at any world size and stage, memory
estimates, bfloat16 copies and settings errors. Gradients are exact (``helpers``), so
every comparison is bit for bit."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    F32,
    F64,
    MIXED,
    MODES,
    SHAPES,
    assert_all,
    assert_raises_all,
    backward,
    estimate_problems,
    make_params,
    mean_grads,
    mismatches,
    paired_cases,
    rank_grads,
    shared_path,
    spec_of,
    train,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.checkpoint import CheckpointError, read
from zerompi.elastic import moves, pieces, snapshot_bytes
from zerompi.memory import estimate
from zerompi.partition import optimizer_layout
from zerompi.reference import ReferenceAdam, ReferenceLion, ReferenceSGD
from zerompi.rules import rule_of

WORLD = MPI.COMM_WORLD
ADAM_STATES = rule_of("adam").states

#: name -> (ZeroOptimizer keywords; the reference's are the same without ``optimizer``)
RULES: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd", "lr": 1e-2},
    "sgd-momentum-l2": {"optimizer": "sgd", "lr": 1e-2, "momentum": 0.9, "weight_decay": 0.05},
    "sgd-nesterov-decoupled": {"optimizer": "sgd", "lr": 1e-2, "momentum": 0.9,
                               "nesterov": True, "weight_decay": 0.1,
                               "decoupled_weight_decay": True},
    "sgd-dampening": {"optimizer": "sgd", "lr": 1e-2, "momentum": 0.8, "dampening": 0.3},
    "lion": {"optimizer": "lion", "lr": 1e-2},
    "lion-decay-betas": {"optimizer": "lion", "lr": 1e-2, "weight_decay": 0.1,
                         "betas": (0.95, 0.98)},
}  # fmt: skip

BUCKETS = [1, 5, 64, None]  # None: the default


def reference(params: dict[str, np.ndarray], keywords: dict[str, Any]) -> Any:
    """The reference optimizer of ``keywords`` (a :data:`RULES` entry)."""
    kw = {k: v for k, v in keywords.items() if k != "optimizer"}
    if keywords["optimizer"] == "sgd":
        return ReferenceSGD(params, **kw)
    return ReferenceLion(params, **kw)


CASES, IDS = paired_cases(
    ((rule, mode, dtype, BUCKETS[i % len(BUCKETS)])
     for i, (rule, mode, dtype) in enumerate(itertools.product(RULES, MODES, [F32, F64]))),
    lambda r, m, d, b: f"{r}-{m}-{d.name}-bucket{b}",
)  # fmt: skip


@pytest.mark.parametrize(("comm", "rule", "mode", "dtype", "bucket_elems"), CASES, ids=IDS,
                         indirect=["comm"])  # fmt: skip
def test_rule_matches_its_reference(
    comm: MPI.Intracomm, rule: str, mode: str, dtype: np.dtype, bucket_elems: int | None
) -> None:
    """Four steps: the parameters after every step, the states after the first and
    the last, bit for bit."""
    stage, api = MODES[mode]
    spec = spec_of(SHAPES, dtype)
    params = make_params(spec)
    extra = {} if bucket_elems is None else {"bucket_elems": bucket_elems}
    opt = ZeroOptimizer(params, comm=comm, stage=stage, **RULES[rule], **extra)
    ref = reference(params, RULES[rule])
    verdict(train(opt, ref, spec, 4, check_state=lambda step: step == 0, api=api))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("rule", ["sgd-nesterov-decoupled", "lion-decay-betas"])
def test_mixed_dtypes_and_empty_shards(comm: MPI.Intracomm, rule: str, stage: int) -> None:
    """float32 and float64 parameters interleaved, one-element buckets (most ranks own
    nothing of most buckets)."""
    params = make_params(MIXED)
    api = "grads" if stage < 2 else "streamed"
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=1, **RULES[rule])
    verdict(train(opt, reference(params, RULES[rule]), MIXED, 3, api=api))


class Grouped:
    """One reference per parameter group, seen as one (params, states, step)."""

    def __init__(self, parts: list[tuple[Any, list[str]]]) -> None:
        self.parts = parts

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {n: ref.params[n] for ref, names in self.parts for n in names}

    @property
    def states(self) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {}
        for ref, names in self.parts:
            for key, values in ref.states.items():
                out.setdefault(key, {}).update({n: values[n] for n in names})
        return out

    def step(self, grads: dict[str, np.ndarray]) -> None:
        for ref, _ in self.parts:
            ref.step({n: grads[n] for n in ref.params})


@pytest.mark.parametrize(("rule", "group"), [
    ("sgd-momentum-l2", {"lr": 5e-2, "momentum": 0.5, "weight_decay": 0.0}),
    ("lion", {"lr": 3e-2, "betas": (0.8, 0.9)}),
])  # fmt: skip
def test_parameter_groups_and_a_schedule(
    comm: MPI.Intracomm, rule: str, group: dict[str, Any]
) -> None:
    """Two groups with their own settings, then ``set_hyperparameters`` halving both
    learning rates after two steps (a schedule), at stage 2 (streamed) and 1."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    second = ["l1.w", "l2.w", "scalar"]
    first = [n for n in params if n not in second]
    base = RULES[rule]
    for stage in (1, 2):
        api = "grads" if stage == 1 else "streamed"
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=5,
                            param_groups=[{"params": second, **group}], **base)  # fmt: skip
        ref_group = {**base, **group}
        refs = Grouped([
            (reference({n: params[n] for n in first}, base), first),
            (reference({n: params[n] for n in second}, ref_group), second),
        ])  # fmt: skip
        problems = train(opt, refs, spec, 2, api=api)
        for g, (ref, _) in enumerate(refs.parts):
            opt.set_hyperparameters(group=g, lr=ref.lr / 2)
            ref.lr /= 2
        for step in range(2, 4):
            backward(opt, rank_grads(spec, step, comm.rank), api)
            opt.step()
            refs.step(mean_grads(spec, step, comm.size))
        problems += mismatches(opt, refs, True, f"stage {stage} after the schedule")
        verdict(problems)


def test_averaging_reaches_the_update(comm: MPI.Intracomm) -> None:
    """SGD's step is the averaged gradient times lr: a sum not divided by the world
    size (or divided twice) moves every parameter by another amount. Lion's sign
    would hide a scale, its momentum does not (``exp_avg`` is compared too)."""
    spec = spec_of({"w": (11,)}, F64)
    params = {"w": np.zeros(11)}
    opt = ZeroOptimizer(params, comm=comm, stage=2, bucket_elems=3, optimizer="sgd", lr=1.0)
    backward(opt, rank_grads(spec, 0, comm.rank), "streamed")
    opt.step()
    want = -mean_grads(spec, 0, comm.size)["w"]
    got = opt.full_params()["w"]
    assert_all(bool(np.array_equal(got, want)), f"{got} != {want}")


def test_checkpoints_at_another_world_size_and_stage(mpi_tmp_path: Path) -> None:
    """SGD saved by the world at stage 2, loaded at every stage by a single rank and
    trained on: the same parameters and momentum as training on without the
    checkpoint; the file holds ``momentum_buffer`` sections under its rule, and an
    Adam optimizer refuses it on every rank (nothing loaded)."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    keywords = RULES["sgd-momentum-l2"]
    path = shared_path(mpi_tmp_path, WORLD, "sgd")
    opt = ZeroOptimizer(params, comm=WORLD, stage=2, bucket_elems=5, **keywords)
    for step in range(2):
        backward(opt, rank_grads(spec, step, WORLD.rank), "streamed")
        opt.step()
    opt.save(path)
    saved = read(path)
    problems = []
    if saved["optimizer"]["rule"] != "sgd" or sorted(k for k in saved if k.endswith("buffer")) \
            != ["momentum_buffer"]:  # fmt: skip
        problems.append(f"file holds {sorted(saved)} with {saved['optimizer']}")
    gathered = opt.gather_state()["momentum_buffer"]
    for name, value in gathered.items():
        if not np.array_equal(saved["momentum_buffer"][name], value):
            problems.append(f"momentum_buffer[{name!r}] in the file differs")
    ref = reference(params, keywords)
    for step in range(2):
        ref.step(mean_grads(spec, step, WORLD.size))
    for stage in range(4):
        single = ZeroOptimizer(make_params(spec, seed=3), comm=MPI.COMM_SELF, stage=stage,
                               bucket_elems=7, **keywords)  # fmt: skip
        single.load(path)
        got, state = single.full_params(), single.gather_state()["momentum_buffer"]
        for name in params:
            if not (np.array_equal(got[name], ref.params[name])
                    and np.array_equal(state[name], ref.momentum_buffer[name])):  # fmt: skip
                problems.append(f"stage {stage}: {name!r} differs after the load")
        if single.step_count != 2:
            problems.append(f"stage {stage}: step_count {single.step_count}")
    assert_all(not problems, "; ".join(problems[:8]))
    adam = ZeroOptimizer(params, comm=WORLD, stage=1)
    before = adam.full_params()
    assert_raises_all(CheckpointError, "saved with optimizer='sgd'", lambda: adam.load(path))
    after = adam.full_params()
    assert_all(all(np.array_equal(before[n], after[n]) for n in params), "Adam state changed")


LAYOUT = [("a", (7, 5), F32), ("b", (5,), F32), ("c", (3,), F64), ("d", (), F64)]


@pytest.mark.parametrize("rule", ["adam", "sgd", "lion"])
def test_estimate_equals_the_optimizer(comm: MPI.Intracomm, rule: str) -> None:
    """Every buffer of every rule, every stage, to the byte; Lion's update needs two
    scratch blocks."""
    problems = estimate_problems(comm, LAYOUT, rule, (1, 6, 64))
    assert_all(not problems, "\n".join(problems[:6]))


def test_states_by_rule_in_the_estimate() -> None:
    """Optimizer states per shard element: Adam 2, SGD and Lion 1 (8 and 4 bytes in
    float32)."""
    specs = [("w", (1000,), F32)]
    states = {r: estimate(specs, 4, 0, 1, optimizer=r)["usage"]["optimizer_states"]
              for r in ("adam", "sgd", "lion")}  # fmt: skip
    assert states == {"adam": 2000, "sgd": 1000, "lion": 1000}, states


def test_snapshot_pieces_follow_the_rule() -> None:
    """Elastic snapshots hold the parameters and the rule's states: re-sharding moves
    every piece of each, at any pair of world sizes."""
    specs = [(n, s, d) for n, s, d in LAYOUT]
    old = optimizer_layout(specs, 3, 0, 2, 6)
    new = optimizer_layout(specs, 2, 0, 2, 6)
    for name in ("adam", "sgd", "lion"):
        states = rule_of(name).states
        sections = {p[0].split(".")[0] for p in pieces(old, 0, states)}
        assert sections == {"params", *(s.label for s in states)}, (name, sections)
        moved = sum(m.count for m in moves(old, 3, new, 2, states))
        assert moved == (1 + len(states)) * sum(int(np.prod(s)) for _, s, _ in LAYOUT), name
    assert snapshot_bytes(old, 0, rule_of("sgd").states) < snapshot_bytes(old, 0, ADAM_STATES)


#: The rules that hold states per block or matrix, or prepare with statistics over
#: whole parameters (their references and most tests are in their own test files).
MORE: dict[str, dict[str, Any]] = {
    "adam8bit": {"optimizer": "adam8bit", "lr": 1e-2, "weight_decay": 0.1,
                 "decoupled_weight_decay": True},
    "adafactor": {"optimizer": "adafactor", "lr": 1e-2, "weight_decay": 0.1},
    "muon": {"optimizer": "muon", "lr": 2e-2, "weight_decay": 0.1},
}  # fmt: skip


@pytest.mark.parametrize("rule", ["sgd-nesterov-decoupled", "lion-decay-betas", *MORE])
def test_bfloat16_copy_is_the_rounded_master_at_every_stage(comm: MPI.Intracomm, rule: str) -> None:
    """``param_dtype=bfloat16``: every stage ends with the same float32 master, and
    the copy the model reads is that master rounded to nearest even."""
    pytest.importorskip("ml_dtypes")
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    masters = []
    problems = []
    for stage in range(4):
        api = "grads" if stage < 2 else "streamed"
        opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=5,
                            param_dtype="bfloat16", **{**RULES, **MORE}[rule])  # fmt: skip
        for step in range(3):
            grads = {n: g.astype(opt.params[n].dtype) if stage < 3 else g
                     for n, g in rank_grads(spec, step, comm.rank).items()}  # fmt: skip
            backward(opt, grads, api)
            opt.step()
        master = opt.full_params()
        masters.append(master)
        if stage < 3:
            for name, low in opt.params.items():
                if not np.array_equal(low, master[name].astype(low.dtype)):
                    problems.append(f"stage {stage}: {name!r} is not the rounded master")
        opt.close()
    for stage, master in enumerate(masters[1:], start=1):
        for name in params:
            if not np.array_equal(master[name], masters[0][name]):
                problems.append(f"stage {stage}: master {name!r} differs from stage 0's")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize(("keywords", "error", "match"), [
    ({"optimizer": "rmsprop"}, ValueError, "optimizer must be one of 'adam', 'sgd', 'lion'"),
    ({"optimizer": "sgd", "betas": (0.9, 0.9)}, ValueError,
     "betas=(0.9, 0.9) is not a setting of optimizer='sgd'"),
    ({"optimizer": "adam", "momentum": 0.9}, ValueError,
     "momentum=0.9 is not a setting of optimizer='adam'"),
    ({"optimizer": "lion", "eps": 1e-6}, ValueError, "eps=1e-06 is not a setting"),
    ({"optimizer": "sgd", "nesterov": True}, ValueError, "nesterov=True needs momentum > 0"),
    ({"optimizer": "sgd", "momentum": -0.5}, ValueError, "momentum must be >= 0"),
    ({"optimizer": "lion", "betas": (0.9, 1.0)}, ValueError, "beta2 must be in [0, 1)"),
    ({"optimizer": "sgd", "param_groups": [{"params": ["a"], "eps": 1e-3}]}, TypeError,
     "a group of sgd may set lr, momentum, dampening, weight_decay"),
])  # fmt: skip
def test_settings_of_another_rule_are_refused_everywhere(
    comm: MPI.Intracomm, keywords: dict[str, Any], error: type, match: str
) -> None:
    params = {"a": np.zeros(3, np.float32)}
    assert_raises_all(error, match, lambda: ZeroOptimizer(params, comm=comm, **keywords))


def test_set_hyperparameters_takes_the_rules_settings(comm: MPI.Intracomm) -> None:
    opt = ZeroOptimizer({"a": np.zeros(3)}, comm=comm, optimizer="sgd", momentum=0.9)
    assert_raises_all(TypeError, "sgd takes lr, momentum, dampening, weight_decay",
                      lambda: opt.set_hyperparameters(beta1=0.5))  # fmt: skip
    opt.set_hyperparameters(momentum=0.5)
    hyper = opt.hyperparameters()
    assert_all(hyper["rule"] == "sgd" and hyper["momentum"] == 0.5
               and hyper["states"] == ["momentum_buffer"], str(hyper))  # fmt: skip


def test_adam_through_the_rule_is_unchanged(comm: MPI.Intracomm) -> None:
    """``optimizer="adam"`` (the default) is the Adam of before: its reference, bit
    for bit, and its checkpoint header names it."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    opt = ZeroOptimizer(params, comm=comm, stage=2, bucket_elems=5, optimizer="adam", lr=1e-2)
    verdict(train(opt, ReferenceAdam(params, lr=1e-2), spec, 3, api="streamed"))
    hyper = opt.hyperparameters()
    assert_all(hyper["rule"] == "adam" and hyper["states"] == ["exp_avg", "exp_avg_sq"],
               str(hyper))  # fmt: skip


def test_clipping_and_a_nonfinite_skip_wrap_every_rule(comm: MPI.Intracomm) -> None:
    """``max_norm`` scales the averaged gradient SGD sees by ``max_norm / (norm +
    1e-6)`` (torch's ``clip_grad_norm_``); a non-finite gradient skips Lion's step
    with its state untouched, on every rank."""
    spec = spec_of({"w": (9,), "b": (4,)}, F64)
    params = make_params(spec)
    opt = ZeroOptimizer(params, comm=comm, stage=2, bucket_elems=4, optimizer="sgd", lr=0.5,
                        max_norm=0.1)  # fmt: skip
    backward(opt, rank_grads(spec, 0, comm.rank), "streamed")
    opt.step()
    mean = mean_grads(spec, 0, comm.size)
    norm = float(np.sqrt(sum(np.sum(g * g) for g in mean.values())))
    coef = 0.1 / (norm + 1e-6)
    got = opt.full_params()
    problems = [f"{n}: {got[n]} != {params[n] - 0.5 * (mean[n] * coef)}" for n in params
                if not np.allclose(got[n], params[n] - 0.5 * (mean[n] * coef),
                                   rtol=1e-12, atol=0)]  # fmt: skip
    lion = ZeroOptimizer(params, comm=comm, stage=1, bucket_elems=4, optimizer="lion", lr=0.1)
    backward(lion, rank_grads(spec, 0, comm.rank), "grads")
    lion.step()
    before, state = lion.full_params(), lion.gather_state()["exp_avg"]
    bad = {n: g.copy() for n, g in rank_grads(spec, 1, comm.rank).items()}
    if comm.rank == comm.size - 1:
        bad["b"][1] = np.nan
    backward(lion, bad, "grads")
    lion.step()
    after, state_after = lion.full_params(), lion.gather_state()["exp_avg"]
    if lion.skipped_steps != 1 or lion.step_count != 1:
        problems.append(f"skipped {lion.skipped_steps}, step_count {lion.step_count}")
    for n in params:
        if not (np.array_equal(before[n], after[n]) and np.array_equal(state[n], state_after[n])):
            problems.append(f"{n!r} changed in a skipped step")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("rule", list(MORE))
def test_a_nonfinite_gradient_skips_the_step_states_untouched(
    comm: MPI.Intracomm, rule: str
) -> None:
    """A NaN in one rank's gradient: the step is skipped on every rank (before a rule
    that prepares sees it), parameters and every state as they were."""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    opt = ZeroOptimizer(params, comm=comm, stage=2, bucket_elems=5, **MORE[rule])
    backward(opt, rank_grads(spec, 0, comm.rank), "streamed")
    opt.step()
    before, state = opt.full_params(), opt.gather_state()
    bad = {n: g.copy() for n, g in rank_grads(spec, 1, comm.rank).items()}
    if comm.rank == comm.size - 1:
        bad["l1.w"][2, 3] = np.nan
    backward(opt, bad, "streamed")
    opt.step()
    after, state_after = opt.full_params(), opt.gather_state()
    problems = [] if opt.skipped_steps == 1 and opt.step_count == 1 else ["not skipped"]
    problems += [n for n in params if not np.array_equal(before[n], after[n])]
    problems += [f"{k}[{n}]" for k, v in state.items() for n in v
                 if not np.array_equal(v[n], state_after[k][n])]  # fmt: skip
    opt.close()
    assert_all(not problems, f"changed in a skipped step: {problems[:6]}")


@pytest.mark.parametrize("rule", list(MORE))
def test_clipping_reaches_the_states_of_every_rule(comm: MPI.Intracomm, rule: str) -> None:
    """``max_norm`` divides the gradient 8-bit Adam, Adafactor and Muon see, as it does
    every rule's: their float states after a clipped step (8-bit Adam's block scales,
    Adafactor's rows, columns and vectors, Muon's momentum and the vectors' AdamW
    moments) equal those of an unclipped step on the gradients times torch's
    coefficient ``max_norm / (norm + 1e-6)``, to float32 rounding, and differ from an
    unclipped step's by far more. (Their updates hardly depend on the gradient's
    scale, so parameters could not show a lost clip; their states scale with it.)"""
    spec = spec_of(SHAPES, F32)
    params = make_params(spec)
    mean = mean_grads(spec, 0, comm.size)
    norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in mean.values())))
    coef = 0.05 / (norm + 1e-6)

    def states(max_norm: float | None, scale: float) -> dict[str, dict[str, np.ndarray]]:
        opt = ZeroOptimizer(params, comm=comm, stage=2, bucket_elems=5, max_norm=max_norm,
                            **MORE[rule])  # fmt: skip
        grads = {n: (g * scale).astype(g.dtype) for n, g in rank_grads(spec, 0, comm.rank).items()}
        backward(opt, grads, "streamed")
        opt.step()
        out = {k: v for k, v in opt.gather_state().items()
               if all(a.dtype.kind == "f" for a in v.values())}  # fmt: skip
        opt.close()
        return out

    clipped, scaled, plain = states(0.05, 1.0), states(None, coef), states(None, 1.0)
    problems = [] if coef < 0.2 and clipped else [f"coef {coef}, states {list(clipped)}"]
    for kind, by_name in clipped.items():
        for name, got in by_name.items():
            want, loose = scaled[kind][name], plain[kind][name]
            if not np.allclose(got, want, rtol=1e-5, atol=1e-30):
                problems.append(f"{kind}[{name}] clipped != scaled: {np.max(np.abs(got - want))}")
            if np.any(loose != 0) and np.allclose(got, loose, rtol=0.1):
                problems.append(f"{kind}[{name}] the same unclipped")
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("argv", [
    ["--optimizer", "sgd", "--momentum", "0.9", "--nesterov", "--weight-decay", "0.01"],
    ["--optimizer", "lion", "--lr", "1e-4", "--weight-decay", "0.1"],
    ["--optimizer", "adam8bit", "--weight-decay", "0.01", "--adamw"],
    ["--optimizer", "adafactor", "--lr", "1e-2", "--weight-decay", "0.01"],
    ["--optimizer", "muon", "--lr", "2e-2", "--weight-decay", "0.01"],
])  # fmt: skip
@pytest.mark.parametrize("stage", [1, 3])
def test_driver_verifies_every_rule(
    argv: list[str], stage: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m zerompi.driver --optimizer ... --verify``: the run ends within the
    driver's tolerance of the rule's unsharded reference, on the world."""
    from zerompi.driver import main

    status = main([*argv, "--stage", str(stage), "--steps", "6", "--batch", "24",
                   "--micro-batches", "2", "--verify", "--log-every", "1000",
                   "--blas-threads", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert_all(status == 0 and (WORLD.rank or "verify OK" in out), f"{status}: {out}")


def test_driver_refuses_settings_of_another_rule(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error (exit status 2), on every rank alike (each parses the same argv)."""
    from zerompi.driver.cli import parse_args

    for argv, match in ((["--optimizer", "lion", "--momentum", "0.9"],
                         "--momentum and --nesterov are SGD's (--optimizer sgd), not lion's"),
                        (["--optimizer", "sgd", "--nesterov"], "--nesterov needs --momentum > 0"),
                        (["--optimizer", "adagrad"], "invalid choice: 'adagrad'")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and match in err, err
