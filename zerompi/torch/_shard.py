"""``shard(model, ...)``: a torch module's parameters moved into a ZeroOptimizer.

What it does, collectively on every rank of ``comm``:

1. checks the module where torch can differ between ranks (device, dtypes) and
   raises on every rank if any rank's is wrong (:meth:`zerompi.mpi.collectives.Comm.agree`);
   the ZeroOptimizer then checks names, shapes and order the same way;
2. builds the optimizer on the trainable parameters (``named_parameters()``: a tied
   parameter once), initial values from rank 0;
3. makes every trainable parameter a view of zerompi's full parameter buffer
   (``param.data = torch.from_numpy(...)``; with node shared memory, of the node's
   one copy; with ``param_dtype``, of its rounded copy), and broadcasts frozen
   parameters and module buffers from rank 0; stage 3 without a node copy gives each
   bucket a torch storage that exists only while a module using it runs
   (:mod:`._units`);
4. routes gradients: stages 0-1 set ``.grad`` to a view of zerompi's gradient
   buffer (autograd then adds into it in place; a hook folds in a gradient that
   landed elsewhere, e.g. after ``model.zero_grad()`` set it to ``None``); stages 2-3
   (and ``param_dtype``/``reduce_dtype`` at any stage) register a post-accumulate-grad
   hook per parameter that adds its gradient into the bucket's staging buffer
   (``opt.gradients``, cast to ``reduce_dtype``) and drops torch's copy, so a bucket
   is reduce-scattered as soon as its last parameter's gradient exists.

With ``elastic=True`` a recovery from a lost rank swaps the ZeroOptimizer's engine
for one built for the survivors (:mod:`zerompi.recovery`): its ``on_recovery``
callback (``_rebinder``) re-points every parameter and ``.grad`` view at the new
engine's buffers, or re-binds stage 3's storages (:meth:`Units.rebind`), before
:class:`zerompi.elastic.RankLost` reaches the training loop. Every hook looks the
current buffers up when it runs, so none is registered twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import allocator
from ..config import ZeroConfig, config_of
from ..mpi.collectives import Comm
from ..partition import Deferred
from ..precision import resolve_dtype
from ._optim import ShardedOptimizer
from ._tensors import to_torch, torch_dtype
from ._units import GradientHooks, Units

#: torch dtypes a parameter the optimizer steps on may have (the master dtype).
MASTER_DTYPES = (torch.float32, torch.float64)


def _dtype_name(value: object, what: str) -> str | None:
    """``param_dtype`` / ``reduce_dtype`` as zerompi's name: a torch dtype
    (``torch.bfloat16``) or what :func:`zerompi.precision.resolve_dtype` takes."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    raise TypeError(f"{what} must be a torch dtype, a dtype name or None, got {value!r:.60}")


def _check_settings(config: ZeroConfig) -> None:
    """What this adapter does not do (arguments: the same on every rank)."""
    if config.stage not in (0, 1, 2, 3):
        raise ValueError(f"zerompi.torch: stage must be 0, 1, 2 or 3, got {config.stage!r}")


def _check_module(model: torch.nn.Module) -> None:
    """This rank's problems with ``model``, as one exception."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"shard() takes a torch.nn.Module, got {type(model).__name__}")
    trainable = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != "cpu":
            raise ValueError(f"{name!r} is on device {tensor.device}: zerompi.torch trains "
                             "CPU models (move the model with model.cpu() first)")  # fmt: skip
        if tensor.is_sparse:
            raise ValueError(f"{name!r} is a sparse tensor: not supported")
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        trainable += 1
        if param.dtype not in MASTER_DTYPES:
            raise TypeError(f"parameter {name!r} is {param.dtype}: trainable parameters must "
                            "be float32 or float64 (the dtype Adam keeps)")  # fmt: skip
    if trainable == 0:
        raise ValueError("the module has no trainable parameter (requires_grad=True)")


def _named_groups(
    groups: list[dict[str, Any]] | None, named: list[tuple[str, torch.nn.Parameter]]
) -> list[dict[str, Any]] | None:
    """torch's ``param_groups`` with each parameter replaced by its name (the same on
    every rank: the ZeroOptimizer checks the groups collectively)."""
    if groups is None:
        return None
    names = {id(p): n for n, p in named}
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"param_groups[{i}] must be a dict with a 'params' list")
        params = group["params"]
        params = [params] if isinstance(params, (str, torch.Tensor)) else params
        listed = []
        for p in params:
            if isinstance(p, str):
                listed.append(p)
            elif id(p) in names:
                listed.append(names[id(p)])
            else:
                raise ValueError(f"param_groups[{i}] lists a tensor that is not a trainable "
                                 "parameter of the module")  # fmt: skip
        out.append({**group, "params": listed})
    return out


def _rest(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's frozen parameters and buffers, in ``named_*`` order."""
    rest = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    return rest + list(model.named_buffers())


