"""Side by side: one whole GPT training step under zerompi and under torch's own
data-parallel trainers.

    python -m zerompi.bench --model gpt [--sizes 16e6,64e6] [--ranks 2] [--json PATH]

Not under mpiexec: for every model size and setup this command launches
``mpiexec -n RANKS python -m zerompi.bench.gpt --setup S --size P ...`` (a worker), so
each setup runs in processes of its own and the peak resident set size a rank reports
(``ru_maxrss``) is that setup's alone. The setups, all AdamW (lr 3e-4, weight decay
0.1, one parameter group) on the same :class:`zerompi.torch.gpt.GPT`, the same initial
values and the same per-rank batches, one thread per rank:

* ``zerompi-1``, ``zerompi-2``, ``zerompi-3``: :func:`zerompi.torch.shard` at that
  stage (a ``NotImplementedError`` raised by every rank, from zerompi or a peer, is
  reported "unsupported" with its message);
  ``zerompi-3s``: stage 3 with ``shared_memory=False``, so each module's parameters
  are gathered before its forward and backward and freed after (on one node stage 3
  otherwise reads the node's one shared copy);
* ``ddp``: ``DistributedDataParallel`` (gloo, ``gradient_as_bucket_view=True``) and
  ``torch.optim.AdamW(fused=True)`` (``foreach`` where fused is refused);
* ``zero-redundancy``: the same DDP and ``ZeroRedundancyOptimizer`` over AdamW;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then the root, on
  a CPU device mesh over gloo, and AdamW over its sharded parameters.

``--arch llama`` times a Hugging Face ``transformers`` ``LlamaForCausalLM`` instead
(random weights; :func:`llama_model`: the same width, blocks and vocabulary, a SwiGLU
MLP of ``8/3`` the width, SDPA attention, tied embeddings; FSDP2 shards each decoder
layer): a model zerompi did not write, as users bring it.

The model of about P parameters is :func:`gpt_config`'s (4 blocks, the width that
holds 80% of P, the vocabulary the rest: 16M is width 512 and 6,556 tokens, 64M width
1024 and 13,230); each rank's batch is ``--rows`` sequences of ``--seq`` tokens
(default one of 64: on one core a 64M step is then about half a second of forward
and backward, mostly reading the weights, which more tokens would barely change).

torch's groups come from :func:`zerompi.torch.gloo.init_gloo`. A step is the
forward, the backward, ``optimizer.step()`` and ``zero_grad()``, from an MPI barrier
to its end; ``step_ms`` is the slowest rank's median over the timed steps (after the
warm-up steps; ``forward_backward_ms`` the same up to the end of ``backward()``,
which at stages 2-3, DDP and FSDP2 includes the reductions started by the backward's
hooks), ``vs_best_torch`` the ratio to the fastest torch setup of that size,
and ``rss_mib`` the largest peak RSS over the ranks (``rss_floor_mib``: the same
before the model was built; every setup builds the whole model before it shards it,
so the peak includes one full copy of the parameters). ``pss_end_mib``: the largest
proportional set size after the timed steps, which counts a page shared by the
node's ranks (zerompi's one parameter copy per node at stages 1-2) once per node,
not once per rank as RSS does (``rss_end_mib``). A setup that fails, hangs
(``--timeout``) or is refused is a row with its status and reason; the others still
run. ``--rounds R`` runs every setup R times, alternated (each round starts one setup
later in the list), and a row is its setup's median run (``rounds_step_ms``: all R),
so the ratios are not the luck of one launch on a busy machine. Rank 0 of a worker
writes its row as JSON; this command prints a markdown table and writes every row
(``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..children import end, process_group
from ..runtime import (
    HelpFormatter,
    Parser,
    clock,
    count,
    current_rss_bytes,
    max_rss_bytes,
    minor_faults,
    non_negative,
    positive,
    pss_bytes,
    write_json,
)

TORCH_SETUPS = ("ddp", "zero-redundancy", "fsdp2")
DEEPSPEED_SETUPS = ("deepspeed-1", "deepspeed-2", "deepspeed-3", "deepspeed-2c")
#: The peers a ratio is taken against: torch's setups and DeepSpeed's.
PEER_SETUPS = (*TORCH_SETUPS, *DEEPSPEED_SETUPS)
SETUPS = ("zerompi-1", "zerompi-2", "zerompi-3", "zerompi-3s", *PEER_SETUPS)
DEFAULT_SIZES = (16_000_000, 64_000_000)
LR, WEIGHT_DECAY, LAYERS = 3e-4, 0.1, 4
#: How far (relative) a setup's last loss may be from DDP's: the same training, to
#: rounding (the order of a reduction's sums differs between setups).
LOSS_RTOL = 1e-4
MIB = 2**20
#: What a worker prints before it aborts, for the launcher to report.
FAILED = "zerompi.bench.gpt: failed on rank"
#: Variables a launcher sets in its ranks: this command must not run under one.
_LAUNCHED = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def gpt_config(params: int, seq: int) -> dict[str, int]:
    """A GPT of about ``params`` parameters: ``LAYERS`` blocks of the widest ``dim``
    (a multiple of 32, heads of 64) holding at most 80% of them, the vocabulary
    making up the rest (the embedding, tied to the head)."""
    from ..torch.gpt import parameter_count

    dim = 32
    while LAYERS * (12 * (dim + 32) ** 2 + 13 * (dim + 32)) <= 0.8 * params:
        dim += 32
    rest = params - parameter_count(0, seq, dim, LAYERS)
    vocab = max(64, round(rest / dim))
    return {"vocab": vocab, "seq": seq, "dim": dim, "layers": LAYERS, "heads": max(1, dim // 64)}


ARCHS = ("gpt", "llama")


def llama_model(cfg: dict[str, int]) -> Any:
    """A ``transformers`` Llama of :func:`gpt_config`'s size (random weights)."""
    import transformers

    dim = cfg["dim"]
    config = transformers.LlamaConfig(
        hidden_size=dim, intermediate_size=32 * round(8 * dim / 3 / 32),
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"], vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq"], tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def make_model(arch: str, cfg: dict[str, int]) -> Any:
    """The network ``--arch`` names, built from ``cfg``."""
    if arch == "llama":
        return llama_model(cfg)
    from ..torch.gpt import GPT

    return GPT(**cfg)


