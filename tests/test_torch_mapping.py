"""A torch optimizer read as ``shard()``'s settings (:mod:`zerompi.torch._mapping`, what
Lightning's strategy and the HF Trainer use): each class's rule, every group's
settings under zerompi's names, and the refusals, with the value named. Pure (no
MPI); the trainings that follow the mapping are in tests/test_lightning.py,
tests/test_hf_trainer.py and tests/test_rules_torch.py."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from zerompi.torch._mapping import torch_settings  # noqa: E402

pytestmark = pytest.mark.mpi_skip


def model(bias: bool = True) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6, bias=bias), torch.nn.Linear(6, 3, bias=bias))


def split(m: Any) -> list[dict[str, Any]]:
    return [{"params": [p for p in m.parameters() if p.dim() >= 2]},
            {"params": [p for p in m.parameters() if p.dim() < 2], "lr": 1e-3}]  # fmt: skip


def fake(module: str, name: str, base: Any = torch.optim.Optimizer) -> type:
    """A class of another package's module and name (not installed here)."""
    return type(name, (base,), {"__module__": module})


def test_adafactor_groups_carry_eps1_and_eps2() -> None:
    m = model()
    opt = torch.optim.Adafactor(split(m), lr=2e-2, eps=(1e-20, 2e-3), d=2.0, beta2_decay=-0.6,
                                weight_decay=0.1)  # fmt: skip
    got = torch_settings(opt, m, "test")
    assert got["optimizer"] == "adafactor"
    assert got["param_groups"][0] == {"params": ["0.weight", "1.weight"], "lr": 2e-2,
                                      "beta2_decay": -0.6, "eps1": 1e-20, "eps2": 2e-3,
                                      "d": 2.0, "weight_decay": 0.1}  # fmt: skip
    assert got["param_groups"][1]["lr"] == 1e-3 and got["eps1"] == 1e-20
    default = torch_settings(torch.optim.Adafactor(m.parameters()), m, "test")
    assert default["eps1"] is None and default["param_groups"][0]["eps1"] is None
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets maximize=True"):
        torch_settings(torch.optim.Adafactor(m.parameters(), maximize=True), m, "test")


def test_torch_muon_groups_and_refusals() -> None:
    m = model(bias=False)
    opt = torch.optim.Muon(m.parameters(), lr=3e-2, weight_decay=0.01, momentum=0.9,
                           nesterov=False, ns_steps=4, adjust_lr_fn="match_rms_adamw")  # fmt: skip
    got = torch_settings(opt, m, "test")
    assert got["param_groups"][0] == {"params": ["0.weight", "1.weight"], "lr": 3e-2,
                                      "weight_decay": 0.01, "momentum": 0.9, "nesterov": False,
                                      "ns_steps": 4, "match_rms": 0.2, "muon": True}  # fmt: skip
    assert (got["optimizer"], got["muon_momentum"], got["muon_nesterov"]) == ("muon", 0.9, False)
    with pytest.raises(ValueError, match=r"ns_coefficients=\(3.0, -4.0, 2.0\)"):
        torch_settings(torch.optim.Muon(m.parameters(), ns_coefficients=(3.0, -4.0, 2.0)), m, "t")
    with pytest.raises(ValueError, match=r"eps=0\.001"):
        torch_settings(torch.optim.Muon(m.parameters(), eps=1e-3), m, "t")
    with pytest.raises(ValueError, match=r"trainable parameters \['0.bias', '1.bias'\]"):
        biased = model()
        weights = [p for p in biased.parameters() if p.dim() == 2]
        torch_settings(torch.optim.Muon(weights), biased, "t")


def test_kellers_muon_with_aux_adam_by_use_muon() -> None:
    m = model()
    aux = fake("muon", "MuonWithAuxAdam")
    groups = [{**split(m)[0], "use_muon": True, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.0},
              {**split(m)[1], "use_muon": False, "lr": 3e-4, "betas": (0.8, 0.9), "eps": 1e-9,
               "weight_decay": 0.0}]  # fmt: skip
    got = torch_settings(aux(groups, {}), m, "test")
    assert got["optimizer"] == "muon"
    assert got["param_groups"][0]["muon"] and got["param_groups"][0]["momentum"] == 0.9
    assert got["param_groups"][1] == {"params": ["0.bias", "1.bias"], "lr": 3e-4,
                                      "betas": (0.8, 0.9), "eps": 1e-9, "weight_decay": 0.0,
                                      "muon": False}  # fmt: skip
    with pytest.raises(ValueError, match=r"param_groups\[0\] of MuonWithAuxAdam has no use_muon"):
        torch_settings(aux(split(m), {}), m, "test")


@pytest.mark.parametrize("name", ["AdamW8bit", "Adam8bit", "PagedAdamW8bit"])
def test_bitsandbytes_8bit_adam_by_name(name: str) -> None:
    m = model()
    cls = fake("bitsandbytes.optim.adamw", name)
    opt = cls(split(m), {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01})
    got = torch_settings(opt, m, "test")
    assert (got["optimizer"], got["decoupled_weight_decay"]) == ("adam8bit", True)
    assert got["param_groups"][1] == {"params": ["0.bias", "1.bias"], "lr": 1e-3,
                                      "betas": (0.9, 0.999), "eps": 1e-8,
                                      "weight_decay": 0.01}  # fmt: skip
    opt.args = type("Args", (), {"percentile_clipping": 5})()
    with pytest.raises(ValueError, match=rf"{name}\(percentile_clipping=5\) is not supported"):
        torch_settings(opt, m, "test")


def test_another_class_is_refused_naming_it() -> None:
    m = model()
    with pytest.raises(TypeError, match=r"who: torch.optim.RMSprop is not supported: zerompi "
                                        r"steps torch.optim.AdamW, Adam, SGD, Adafactor or Muon"):
        torch_settings(torch.optim.RMSprop(m.parameters()), m, "who")
    lookalike = fake("my_package.optim", "AdamW8bit")
    with pytest.raises(TypeError, match=r"my_package\.optim\.AdamW8bit is not supported"):
        torch_settings(lookalike(m.parameters(), {"lr": 1e-3}), m, "who")
