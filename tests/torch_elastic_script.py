"""A torch training loop over ``zerompi.torch.shard(..., elastic=True)`` under a test's
control, for tests/test_torch_elastic.py::

    mpiexec --with-ft ulfm -n 4 python tests/torch_elastic_script.py --stage S --json OUT

Each rank writes its PID to ``$ZEROMPI_TEST_CONTROL/pid.<rank>``. ``$ZEROMPI_TEST_PAUSE``
lists the moments (comma separated) at which every rank writes a marker
``<moment>.<rank>`` (holding its PID) and sleeps ``$ZEROMPI_TEST_PAUSE_S`` seconds, so
that the test can SIGKILL a rank by PID, from outside, at that moment (as
tests/elastic_script.py does for the driver):

* ``forward:N``: before batch N's forward (1-based), so that at stage 3 the survivors
  see the loss in the forward (the first module's gather, in its forward pre-hook);
* ``backward:N``: between batch N's forward and its backward, so that at stage 3 they
  see it in the backward (the last module's gather, in a tensor hook of its output);
* ``step:N``: in batch N's ``step()``, after its reduction, before its agreement.

Each moment pauses once per process. The model (a float64 MLP) trains ``--steps``
batches; batch ``b``'s global rows are fixed by ``b`` alone and split over however many
ranks there are, so a recovery that goes back to ``lost.step`` and redoes the batches
since must end where an uninterrupted run of the same batches ends: rank 0 (of the
survivors) trains a copy of the model with ``torch.optim.AdamW`` on the whole of every
batch in one process and writes, to the JSON file, the largest difference of any
final parameter to it (relative to that parameter's largest magnitude), the world size
at the end, the recoveries and where in the loop each ``RankLost`` came out
(``forward``, ``backward``, ``step``, ``zero_grad``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

# tests/elastic_script.py's control: the PID file, pause(moment) and the "step:N"
# pause in the agreement (importing it installs them; its driver does not run).
from elastic_script import pause

from zerompi import RankLost
from zerompi.partition import shard_range
from zerompi.torch import shard

ROWS, IN, OUT, LR = 12, 6, 3, 1e-2  # ROWS per global batch: 3 per rank at W = 4, 4 at 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, OUT),
    ).double()


def global_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + index)
    x = torch.randn(ROWS, IN, generator=g, dtype=torch.float64)
    return x, torch.randn(ROWS, OUT, generator=g, dtype=torch.float64)


def train(model: torch.nn.Module, opt, steps: int) -> tuple[int, list[str]]:  # type: ignore[no-untyped-def]
    """The user's loop: back to ``lost.step`` after a lost rank. Returns the batches
    run (redone ones included) and where each RankLost came out."""
    batch, runs, where = 0, 0, []
    while batch < steps:
        phase = "forward"
        try:
            pause(f"forward:{batch + 1}")
            comm = opt.zero.comm  # the survivors' after a recovery
            lo, hi = shard_range(ROWS, comm.size, comm.rank)
            x, y = global_batch(batch)
            loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
            phase = "backward"
            pause(f"backward:{batch + 1}")
            loss.backward()
            phase = "step"
            opt.step()
            phase = "zero_grad"
            opt.zero_grad()
            batch += 1
            runs += 1
        except RankLost as lost:
            where.append(phase)
            if lost.step is None:
                raise
            batch = lost.step
    return runs, where


def reference(steps: int) -> dict[str, torch.Tensor]:
    """An uninterrupted run of the same batches, in one process, with torch's AdamW."""
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for batch in range(steps):
        x, y = global_batch(batch)
        torch.nn.functional.mse_loss(model(x), y).backward()
        adamw.step()
        adamw.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    model, opt = shard(make_model(), stage=args.stage, lr=LR, elastic=True, snapshot_every=1)
    runs, where = train(model, opt, args.steps)
    with opt.full_parameters():
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    comm = opt.zero.comm
    if comm.rank == 0:
        want = reference(args.steps)
        diffs = {n: float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items()}
        results = {
            "world_size": comm.size, "stage": args.stage, "runs": runs, "where": where,
            "step_count": opt.zero.step_count, "recoveries": opt.zero.recoveries,
            "max_rel_diff": max(diffs.values()), "diffs": diffs,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"torch_elastic_script: W={comm.size} stage {args.stage}, RankLost out of "
              f"{where}, max rel diff {results['max_rel_diff']:.3g}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