def blocks(model: Any) -> Any:
    """The repeated blocks FSDP2 shards one by one."""
    inner = getattr(model, "model", None)
    return inner.layers if inner is not None else model.blocks


def logits(output: Any) -> Any:
    """A ``transformers`` output's logits, or the tensor a plain module returns."""
    return getattr(output, "logits", output)


# -- the worker: one setup, under mpiexec -----------------------------------------


def _adamw(params: Any) -> tuple[Any, str]:
    """torch's AdamW, fused where torch accepts it on these parameters."""
    import torch

    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True), "foreach"


class DeepSpeedSteps:
    """DeepSpeed's engine as the bench's optimizer: its ``backward`` (the engine reduces
    and partitions the gradients there, so the loop calls it instead of the loss's)
    and its ``step`` (the optimizer's step, then the gradients zeroed)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def backward(self, loss: Any) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        """Nothing: ``step`` zeroed them."""


def backward(opt: Any, loss: Any) -> None:
    """The setup's backward of ``loss``: DeepSpeed's engine's, else the loss's own."""
    if isinstance(opt, DeepSpeedSteps):
        opt.backward(loss)
    else:
        loss.backward()


def deepspeed_setup(setup: str, model: Any, rows: int, comm: Any) -> tuple[Any, Any, str]:
    """``deepspeed-S`` (ZeRO stage S, torch's AdamW as the client optimizer) or
    ``deepspeed-2c`` (stage 2 with ``DeepSpeedCPUAdam``, compiled on first use) on
    DeepSpeed's CPU accelerator over the gloo group already made. Gradient clipping
    off (DeepSpeed clips at 1.0 unless told), no loss scaling (float32): the same
    training as the other setups. ``ModuleNotFoundError`` without deepspeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (read when deepspeed is imported)
    # What DeepSpeed reads of a launcher's environment (torchrun's names): the group
    # itself is torch's, made over MPI already.
    hosts = comm.allgather(socket.gethostname())
    os.environ.update(RANK=str(comm.rank), WORLD_SIZE=str(comm.size),
                      LOCAL_RANK=str(hosts[: comm.rank].count(hosts[comm.rank])))  # fmt: skip
    try:
        import deepspeed
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"deepspeed is not installed ({exc}): DS_BUILD_OPS=0 pip install "
            "--no-build-isolation deepspeed (after torch)"
        ) from None
    deepspeed.init_distributed(dist_backend="gloo")  # (finds torch's group made)
    mode = setup.rsplit("-", 1)[1]
    stage = int(mode[0])
    if mode.endswith("c"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                               adamw_mode=True)  # fmt: skip
        impl = "DeepSpeedCPUAdam"
    else:
        opt, impl = _adamw(model.parameters())
        impl = f"torch {impl}"
    config = {
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
    }  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    what = (f"DeepSpeed {deepspeed.__version__} ZeRO stage {stage} (CPU accelerator, gloo), "
            f"AdamW {impl}")  # fmt: skip
    return engine, DeepSpeedSteps(engine), what


