"""Stand-ins for optimizer classes of packages the tests do not install: their names,
modules and defaults (and Keller Jordan's ``use_muon`` groups), which
:mod:`zerompi.torch._mapping` matches by name and reads; zerompi never steps them."""

from __future__ import annotations

from typing import Any

import torch


class AdamW8bit(torch.optim.Optimizer):
    """bitsandbytes' ``AdamW8bit``: its name, module and defaults."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})  # fmt: skip


AdamW8bit.__module__ = "bitsandbytes.optim.adamw"


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Keller Jordan's ``muon.MuonWithAuxAdam``: its name, module, groups with
    ``use_muon`` and their defaults."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        for group in param_groups:
            defaults = ({"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0} if group["use_muon"]
                        else {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10,
                              "weight_decay": 0.0})  # fmt: skip
            for key, value in defaults.items():
                group.setdefault(key, value)
        super().__init__(param_groups, {})


MuonWithAuxAdam.__module__ = "muon"
