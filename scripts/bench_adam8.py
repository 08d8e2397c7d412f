"""8-bit Adam's step against float32 Adam's, on one process's shard, alternated.

    python scripts/bench_adam8.py [--elems 16e6] [--rounds 7]

One shard of ``--elems`` float32 parameters: :func:`zerompi.adam.adam_step` (the
compiled float32 Adam, moments 8 bytes an element) and :func:`zerompi.quant.adam8_step`
(moments in 8 bits, :mod:`zerompi.quant`, compiled for the whole blocks), each timed
``--rounds`` times in alternating order on the same gradient. Prints the median of
each, their ratio (issue 26's target: <= 1.1), the bytes of state each holds per
element and their ratio (target: <= 0.27), and what each step must move per element
(parameters read and written, the gradient read, the states read and written).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from zerompi import quant
from zerompi.adam import AdamConfig, adam_step
from zerompi.runtime import count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elems", type=count, default=16_000_000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    n = args.elems - args.elems % quant.BLOCK
    rng = np.random.default_rng(0)
    grad0 = rng.standard_normal(n, dtype=np.float32)
    config = AdamConfig(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    p32, m, v = rng.standard_normal(n, dtype=np.float32), np.zeros(n, np.float32), np.zeros(
        n, np.float32)
    p8 = p32.copy()
    qm = np.zeros(n, np.uint8)
    qv = np.zeros(n, np.uint8)
    nb = n // quant.BLOCK
    sm, sv = np.zeros(nb, np.float32), np.zeros(nb, np.float32)
    grad = np.empty_like(grad0)
    scratch = np.empty(1 << 15, np.float32)
    times: dict[str, list[float]] = {"float32": [], "8-bit": []}
    for r in range(args.rounds + 1):
        for side in ("float32", "8-bit") if r % 2 == 0 else ("8-bit", "float32"):
            np.copyto(grad, grad0)
            start = time.perf_counter()
            if side == "float32":
                adam_step(p32, grad, m, v, r + 1, config, scratch)
            else:
                quant.adam8_step(p8, grad, qm, qv, sm, sv, 0, r + 1, config)
            if r:  # the first round faults in and warms up
                times[side].append(time.perf_counter() - start)
    f32, b8 = (1e3 * statistics.median(times[k]) for k in ("float32", "8-bit"))
    state32, state8 = 8.0, 2.0 + 8.0 / quant.BLOCK
    print(f"adam8 bench: {n:,} elements, {args.rounds} rounds alternated, one process")
    print(f"median step ms: float32 {f32:.1f}, 8-bit {b8:.1f}, 8-bit/float32 {b8 / f32:.3f}")
    print(f"state bytes per element: float32 {state32:.0f}, 8-bit {state8:.4f}, ratio "
          f"{state8 / state32:.3f}; bytes moved per element: float32 28, 8-bit "
          f"{12 + 4 + 16 / quant.BLOCK:.3f}")  # fmt: skip
    print(f"max |param difference| after {args.rounds + 1} steps: "
          f"{float(np.max(np.abs(p8 - p32))):.3g}")


if __name__ == "__main__":
    main()