def build(
    setup: str, model: Any, comm: Any, timeout: float, rows: int = 1
) -> tuple[Any, Any, str]:
    """Collective: ``(module to call, optimizer, what it is)`` for ``setup``
    (``rows``: sequences per rank and step, which DeepSpeed's config states).
    ``NotImplementedError`` where zerompi refuses the stage, ``ModuleNotFoundError``
    where the setup's package is not installed."""
    import torch

    if setup.startswith("zerompi-"):
        from ..torch import shard

        mode = setup.rsplit("-", 1)[1]  # "3s": stage 3 without the node's parameter copy
        stage, shared = int(mode[0]), (False if mode.endswith("s") else None)
        model, opt = shard(model, stage=stage, lr=LR, weight_decay=WEIGHT_DECAY, comm=comm.mpi,
                           shared_memory=shared)  # fmt: skip
        extra = ", shared_memory=False" if shared is False else ""
        return model, opt, f"zerompi.torch.shard(stage={stage}{extra}), AdamW"
    from ..torch.gloo import init_gloo

    init_gloo(comm.mpi, timeout=timeout)
    if setup.startswith("deepspeed-"):
        return deepspeed_setup(setup, model, rows, comm)
    if setup == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (comm.size,))
        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt, impl = _adamw(model.parameters())
        return model, opt, f"fully_shard per block and root (gloo, CPU), AdamW {impl}"
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if setup == "ddp":
        opt, impl = _adamw(model.parameters())
        return ddp, opt, f"DistributedDataParallel (gloo), AdamW {impl}"
    if setup != "zero-redundancy":
        raise ValueError(f"unknown setup {setup!r}")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    kwargs = {"optimizer_class": torch.optim.AdamW, "lr": LR, "weight_decay": WEIGHT_DECAY}
    try:
        opt, impl = ZeroRedundancyOptimizer(model.parameters(), fused=True, **kwargs), "fused"
    except (RuntimeError, TypeError, ValueError):
        opt, impl = ZeroRedundancyOptimizer(model.parameters(), foreach=True, **kwargs), "foreach"
    return ddp, opt, f"DistributedDataParallel + ZeroRedundancyOptimizer (gloo), AdamW {impl}"


def timed_step(comm: Any, module: Any, opt: Any, step: int, cfg: dict[str, int]) -> dict[str, Any]:
    """Collective over ``comm`` (a :class:`zerompi.mpi.collectives.Comm`): one
    training step of the bench's model on batch ``step`` (this rank's row), from a
    barrier to its end: forward, the loss, backward, ``step()``, ``zero_grad()``.
    Returns the slowest rank's ``seconds``, this rank's minor page ``faults`` in it
    and the ``loss`` (the scripts that alternate two settings in one run share it)."""
    import torch.nn.functional as F

    from ..torch.gpt import batch

    vocab = cfg["vocab"]
    data = batch(step, comm.rank, 1, cfg["seq"], vocab)
    comm.barrier()
    faults = minor_faults()
    start = clock()
    out = logits(module(data[:, :-1]))
    loss = F.cross_entropy(out.reshape(-1, vocab), data[:, 1:].reshape(-1))
    backward(opt, loss)
    opt.step()
    opt.zero_grad()
    seconds = comm.max(clock() - start)
    return {"seconds": seconds, "faults": minor_faults() - faults, "loss": float(loss.item())}


