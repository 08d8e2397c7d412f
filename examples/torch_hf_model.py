"""A Hugging Face ``transformers`` model trained through ``zerompi.torch.shard`` with
the plain torch loop, then saved as full weights that ``from_pretrained`` reads.

    mpiexec -n 4 python examples/torch_hf_model.py --stage 3 --save out/llama
    srun --mpi=pmi2 -n 4 python examples/torch_hf_model.py --stage 3 --save out/llama

(or, from a batch script: ``ZEROMPI_PROGRAM=examples/torch_hf_model.py sbatch
slurm/driver_single_node.sbatch --stage 3``). The model is a small ``LlamaForCausalLM``
with random weights (``--model gpt2`` for GPT-2), unmodified: ``shard()`` makes its
parameters views of zerompi's buffers and the ordinary loop runs as it is (forward,
``loss.backward()``, ``optimizer.step()``, ``zero_grad()``), here with AdamW over two
parameter groups, gradient clipping and a warm-up schedule. The data: random token
runs written twice, so the second half can be predicted from the first; each rank
draws its own rows of every global batch. Rank 0 prints the loss (mean over ranks).

At stage 3 a parameter is whole only while the module that uses it runs; the save
reads them inside ``optimizer.full_parameters()`` (every rank takes part, rank 0
writes), so the files hold the trained weights, never empty tensors.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
import transformers
from mpi4py import MPI

from zerompi.torch import shard


def build(name: str, vocab: int, seq: int) -> torch.nn.Module:
    """A small random-weight model of the ``transformers`` library."""
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=vocab,
                                         n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=344,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=seq,
                                      tie_word_embeddings=True)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batch(step: int, rank: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """This rank's rows of the global batch: a random half written twice."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    half = torch.randint(1, vocab, (rows, seq // 2), generator=g)
    return torch.cat([half, half], dim=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--no-shared-memory", action="store_true",
                   help="stage 3: gather each module's parameters (no node copy)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--rows", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--save", help="write the trained model here (save_pretrained)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)

    torch.manual_seed(0)  # shard() takes rank 0's initial values anyway
    model = build(args.model, args.vocab, args.seq)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    model, optimizer = shard(model, stage=args.stage, lr=3e-3, weight_decay=0.1,
                             max_norm=1.0, param_groups=groups,
                             shared_memory=False if args.no_shared_memory else None)  # fmt: skip
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    for step in range(args.steps):
        ids = batch(step, comm.rank, args.rows, args.seq, args.vocab)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        mean = comm.allreduce(loss.item()) / comm.size
        if comm.rank == 0 and (step % args.every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean:.4f}", flush=True)
    if args.save:
        with optimizer.full_parameters():  # collective: whole parameters on every rank
            if comm.rank == 0:
                model.save_pretrained(args.save)  # safetensors, the tied head once
        if comm.rank == 0:
            print(f"saved {args.save}", flush=True)
    optimizer.close()


if __name__ == "__main__":
    main()
