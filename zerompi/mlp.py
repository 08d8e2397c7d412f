"""A small numpy MLP classifier with a hand-written backward pass, and its data.

The model is what :mod:`zerompi.driver` trains: ``depth`` hidden layers with tanh
and a linear output layer, trained with softmax cross-entropy. Parameters are named
``layer{i}.weight`` (shape ``(fan_in, fan_out)``, so a layer is ``h @ W + b``) and
``layer{i}.bias``, in layer order; the group of layer ``i`` (the name prefix before
the last dot, what :class:`zerompi.ZeroOptimizer` gathers and reduces as a unit) is
``layer_name(i)``.

The model is written layer by layer, so that it can run on parameters that exist
only one layer at a time (ZeRO stage 3)::

    names = layer_names(sizes)
    n = len(names)
    acts = [x]                                        # forward
    for i, name in enumerate(names):
        with opt.gathered(name) as p:
            acts.append(layer_forward(p, i, acts[-1], last=i == n - 1))
    total, delta = loss_grad(acts.pop(), y, scale)
    for i in reversed(range(n)):                      # backward
        with opt.gathered(names[i]) as p, opt.gradients(names[i]) as g:
            delta = layer_backward(p, g, i, acts.pop(), delta, first=i == 0)

where ``p`` and ``g`` are mappings holding (at least) that layer's two arrays.
:func:`loss_and_grad` does exactly this over a whole-model ``dict``, and
:func:`deferred_params` describes the initial parameters as
:class:`zerompi.Deferred` so that the optimizer can make them one bucket at a time.

The data is synthetic and reproducible without any file or communication: every
micro-batch is a pure function of ``(seed, step, micro)``, so each rank can build
the same batch and take its own rows, and a one-process reference can rebuild
exactly the batches the sharded run saw. Labels come from a fixed random "teacher"
network, which makes the task learnable (the loss falls) but not trivial.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from functools import lru_cache, partial
from itertools import pairwise

import numpy as np

from .partition import Deferred

#: Width of the teacher's hidden layer (small: it only has to make labels).
TEACHER_HIDDEN = 64

# Distinct second words after the seed keep the random streams of the data, the
# teacher and the initial weights (one stream per layer) from ever coinciding.
_DATA_STREAM = 1
_TEACHER_STREAM = 2
_INIT_STREAM = 3

#: Elements of float64 drawn at a time when making an initial weight.
_INIT_BLOCK = 1 << 16


def layer_sizes(in_dim: int, hidden: int, depth: int, classes: int) -> list[int]:
    """Widths ``[in_dim, hidden, ..., hidden, classes]`` of an MLP with ``depth``
    hidden layers (``depth=0`` is a linear classifier)."""
    for name, value in (("in_dim", in_dim), ("hidden", hidden), ("classes", classes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    return [in_dim, *([hidden] * depth), classes]


def count_params(sizes: Sequence[int]) -> int:
    """Number of scalars in :func:`init_params` ``(sizes, ...)``: weights and biases."""
    return sum(a * b + b for a, b in pairwise(sizes))


def layer_name(layer: int) -> str:
    """The group of layer ``layer``'s parameters: ``"layer{layer}"``."""
    return f"layer{layer}"


def layer_names(sizes: Sequence[int]) -> list[str]:
    """The groups of an MLP with layer widths ``sizes``, in forward order."""
    return [layer_name(i) for i in range(len(sizes) - 1)]


def _names(layer: int) -> tuple[str, str]:
    """``(weight name, bias name)`` of layer ``layer``."""
    group = layer_name(layer)
    return f"{group}.weight", f"{group}.bias"


def _check_sizes(sizes: Sequence[int]) -> None:
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least an input and an output width, got {sizes}")