def _refusal(comm: Any, error: BaseException | None) -> dict[str, Any] | None:
    """Collective: ``None`` when every rank built its setup, else the row's status."""
    reasons = comm.allgather(None if error is None else (
        isinstance(error, NotImplementedError), f"{type(error).__name__}: {error}"))  # fmt: skip
    failed = [(r, x) for r, x in enumerate(reasons) if x is not None]
    if not failed:
        return None
    unsupported = len(failed) == comm.size and all(x[0] for _, x in failed)
    if unsupported:
        return {"status": "unsupported", "reason": failed[0][1][1]}
    if len(failed) == comm.size and all(x[1].startswith("ModuleNotFoundError") for _, x in failed):
        reason = failed[0][1][1].partition(": ")[2]  # (not installed here: no class name)
        return {"status": "skipped", "reason": reason}
    return {"status": "failed", "reason": "; ".join(f"rank {r}: {x[1]}" for r, x in failed)}


def measure(args: argparse.Namespace, comm: Any) -> dict[str, Any]:
    """Collective: build ``args.setup`` and time its steps; the row (every rank)."""
    import torch
    import torch.nn.functional as F

    from ..torch.gpt import batch

    torch.set_num_threads(1)
    cfg = gpt_config(args.size, args.seq)
    floor = max_rss_bytes()
    torch.manual_seed(0)
    model = make_model(args.arch, cfg)
    row: dict[str, Any] = {"setup": args.setup, "size": args.size, "ranks": comm.size,
                           "arch": args.arch, "params": sum(p.numel() for p in
                                                            model.parameters()),
                           "config": cfg, "rows_per_rank": args.rows}  # fmt: skip
    error: BaseException | None = None
    try:
        module, opt, what = build(args.setup, model, comm, args.gloo_timeout, args.rows)
    except Exception as exc:  # reported, collectively, as the setup's row
        error = exc
    refused = _refusal(comm, error)
    if refused is not None:
        return {**row, **refused}
    times, passes, vocab = [], [], cfg["vocab"]
    for i in range(args.warmup + args.steps):
        data = batch(i, comm.rank, args.rows, cfg["seq"], vocab)
        comm.barrier()
        start = clock()
        out = logits(module(data[:, :-1]))
        loss = F.cross_entropy(out.reshape(-1, vocab), data[:, 1:].reshape(-1))
        backward(opt, loss)
        middle = clock()
        opt.step()
        opt.zero_grad()
        if i >= args.warmup:
            times.append(clock() - start)
            passes.append(middle - start)
    mine = (1e3 * statistics.median(times), max_rss_bytes() / MIB, floor / MIB,
            float(loss.item()), current_rss_bytes() / MIB, pss_bytes() / MIB,
            1e3 * statistics.median(passes))  # fmt: skip
    every = comm.allgather(mine)
    if hasattr(opt, "close"):
        opt.close()
    return {
        **row, "status": "ok", "reason": None, "what": what,
        "step_ms": max(e[0] for e in every), "step_ms_per_rank": [e[0] for e in every],
        "rss_mib": max(e[1] for e in every), "rss_mib_per_rank": [e[1] for e in every],
        "rss_floor_mib": max(e[2] for e in every), "last_loss": every[0][3],
        "rss_end_mib": max(e[4] for e in every), "pss_end_mib": max(e[5] for e in every),
        "forward_backward_ms": max(e[6] for e in every),
        "torch_version": str(torch.__version__), "threads": torch.get_num_threads(),
    }  # fmt: skip


def worker(args: argparse.Namespace) -> int:
    """One setup under mpiexec; rank 0 writes the row to ``args.out``. An error in
    a step (possibly on one rank) is printed with :data:`FAILED` and ends the job."""
    from ..mpi.collectives import Comm

    comm = Comm(None, timeout=0)
    try:
        row = measure(args, comm)
    except Exception as exc:
        sys.stderr.write(f"{FAILED} {comm.rank}: {type(exc).__name__}: {exc}\n"
                         f"{traceback.format_exc()}")  # fmt: skip
        sys.stderr.flush()
        time.sleep(0.5)  # let the launcher forward it before the kill
        comm.abort(1)
    if comm.rank == 0:
        write_json(args.out, row)
    comm.barrier()
    from ..torch.gloo import destroy_gloo

    destroy_gloo()
    return 0


# -- the launcher: every setup, each in its own mpiexec ---------------------------


