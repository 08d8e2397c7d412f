"""The ``torch.optim.Optimizer`` face of a :class:`zerompi.ZeroOptimizer`.

``param_groups`` are torch's own dictionaries, so ``torch.optim.lr_scheduler``
classes work unchanged: whatever a scheduler (or the user) writes into a group
between steps — ``lr``, ``betas``, ``eps``, ``weight_decay`` — is handed to
:meth:`zerompi.ZeroOptimizer.set_hyperparameters` at the next ``step()`` for the
zerompi parameter group it stands for (:mod:`zerompi.settings`), which also checks
that every rank set the same. Groups are fixed at ``shard()``: ``add_param_group``
is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

if TYPE_CHECKING:
    from ..optimizer import ZeroOptimizer
    from ._units import GradientHooks, Units


#: id -> parameter, for every parameter a ShardedOptimizer trains (weak: a dropped
#: model leaves no trace). Keyed by id: a tensor's ``==`` is elementwise.
_MANAGED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_GUARD: list[Any] = []


def _refuse_other_optimizers(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A global optimizer pre-step hook: another optimizer (built before ``shard()``,
    or after it on the module's parameters) would step zerompi's parameter views
    itself, and silently train something else than the ranks agree on."""
    if isinstance(optimizer, ShardedOptimizer) or not _MANAGED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if _MANAGED.get(id(param)) is param:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() on a parameter of shape "
                    f"{tuple(param.shape)} that zerompi.torch.shard() trains: step the "
                    "optimizer shard() returned instead (build no optimizer of your own "
                    "on the module's parameters, before or after shard())"
                )


