"""A Hugging Face GPT-2 (random weights, tiny config) through zerompi and back, run by
``tests/test_hf.py`` under ``mpiexec -n 2``: its ``save_pretrained`` safetensors
loaded into the sharded model (``load_safetensors``), three steps at each stage given,
zerompi's checkpoint exported with ``python -m zerompi.checkpoint export
--safetensors`` and read back by ``GPT2LMHeadModel.from_pretrained``. Prints one
``RESULT {json}`` line per stage on rank 0 (one launch for all: importing
transformers on every rank is most of a launch's time).

    mpiexec -n 2 python tests/hf_script.py DIR STAGE:SHARED [STAGE:SHARED ...]

(``SHARED``: 1 or 0, the ``shared_memory`` asked for.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # before transformers is imported
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from mpi4py import MPI
from transformers import GPT2Config, GPT2LMHeadModel

from zerompi.torch import shard

comm = MPI.COMM_WORLD
root = sys.argv[1]
torch.set_num_threads(1)
config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=16,
                    bos_token_id=0, eos_token_id=0)  # fmt: skip

torch.manual_seed(1)
source = GPT2LMHeadModel(config)
if comm.rank == 0:
    source.save_pretrained(f"{root}/source")  # safetensors, the tied head left out
comm.barrier()


def run(stage: int, shared: bool, out: str) -> None:
    """One stage: in, three steps, out, read back; rank 0 prints its RESULT line."""
    if comm.rank == 0:
        os.makedirs(out)
    torch.manual_seed(0)
    model, optimizer = shard(GPT2LMHeadModel(config), stage=stage, lr=1e-2, shared_memory=shared)
    optimizer.load_safetensors(f"{root}/source")
    with optimizer.full_parameters():
        loaded = max((p - dict(source.named_parameters())[n]).abs().max().item()
                     for n, p in model.named_parameters())  # fmt: skip

    losses = []
    for step in range(3):
        seed = step * comm.size + comm.rank  # this rank's part of the global batch
        idx = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(seed))
        loss = model(input_ids=idx, labels=idx).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(comm.allreduce(loss.item()) / comm.size)
    optimizer.save(f"{out}/run.zmpi")
    with optimizer.full_parameters():
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.close()

    if comm.rank == 0:
        config.save_pretrained(f"{out}/export")
        subprocess.run([sys.executable, "-m", "zerompi.checkpoint", "export", f"{out}/run.zmpi",
                        "--safetensors", f"{out}/export"], check=True)  # fmt: skip
        back = GPT2LMHeadModel.from_pretrained(f"{out}/export")
        named = dict(back.named_parameters())
        print("RESULT " + json.dumps({
            "stage": stage, "shared": shared,
            "loaded_diff": loaded,
            "exported_diff": max((named[n] - p).abs().max().item() for n, p in trained.items()),
            "names_match": sorted(named) == sorted(trained),
            "tied": back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr(),
            "losses": losses,
        }), flush=True)


for spec in sys.argv[2:]:
    stage, shared = spec.split(":")
    run(int(stage), shared == "1", f"{root}/stage{stage}-{shared}")