def mpiexec() -> str:
    """The launcher that goes with this Python's mpi4py: ``$MPIEXEC``, else the one
    beside this Python (the MPICH wheel's), else the first on ``PATH``."""
    beside = Path(sysconfig.get_path("scripts")) / "mpiexec"
    found = os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else None)
    found = found or shutil.which("mpiexec")
    if not found:
        raise SystemExit("zerompi.bench --model gpt: no mpiexec (set MPIEXEC)")
    return found


def _reason(out: str, code: int | None) -> str:
    """Why a worker failed, from its output: its own :data:`FAILED` line, else
    zerompi's abort hook's, else the last lines."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for marker in (FAILED, "zerompi: rank"):
        found = [ln[ln.index(marker):] for ln in lines if marker in ln]
        if found:
            return found[0]
    tail = " | ".join(lines[-3:])
    return f"exit status {code}" + (f": {tail}" if tail else "")


def launch(setup: str, size: int, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    """Run one setup in ``mpiexec -n args.ranks`` and return its row; a failure, a
    timeout or a missing row is a row with ``status`` ``"failed"``."""
    out = os.path.join(folder, f"{setup}-{size}.json")
    cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "zerompi.bench.gpt",
           "--setup", setup, "--size", str(size), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seq", str(args.seq), "--rows", str(args.rows),
           "--gloo-timeout", str(args.gloo_timeout), "--arch", args.arch,
           "--out", out]  # fmt: skip
    # The workers import the zerompi this command runs, wherever they start.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))  # fmt: skip
    row = {"setup": setup, "size": size, "ranks": args.ranks, "arch": args.arch,
           "command": " ".join(cmd)}  # fmt: skip
    start = time.perf_counter()
    # In a group of its own, ended with this launcher (zerompi.children: a timeout's
    # SIGTERM or a Ctrl-C here ends mpiexec, its proxies and every rank too).
    with process_group(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True) as proc:  # fmt: skip
        try:
            text, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            end(proc, grace=0)  # mpiexec, its proxies and every rank
            proc.communicate()
            return {**row, "status": "failed", "reason": f"timed out after {args.timeout:g} s"}
    row["seconds"] = time.perf_counter() - start
    if proc.returncode != 0 or not os.path.exists(out):
        return {**row, "status": "failed", "reason": _reason(text, proc.returncode)}
    with open(out) as f:
        return {**row, **json.load(f)}


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One setup's row from its ``--rounds`` runs (each a row): the run whose step
    time is the median (the lower middle of an even count), with ``rounds_step_ms``
    every run's step time and ``rss_mib`` the largest peak of them; the first run
    that did not succeed instead, where one did not (with the round it was)."""
    for at, run in enumerate(runs):
        if run.get("status") != "ok":
            return {**run, "reason": f"round {at + 1} of {len(runs)}: {run.get('reason')}"}
    ordered = sorted(runs, key=lambda r: r["step_ms"])
    middle = ordered[(len(ordered) - 1) // 2]
    return {**middle, "rounds_step_ms": [r["step_ms"] for r in runs],
            "rss_mib": max(r["rss_mib"] for r in runs)}  # fmt: skip


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_best_torch``: each measured row's step time over the fastest torch setup
    of the same size; ``vs_best_peer``: over the fastest torch or DeepSpeed setup
    (``None`` when no such setup of that size ran)."""
    for row in rows:
        for key, peers in (("vs_best_torch", TORCH_SETUPS), ("vs_best_peer", PEER_SETUPS)):
            best = [r["step_ms"] for r in rows if r["size"] == row["size"]
                    and r["setup"] in peers and r.get("status") == "ok"]  # fmt: skip
            ok = row.get("status") == "ok" and best
            row[key] = row["step_ms"] / min(best) if ok else None
        ddp = [r for r in rows if r["size"] == row["size"] and r["setup"] == "ddp"
               and r.get("status") == "ok"]  # fmt: skip
        known = ddp and row.get("status") == "ok" and "last_loss" in row
        row["loss_vs_ddp"] = (abs(row["last_loss"] - ddp[0]["last_loss"]) / abs(ddp[0]["last_loss"])
                              if known else None)  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| params | setup | step ms | of which forward + backward | vs best torch | "
             "vs best torch or DeepSpeed | peak RSS MiB/rank | PSS at end MiB/rank | status |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        params = f"{r.get('params', r['size']):,}"
        if r.get("arch", "gpt") != "gpt":
            params += f" ({r['arch']})"
        if r.get("status") == "ok":
            ratios = [f"{r[k]:.2f}" if r.get(k) is not None else "-"
                      for k in ("vs_best_torch", "vs_best_peer")]  # fmt: skip
            status = "ok"
            if (r.get("loss_vs_ddp") or 0) > LOSS_RTOL:  # (the same training: the same loss)
                status = f"ok, but its last loss is {r['loss_vs_ddp']:.1e} (relative) from ddp's"
            cells = [f"{r['step_ms']:.0f}", f"{r['forward_backward_ms']:.0f}", *ratios,
                     f"{r['rss_mib']:.0f}", f"{r['pss_end_mib']:.0f}", status]  # fmt: skip
        else:
            cells = ["-"] * 6 + [f"{r['status']}: {r['reason']}"]
        lines.append(f"| {params} | {r['setup']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser(rank: int = 0) -> argparse.ArgumentParser:
    """Options of the launcher and (``--setup``, ``--out``) of a worker; messages
    from ``rank`` 0 only."""
    p = Parser(
        rank=rank,
        prog="python -m zerompi.bench --model gpt",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Run it without mpiexec: it launches 'mpiexec -n RANKS' for every setup "
        "and size ($MPIEXEC, else the mpiexec beside this Python, else PATH's).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="comma-separated model sizes in parameters (1.6e7 notation)")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help=f"comma-separated setups, of {', '.join(SETUPS)}")
    p.add_argument("--ranks", type=positive, default=2, help="ranks per setup")
    p.add_argument("--steps", type=positive, default=10, help="timed steps")
    p.add_argument("--rounds", type=positive, default=1,
                   help="runs of every setup, alternated (round r starts r setups later in "
                        "the list); a row is its setup's median run, so a machine's drift "
                        "or a burst of other load moves every setup alike")
    p.add_argument("--warmup", type=non_negative, default=2, help="untimed steps before")
    p.add_argument("--seq", type=positive, default=64, help="tokens per sequence")
    p.add_argument("--rows", type=positive, default=1, help="sequences per rank and step")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one setup may take before it is killed (a failed row)")
    p.add_argument("--gloo-timeout", type=float, default=120.0,
                   help="seconds torch.distributed waits for a peer")
    p.add_argument("--arch", choices=ARCHS, default="gpt",
                   help="the network: zerompi.torch.gpt.GPT, or a transformers Llama")
    p.add_argument("--json", metavar="PATH", help="write every row to PATH")
    p.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # a worker
    p.add_argument("--size", type=count, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The launcher (or, with ``--setup``, a worker). Exit status 0 when every row
    was written, whatever the setups' statuses; 2 for a usage error."""
    launched = [os.environ[k] for k in _LAUNCHED if k in os.environ]
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    parser = build_parser(rank)
    args = parser.parse_args(argv)
    if args.setup is not None:
        return worker(args)
    if launched:
        parser.error("run this without mpiexec: it launches 'mpiexec -n RANKS' itself for "
                     "every setup (--ranks, default 2)")  # fmt: skip
    sizes = [count(s) for s in args.sizes.split(",") if s.strip()]
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown or not sizes or not setups:
        parser.error(f"unknown setups {unknown}" if unknown else "no size or no setup")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zerompi-gpt-") as folder:
        for size in sizes:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in setups}
            for r in range(args.rounds):
                for setup in setups[r % len(setups):] + setups[: r % len(setups)]:
                    row = launch(setup, size, args, folder)
                    ok = row.get("status") == "ok"
                    shown = (f"{row['step_ms']:.0f} ms, {row['rss_mib']:.0f} MiB" if ok
                             else f"{row['status']}: {row['reason']}")  # fmt: skip
                    print(f"zerompi.bench gpt: {args.arch}, {size:,} params, {setup}: "
                          f"{shown}", flush=True)  # fmt: skip
                    runs[setup].append(row)
            rows.extend(merge_rounds(runs[s]) for s in setups)
    add_ratios(rows)
    print(table(rows), flush=True)
    if args.json:
        write_json(args.json, {"arch": args.arch, "ranks": args.ranks, "steps": args.steps,
                               "warmup": args.warmup, "rounds": args.rounds,
                               "seq": args.seq, "rows_per_rank": args.rows,
                               "argv": list(sys.argv[1:] if argv is None else argv),
                               "rows": rows})  # fmt: skip
        print(f"zerompi.bench gpt: wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
