"""A small numpy MLP classifier with a hand-written backward pass, and its data.

The model is what :mod:`zerompi.driver` trains: ``depth`` hidden layers with tanh
and a linear output layer, trained with softmax cross-entropy. Parameters are a
plain ``dict`` of numpy arrays named ``layer{i}.weight`` (shape ``(fan_in,
fan_out)``, so a layer is ``h @ W + b``) and ``layer{i}.bias``, in layer order, so
they can be handed to :class:`zerompi.ZeroOptimizer` as is; the model then reads
``opt.params`` and adds into ``opt.grads``.

The data is synthetic and reproducible without any file or communication: every
micro-batch is a pure function of ``(seed, step, micro)``, so each rank can build
the same batch and take its own rows, and a one-process reference can rebuild
exactly the batches the sharded run saw. Labels come from a fixed random "teacher"
network, which makes the task learnable (the loss falls) but not trivial.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from functools import lru_cache
from itertools import pairwise

import numpy as np

#: Width of the teacher's hidden layer (small: it only has to make labels).
TEACHER_HIDDEN = 64

# Distinct first words after the seed keep the streams of the data, the teacher
# and init_params (which seeds with ``seed`` alone) from ever coinciding.
_DATA_STREAM = 1
_TEACHER_STREAM = 2


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


def init_params(
    sizes: Sequence[int], seed: int, dtype: np.dtype | type = np.float32
) -> dict[str, np.ndarray]:
    """Fresh parameters for an MLP with layer widths ``sizes``, in layer order.

    Layers followed by a tanh get LeCun-normal weights (std ``sqrt(1 / fan_in)``),
    which keeps activations from saturating or vanishing with depth; the output layer gets
    Glorot-normal weights (std ``sqrt(2 / (fan_in + fan_out))``). Biases start at
    zero. Values are drawn in float64 from ``np.random.default_rng(seed)`` and then
    cast, so float32 and float64 models start from the same (rounded) point.
    """
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least an input and an output width, got {sizes}")
    rng = np.random.default_rng(seed)
    last = len(sizes) - 2
    params: dict[str, np.ndarray] = {}
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        std = np.sqrt(2.0 / (fan_in + fan_out)) if i == last else np.sqrt(1.0 / fan_in)
        weight = rng.standard_normal((fan_in, fan_out)) * std
        params[f"layer{i}.weight"] = weight.astype(dtype)
        params[f"layer{i}.bias"] = np.zeros(fan_out, dtype=dtype)
    return params


def _layers(params: Mapping[str, np.ndarray]) -> list[tuple[str, str]]:
    """``(weight name, bias name)`` of every layer, in order."""
    names = []
    while f"layer{len(names)}.weight" in params:
        names.append((f"layer{len(names)}.weight", f"layer{len(names)}.bias"))
    if not names:
        raise KeyError("params has no 'layer0.weight': not an MLP from init_params")
    return names


def forward(params: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Logits of the rows of ``x`` (shape ``(rows, in_dim)``)."""
    return _forward(params, x, _layers(params))[-1]


def _forward(
    params: Mapping[str, np.ndarray], x: np.ndarray, layers: list[tuple[str, str]]
) -> list[np.ndarray]:
    """Input, every hidden activation (after tanh) and the logits."""
    acts = [x]
    for i, (w, b) in enumerate(layers):
        z = acts[-1] @ params[w]
        z += params[b]
        if i < len(layers) - 1:
            np.tanh(z, out=z)
        acts.append(z)
    return acts


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
    """
    if x.shape[0] == 0:
        return 0.0
    layers = _layers(params)
    acts = _forward(params, x, layers)
    logits = acts.pop()
    rows = np.arange(x.shape[0])
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp cannot overflow
    exp = np.exp(shifted)
    total = exp.sum(axis=1)
    loss = float(np.sum(np.log(total) - shifted[rows, y]))
    if grads is None:
        return loss
    # d loss / d logits = softmax - onehot; the scale is applied once, here, since
    # every parameter gradient is linear in it.
    delta = exp
    delta /= total[:, None]
    delta[rows, y] -= 1
    delta *= scale
    for i in range(len(layers) - 1, -1, -1):
        w, b = layers[i]
        grads[w] += acts[i].T @ delta
        grads[b] += delta.sum(axis=0)
        if i > 0:
            delta = delta @ params[w].T
            delta *= 1 - acts[i] * acts[i]  # tanh' = 1 - tanh^2
    return loss


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
