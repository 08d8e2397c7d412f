"""A torch optimizer read as :func:`zerompi.torch.shard`'s settings, never stepped:
what Lightning's ``configure_optimizers`` returns (:mod:`zerompi.lightning`) and what
the Hugging Face Trainer is given (``optimizers=`` or ``optimizer_cls_and_kwargs``,
:mod:`zerompi.hf`). Its class picks zerompi's rule, each of its ``param_groups``
becomes a group of ``shard()`` (by parameter name, with the group's settings under
zerompi's names), and what zerompi's rule would do differently is refused with the
reason:

- ``torch.optim.AdamW`` / ``Adam``: ``optimizer="adam"`` (``decoupled_weight_decay``
  AdamW's or Adam's flag); ``torch.optim.SGD``: ``"sgd"`` (its decay an L2 term);
- ``torch.optim.Adafactor``: ``"adafactor"`` (``eps`` is ``(eps1, eps2)``);
- ``torch.optim.Muon``: ``"muon"`` (``adjust_lr_fn`` ``"original"`` is Keller's scale,
  ``"match_rms_adamw"`` Moonlight's ``match_rms=0.2``; its Newton-Schulz runs in
  bfloat16, zerompi's in the parameters' dtype); Keller Jordan's
  ``MuonWithAuxAdam`` / ``SingleDeviceMuonWithAuxAdam`` (``muon.py``, matched by
  name): ``"muon"`` with each group's ``use_muon`` as zerompi's group ``muon``;
- bitsandbytes' ``AdamW8bit``, ``Adam8bit`` and their ``Paged`` forms (matched by
  name; bitsandbytes is not imported): ``"adam8bit"``, weight decay decoupled as
  bitsandbytes applies it for both (``p *= 1 - lr * weight_decay``). zerompi keeps
  8-bit states for every tensor, where bitsandbytes keeps 32-bit ones below
  ``min_8bit_size`` elements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: torch's classes zerompi steps (exactly these: a subclass may step otherwise).
TORCH_CLASSES: dict[type, str] = {torch.optim.AdamW: "adam", torch.optim.Adam: "adam",
                                  torch.optim.SGD: "sgd", torch.optim.Adafactor: "adafactor",
                                  torch.optim.Muon: "muon"}  # fmt: skip
#: Classes of other packages, by (top-level module, class name): matched without
#: importing them.
NAMED_CLASSES: dict[tuple[str, str], str] = {
    ("bitsandbytes", "AdamW8bit"): "adam8bit", ("bitsandbytes", "Adam8bit"): "adam8bit",
    ("bitsandbytes", "PagedAdamW8bit"): "adam8bit", ("bitsandbytes", "PagedAdam8bit"): "adam8bit",
    ("muon", "MuonWithAuxAdam"): "muon", ("muon", "SingleDeviceMuonWithAuxAdam"): "muon",
}  # fmt: skip
#: What ``configure_optimizers`` / the Trainer may hand over, for the messages.
ACCEPTED = ("torch.optim.AdamW, Adam, SGD, Adafactor or Muon, bitsandbytes' AdamW8bit/"
            "Adam8bit, Keller Jordan's MuonWithAuxAdam")  # fmt: skip

#: Flags of torch's optimizers that change the update and that zerompi does not have.
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable_and_differentiable")
#: torch.optim.Muon's Newton-Schulz coefficients and epsilon (zerompi's: Keller's).
_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
_NS_EPS = 1e-7


def rule_of_class(optimizer: torch.optim.Optimizer | type, who: str) -> str:
    """zerompi's rule for ``optimizer``'s class (or the class given), or a
    ``TypeError`` naming it."""
    kind = optimizer if isinstance(optimizer, type) else type(optimizer)
    if kind in TORCH_CLASSES:
        return TORCH_CLASSES[kind]
    key = (kind.__module__.partition(".")[0], kind.__name__)
    if key in NAMED_CLASSES:
        return NAMED_CLASSES[key]
    public = getattr(torch.optim, kind.__name__, None) is kind
    name = f"torch.optim.{kind.__name__}" if public else f"{kind.__module__}.{kind.__name__}"
    raise TypeError(f"{who}: {name} is not supported: zerompi steps {ACCEPTED} (read, then "
                    "stepped by zerompi); or zerompi.torch.shard(optimizer='lion') for Lion")


def _flags(group: dict[str, Any], index: int, who: str) -> None:
    for flag in _UNSUPPORTED_FLAGS:
        if group.get(flag):
            raise ValueError(f"{who}: param_groups[{index}] sets {flag}=True, which zerompi's "
                             "optimizers do not do")  # fmt: skip


def _adam(group: dict[str, Any]) -> dict[str, Any]:
    b1, b2 = group["betas"]
    return {"lr": float(group["lr"]), "betas": (float(b1), float(b2)),
            "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}  # fmt: skip


def _sgd(group: dict[str, Any]) -> dict[str, Any]:
    return {k: float(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")}


def _adafactor(group: dict[str, Any]) -> dict[str, Any]:
    eps1, eps2 = group["eps"]
    return {"lr": float(group["lr"]), "beta2_decay": float(group["beta2_decay"]),
            "eps1": None if eps1 is None else float(eps1), "eps2": float(eps2),
            "d": float(group["d"]), "weight_decay": float(group["weight_decay"])}  # fmt: skip


def _muon(group: dict[str, Any], index: int, who: str) -> dict[str, Any]:
    """torch.optim.Muon's group."""
    where = f"{who}: param_groups[{index}]"
    coefficients = tuple(float(c) for c in group.get("ns_coefficients", _NS_COEFFICIENTS))
    if coefficients != _NS_COEFFICIENTS:
        raise ValueError(f"{where}: ns_coefficients={group['ns_coefficients']!r}; zerompi's "
                         f"Newton-Schulz uses Keller Jordan's {_NS_COEFFICIENTS}")  # fmt: skip
    if float(group.get("eps", _NS_EPS)) != _NS_EPS:
        raise ValueError(f"{where}: eps={group['eps']!r}; zerompi's Newton-Schulz divides by "
                         f"the norm + {_NS_EPS} (torch's default)")  # fmt: skip
    adjust = group.get("adjust_lr_fn")
    scales = {None: 0.0, "original": 0.0, "match_rms_adamw": 0.2}
    if adjust not in scales:
        raise ValueError(f"{where}: adjust_lr_fn={adjust!r}; zerompi has 'original' and "
                         "'match_rms_adamw'")  # fmt: skip
    return {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
            "momentum": float(group["momentum"]), "nesterov": bool(group["nesterov"]),
            "ns_steps": int(group["ns_steps"]), "match_rms": scales[adjust],
            "muon": True}  # fmt: skip