def _broadcast_rest(comm: Comm, model: torch.nn.Module, param_dtype: str | None) -> None:
    """Frozen parameters and buffers from rank 0, in ``named_*`` order (``shard``
    checked first that every rank has the same ones: no mismatched broadcasts).
    With ``param_dtype`` frozen floating parameters are then cast to it, so the
    module computes in one dtype (FSDP2's policy; buffers keep theirs)."""
    for _, tensor in _rest(model):
        with torch.no_grad():
            data = tensor.detach()
            array = np.ascontiguousarray(data.numpy())
            comm.bcast_inplace(array)
            if not np.shares_memory(array, data.numpy()):
                data.copy_(torch.from_numpy(array))
    if param_dtype is not None:
        wanted = torch_dtype(resolve_dtype(param_dtype, "param_dtype"))
        with torch.no_grad():
            for _, param in model.named_parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(wanted)


def _taken(param: torch.nn.Parameter) -> Deferred:
    """``param`` as the optimizer's initial value (read on rank 0 only), whose
    storage is dropped on every rank once the optimizer holds it, before its other
    buffers are touched: the module's own copy and zerompi's state never coexist in
    full (``_route`` then points the parameter at zerompi's memory)."""

    def release() -> None:
        with torch.no_grad():
            param.data = param.data.new_empty(0)

    def value() -> np.ndarray:
        return param.detach().numpy()

    dtype = torch.empty(0, dtype=param.dtype).numpy().dtype  # (no reference to the data)
    return Deferred(tuple(param.shape), dtype, value, release)


def _buffer_hook(views: dict[torch.nn.Parameter, torch.Tensor]) -> Any:
    """The post-accumulate-grad hook of stages 0-1: ``.grad`` stays ``views[param]``,
    looked up when it runs (a recovery replaces the views: :func:`_point`)."""

    def keep_in_buffer(param: torch.nn.Parameter) -> None:
        grad, view = param.grad, views[param]
        if grad is not view:  # autograd made a new tensor (.grad was None): fold it in
            if grad.data_ptr() != view.data_ptr():
                view.add_(grad)
            param.grad = view

    return keep_in_buffer


#: Where ``shard()`` without a config starts from: ``torch.optim.AdamW``'s defaults,
#: not :class:`zerompi.ZeroConfig`'s (stage 1, no weight decay, Adam): stage 2, weight
#: decay 0.01, decoupled; and one staging slot at stage 3 (``overlap=False``), whose
#: largest bucket is often the embedding (also for ``optimizer="adam8bit"``). With
#: another ``optimizer`` (``"sgd"``, ``"lion"``) only the stage and the staging slot:
#: their weight decay defaults to 0, as torch's ``SGD``'s. A config passed in is used
#: as given.
TORCH_DEFAULTS: dict[str, Any] = {"stage": 2, "weight_decay": 0.01, "decoupled_weight_decay": True}


