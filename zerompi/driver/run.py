"""One driver run: BLAS threads and RSS floor, training, ``--verify``, the summary
rank 0 prints and the JSON it writes."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ..mpi.collectives import Comm
from ..runtime import (
    blas_threads,
    clock,
    current_rss_bytes,
    format_bytes,
    max_rss_bytes,
    pss_bytes,
    write_json,
)
from . import training
from .verify import failure_message, verify

if TYPE_CHECKING:
    from ..optimizer import ZeroOptimizer


def run(args: argparse.Namespace, comm: Comm, rss_floor: int | None = None) -> int:
    """Train, summarise, optionally verify and write JSON. Returns the exit status.
    ``rss_floor``: this rank's peak RSS before the model was built (default: now)."""
    with blas_threads(args.blas_threads, comm.size) as threads:
        training.warm_up(comm, args)
        if rss_floor is None:
            rss_floor = current_rss_bytes()
        pss_floor = pss_bytes()
        wall = clock()
        opt, results = training.train(args, comm)
        comm = opt.comm  # --elastic: after a lost rank, the survivors' communicator
        results["shared_memory"] = opt.shared_memory
        # What a node holds, counting node-shared pages once: the largest over nodes
        # of the sum over its ranks of their proportional set sizes, now and before.
        node = opt.nodes.node
        results["node_pss_bytes"] = int(comm.max(node.sum(pss_bytes())))
        results["node_pss_floor_bytes"] = int(comm.max(node.sum(pss_floor)))
        results["train_wall_s"] = comm.max(clock() - wall)
        results["rss_floor_bytes"] = int(comm.max(rss_floor))
        results["rss_peak_bytes"] = int(comm.max(max_rss_bytes()))  # before --verify
        results["blas_threads"] = threads
        return finish(args, opt, results)


def finish(args: argparse.Namespace, opt: ZeroOptimizer, results: dict[str, Any]) -> int:
    """Verify (optionally), print the summary, write the JSON; the exit status."""
    comm = opt.comm
    status = 0
    check = None
    if args.verify:
        check = verify(args, opt, results["grad_norms"], results["first_step"])
        results["max_abs_diff"] = check["max_abs_diff"]
        results["max_rel_diff"] = check["max_rel_diff"]
        results["verify_tolerance"] = check["tolerance"]
        results["grad_norm_rel_diff"] = check["grad_norm_rel_diff"]
        results["grad_norm_tolerance"] = check["grad_norm_tolerance"]
        results["verify_ok"] = check["ok"]
        status = 0 if check["ok"] else 1
    opt.close()  # collective: releases the shared-memory segments, if any
    if comm.rank == 0:
        print(summary(results, check), flush=True)
        if check is not None and not check["ok"]:
            print(failure_message(check, results["dtype"]), file=sys.stderr, flush=True)
        if args.json:
            write_json(args.json, results)
    return status


def summary(r: dict[str, Any], check: dict[str, Any] | None) -> str:
    """The summary rank 0 prints: what ran, loss, timings, traffic, memory, verdict.
    Counts the steps this process ran (a resumed run starts at ``first_step``)."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in r["phase_ms"].items())
    memory = ", ".join(f"{k} {format_bytes(v)}" for k, v in r["memory_bytes"].items())
    total = format_bytes(sum(r["memory_bytes"].values()))
    traffic = ", ".join(f"{k} {format_bytes(v)}" for k, v in r["comm_bytes"].items() if v)
    span = (
        f"steps {r['first_step'] + 1}-{r['steps']}, resumed at step {r['first_step']}"
        if r["first_step"]
        else f"step {r['steps']} reached"
    )
    lines = [
        f"summary: {r['params']:,} params ({precision_words(r)}), world size {r['world_size']}, "
        f"stage {r['stage']}, {r['buckets']} bucket(s), batch {r['batch']} in "
        f"{r['micro_batches']} micro-batch(es)",
        f"  loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} over {r['steps_run']} steps "
        f"({span}; {r['train_wall_s']:.2f} s)",
        f"  median step {r['step_ms']:.3f} ms (accumulate + step), train step "
        f"{r['train_step_ms']:.3f} ms (with forward/backward)",
        f"  median phase ms: {phases}",
        f"  sent per step and rank (mean over ranks): "
        f"{format_bytes(sum(r['comm_bytes'].values()))} ({traffic or 'nothing'}); "
        f"textbook {format_bytes(r['comm_bytes_theory'])} for one micro-batch; "
        f"between nodes {format_bytes(sum(r['comm_bytes_between_nodes'].values()))} "
        f"({r['nodes'][0]} node(s) of {r['nodes'][1]} rank(s), node shared memory "
        f"{'on' if r.get('shared_memory') else 'off'})",
        f"  optimizer memory per rank (max over ranks): {total}: {memory}",
        f"  peak RSS per rank (max over ranks): {format_bytes(r['rss_peak_bytes'])}, of "
        f"which {format_bytes(r['rss_floor_bytes'])} before the model was built",
        f"  MPI: {r['mpi_library']}; Adam kernel: {r['adam_kernel']}",
    ]
    if check is not None:
        verdict = "OK" if check["ok"] else "FAILED"
        lines.append(
            f"  verify {verdict}: max_abs_diff {check['max_abs_diff']:.3e}, max_rel_diff "
            f"{check['max_rel_diff']:.3e} (tolerance {check['tolerance']:g}), grad norm "
            f"rel diff {check['grad_norm_rel_diff']:.3e} (tolerance "
            f"{check['grad_norm_tolerance']:g}; reference {check['reference_s']:.2f} s)"
        )
    return "\n".join(lines)


def precision_words(r: dict) -> str:
    """``float32``, or ``float32 master, bfloat16 params, float16 gradients, loss scale
    65536 -> 512`` with mixed precision."""
    if (r["param_dtype"], r["reduce_dtype"]) == (r["dtype"], r["dtype"]):
        return r["dtype"]
    words = f"{r['dtype']} master, {r['param_dtype']} params, {r['reduce_dtype']} gradients"
    scales = r["loss_scales"]
    if scales and (scales[0] != 1.0 or scales[-1] != 1.0):
        words += f", loss scale {scales[0]:g} -> {scales[-1]:g}"
    return words
