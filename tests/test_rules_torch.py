"""``zerompi.torch.shard(model, optimizer="sgd" | "lion" | "adafactor" | "muon", ...)`` against
single-process torch on the whole global batch (:mod:`zerompi.torch.parity`'s model and
data, two ``backward()`` per step, a ``StepLR``): torch's own ``SGD`` (momentum,
Nesterov, L2) and ``Adafactor``, and Lion written here from Chen et al. 2023 as a
``torch.optim.Optimizer``; every
stage, node copy or not, with two parameter groups. Relative parameter difference
≤ 1e-5, the scheduler's learning rates in effect."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from helpers import assert_all
from mpi4py import MPI

torch = pytest.importorskip("torch")
from zerompi.torch import shard  # noqa: E402
from zerompi.torch.parity import ROWS, batch, differences, loss_of, make_model  # noqa: E402

torch.set_num_threads(1)

MODES = {"0": (0, None), "1": (1, None), "2": (2, None), "3": (3, None), "3s": (3, False)}


class TorchLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2), per parameter: ``c = b1 m + (1 - b1) g``,
    ``p -= lr (sign(c) + wd p)``, ``m = b2 m + (1 - b2) g``."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float],
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = torch.sign(b1 * m + (1 - b1) * g) + group["weight_decay"] * p
                p -= group["lr"] * update
                m.mul_(b2).add_(g, alpha=1 - b2)


#: name -> (shard() keywords, the reference optimizer from its params, the second
#: group's settings)
RULES: dict[str, tuple[dict[str, Any], Callable[[Any], Any], dict[str, Any]]] = {
    "sgd-nesterov-l2": (
        {"optimizer": "sgd", "lr": 5e-2, "momentum": 0.9, "nesterov": True,
         "weight_decay": 0.05},
        lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.05),
        {"lr": 2e-2, "weight_decay": 0.0}),
    "sgd-momentum": (
        {"optimizer": "sgd", "lr": 5e-2, "momentum": 0.8},
        lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.8),
        {"momentum": 0.5}),
    "lion": (
        {"optimizer": "lion", "lr": 3e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
        lambda ps: TorchLion(ps, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
        {"lr": 1e-3, "betas": (0.8, 0.95)}),
    "adafactor": (
        {"optimizer": "adafactor", "lr": 2e-2, "weight_decay": 0.05},
        lambda ps: torch.optim.Adafactor(ps, lr=2e-2, weight_decay=0.05),
        {"lr": 5e-3, "beta2_decay": -0.6}),
}  # fmt: skip


def train_alongside(
    model: torch.nn.Module, opt: Any, ref: torch.nn.Module, ref_opt: Any,
    comm: MPI.Intracomm, scheds: Sequence[Any] = (),
) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Five steps of two micro-batches: the sharded ``model`` on this rank's rows, the
    reference on the whole global batch, ``scheds`` stepped after each; then the
    difference of every parameter (absolute, relative), the full parameters gathered."""
    rank, world = comm.rank, comm.size
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    for step in range(5):
        for micro in range(2):
            idx, target = batch(step, micro, world)
            loss_of(model, idx[mine], target[mine]).backward()
            loss_of(ref, idx, target).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for sched in scheds:
            sched.step()
    with opt.full_parameters():
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    return differences(got, dict(ref.named_parameters()))