def _init_weight(
    seed: int, layer: int, fan_in: int, fan_out: int, last: bool, dtype: np.dtype
) -> np.ndarray:
    """The initial weight of one layer, from that layer's own random stream: the
    float64 draw of ``standard_normal((fan_in, fan_out))``, scaled and cast. Drawn a
    block of rows at a time (the same values: the generator fills in order), so that
    the only full-size array is the result in ``dtype``."""
    std = np.sqrt(2.0 / (fan_in + fan_out)) if last else np.sqrt(1.0 / fan_in)
    rng = np.random.default_rng((seed, _INIT_STREAM, layer))
    weight = np.empty((fan_in, fan_out), dtype)
    rows = max(1, _INIT_BLOCK // fan_out)
    for lo in range(0, fan_in, rows):
        block = rng.standard_normal((min(rows, fan_in - lo), fan_out))
        block *= std
        weight[lo : lo + block.shape[0]] = block
    return weight


def deferred_params(
    sizes: Sequence[int], seed: int, dtype: np.dtype | type = np.float32
) -> dict[str, Deferred]:
    """The parameters of :func:`init_params` as :class:`zerompi.Deferred`: shapes and
    dtypes now, values made by each one's ``init()`` when called (by the optimizer, on
    rank 0, one bucket at a time). ``init()`` returns exactly what :func:`init_params`
    holds for that name, since every layer draws from its own stream."""
    _check_sizes(sizes)
    dtype = np.dtype(dtype)
    last = len(sizes) - 2
    params: dict[str, Deferred] = {}
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        weight, bias = _names(i)
        params[weight] = Deferred(
            (fan_in, fan_out),
            dtype,
            partial(_init_weight, seed, i, fan_in, fan_out, i == last, dtype),
        )
        params[bias] = Deferred((fan_out,), dtype, partial(np.zeros, fan_out, dtype))
    return params


def init_params(
    sizes: Sequence[int], seed: int, dtype: np.dtype | type = np.float32
) -> dict[str, np.ndarray]:
    """Fresh parameters for an MLP with layer widths ``sizes``, in layer order.

    Layers followed by a tanh get LeCun-normal weights (std ``sqrt(1 / fan_in)``),
    which keeps activations from saturating or vanishing with depth; the output layer gets
    Glorot-normal weights (std ``sqrt(2 / (fan_in + fan_out))``). Biases start at
    zero. The weights of layer ``i`` are drawn in float64 from
    ``np.random.default_rng((seed, 3, i))`` and then cast, so float32 and float64
    models start from the same (rounded) point, and any layer can be made alone
    (:func:`deferred_params`).
    """
    return {name: d.init() for name, d in deferred_params(sizes, seed, dtype).items()}


def _layer_count(params: Mapping[str, np.ndarray]) -> int:
    """Number of layers of a whole-model mapping."""
    count = 0
    while f"layer{count}.weight" in params:
        count += 1
    if not count:
        raise KeyError("params has no 'layer0.weight': not an MLP from init_params")
    return count


def layer_forward(p: Mapping[str, np.ndarray], layer: int, x: np.ndarray, last: bool) -> np.ndarray:
    """Output of layer ``layer`` for the rows of ``x``: ``tanh(x @ W + b)``, or the
    logits ``x @ W + b`` when ``last``. ``p`` holds the layer's weight and bias (e.g.
    what ``opt.gathered(layer_name(layer))`` yields); the result is a new array that
    does not refer to them."""
    weight, bias = _names(layer)
    z = x @ p[weight]
    z += p[bias]
    if not last:
        np.tanh(z, out=z)
    return z


def _softmax_parts(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Summed cross-entropy, ``exp(logits - max)`` and its row sums."""
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp cannot overflow
    exp = np.exp(shifted)
    total = exp.sum(axis=1)
    loss = float(np.sum(np.log(total) - shifted[np.arange(logits.shape[0]), y]))
    return loss, exp, total


def loss(logits: np.ndarray, y: np.ndarray) -> float:
    """Summed softmax cross-entropy ``sum_i -log softmax(logits_i)[y_i]`` (0.0 for no rows)."""
    return _softmax_parts(logits, y)[0]


def loss_grad(logits: np.ndarray, y: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
    """:func:`loss` and ``scale * d loss / d logits`` (``scale * (softmax - onehot)``),
    as a new array: the ``delta`` that starts :func:`layer_backward` at the last
    layer. The scale is applied once, here, since every parameter gradient is linear
    in it (``scale=1/rows`` gives the gradient of the mean loss)."""
    total_loss, delta, total = _softmax_parts(logits, y)
    delta /= total[:, None]
    delta[np.arange(logits.shape[0]), y] -= 1
    delta *= scale
    return total_loss, delta


def layer_backward(
    p: Mapping[str, np.ndarray],
    g: MutableMapping[str, np.ndarray],
    layer: int,
    x: np.ndarray,
    delta: np.ndarray,
    first: bool,
) -> np.ndarray | None:
    """Backward through layer ``layer``, given its input ``x`` (what
    :func:`layer_forward` was called with) and ``delta``, the gradient of the loss
    with respect to its pre-activation ``x @ W + b``.

    *Adds* the weight and bias gradients into ``g`` in place (``g`` may be what
    ``opt.gradients(layer_name(layer))`` yields). Unless ``first``, returns the
    gradient with respect to the previous layer's pre-activation: ``x`` is then that
    layer's tanh output, so ``(delta @ W.T) * (1 - x**2)``. The largest temporary is
    one weight-sized array (``x.T @ delta``), freed before the next is made.
    """
    weight, bias = _names(layer)
    g[weight] += x.T @ delta
    g[bias] += delta.sum(axis=0)
    if first:
        return None
    back = delta @ p[weight].T
    slope = np.square(x)  # tanh' = 1 - tanh^2
    np.subtract(1, slope, out=slope)
    back *= slope
    return back


def forward(params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Logits of the rows of ``x`` (shape ``(rows, in_dim)``) for a whole-model mapping."""
    layers = _layer_count(params)
    for i in range(layers):
        x = layer_forward(params, i, x, last=i == layers - 1)
    return x


def loss_and_grad(
    params: Mapping[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    grads: MutableMapping[str, np.ndarray] | None,
    scale: float = 1.0,
) -> float:
    """Summed softmax cross-entropy of the rows ``(x, y)``; adds its gradient.

    Returns ``sum_i -log softmax(forward(x_i))[y_i]`` as a Python float. Unless
    ``grads`` is ``None``, ``scale * d(that sum)/d(param)`` is *added* in place into
    ``grads[name]`` for every parameter (the arrays are written, never replaced, so
    ``grads`` may be :attr:`zerompi.ZeroOptimizer.grads`). ``scale=1/rows`` gives
    the gradient of the mean loss. Zero rows: returns 0.0 and adds nothing.

    The whole model at once, for a model held whole (the reference, tests): it runs
    :func:`layer_forward`, :func:`loss_grad` and :func:`layer_backward`.
    """
    if x.shape[0] == 0:
        return 0.0
    layers = _layer_count(params)
    acts = [x]  # the input of every layer
    for i in range(layers):
        acts.append(layer_forward(params, i, acts[-1], last=i == layers - 1))
    logits = acts.pop()
    if grads is None:
        return loss(logits, y)
    total, delta = loss_grad(logits, y, scale)
    for i in range(layers - 1, -1, -1):
        delta = layer_backward(params, grads, i, acts.pop(), delta, first=i == 0)
    return total


@lru_cache(maxsize=8)
def _teacher(seed: int, in_dim: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed random network that labels the data (float64, cached)."""
    rng = np.random.default_rng((seed, _TEACHER_STREAM))
    first = rng.standard_normal((in_dim, TEACHER_HIDDEN)) / np.sqrt(in_dim)
    second = rng.standard_normal((TEACHER_HIDDEN, classes))
    first.flags.writeable = second.flags.writeable = False
    return first, second


def make_batch(
    seed: int,
    step: int,
    micro: int,
    global_rows: int,
    in_dim: int,
    classes: int,
    dtype: np.dtype | type = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Micro-batch ``micro`` of training step ``step``: ``global_rows`` rows over all
    ranks, as ``(x, y)`` with ``x`` of shape ``(global_rows, in_dim)`` in ``dtype``
    and integer labels ``y`` in ``[0, classes)``.

    A pure function of its arguments: inputs are standard normal from
    ``default_rng((seed, 1, step, micro))`` and each label is the argmax of a
    fixed teacher ``tanh(x @ A) @ B`` (seeded from ``seed`` only), computed in
    float64 so that the labels do not depend on ``dtype``. Each rank builds the
    whole micro-batch and keeps its rows (``shard_range(global_rows, W, rank)``).
    """
    if min(seed, step, micro, global_rows) < 0:
        raise ValueError(
            "seed, step, micro and global_rows must be >= 0, got "
            f"{(seed, step, micro, global_rows)}"
        )
    rng = np.random.default_rng((seed, _DATA_STREAM, step, micro))
    x = rng.standard_normal((global_rows, in_dim))
    first, second = _teacher(seed, in_dim, classes)
    y = np.argmax(np.tanh(x @ first) @ second, axis=1)
    return x.astype(dtype), y