def torch_config(config: ZeroConfig | None, keywords: dict[str, Any]) -> ZeroConfig:
    """The config ``shard(model, config, **keywords)`` uses (see :data:`TORCH_DEFAULTS`)."""
    if config is not None:
        return config_of(config, keywords)
    adam = keywords.get("optimizer", "adam") in ("adam", "adam8bit")
    settings = {**(TORCH_DEFAULTS if adam else {"stage": TORCH_DEFAULTS["stage"]}), **keywords}
    if settings.get("overlap") is None:  # (None: the default, by stage)
        settings["overlap"] = settings["stage"] != 3
    return ZeroConfig().replace(**settings)


def shard(
    model: torch.nn.Module, config: ZeroConfig | None = None, *, comm: Any = None,
    keep_memory: bool = True, **keywords: Any,
) -> tuple[torch.nn.Module, ShardedOptimizer]:  # fmt: skip
    """Collective: shard ``model``'s trainable parameters over ``comm`` (default
    ``COMM_WORLD``) and return ``(model, optimizer)``; the module is changed in place
    (its parameters become views of zerompi's buffers).

    ``config`` is a :class:`zerompi.ZeroConfig` and ``keywords`` its settings by flat
    name, as for :class:`zerompi.ZeroOptimizer`. Without a config the settings start
    from ``torch.optim.AdamW``'s defaults (:data:`TORCH_DEFAULTS`: stage 2,
    ``weight_decay=0.01``, decoupled, one staging slot at stage 3); a config is used
    as given. ``decoupled_weight_decay=False`` is ``Adam`` with an L2 term.
    ``max_norm`` clips the global gradient norm (torch's ``clip_grad_norm_``) inside
    the step. ``param_groups``: torch's list of dicts, ``{"params": [parameters or
    their names], "lr": ..., "weight_decay": ...}``; a trainable parameter no group
    lists keeps the config's settings.

    ``param_dtype`` (``torch.bfloat16``, ``torch.float16`` or their names): the
    module computes with zerompi's rounded copy in that dtype (frozen parameters are
    cast to it; feed it inputs of that dtype), Adam keeps the float32 master;
    ``reduce_dtype``: the dtype gradients are handed over and moved in (default
    float32; 16-bit ones are still summed in float32); ``loss_scale``: zerompi's
    (multiply the loss by ``optimizer.loss_scale`` before ``backward()``).
    ``elastic=True`` (Open MPI, ``mpiexec --with-ft ulfm``; ``snapshot_every``):
    a rank lost anywhere in ``forward``, ``backward()``, ``step()`` or
    ``zero_grad()`` raises :class:`zerompi.RankLost` on every survivor, out of
    torch's hooks as well; by then the module's parameters (and ``.grad`` at stages
    0-1) are views of the survivors' new buffers, holding the snapshot's values, so
    the loop goes back to batch ``lost.step`` (each batch split over
    ``optimizer.zero.comm.size`` ranks) and goes on with the same module and
    optimizer; wrap collectives of your own in ``with optimizer.survive():``.
    Stage 3 then always gathers per module (``elastic`` turns node memory off).

    Stage 3 (without a node copy of the parameters: over several nodes, or
    ``shared_memory=False``) gathers a module's parameters before its forward and
    again before its backward and frees them after; a parameter read elsewhere in the
    model's forward is gathered for it (:mod:`._units`). Between steps every trainable
    parameter is an empty tensor: read them inside
    ``with optimizer.full_parameters():``.

    ``keep_memory`` (default): the process's C allocator keeps what a step frees for
    the next one (:func:`zerompi.allocator.keep_freed`), so autograd's tensors do
    not fault in fresh pages at every step; ``False`` leaves the allocator as it is.
    Any error is raised on every rank."""
    from ..optimizer import ZeroOptimizer

    check = Comm(comm, timeout=0)
    named: list[tuple[str, torch.nn.Parameter]] = []
    zero_config = ZeroConfig()
    with check.verdict():
        zero_config = torch_config(config, keywords)
        _check_settings(zero_config)
        p = zero_config.precision
        dtypes = (_dtype_name(p.param_dtype, "param_dtype"),
                  _dtype_name(p.reduce_dtype, "reduce_dtype"))  # fmt: skip
        _check_module(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = _named_groups(zero_config.param_groups, named)
        zero_config = zero_config.replace(param_groups=groups, param_dtype=dtypes[0],
                                          reduce_dtype=dtypes[1])  # fmt: skip
    # Every refusal before the ZeroOptimizer takes the parameters (their storages are
    # freed as it does): a refused shard() leaves the module as it was.
    check.check_same([(n, tuple(t.shape), str(t.dtype)) for n, t in _rest(model)],
                     "the module's frozen parameters and buffers (name, shape, dtype)")  # fmt: skip
    if keep_memory:
        allocator.keep_freed()
    # Stage 3 gathers into the modules' own storages (_units): no gather buffers.
    zero = ZeroOptimizer({name: _taken(param) for name, param in named},
                         zero_config.replace(gather_buffers=False), comm=comm)  # fmt: skip
    _broadcast_rest(zero.comm, model, zero_config.precision.param_dtype)
    hand_over = GradientHooks(zero)
    units, grad_views = _route(zero, model, named, hand_over)
    zero.on_recovery.append(_rebinder(zero, named, units, grad_views, hand_over))
    engine = zero.engine
    torch_groups = [(i, [p for n, p in named if zero.param_group(n) == i])
                    for i in range(len(engine.configs))]  # fmt: skip
    torch_groups = [(i, ps) for i, ps in torch_groups if ps or i > 0]
    return model, ShardedOptimizer(zero, torch_groups, grad_views, units, hand_over)


def _route(
    zero: Any, model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]],
    hand_over: GradientHooks,
) -> tuple[Units | None, dict[torch.nn.Parameter, torch.Tensor] | None]:
    """Where parameters live and gradients go. Parameters: views of zerompi's full
    (node) copy where it has one, else stage 3's per-bucket storages (:class:`Units`).
    Gradients: ``.grad`` *is* zerompi's buffer at stages 0-1 when its dtype is the
    parameter's; otherwise a hook hands each one over as it is computed."""
    resident = zero.resident_params
    views = zero.engine.plan.full_grads and not any(
        p.low_params or p.low_grads for p in zero.engine.precisions.values()
    )
    grad_views: dict[torch.nn.Parameter, torch.Tensor] | None = {} if views else None
    if resident is None:
        for _, param in named:
            param.grad = None
        return Units(zero, model, named, hand_over), None
    _point(zero, named, grad_views)
    for name, param in named:
        if grad_views is not None:
            param.register_post_accumulate_grad_hook(_buffer_hook(grad_views))
        else:
            param.register_post_accumulate_grad_hook(hand_over(name))
    return None, grad_views