def _muon_aux(group: dict[str, Any], index: int, who: str) -> dict[str, Any]:
    """A group of Keller Jordan's ``MuonWithAuxAdam``: ``use_muon`` says which."""
    if "use_muon" not in group:
        raise ValueError(f"{who}: param_groups[{index}] of MuonWithAuxAdam has no use_muon")
    if group["use_muon"]:
        return {"lr": float(group["lr"]), "momentum": float(group.get("momentum", 0.95)),
                "weight_decay": float(group.get("weight_decay", 0.0)), "nesterov": True,
                "ns_steps": 5, "muon": True}  # fmt: skip
    b1, b2 = group.get("betas", (0.9, 0.95))
    return {"lr": float(group["lr"]), "betas": (float(b1), float(b2)),
            "eps": float(group.get("eps", 1e-10)),
            "weight_decay": float(group.get("weight_decay", 0.0)), "muon": False}  # fmt: skip


def _adam8bit(optimizer: torch.optim.Optimizer, who: str) -> None:
    """What bitsandbytes' 8-bit Adam may set that zerompi's does not do."""
    args = getattr(optimizer, "args", None)
    checks = (("percentile_clipping", 100), ("max_unorm", 0.0), ("block_wise", True),
              ("optim_bits", 8))  # fmt: skip
    for name, plain in checks:
        value = getattr(args, name, plain)
        if value != plain:
            raise ValueError(f"{who}: {type(optimizer).__name__}({name}={value!r}) is not "
                             f"supported: zerompi's 8-bit Adam has {name}={plain!r}")  # fmt: skip


