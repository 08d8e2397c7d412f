"""What surviving a lost rank costs and saves (README "Surviving a lost rank"); run it
through ``scripts/elastic_measure`` (Open MPI's venv, ``mpiexec --with-ft ulfm``).

1. The snapshot's cost per step: the driver at W = 2 without ``--elastic`` (with and
   without node shared memory, which ``--elastic`` turns off) and with
   ``--snapshot-every`` 100, 10 and 1, in alternating rounds; mean and median train
   step (the snapshot's work lands on one step in K, so the mean is the figure).
2. A lost rank survived against a restart from the newest checkpoint on disk, same run:
   W = 2, ``--snapshot-every 10 --save-every 50``, rank 1 SIGKILLed in batch 73. The
   survivor's recovery seconds and the batches it redoes (from the snapshot) against
   what a restart costs: launching a W = 1 job that loads the newest checkpoint (50)
   and takes one step (the launch, MPI start, imports, model, load), and the batches
   it redoes.
3. The 4 -> 3 -> 2 run (ranks killed in batches 13 and 27) against an uninterrupted
   W = 4 run: the loss of every batch.

Prints one table per part. Kills go through tests/elastic_script.py's pauses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zerompi.children import process_group

ROOT = Path(__file__).resolve().parent.parent
GROUPS = contextlib.ExitStack()  # every launched group, ended (if still running) at the end
SCRIPT = ROOT / "tests" / "elastic_script.py"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def launch(tmp: Path, ranks: int, args: list[str], pauses: str = "", ft: bool = True,
           program: list[str] | None = None) -> tuple[subprocess.Popen, Path, Path]:  # fmt: skip
    control = Path(tempfile.mkdtemp(dir=tmp))
    out = control / "out.json"
    env = dict(os.environ, ZEROMPI_TEST_CONTROL=str(control), ZEROMPI_TEST_PAUSE=pauses)
    ulfm = ["--with-ft", "ulfm"] if ft else []
    cmd = [MPIEXEC, *ulfm, "--oversubscribe", "-n", str(ranks),
           sys.executable, *(program or [str(SCRIPT)]), *args, "--json", str(out)]  # fmt: skip
    # A group of its own, ended with this script (zerompi.children: a timeout's
    # SIGTERM or a Ctrl-C ends mpiexec and every rank too); left open until main's end.
    proc = GROUPS.enter_context(process_group(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return proc, control, out


def finish(proc: subprocess.Popen, out: Path) -> dict:
    text, _ = proc.communicate(timeout=900)
    if not out.exists():
        sys.exit(f"elastic_measure: no results (exit {proc.returncode}):\n{text[-3000:]}")
    return json.loads(out.read_text())


def marker(control: Path, moment: str, ranks: int) -> dict[int, int]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        found = {int(p.name.rpartition(".")[2]): int(p.read_text() or 0)
                 for p in control.glob(f"{moment}.*")}  # fmt: skip
        if len(found) >= ranks and all(found.values()):
            return found
        time.sleep(0.02)
    sys.exit(f"elastic_measure: nobody reached {moment}")


def snapshot_cost(tmp: Path, model: list[str], steps: int, rounds: int) -> None:
    setups = {"no --elastic": [], "same, no shm": ["--no-shared-memory"],
              "K = 100": ["--elastic", "--snapshot-every", "100"],
              "K = 10": ["--elastic", "--snapshot-every", "10"],
              "K = 1": ["--elastic", "--snapshot-every", "1"]}  # fmt: skip
    means: dict[str, list[float]] = {k: [] for k in setups}
    medians: dict[str, list[float]] = {k: [] for k in setups}
    info: dict = {}
    for _ in range(rounds):
        for name, extra in setups.items():
            proc, _, out = launch(tmp, 2, [*model, "--steps", str(steps), *extra])
            r = finish(proc, out)
            means[name].append(1e3 * r["train_wall_s"] / r["steps_run"])
            medians[name].append(r["train_step_ms"])
            info[name] = r
    base = statistics.median(means["same, no shm"])  # elastic's data path: no shared memory
    r = info["K = 1"]
    print(f"\n1. snapshot cost per step: W = 2, {r['params']:,} params ({r['dtype']}), "
          f"stage {r['stage']}, {steps} steps x {rounds} rounds (median of the rounds)")
    print(f"   snapshot buffers per rank: {r['memory_bytes']['snapshots'] / 2**20:.1f} MiB; "
          f"optimizer without them: "
          f"{(sum(r['memory_bytes'].values()) - r['memory_bytes']['snapshots']) / 2**20:.1f} MiB")
    print("   (ratio: to 'same, no shm', the data path --elastic uses; 'no --elastic' uses "
          "node shared memory, which --elastic turns off)")
    print(f"   {'setup':<14}{'mean step ms':>14}{'ratio':>8}{'median ms':>11}"
          f"{'snapshot B/step':>17}")
    for name in setups:
        mean = statistics.median(means[name])
        sent = info[name]["comm_bytes"].get("snapshot", 0)
        print(f"   {name:<14}{mean:>14.2f}{mean / base:>8.3f}"
              f"{statistics.median(medians[name]):>11.2f}{sent:>17,.0f}")


def recovery_vs_restart(tmp: Path, model: list[str]) -> None:
    prefix = tmp / "ck"
    args = [*model, "--steps", "100", "--elastic", "--snapshot-every", "10",
            "--save", str(prefix), "--save-every", "50", "--keep", "5"]  # fmt: skip
    proc, control, out = launch(tmp, 2, args, pauses="step:73", program=[str(SCRIPT)])
    os.kill(marker(control, "step:73", 2)[1], signal.SIGKILL)
    r = finish(proc, out)
    (rec,) = r["recoveries"]
    step_s = r["train_step_ms"] / 1e3  # at W = 1, after the loss
    t0 = time.monotonic()
    done = subprocess.run(
        [MPIEXEC, "-n", "1", sys.executable, "-m", "zerompi.driver", *model, "--steps", "51",
         "--resume", f"{prefix}.00000050"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    relaunch = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(f"elastic_measure: the restart failed:\n{done.stdout[-2000:]}"
                 f"{done.stderr[-2000:]}")
    lost_elastic = 72 - rec["step"]  # batches 1-72 were done when batch 73 failed
    lost_disk = 72 - 50
    print(f"\n2. a lost rank: W = 2 -> 1, {r['params']:,} params, rank 1 SIGKILLed in batch 73, "
          f"snapshots every 10, checkpoints every 50; a step at W = 1: {1e3 * step_s:.1f} ms")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in rec["phases"].items())
    print(f"   recovery phases (s): {phases}")
    print(f"   {'':<34}{'to go on (s)':>13}{'batches redone':>16}{'total (s)':>11}")
    print(f"   {'in-memory snapshot (--elastic)':<34}{rec['seconds']:>13.3f}{lost_elastic:>16}"
          f"{rec['seconds'] + lost_elastic * step_s:>11.2f}")
    print(f"   {'restart from checkpoint 50':<34}{relaunch:>13.3f}{lost_disk:>16}"
          f"{relaunch + lost_disk * step_s:>11.2f}")
    print("   (the restart's launch is measured on this idle machine; a real one also waits "
          "for the scheduler and reads the checkpoint from a shared file system)")


def loss_curves(tmp: Path) -> None:
    model = ["--steps", "40", "--batch", "64", "--hidden", "32", "--in-dim", "16",
             "--stage", "1", "--verify"]  # fmt: skip
    proc, control, out = launch(tmp, 4, [*model, "--elastic", "--snapshot-every", "5"],
                                pauses="step:13,step:27")  # fmt: skip
    os.kill(marker(control, "step:13", 4)[3], signal.SIGKILL)
    os.kill(marker(control, "step:27", 3)[0], signal.SIGKILL)
    lost = finish(proc, out)
    proc, _, out = launch(tmp, 4, model, ft=False, program=["-m", "zerompi.driver"])
    plain = finish(proc, out)
    print("\n3. 4 -> 3 -> 2 (ranks killed in batches 13 and 27, snapshots every 5) against an "
          "uninterrupted W = 4 run, loss per batch:")
    recs = [(x["step"], x["world_size_before"], x["world_size_after"]) for x in lost["recoveries"]]
    ok = "OK" if lost["verify_ok"] else "FAILED"
    print(f"   recoveries (batch, W before, W after): {recs}; verify {ok} (max_rel_diff "
          f"{lost['max_rel_diff']:.2e}); uninterrupted verify "
          f"{'OK' if plain['verify_ok'] else 'FAILED'}")
    diffs = [abs(a - b) for a, b in zip(lost["losses"], plain["losses"], strict=True)]
    for start in range(0, 40, 10):
        row = "  ".join(f"{lost['losses'][i]:.4f}/{plain['losses'][i]:.4f}"
                        for i in range(start, start + 10, 3))  # fmt: skip
        print(f"   batches {start + 1:>2}-{start + 10:<2} (every 3rd, lost/plain): {row}")
    print(f"   largest difference over the 40 batches: {max(diffs):.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--in-dim", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--parts", default="1,2,3")
    a = p.parse_args()
    model = ["--hidden", str(a.hidden), "--depth", str(a.depth), "--in-dim", str(a.in_dim),
             "--stage", str(a.stage), "--batch", "256", "--log-every", "1000",
             "--blas-threads", "1"]  # fmt: skip
    with GROUPS, tempfile.TemporaryDirectory() as tmp:
        parts = set(a.parts.split(","))
        if "1" in parts:
            snapshot_cost(Path(tmp), model, a.steps, a.rounds)
        if "2" in parts:
            recovery_vs_restart(Path(tmp), model)
        if "3" in parts:
            loss_curves(Path(tmp))


if __name__ == "__main__":
    main()
