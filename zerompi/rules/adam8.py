"""8-bit Adam/AdamW as an update rule: Adam's arithmetic (:mod:`zerompi.rules.adam`'s
settings and defaults) with both moments stored blockwise in 8 bits (Dettmers et
al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022; the maps and the
blocks of :mod:`zerompi.quant`): one byte per element per moment plus one float32
scale per block of 256 elements, 2.03 bytes of state per element against float32
Adam's 8.

Each step dequantizes a block's moments, steps it in float32 and quantizes the new
moments with the block's new largest magnitude. Blocks are cut from the start of the
flat parameters, so a shard may begin or end inside one: such a block is stepped,
and its new moments wait until the end of the update, when the ranks (and buckets)
holding parts of it agree on its scale (:class:`zerompi.blockwise.Agreement`, one
small ``MAX`` allreduce per step). The result is the same bytes at every world size
and stage as :class:`zerompi.reference.ReferenceAdam8bit` on the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import quant
from ..buffers import StateKind
from .adam import Adam
from .base import write_low


class Adam8bit(Adam):
    name = "adam8bit"
    states = (
        StateKind("exp_avg_codes", dtype="uint8"),
        StateKind("exp_avg_sq_codes", dtype="uint8"),
        StateKind("exp_avg_scales", dtype="float32", per="block", block=quant.BLOCK),
        StateKind("exp_avg_sq_scales", dtype="float32", per="block", block=quant.BLOCK),
    )
    dtypes = ("float32",)

    def update(
        self, param: np.ndarray, grad: np.ndarray, states: Sequence[np.ndarray], step: int,
        config: Any, scratch: np.ndarray, divisor: float, low: np.ndarray | None,
        stochastic: tuple[int, int] | None, offset: int = 0, context: Any = None,
    ) -> tuple[quant.Edges, int, tuple[np.ndarray, ...]] | None:  # fmt: skip
        qm, qv, sm, sv = states
        edges = quant.adam8_step(param, grad, qm, qv, sm, sv, offset, step, config, divisor,
                                 kernel=self.kernel, variant=self.variant)  # fmt: skip
        write_low(param, low, stochastic, 0)
        return (edges, offset, tuple(states)) if edges.spans else None

    def finish(self, pending: list[Any], agree: Any) -> None:
        """The partial blocks' scales: each the largest of its parts' (this rank's
        calls first, then over the ranks), then their moments quantized."""
        proposed: dict[tuple[str, int], np.ndarray] = {}
        for edges, offset, _ in pending:
            for (_, lo, _), maxima in zip(edges.spans, quant.edge_maxima(edges), strict=True):
                key = ("float32", (offset + lo) // quant.BLOCK)
                value = proposed.setdefault(key, np.zeros(2, np.float32))
                np.maximum(value, np.array(maxima, np.float32), out=value)
        agree(proposed, 2)
        for edges, offset, (qm, qv, sm, sv) in pending:
            agreed = [tuple(map(float, proposed[("float32", (offset + lo) // quant.BLOCK)]))
                      for _, lo, _ in edges.spans]  # fmt: skip
            quant.finish_edges(edges, qm, qv, sm, sv, offset, agreed)


ADAM8BIT = Adam8bit()