class ShardedOptimizer(torch.optim.Optimizer):
    """``step()``, ``zero_grad()``, ``param_groups``, ``save``/``load`` over ``zero``.

    ``grads_are_buffers`` (stages 0-1): each parameter's ``.grad`` is a view of
    zerompi's gradient buffer, zeroed in place by ``zero_grad()`` and by the step
    (torch keeps gradients after ``step()``; here they are consumed by it)."""

    def __init__(
        self,
        zero: ZeroOptimizer,
        groups: Sequence[tuple[int, Sequence[torch.nn.Parameter]]],
        grad_views: dict[torch.nn.Parameter, torch.Tensor] | None,
        units: Units | None = None,
        hand_over: GradientHooks | None = None,
    ) -> None:
        def settings(i: int) -> dict[str, Any]:
            return zero.engine.rule.as_group(zero.engine.configs[i])

        self._building = True
        super().__init__([{"params": list(ps), **settings(i)} for i, ps in groups], settings(0))
        self._building = False
        self.zero = zero
        #: per torch group, the zerompi group it stands for
        self.zero_groups = [i for i, _ in groups]
        self._grad_views = grad_views
        #: the gradient views' summed version counters when they were last known to
        #: be zero (after a step or ``zero_grad``); ``None``: unknown
        self._zeroed_at: int | None = None
        zero.on_recovery.append(self._forget_zeroed)  # new views, counters from 0
        #: stage 3's per-bucket storages (None where parameters stay resident)
        self.units = units
        self._hand_over = hand_over
        for group in self.param_groups:
            for param in group["params"]:
                _MANAGED[id(param)] = param
        if not _GUARD:
            _GUARD.append(register_optimizer_step_pre_hook(
                _refuse_other_optimizers))  # fmt: skip

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_building", False):
            raise NotImplementedError(
                "zerompi.torch: the parameter groups are fixed at shard() (its "
                "param_groups argument)"
            )
        super().add_param_group(param_group)

    def _settings(self, group: dict[str, Any], c: Any) -> dict[str, float | None]:
        """The torch group's settings that differ from its zerompi group's ``c`` (those
        of the update rule, :attr:`zerompi.rules.Rule.settings`; ``None`` stays None:
        Adafactor's ``eps1``)."""
        wanted: dict[str, float | None] = {}
        for key in self.zero.engine.rule.settings:
            if key in ("beta1", "beta2"):
                wanted[key] = float(group["betas"][key == "beta2"])
            else:
                wanted[key] = None if group[key] is None else float(group[key])
        return {k: v for k, v in wanted.items() if getattr(c, k) != v}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Collective: the zerompi step (reduce, agree, Adam, publish) with the
        group's current settings. ``closure`` re-evaluates the loss, as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, index in zip(self.param_groups, self.zero_groups, strict=True):
            changed = self._settings(group, self.zero.engine.configs[index])
            if changed:
                self.zero.set_hyperparameters(group=index, **changed)
        if self.units is not None:
            self.units.release_all()  # nothing gathered may outlive the shards' change
        if self._hand_over is not None:
            self._hand_over.reset()
        self.zero.step()
        self._zeroed_at = self._grad_versions()  # the step consumed the gradients
        return loss

    def _forget_zeroed(self) -> None:
        self._zeroed_at = None

    def _grad_versions(self) -> int | None:
        """The sum of the gradient views' version counters (stages 0-1; else
        ``None``): every in-place write to a view (autograd's accumulation, the
        buffer hook's fold, a user's ``mul_``) raises it, so an unchanged sum means
        that no view was written since it was taken."""
        views = self._grad_views
        if views is None:
            return None
        return sum(view._version for view in views.values())

    @property
    def loss_scale(self) -> float:
        """What to multiply the loss by before ``backward()`` (1.0 without loss
        scaling; see zerompi's ``loss_scale``)."""
        return float(self.zero.loss_scale)

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Collective: inside the block every trainable parameter holds its full value
        (stage 3 gathers them all; other stages hold them anyway), e.g. for
        ``model.state_dict()`` or an evaluation that reads parameters directly."""
        units = self.units
        if units is None:
            yield
            return
        generation = units.generation
        units.gathered_all()
        try:
            yield
        finally:
            if units.generation == generation:  # (a recovery inside released them all)
                units.released_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients added since the last step (no collective). At stages
        0-1 ``.grad`` stays the (zeroed) buffer whatever ``set_to_none`` says: it is
        where the next backward adds; when nothing wrote to it since ``step()`` (which
        leaves it zero) it is not zero-filled again."""
        versions = self._grad_versions()
        if versions is None or versions != self._zeroed_at:
            self.zero.zero_grad()
        if self._hand_over is not None:
            self._hand_over.reset()
        if self._grad_views is not None:
            for param, view in self._grad_views.items():
                param.grad = view
            self._zeroed_at = versions
        else:
            for group in self.param_groups:
                for param in group["params"]:
                    param.grad = None

    def save(self, path: str) -> None:
        """Collective: zerompi's single-file checkpoint (:mod:`zerompi.checkpoint`),
        keyed by the module's parameter names; loadable at any world size and stage."""
        self.zero.save(path)

    def load(self, path: str) -> dict:
        """Collective: restore parameters, moments and step count (the module's
        parameters are the restored values: they are views of the same buffers, or
        gathered from the restored shards at stage 3)."""
        if self.units is not None:
            self.units.release_all()
        return self.zero.load(path)

    def load_safetensors(self, path: str, strict: bool = True) -> None:
        """Collective: the trainable parameters from a safetensors file or directory
        keyed by the module's parameter names (``ZeroOptimizer.load_safetensors``:
        each rank reads its own shards; moments and step count are kept)."""
        if self.units is not None:
            self.units.release_all()
        self.zero.load_safetensors(path, strict)

    def survive(self) -> AbstractContextManager[None]:
        """``with optimizer.survive():`` around collectives of your own on
        ``optimizer.zero.comm`` (a loss average): with ``elastic=True`` a lost rank
        seen there is recovered from and :class:`zerompi.RankLost` raised on every
        survivor, as inside the optimizer and the module's hooks
        (:meth:`zerompi.ZeroOptimizer.survive`)."""
        return self.zero.survive()

    def close(self) -> None:
        """Collective: release zerompi's buffers' shared memory (the module keeps its
        parameter views valid)."""
        self.zero.close()