def _one_flag(optimizer: torch.optim.Optimizer, key: str, default: bool, who: str) -> bool:
    """A flag zerompi has once for all groups: the same in every group, or an error."""
    flags = {bool(g.get(key, default)) for g in optimizer.param_groups}
    if len(flags) != 1:
        raise ValueError(f"{who}: {key} differs between parameter groups; zerompi has one "
                         "setting for all")  # fmt: skip
    return flags.pop()


def named_groups(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, who: str
) -> list[list[str]]:
    """Each group's trainable parameters by name (frozen ones dropped: torch never
    steps a parameter without a gradient); every trainable parameter must be in a
    group (torch would leave it alone, zerompi would train it)."""
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
                raise ValueError(f"{who}: param_groups[{i}] holds a tensor of shape "
                                 f"{tuple(param.shape)} that is not a parameter of the "
                                 "model")  # fmt: skip
        groups.append(mine)
    missing = [n for key, n in names.items() if key not in listed]
    if missing:
        raise ValueError(
            f"{who}: trainable parameters {missing[:5]} are in no parameter group of the "
            "optimizer; zerompi trains every parameter with requires_grad=True: list them, "
            "or freeze them with requires_grad_(False)"
        )
    return groups


def torch_settings(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, who: str
) -> dict[str, Any]:
    """``shard()``'s keywords for ``optimizer`` over ``module``'s parameters:
    ``optimizer`` (the rule), its defaults, the settings zerompi holds once for all
    groups, and ``param_groups`` (by parameter name, each with every setting of its
    group)."""
    rule = rule_of_class(optimizer, who)
    kind = type(optimizer)
    keyed = kind.__name__ in ("MuonWithAuxAdam", "SingleDeviceMuonWithAuxAdam")
    of_group: Callable[[dict[str, Any], int], dict[str, Any]] = {
        "adam": lambda g, i: _adam(g), "adam8bit": lambda g, i: _adam(g),
        "sgd": lambda g, i: _sgd(g), "adafactor": lambda g, i: _adafactor(g),
        "muon": (lambda g, i: _muon_aux(g, i, who)) if keyed
                else (lambda g, i: _muon(g, i, who)),
    }[rule]  # fmt: skip
    for i, group in enumerate(optimizer.param_groups):
        _flags(group, i, who)
    if rule == "adam8bit":
        _adam8bit(optimizer, who)
    names = named_groups(optimizer, module, who)
    groups = [{"params": mine, **of_group(group, i)}
              for i, (mine, group) in enumerate(zip(names, optimizer.param_groups,
                                                    strict=True))]  # fmt: skip
    out: dict[str, Any] = {"optimizer": rule, "param_groups": groups}
    if not keyed:  # the defaults too (zerompi validates its base settings)
        top = of_group(optimizer.defaults, -1)
        renamed = {"momentum": "muon_momentum", "nesterov": "muon_nesterov"}
        out.update({(renamed.get(k, k) if rule == "muon" else k): v
                    for k, v in top.items() if k != "muon"})  # fmt: skip
    if rule == "adam":
        default = isinstance(optimizer, torch.optim.AdamW)
        out["decoupled_weight_decay"] = _one_flag(optimizer, "decoupled_weight_decay", default,
                                                  who)  # fmt: skip
    elif rule == "adam8bit":
        out["decoupled_weight_decay"] = True
    elif rule == "sgd":
        out["nesterov"] = _one_flag(optimizer, "nesterov", False, who)
        out["decoupled_weight_decay"] = False
    return out


__all__ = ["ACCEPTED", "NAMED_CLASSES", "TORCH_CLASSES", "named_groups", "rule_of_class",
           "torch_settings"]  # fmt: skip
