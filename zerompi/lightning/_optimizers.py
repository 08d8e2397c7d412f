"""``configure_optimizers`` mapped onto :func:`zerompi.torch.shard`.

The user's ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` is only read, never stepped:
its settings (Adam's ``lr``, ``betas``, ``eps``, ``weight_decay`` and AdamW or Adam's
``decoupled_weight_decay``; SGD's ``lr``, ``momentum``, ``dampening``,
``weight_decay`` as an L2 term and ``nesterov``: zerompi's ``optimizer="sgd"``) and
its parameter groups become ``shard()``'s keywords (:func:`shard_settings`), the
Trainer's ``gradient_clip_val`` becomes ``max_norm`` (clipped inside zerompi's step,
over the global gradient norm), and its LR schedulers are re-pointed at the
:class:`zerompi.torch.ShardedOptimizer` (:func:`repoint_schedulers`), whose
``param_groups`` are then the user's, in the same order, with every key a scheduler
wrote (``initial_lr``, ...). What zerompi cannot do is refused with the reason
(another optimizer class, ``amsgrad``, ``maximize``, ``nesterov`` differing between
groups, clipping by value, a trainable parameter no group lists).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from functools import wraps
from typing import Any

import torch

#: The optimizer classes zerompi steps (exactly these: a subclass may step otherwise).
SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)

#: Flags of torch's Adam and SGD that change the update and that zerompi does not have.
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize")

#: SGD's per-group settings, as zerompi's group keys.
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay")


def _the_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one Adam/AdamW/SGD of ``configure_optimizers``, or an error saying what to
    return."""
    if len(optimizers) != 1:
        raise ValueError(f"zerompi.lightning: configure_optimizers must return one optimizer "
                         f"(torch.optim.AdamW, Adam or SGD), not {len(optimizers)}")  # fmt: skip
    optimizer = optimizers[0]
    kind = type(optimizer)
    if kind not in SUPPORTED:
        public = getattr(torch.optim, kind.__name__, None) is kind
        name = f"torch.optim.{kind.__name__}" if public else f"{kind.__module__}.{kind.__name__}"
        raise TypeError(
            f"zerompi.lightning: {name} is not supported: configure_optimizers maps "
            "torch.optim.AdamW, Adam and SGD; return one of them (zerompi's Lion: "
            "zerompi.torch.shard(optimizer='lion'))"
        )
    return optimizer


def _group_settings(sgd: bool, group: dict[str, Any], index: int) -> dict[str, Any]:
    """One torch group's settings (``sgd``: SGD's, else Adam's) as zerompi's group
    keys (floats)."""
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag):
            raise ValueError(f"zerompi.lightning: param_groups[{index}] sets {flag}=True, "
                             "which zerompi's optimizers do not do")  # fmt: skip
    if sgd:
        return {key: float(group[key]) for key in _SGD_KEYS}
    b1, b2 = group["betas"]
    return {"lr": float(group["lr"]), "betas": (float(b1), float(b2)),
            "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}  # fmt: skip


def _nesterov(optimizer: torch.optim.Optimizer) -> bool:
    """SGD's ``nesterov``: one flag for all groups (zerompi has one setting)."""
    flags = {bool(g.get("nesterov", False)) for g in optimizer.param_groups}
    if len(flags) != 1:
        raise ValueError("zerompi.lightning: nesterov differs between parameter groups; "
                         "zerompi has one setting for all")  # fmt: skip
    return flags.pop()


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """AdamW's decoupled weight decay, or Adam's L2 term: one flag for all groups."""
    default = isinstance(optimizer, torch.optim.AdamW)
    flags = {bool(g.get("decoupled_weight_decay", default)) for g in optimizer.param_groups}
    if len(flags) != 1:
        raise ValueError("zerompi.lightning: decoupled_weight_decay differs between "
                         "parameter groups; zerompi has one setting for all")  # fmt: skip
    return flags.pop()


def _named_groups(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> list[list[str]]:
    """Each group's trainable parameters by name (frozen ones dropped: torch's Adam
    never steps a parameter without a gradient); every trainable parameter must be
    in a group (torch would leave it alone, zerompi would train it)."""
    names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    groups, listed = [], set()
    for i, group in enumerate(optimizer.param_groups):
        mine = []
        for param in group["params"]:
            if id(param) in names:
                mine.append(names[id(param)])
                listed.add(id(param))
            elif id(param) not in frozen:
                raise ValueError(f"zerompi.lightning: param_groups[{i}] holds a tensor of "
                                 f"shape {tuple(param.shape)} that is not a parameter of the "
                                 "LightningModule")  # fmt: skip
        groups.append(mine)
    missing = [n for key, n in names.items() if key not in listed]
    if missing:
        raise ValueError(
            f"zerompi.lightning: trainable parameters {missing[:5]} are in no parameter "
            "group of the optimizer; zerompi trains every parameter with requires_grad=True: "
            "list them, or freeze them with requires_grad_(False)"
        )
    return groups


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
    """``shard()``'s keywords for the user's optimizer and the Trainer's clipping: its
    defaults (Adam: ``lr``, ``betas``, ``eps``, ``weight_decay``; SGD: ``lr``,
    ``momentum``, ``dampening``, ``weight_decay``), ``decoupled_weight_decay`` (SGD's
    is an L2 term), ``optimizer`` (with SGD's ``nesterov``), ``param_groups`` (by
    parameter name, each with its settings) and ``max_norm``."""
    optimizer = _the_optimizer(optimizers)
    sgd = isinstance(optimizer, torch.optim.SGD)
    defaults = _group_settings(sgd, optimizer.defaults, -1)
    groups = [
        {"params": names, **_group_settings(sgd, group, i)}
        for i, (names, group) in enumerate(zip(_named_groups(optimizer, module),
                                               optimizer.param_groups, strict=True))
    ]  # fmt: skip
    rule = ({"optimizer": "sgd", "nesterov": _nesterov(optimizer),
             "decoupled_weight_decay": False} if sgd
            else {"optimizer": "adam",
                  "decoupled_weight_decay": _decoupled(optimizer)})  # fmt: skip
    return {**defaults, **rule, "param_groups": groups,
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
