"""Bad input is refused on every rank, naming it, and leaves the communicator usable:
bad parameters and settings, a layout or a setting that differs between ranks, a local
error on one rank only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from helpers import (
    F32,
    F64,
    MIXED,
    good_params,
    raises,
    train,
    verdict,
)
from mpi4py import MPI

from zerompi import ZeroOptimizer
from zerompi.mpi.agreement import CollectiveError
from zerompi.reference import ReferenceAdam

BAD_PARAMS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("int dtype", lambda: {"w": np.arange(6)}, TypeError, "parameter 'w' has dtype int64"),
    ("float16", lambda: {"h": np.zeros(3, np.float16)}, TypeError, "'h' has dtype float16"),
    ("complex", lambda: {"c": np.zeros(3, np.complex128)}, TypeError, "has dtype complex128"),
    ("list", lambda: {"w": [1.0, 2.0]}, TypeError, "or zerompi.Deferred, got list [1.0, 2.0]"),
    ("int", lambda: {"w": 3}, TypeError, "parameter 'w' must be a numpy array or zerompi.Def"),
    ("np scalar", lambda: {"w": np.float32(1)}, TypeError, "'w' must be a numpy array"),
    ("empty mapping", dict, ValueError, "params is empty"),
    (
        "zero-size",
        lambda: {"w": np.zeros((0, 3), F32)},
        ValueError,
        "'w' has no elements (shape (0, 3))",
    ),
    ("not a mapping", lambda: [np.zeros(3, F32)], TypeError, "params must be a mapping"),
    (
        "name not str",
        lambda: {1: np.zeros(3, F32)},
        TypeError,
        "parameter names must be str, got 1",
    ),
    (
        "later param bad",
        lambda: {**good_params(), "z": np.ones(2, np.int32)},
        TypeError,
        "'z' has dtype int32",
    ),
]


BAD_SETTINGS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("stage 4", {"stage": 4}, ValueError, "stage must be one of (0, 1, 2, 3), got 4"),
    ("stage -1", {"stage": -1}, ValueError, "stage must be one of (0, 1, 2, 3), got -1"),
    ("stage '2'", {"stage": "2"}, ValueError, "stage must be one of (0, 1, 2, 3), got '2'"),
    ("stage True", {"stage": True}, ValueError, "stage must be one of (0, 1, 2, 3), got True"),
    ("stage False", {"stage": False}, ValueError, "stage must be one of (0, 1, 2, 3), got False"),
    ("stage 2.0", {"stage": 2.0}, ValueError, "stage must be one of (0, 1, 2, 3), got 2.0"),
    ("stage None", {"stage": None}, ValueError, "stage must be one of (0, 1, 2, 3), got None"),
    ("lr < 0", {"lr": -1e-3}, ValueError, "lr must be >= 0, got -0.001"),
    ("lr -0.5", {"lr": -0.5}, ValueError, "lr must be >= 0, got -0.5"),
    ("lr nan", {"lr": float("nan")}, ValueError, "lr must be finite, got nan"),
    ("lr inf", {"lr": float("inf")}, ValueError, "lr must be finite, got inf"),
    ("lr str", {"lr": "0.1"}, TypeError, "lr must be a real number, got '0.1'"),
    ("lr None", {"lr": None}, TypeError, "lr must be a real number, got None"),
    ("eps 0", {"eps": 0.0}, ValueError, "eps must be > 0, got 0.0"),
    ("eps < 0", {"eps": -1e-8}, ValueError, "eps must be > 0, got -1e-08"),
    ("eps nan", {"eps": float("nan")}, ValueError, "eps must be finite, got nan"),
    ("beta1 1", {"betas": (1.0, 0.999)}, ValueError, "beta1 must be in [0, 1), got 1.0"),
    ("beta1 < 0", {"betas": (-0.5, 0.999)}, ValueError, "beta1 must be in [0, 1), got -0.5"),
    ("beta2 < 0", {"betas": (0.9, -0.1)}, ValueError, "beta2 must be in [0, 1), got -0.1"),
    ("beta2 1.5", {"betas": (0.9, 1.5)}, ValueError, "beta2 must be in [0, 1), got 1.5"),
    ("beta2 nan", {"betas": (0.9, float("nan"))}, ValueError, "beta2 must be finite, got nan"),
    ("betas 1", {"betas": (0.9,)}, ValueError, "betas must be a pair (beta1, beta2), got (0.9,)"),
    ("betas 3", {"betas": (0.9, 0.99, 0.999)}, ValueError, "got (0.9, 0.99, 0.999)"),
    ("betas float", {"betas": 0.9}, ValueError, "betas must be a pair (beta1, beta2), got 0.9"),
    ("betas str", {"betas": "abc"}, ValueError, "betas must be a pair (beta1, beta2), got 'abc'"),
    ("wd < 0", {"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0, got -0.1"),
    ("wd nan", {"weight_decay": float("nan")}, ValueError, "weight_decay must be finite, got nan"),
    ("decoupled 1", {"decoupled_weight_decay": 1}, TypeError, "must be a bool, got 1"),
    ("bucket 0", {"bucket_elems": 0}, ValueError, "got 0"),
    ("bucket < 0", {"bucket_elems": -5}, ValueError, "got -5"),
    ("bucket float", {"bucket_elems": 2.5}, TypeError, "got 2.5"),
    ("bucket True", {"bucket_elems": True}, TypeError, "got True"),
]


def test_rejects_bad_input_on_every_rank() -> None:
    """Each case is rejected on every rank of the world, with its own type (TypeError
    stays TypeError; value errors arrive as CollectiveError, a ValueError), and a
    message naming the value and saying it was found on all ranks."""
    world = MPI.COMM_WORLD
    cases = [
        (name, lambda make=make: ZeroOptimizer(make(), comm=world), exc_type, match)  # type: ignore[arg-type]
        for name, make, exc_type, match in BAD_PARAMS
    ] + [
        (name, lambda kw=kw: ZeroOptimizer(good_params(), comm=world, **kw), exc_type, match)
        for name, kw, exc_type, match in BAD_SETTINGS
    ]
    problems = []
    for name, fn, exc_type, match in cases:
        exc, wrong = raises(exc_type, match, fn, name)
        problems += wrong
        suffix = f"(on all {world.size} ranks)" if world.size > 1 else "(on rank 0 of 1)"
        if exc is not None and not str(exc).endswith(suffix):
            problems.append(f"{name}: {exc!s} does not end with {suffix}")
        if exc is not None and exc_type is TypeError and type(exc) is not TypeError:
            problems.append(f"{name}: TypeError arrived as {type(exc).__name__}")
        if exc is not None and exc_type is ValueError and type(exc) is not CollectiveError:
            problems.append(f"{name}: ValueError arrived as {type(exc).__name__}")
    verdict(problems)


def still_usable(comm: MPI.Intracomm) -> list[str]:
    """After a rejected construction the communicator must still be in step: build a
    good optimizer and train one step against the reference."""
    params = good_params()
    opt = ZeroOptimizer(params, comm=comm)
    return train(opt, ReferenceAdam(params), MIXED, 1)


def swap_first_two(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = list(p)
    names[0], names[1] = names[1], names[0]
    return {n: p[n] for n in names}


def rename(p: dict[str, np.ndarray], old: str, new: str) -> dict[str, np.ndarray]:
    return {(new if n == old else n): v for n, v in p.items()}


LAYOUT = "the parameter layout (name, shape, dtype, group) differs between ranks"


SETTINGS = (
    "the optimizer settings (stage, optimizer, hyperparameters, param_groups, bucket_elems) "
    "differs between ranks"
)


#: (id, the rank that differs, its params, its settings, the message, what it names)
ODD_LAYOUTS: list[tuple[str, str, Callable[[], dict], dict[str, Any], str, str]] = [
    ("shape", "last", lambda: {**good_params(), "w": np.zeros((4, 6), F32)}, {}, LAYOUT, "(4, 6)"),
    (
        "shape rank0",
        "first",
        lambda: {**good_params(), "b": np.zeros((1, 3), F32)},
        {},
        LAYOUT,
        "(1, 3)",
    ),
    ("name", "last", lambda: rename(good_params(), "b", "bias"), {}, LAYOUT, "'bias'"),
    ("order", "last", lambda: swap_first_two(good_params()), {}, LAYOUT, "item 0"),
    ("dtype", "last", lambda: {**good_params(), "b": np.zeros(3, F64)}, {}, LAYOUT, "'<f8'"),
    (
        "extra param",
        "last",
        lambda: {**good_params(), "x": np.zeros(2, F32)},
        {},
        LAYOUT,
        "0 has 5 items",
    ),
    (
        "missing param",
        "first",
        lambda: dict(list(good_params().items())[:-1]),
        {},
        LAYOUT,
        "0 has 4 items",
    ),
    ("lr", "last", good_params, {"lr": 2e-3}, SETTINGS, "lr=0.002"),
    ("optimizer", "last", good_params, {"optimizer": "sgd"}, SETTINGS,
     "item 1 is 'adam' on rank 0 but 'sgd'"),
    ("stage", "last", good_params, {"stage": 2}, SETTINGS, "item 0 is 1 on rank 0 but 2"),
    ("stage rank0", "first", good_params, {"stage": 2}, SETTINGS, "item 0 is 2 on rank 0 but 1"),
    ("stage 0", "last", good_params, {"stage": 0}, SETTINGS, "item 0 is 1 on rank 0 but 0"),
    ("stage 3", "last", good_params, {"stage": 3}, SETTINGS, "item 0 is 1 on rank 0 but 3"),
    ("stage 3 rank0", "first", good_params, {"stage": 3}, SETTINGS, "is 3 on rank 0 but 1"),
    (
        "group",
        "last",
        good_params,
        {"group_of": lambda name: "all"},
        LAYOUT,
        "('w', (6, 4), '<f4', 'all')",
    ),
    ("betas", "last", good_params, {"betas": (0.8, 0.999)}, SETTINGS, "beta1=0.8"),
    ("weight decay", "last", good_params, {"weight_decay": 0.01}, SETTINGS, "weight_decay=0.01"),
    (
        "decoupled",
        "last",
        good_params,
        {"decoupled_weight_decay": True},
        SETTINGS,
        "decoupled=True",
    ),
    (
        "bucket_elems",
        "last",
        good_params,
        {"bucket_elems": 5},
        SETTINGS,
        "item 4 is 4 on rank 0 but 5",
    ),
]


def test_rank_dependent_layout_raises_everywhere(comm: MPI.Intracomm) -> None:
    """One rank differs: every rank raises a CollectiveError (instead of hanging in a
    mismatched collective) naming the first rank unlike rank 0 and the difference. On
    a communicator of one rank nothing can differ and construction succeeds."""
    problems = []
    for name, odd, make, kwargs, message, detail in ODD_LAYOUTS:
        odd_rank = 0 if odd == "first" else comm.size - 1
        mine = make() if comm.rank == odd_rank else good_params()
        settings_ = {"bucket_elems": 4, **(kwargs if comm.rank == odd_rank else {})}
        build = lambda mine=mine, settings_=settings_: ZeroOptimizer(  # noqa: E731
            mine, comm=comm, **settings_
        )
        if comm.size == 1:
            try:
                build()
            except Exception as exc:
                problems.append(f"{name}: alone, {type(exc).__name__}: {exc}")
            continue
        exc, wrong = raises(CollectiveError, message, build, name)
        problems += wrong
        named = f"rank {1 if odd == 'first' else comm.size - 1}"  # first rank unlike rank 0
        if exc is not None and (detail not in str(exc) or named not in str(exc)):
            problems.append(f"{name}: {exc!s} does not name {detail!r} and {named}")
    verdict(problems + still_usable(comm))


#: (id, the rank that fails, its params, its settings, error type, message)
LocalCase = tuple[str, str, Callable[[], object], dict[str, Any], type[Exception], str]


ODD_LOCAL_ERRORS: list[LocalCase] = [
    ("int array rank0", "first", lambda: {**good_params(), "w": np.arange(24).reshape(6, 4)}, {},
     TypeError, "parameter 'w' has dtype int64"),
    ("list last", "last", lambda: {**good_params(), "b": [1.0, 2.0, 3.0]}, {},
     TypeError, "parameter 'b' must be a numpy array"),
    ("zero-size last", "last", lambda: {**good_params(), "b": np.zeros(0, F32)}, {},
     ValueError, "parameter 'b' has no elements"),
    ("empty last", "last", dict, {}, ValueError, "params is empty"),
    ("lr last", "last", good_params, {"lr": -1.0}, ValueError, "lr must be >= 0, got -1.0"),
    ("betas rank0", "first", good_params, {"betas": (1.0, 0.999)}, ValueError,
     "beta1 must be in [0, 1), got 1.0"),
    ("stage rank0", "first", good_params, {"stage": 4}, ValueError,
     "stage must be one of (0, 1, 2, 3), got 4"),
    ("stage last", "last", good_params, {"stage": 2.0}, ValueError,
     "stage must be one of (0, 1, 2, 3), got 2.0"),
    ("bucket last", "last", good_params, {"bucket_elems": 0}, ValueError, "got 0"),
    # float(10**400) overflows: an error outside TypeError/ValueError must not hang either.
    ("huge lr last", "last", good_params, {"lr": 10**400}, ValueError, "lr must be finite"),
]  # fmt: skip


def test_local_error_on_one_rank_raises_everywhere(comm: MPI.Intracomm) -> None:
    """Only one rank's own validation fails; every rank raises that error (a TypeError
    stays a TypeError) naming the rank it came from."""
    problems = []
    for name, odd, make, kwargs, exc_type, match in ODD_LOCAL_ERRORS:
        odd_rank = 0 if odd == "first" else comm.size - 1
        mine = make() if comm.rank == odd_rank else good_params()
        settings_ = kwargs if comm.rank == odd_rank else {}
        build = lambda mine=mine, settings_=settings_: ZeroOptimizer(  # noqa: E731
            mine, comm=comm, **settings_
        )
        exc, wrong = raises(exc_type, match, build, name)
        problems += wrong
        where = f"(on rank {odd_rank} of {comm.size})"
        if exc is not None and not str(exc).endswith(where):
            problems.append(f"{name}: {exc!s} does not end with {where}")
        if exc is not None and exc_type is TypeError and type(exc) is not TypeError:
            problems.append(f"{name}: TypeError arrived as {type(exc).__name__}")
    verdict(problems + still_usable(comm))