def groups_of(model: torch.nn.Module, second: dict[str, Any]) -> list[dict[str, Any]]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2]},
            {"params": [p for p in trainable if p.dim() < 2], **second}]  # fmt: skip


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", MODES)
def test_rule_through_shard_matches_torch(comm: MPI.Intracomm, mode: str, rule: str) -> None:
    stage, shared = MODES[mode]
    keywords, make_ref, second = RULES[rule]
    model = make_model(comm.rank)
    model, opt = shard(model, stage=stage, comm=comm, bucket_elems=40, shared_memory=shared,
                       param_groups=groups_of(model, second), **keywords)  # fmt: skip
    ref = make_model(0)
    ref_opt = make_ref(groups_of(ref, second))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref_opt)]
    diffs = train_alongside(model, opt, ref, ref_opt, comm, scheds)
    problems = [f"{name} differs by {a:.3g} (relative {r:.3g})"
                for name, (a, r) in diffs.items() if not r <= 1e-5]  # fmt: skip
    lrs = [opt.zero.engine.configs[i].lr for i in opt.zero_groups]
    if lrs != scheds[1].get_last_lr():
        problems.append(f"learning rates {lrs} != {scheds[1].get_last_lr()}")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    if opt.zero.hyperparameters()["rule"] != keywords["optimizer"] or not all(
            "weight_decay" in g for g in groups):  # fmt: skip
        problems.append(f"param_groups {groups}")
    opt.close()
    assert_all(not problems, "\n".join(problems[:6]))


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_shard_with_another_rule_starts_without_weight_decay(
    comm: MPI.Intracomm, rule: str
) -> None:
    """Without a config, ``optimizer="sgd"`` takes torch ``SGD``'s defaults (no weight
    decay, L2 when set), Lion no weight decay: not AdamW's 0.01 that ``shard()``
    starts Adam from."""
    _, opt = shard(make_model(0), comm=comm, optimizer=rule, lr=0.1)
    hyper = opt.zero.hyperparameters()
    opt.close()
    assert_all(hyper["weight_decay"] == 0.0 and not hyper.get("decoupled", False),
               str(hyper))  # fmt: skip


class TorchAdam8bit(torch.optim.Optimizer):
    """:class:`zerompi.reference.ReferenceAdam8bit` on the model's parameters laid end
    to end in their order (numpy float32 copies; the torch tensors take the result)."""

    def __init__(self, params: Any, **adam: Any) -> None:
        super().__init__(params, {})
        from zerompi.reference import ReferenceAdam8bit

        self.tensors = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self.ref = ReferenceAdam8bit({str(i): p.detach().numpy().copy()
                                      for i, p in enumerate(self.tensors)}, **adam)  # fmt: skip

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        self.ref.step({str(i): np.zeros(tuple(p.shape), np.float32) if p.grad is None
                       else p.grad.numpy() for i, p in enumerate(self.tensors)})  # fmt: skip
        for i, p in enumerate(self.tensors):
            p.copy_(torch.from_numpy(self.ref.params[str(i)]))


@pytest.mark.parametrize("mode", MODES)
def test_adam8bit_through_shard_matches_the_reference(comm: MPI.Intracomm, mode: str) -> None:
    """``shard(model, optimizer="adam8bit")`` against the 8-bit reference stepping the
    whole model on the global batch: bit for bit on one rank; on more, within 1e-5 of
    the largest parameter after 5 steps, as the other rules (the sharded gradients are
    summed in another order: 9.7e-8 measured, no 8-bit code flipped)."""
    stage, shared = MODES[mode]
    rank, world = comm.rank, comm.size
    adam = {"lr": 1e-3, "weight_decay": 0.01, "decoupled_weight_decay": True}
    model, opt = shard(make_model(rank), stage=stage, comm=comm, bucket_elems=40,
                       shared_memory=shared, optimizer="adam8bit", lr=1e-3)  # fmt: skip
    ref = make_model(0)
    ref_opt = TorchAdam8bit(ref.parameters(), **adam)  # (the trainable ones: shard()'s)
    diffs = train_alongside(model, opt, ref, ref_opt, comm)
    hyper = opt.zero.hyperparameters()
    opt.close()
    worst = max(r for _, r in diffs.values())
    limit = 0.0 if world == 1 else 1e-5
    assert_all(worst <= limit and hyper["rule"] == "adam8bit" and hyper["weight_decay"] == 0.01,
               f"worst relative difference {worst:.3g} (limit {limit:g}); {hyper}")  # fmt: skip


