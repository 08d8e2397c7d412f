"""The bad-input catalogue: every case is refused with a clear message naming the value,
raised on every rank together (never a hang, never silent corruption), and the
optimizer is left usable. The README's "What is refused" lists the same cases."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from helpers import WORLD, assert_all, assert_raises_all

from zerompi import Deferred, ZeroOptimizer
from zerompi.mpi.agreement import CollectiveError


def good() -> dict[str, np.ndarray]:
    return {"l0.w": np.ones((4, 3), np.float32), "l0.b": np.zeros(3, np.float32)}


def build(**kwargs: object) -> Callable[[], object]:
    params = kwargs.pop("params", None)
    return lambda: ZeroOptimizer(good() if params is None else params, **kwargs)


CONSTRUCTION = [
    ("integer dtype", TypeError, "parameter 'w' has dtype int64",
     build(params={"w": np.arange(4)})),
    ("float16", TypeError, "parameter 'w' has dtype float16",
     build(params={"w": np.ones(4, np.float16)})),
    ("list, not an array", TypeError, "parameter 'w' must be a numpy array",
     build(params={"w": [1.0, 2.0]})),
    ("zero-size parameter", ValueError, "parameter 'w' has no elements",
     build(params={"w": np.zeros((0, 3), np.float32)})),
    ("empty mapping", ValueError, "params is empty", build(params={})),
    ("not a mapping", TypeError, "params must be a mapping", build(params=[np.ones(3)])),
    ("non-str name", TypeError, "parameter names must be str, got 1",
     build(params={1: np.ones(3, np.float32)})),
    ("NaN lr", ValueError, "lr must be finite, got nan", build(lr=float("nan"))),
    ("negative lr", ValueError, "lr must be >= 0, got -0.1", build(lr=-0.1)),
    ("zero eps", ValueError, "eps must be > 0, got 0.0", build(eps=0.0)),
    ("beta1 = 1", ValueError, "beta1 must be in [0, 1), got 1.0", build(betas=(1.0, 0.999))),
    ("negative beta2", ValueError, "beta2 must be in [0, 1), got -0.1", build(betas=(0.9, -0.1))),
    ("betas not a pair", ValueError, "betas must be a pair", build(betas=0.9)),
    ("negative weight decay", ValueError, "weight_decay must be >= 0, got -1.0",
     build(weight_decay=-1.0)),
    ("unknown stage", ValueError, "stage must be one of (0, 1, 2, 3), got 5", build(stage=5)),
    ("stage as a string", ValueError, "got '2'", build(stage="2")),
    ("bucket_elems 0", ValueError, "bucket_elems must be >= 1, got 0", build(bucket_elems=0)),
    ("negative max_norm", ValueError, "max_norm", build(max_norm=-1.0)),
    ("unknown nonfinite policy", ValueError, "nonfinite", build(nonfinite="ignore")),
    ("overlap not a bool", TypeError, "overlap must be a bool, got 1", build(overlap=1)),
    ("shared_memory not a bool", TypeError, "shared_memory must be a bool, got 'yes'",
     build(shared_memory="yes")),
    ("Deferred init of the wrong shape", ValueError, "expected an array of shape (4,)",
     build(params={"w": Deferred((4,), np.float32, lambda: np.ones(5, np.float32))})),
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "kind", "message", "make"), CONSTRUCTION, ids=[c[0] for c in CONSTRUCTION]
)
def test_construction_refuses(what: str, kind: type, message: str, make: Callable) -> None:
    assert_raises_all(kind, message, make)


def test_catalogue_is_at_least_fifteen_cases() -> None:
    assert len(CONSTRUCTION) + len(USE) + 3 >= 15


def wrong_shape(opt: ZeroOptimizer) -> None:
    opt.grads["l0.w"] = np.ones((3, 4), np.float32)


def wrong_dtype(opt: ZeroOptimizer) -> None:
    opt.grads["l0.w"] = np.ones((4, 3), np.float64)


def not_an_array(opt: ZeroOptimizer) -> None:
    opt.grads["l0.w"] = 1.0  # type: ignore[assignment]


def unknown_name(opt: ZeroOptimizer) -> None:
    with opt.gradients("l9"):
        pass


USE = [
    ("gradient of the wrong shape", ValueError, "gradient 'l0.w' must have shape (4, 3)",
     wrong_shape),
    ("gradient of the wrong dtype", ValueError, "and dtype float32, got shape (4, 3) and "
     "dtype float64", wrong_dtype),
    ("gradient that is not an array", TypeError, "gradient 'l0.w' must be a numpy array",
     not_an_array),
    ("unknown parameter or group", KeyError, "'l9' is neither a parameter nor a group",
     unknown_name),
]  # fmt: skip


@pytest.mark.parametrize(("what", "kind", "message", "use"), USE, ids=[c[0] for c in USE])
def test_use_refuses_and_the_optimizer_stays_usable(
    what: str, kind: type, message: str, use: Callable
) -> None:
    opt = ZeroOptimizer(good(), stage=1, lr=0.1)
    assert_raises_all(kind, message, lambda: use(opt))
    before = opt.full_params()
    opt.step()  # nothing was written: a zero gradient, parameters unchanged
    after = opt.full_params()
    assert_all(all(np.array_equal(before[n], after[n]) for n in before), "state changed")


def test_rank_dependent_layout_is_refused_everywhere() -> None:
    params = good()
    if WORLD.rank == WORLD.size - 1 and WORLD.size > 1:
        params["l0.b"] = np.zeros(4, np.float32)
    if WORLD.size > 1:
        assert_raises_all(CollectiveError, "differs between ranks", build(params=params))


def test_diverged_step_counts_are_refused_everywhere() -> None:
    opt = ZeroOptimizer(good(), stage=2, lr=0.1)
    if WORLD.size > 1 and WORLD.rank == WORLD.size - 1:
        opt.engine.step_count += 1  # as if this rank had run one step() more
    if WORLD.size > 1:
        assert_raises_all(CollectiveError, "the step count differs between ranks", opt.step)


def test_one_rank_alone_while_the_launcher_started_several(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    if WORLD.size == 1:  # under mpiexec the world is real and the check passes
        assert_raises_all(CollectiveError, "MPI sees a world of 1 process, but "
                          "SLURM_STEP_NUM_TASKS=4", build())
        monkeypatch.setenv("ZEROMPI_ALLOW_SINGLETON", "1")
    build()()


def test_non_contiguous_arrays_are_accepted_and_copied() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    opt = ZeroOptimizer({"l0.w": base[:, ::2], "l0.b": base[0, 1::2]}, stage=1)
    got = opt.full_params()
    assert_all(np.array_equal(got["l0.w"], base[:, ::2]) and np.array_equal(
        got["l0.b"], base[0, 1::2]), "non-contiguous parameters were not copied faithfully")
    opt.grads["l0.w"] = np.ones((3, 4), np.float32).T  # a non-contiguous gradient too
    assert_all(bool(np.all(opt.grads["l0.w"] == 1)), "gradient not copied")