def _point(
    zero: Any, named: list[tuple[str, torch.nn.Parameter]],
    grad_views: dict[torch.nn.Parameter, torch.Tensor] | None,
) -> None:  # fmt: skip
    """Every parameter a view of zerompi's resident (full or rounded) copy, and at
    stages 0-1 its ``.grad`` (and ``grad_views``) one of the gradient buffer; else no
    ``.grad``. At ``shard()`` and after each recovery (the new engine's buffers)."""
    resident = zero.resident_params
    if resident is None:
        raise RuntimeError("zerompi.torch: the engine has no resident copy of the parameters")
    with torch.no_grad():
        for name, param in named:
            param.grad = None
            param.data = to_torch(resident[name])
            if grad_views is not None:
                view = torch.from_numpy(zero.grads[name])
                grad_views[param] = param.grad = view


def _rebinder(
    zero: Any, named: list[tuple[str, torch.nn.Parameter]], units: Units | None,
    grad_views: dict[torch.nn.Parameter, torch.Tensor] | None, hand_over: GradientHooks,
) -> Callable[[], None]:  # fmt: skip
    """The ``on_recovery`` callback: the module onto the new engine's memory (its
    parameter and gradient views, or stage 3's storages), and the gradient hooks'
    per-backward state (a backward the loss interrupted never ran its callbacks)."""

    def rebind() -> None:
        hand_over.reset()
        if units is not None:
            units.rebind()
        else:
            _point(zero, named, grad_views)

    return rebind
