"""Every update rule against its unsharded reference, by stage, on this world: the
largest difference over four steps (parameters and states, relative to the largest
magnitude), with exactly representable gradients (``tests/helpers.py``'s) and
buckets that cut the matrices across ranks.

    for w in 1 2 3 4; do mpiexec -n $w python scripts/rule_parity.py; done

Rank 0 prints one markdown row per rule: W, then per stage the difference (``0`` is
bit for bit).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import MODES, backward, make_params, mean_grads, rank_grads, spec_of

from zerompi import ZeroOptimizer
from zerompi import reference as r

SHAPES = {"emb": (37, 19), "b": (5,), "stack": (3, 7, 11), "one": (1,), "scalar": (),
          "w": (9, 70)}  # fmt: skip
RULES: dict[str, tuple[dict[str, Any], Any]] = {
    "adam": ({"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
             lambda p: r.ReferenceAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "sgd": ({"lr": 1e-2, "momentum": 0.9, "nesterov": True},
            lambda p: r.ReferenceSGD(p, lr=1e-2, momentum=0.9, nesterov=True)),
    "lion": ({"lr": 1e-3, "weight_decay": 0.1}, lambda p: r.ReferenceLion(p, lr=1e-3,
                                                                         weight_decay=0.1)),
    "adam8bit": ({"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True},
                 lambda p: r.ReferenceAdam8bit(p, lr=1e-2, weight_decay=0.1,
                                               decoupled_weight_decay=True)),
    "adafactor": ({"lr": 1e-2, "weight_decay": 0.1},
                  lambda p: r.ReferenceAdafactor(p, lr=1e-2, weight_decay=0.1)),
    "muon": ({"lr": 2e-2, "weight_decay": 0.1},
             lambda p: r.ReferenceMuon(p, lr=2e-2, weight_decay=0.1)),
}  # fmt: skip


def difference(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    scale = float(np.max(np.abs(b64))) if b64.size else 0.0
    diff = float(np.max(np.abs(a64 - b64))) if b64.size else 0.0
    return diff / scale if scale else diff


def run(rule: str, stage: int, api: str, comm: MPI.Intracomm) -> float:
    spec = spec_of(SHAPES, np.float32)
    params = make_params(spec)
    keywords, make_ref = RULES[rule]
    opt = ZeroOptimizer(params, comm=comm, stage=stage, bucket_elems=100, optimizer=rule,
                        **keywords)  # fmt: skip
    ref = make_ref(params)
    for step in range(4):
        backward(opt, rank_grads(spec, step, comm.rank), api)
        opt.step()
        ref.step(mean_grads(spec, step, comm.size))
    got, state = opt.full_params(), opt.gather_state()
    worst = max(difference(got[n], ref.params[n]) for n in params)
    for label, values in ref.states.items():
        worst = max(worst, *(difference(state[label][k], v) for k, v in values.items()))
    opt.close()
    return worst


def main() -> None:
    comm = MPI.COMM_WORLD
    stages = {0: "stage0", 1: "stage1", 2: "stage2-streamed", 3: "stage3"}
    for rule in RULES:
        cells = [run(rule, s, MODES[m][1], comm) for s, m in stages.items()]
        if comm.rank == 0:
            print(f"| {rule} | {comm.size} | " + " | ".join(
                "0" if c == 0 else f"{c:.1e}" for c in cells) + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
