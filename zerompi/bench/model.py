"""The benchmark's synthetic model: float tensors summing to exactly P elements, the
same initial values on every rank (and in every torch peer), and a different
gradient per rank, prepared once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..partition import Deferred

#: Learning rate of every optimizer here: small, so that values stay finite.
LR = 1e-4
#: Gradient scale of the synthetic gradients.
GRAD_SCALE = 1e-2


def tensor_sizes(params: int, tensor_elems: int) -> list[int]:
    """``params`` split into tensors of ``tensor_elems`` and a remainder."""
    full, rest = divmod(params, tensor_elems)
    return [tensor_elems] * full + ([rest] if rest else [])


def init_tensor(seed: int, index: int, size: int, dtype: np.dtype) -> np.ndarray:
    """Initial values of tensor ``index``: the same on every rank and in every peer."""
    rng = np.random.default_rng([seed, index])
    out = rng.standard_normal(size, dtype=dtype)
    out *= 0.02
    return out


def tensor_shape(size: int, cols: int = 0) -> tuple[int, ...]:
    """A tensor's shape: a matrix of ``cols`` columns where ``cols`` divides ``size``
    (``--matrix-cols``: what Adafactor factors), else a vector."""
    if cols and size >= cols and size % cols == 0:
        return (size // cols, cols)
    return (size,)


def deferred_model(
    sizes: Sequence[int], seed: int, dtype: np.dtype, cols: int = 0
) -> dict[str, Deferred]:
    """The model as ``Deferred`` tensors (matrices of ``cols`` columns where they
    divide): only rank 0 makes the initial values."""
    return {
        f"t{i}": Deferred(tensor_shape(n, cols), dtype, lambda i=i, n=n: init_tensor(
            seed, i, n, dtype).reshape(tensor_shape(n, cols)))
        for i, n in enumerate(sizes)
    }  # fmt: skip


def make_grads(
    sizes: Sequence[int], seed: int, rank: int, dtype: np.dtype, cols: int = 0
) -> dict[str, np.ndarray]:
    """This rank's synthetic gradients (different on every rank; shaped as
    :func:`deferred_model`'s tensors), made once."""
    rng = np.random.default_rng([seed, 1_000_003, rank])
    grads = {}
    for i, n in enumerate(sizes):
        g = rng.standard_normal(n, dtype=dtype)
        g *= GRAD_SCALE
        grads[f"t{i}"] = g.reshape(tensor_shape(n, cols))
    return grads