class TorchMuon(torch.optim.Optimizer):
    """Muon from Keller Jordan's reference (``muon.py``: a lerp momentum buffer,
    Nesterov, the quintic Newton-Schulz iteration, here in float32, ``max(1,
    rows/cols)^0.5``), AdamW (torch's arithmetic) for the parameters with fewer than
    two dimensions, decoupled weight decay ``p *= 1 - lr * wd``."""

    def __init__(self, params: Any, lr: float, weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @staticmethod
    def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
        a, b, c = (3.4445, -4.7750, 2.0315)
        x = g.T if g.size(0) > g.size(1) else g
        x = x / (x.norm() + 1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if g.size(0) > g.size(1) else x

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                if p.dim() >= 2:
                    m = state.setdefault("momentum", torch.zeros_like(p))
                    m.lerp_(g, 1 - 0.95)
                    u = g.lerp(m, 0.95).reshape(p.size(0), -1)
                    o = self.newton_schulz(u) * max(1, u.size(0) / u.size(1)) ** 0.5
                    p.mul_(1 - lr * wd).add_(o.reshape(p.shape), alpha=-lr)
                else:
                    m = state.setdefault("exp_avg", torch.zeros_like(p))
                    v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
                    m.mul_(0.9).add_(g, alpha=0.1)
                    v.mul_(0.95).addcmul_(g, g, value=0.05)
                    t = state["step"]
                    denom = (v / (1 - 0.95**t)).sqrt() + 1e-8
                    p.mul_(1 - lr * wd).addcdiv_(m / (1 - 0.9**t), denom, value=-lr)


@pytest.mark.parametrize("mode", MODES)
def test_muon_through_shard_matches_kellers(comm: MPI.Intracomm, mode: str) -> None:
    """``shard(model, optimizer="muon")`` against :class:`TorchMuon` on the whole
    batch, 5 steps: parameters within 1e-5 of the largest, as the other rules
    (torch's float32 matmuls and lerps round differently from numpy's: 2.6e-6
    measured on one rank)."""
    stage, shared = MODES[mode]
    model, opt = shard(make_model(comm.rank), stage=stage, comm=comm, bucket_elems=40,
                       shared_memory=shared, optimizer="muon", lr=2e-2,
                       weight_decay=0.05)  # fmt: skip
    ref = make_model(0)
    ref_opt = TorchMuon([p for p in ref.parameters() if p.requires_grad], lr=2e-2,
                        weight_decay=0.05)  # fmt: skip
    diffs = train_alongside(model, opt, ref, ref_opt, comm)
    opt.close()
    worst = max(r for _, r in diffs.values())
    assert_all(worst <= 1e-5, f"worst relative difference {worst:.3g}")


def float32_newton_schulz(grad: Any, ns_coefficients: Any, ns_steps: int, eps: float) -> Any:
    """torch's ``_zeropower_via_newtonschulz`` without its cast to bfloat16."""
    a, b, c = ns_coefficients
    x = grad.T if grad.size(0) > grad.size(1) else grad
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("mode", ["1", "3"])
def test_torch_muon_mapped_as_torch_steps_it(
    comm: MPI.Intracomm, mode: str, adjust: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """``torch.optim.Muon`` read by :func:`zerompi.torch._mapping.torch_settings` (what
    Lightning's strategy and the HF Trainer do with it), then zerompi's Muon, against
    torch's Muon stepping the whole batch (the model's vectors frozen: torch's Muon
    takes matrices only), its Newton-Schulz patched to run in float32 as zerompi's
    does (torch casts to bfloat16): within 1e-5, as the other rules."""
    from zerompi.torch._mapping import torch_settings

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", float32_newton_schulz)

    def matrices_only(model: torch.nn.Module) -> torch.nn.Module:
        for p in model.parameters():
            p.requires_grad_(p.dim() >= 2)
        return model

    def muon(model: torch.nn.Module) -> Any:
        return torch.optim.Muon([p for p in model.parameters() if p.requires_grad], lr=2e-2,
                                weight_decay=0.05, momentum=0.9, adjust_lr_fn=adjust)  # fmt: skip

    stage, shared = MODES[mode]
    model = matrices_only(make_model(comm.rank))
    settings = torch_settings(muon(model), model, "test")
    model, opt = shard(model, stage=stage, comm=comm, bucket_elems=40, shared_memory=shared,
                       **settings)  # fmt: skip
    ref = matrices_only(make_model(0))
    diffs = train_alongside(model, opt, ref, muon(ref), comm)
    opt.close()
    worst = max(r for _, r in diffs.values())
    assert_all(settings["param_groups"][0]["match_rms"] == (0.2 if adjust != "original" else 0.0)
               and worst <= 1e-5, f"worst relative difference {worst:.3g}, {settings}")  # fmt: skip
