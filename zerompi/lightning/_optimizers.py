"""``configure_optimizers`` mapped onto :func:`zerompi.torch.shard`.

The user's optimizer (``torch.optim.AdamW``, ``Adam``, ``SGD``, ``Adafactor``,
``Muon``, bitsandbytes' ``AdamW8bit``, Keller Jordan's ``MuonWithAuxAdam``:
:mod:`zerompi.torch._mapping`) is only read, never stepped: its class picks zerompi's
rule and its parameter groups, with their settings, become ``shard()``'s keywords
(:func:`shard_settings`); the Trainer's ``gradient_clip_val`` becomes ``max_norm``
(clipped inside zerompi's step, over the global gradient norm), and its LR schedulers
are re-pointed at the :class:`zerompi.torch.ShardedOptimizer`
(:func:`repoint_schedulers`), whose ``param_groups`` are then the user's, in the same
order, with every key a scheduler wrote (``initial_lr``, ...). What zerompi cannot do
is refused with the reason (another optimizer class, ``amsgrad``, ``maximize``,
``nesterov`` differing between groups, clipping by value, a trainable parameter no
group lists).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from functools import wraps
from typing import Any

import torch

from ..torch._mapping import ACCEPTED, rule_of_class, torch_settings

WHO = "zerompi.lightning"


def _the_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one optimizer of ``configure_optimizers`` zerompi steps, or an error saying
    what to return."""
    if len(optimizers) != 1:
        raise ValueError(f"{WHO}: configure_optimizers must return one optimizer "
                         f"({ACCEPTED}), not {len(optimizers)}")  # fmt: skip
    rule_of_class(optimizers[0], WHO)
    return optimizers[0]


def _max_norm(clip_val: float | None, algorithm: Any) -> float | None:
    """The Trainer's ``gradient_clip_val`` as zerompi's ``max_norm`` (norm clipping
    only: zerompi clips the global norm inside its step)."""
    if not clip_val:
        return None
    name = getattr(algorithm, "value", algorithm) or "norm"
    if str(name).lower() != "norm":
        raise ValueError(
            f"zerompi.lightning: gradient_clip_algorithm={name!r} is not supported: zerompi "
            "clips the global gradient norm inside its step (gradient_clip_algorithm='norm')"
        )
    return float(clip_val)


def shard_settings(
    optimizers: Sequence[torch.optim.Optimizer], module: torch.nn.Module,
    clip_val: float | None, clip_algorithm: Any,
) -> dict[str, Any]:  # fmt: skip
    """``shard()``'s keywords for the user's optimizer
    (:func:`zerompi.torch._mapping.torch_settings`: ``optimizer``, the flags held once,
    ``param_groups`` by parameter name, each with its settings) and the Trainer's
    clipping (``max_norm``)."""
    optimizer = _the_optimizer(optimizers)
    return {**torch_settings(optimizer, module, WHO),
            "max_norm": _max_norm(clip_val, clip_algorithm)}  # fmt: skip


def _schedulers_in(scheduler: Any) -> Iterator[Any]:
    """``scheduler`` and those it drives (``SequentialLR``, ``ChainedScheduler``)."""
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", ()) or ():
        yield from _schedulers_in(inner)


def _track_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers do at construction (they warn
    about a scheduler stepped before its optimizer, or an optimizer whose ``step``
    was replaced after them)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


def repoint_schedulers(
    configs: Sequence[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer
) -> None:
    """Make Lightning's LR scheduler configs drive ``new`` instead of ``old``: ``new``'s
    groups (the same groups, in the same order) take every setting ``old``'s hold,
    including what the schedulers wrote at construction (``initial_lr``, the current
    ``lr``), and each scheduler's ``optimizer`` becomes ``new``."""
    if len(old.param_groups) != len(new.param_groups):  # (shard() keeps the groups)
        raise RuntimeError(f"zerompi.lightning: {len(new.param_groups)} sharded groups for "
                           f"the optimizer's {len(old.param_groups)}")  # fmt: skip
    for mine, theirs in zip(new.param_groups, old.param_groups, strict=True):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    for config in configs:
        for scheduler in _schedulers_in(config.scheduler):
            if getattr(scheduler, "optimizer", old) is not old:
                raise ValueError(f"zerompi.lightning: {type(scheduler).__name__} drives another "
                                 "optimizer than configure_optimizers returned")  # fmt: skip
            scheduler.optimizer = new
    _track_steps(new)
