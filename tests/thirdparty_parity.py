"""Models someone else wrote, unmodified, through ``zerompi.torch.shard`` at every
stage, against torch's own DDP in the same processes, as a table.

    mpiexec -n W python tests/thirdparty_parity.py [--steps 10] [--models gpt2,llama,bert,nanogpt]

The models are Hugging Face ``transformers`` classes built from a small config with
random weights: GPT-2 (eager attention, tied head, a causal-mask buffer), Llama
(SDPA attention, grouped-query heads, rotary caches as buffers, tied embeddings) and
a BERT-style encoder with its masked-LM head (the decoder's weight tied to the word
embeddings); and, where the package index's ``nano-gpt`` (0.1.0: Allen Porter's
packaging of Karpathy's nanoGPT GPT-2, MIT) is installed, its ``nano_gpt.model.GPT``
(SDPA causal attention, a registered ``bias`` mask buffer, ``wte`` tied to
``lm_head``, called as ``model(x, targets) -> (logits, loss)``; no ``generate()``,
so a greedy loop over its forward stands in). Each trains ``--steps`` steps twice over: with
``torch.nn.parallel.DistributedDataParallel`` on a gloo group of the same ranks and
``torch.optim.AdamW`` (two parameter groups: matrices decay, vectors do not and take
another learning rate), ``clip_grad_norm_`` and a ``StepLR``; and with
``zerompi.torch.shard`` at stages 0, 1, 2, 3 (the node's parameter copy) and 3 with
``shared_memory=False`` (per-module gathers), the same settings. Both start from
rank-dependent initial values (each must take rank 0's), each rank sees its slice of
every global micro-batch, and a step accumulates two ``backward()`` calls (DDP's first
under ``no_sync()``). Afterwards the causal models ``generate()`` greedily on both
sides.

Printed per model and stage: the largest difference of any final parameter relative to
that parameter's largest magnitude, and of any micro-batch's loss relative to DDP's
(max over ranks), in float32; with ``param_dtype=bfloat16`` (zerompi computes with its
rounded copy, DDP stays float32) the loss difference to DDP and to stage 0's bfloat16
losses. Rank 0 ends with one ``RESULT {json}`` line (``tests/test_thirdparty.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers
from mpi4py import MPI

from zerompi.torch import shard
from zerompi.torch.gloo import destroy_gloo, init_gloo

VOCAB, SEQ, ROWS = 97, 12, 2  # ROWS: sequences per rank and micro-batch
LR, LR_VECTORS, WEIGHT_DECAY, MAX_NORM = 3e-3, 1e-3, 0.1, 0.5
#: (name, shard() keywords)
STAGES = (("0", {"stage": 0}), ("1", {"stage": 1}), ("2", {"stage": 2}),
          ("3", {"stage": 3}), ("3 own", {"stage": 3, "shared_memory": False}))  # fmt: skip


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ + 8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ + 8,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=SEQ + 8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0)  # fmt: skip
    return transformers.BertForMaskedLM(config)


def nanogpt() -> torch.nn.Module:
    from nano_gpt.config import GPTConfig
    from nano_gpt.model import GPT

    config = GPTConfig(block_size=SEQ + 8, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32)
    return GPT(config, tokenizer=None)  # (the tokenizer only serves its text sampling)


def hf_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def nanogpt_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())[1]


def hf_generate(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                          max_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip


def greedy(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    """nanoGPT's sampling loop (``nano_gpt.model.sample``) made greedy."""
    x = prompt
    for _ in range(6):
        logits, _ = model(x)
        x = torch.cat((x, logits[:, -1, :].argmax(-1, keepdim=True)), dim=-1)
    return x


Loss = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
Generate = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
#: name -> (builder, the loss of a micro-batch, generation: None for an encoder)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Loss, Generate | None]] = {
    "gpt2": (gpt2, hf_loss, hf_generate), "llama": (llama, hf_loss, hf_generate),
    "bert": (bert, hf_loss, None), "nanogpt": (nanogpt, nanogpt_loss, greedy)}  # fmt: skip


def available() -> list[str]:
    """The models whose packages are installed (``nano-gpt`` is optional)."""
    try:
        import nano_gpt.model  # noqa: F401
    except ImportError:
        return [m for m in MODELS if m != "nanogpt"]
    return list(MODELS)


def make(name: str, rank: int) -> torch.nn.Module:
    """``name``'s model with this rank's own random weights (rank 0's must win)."""
    torch.manual_seed(100 + rank)
    return MODELS[name][0]()


def batch(step: int, micro: int, world: int, rank: int) -> torch.Tensor:
    """This rank's rows of the global micro-batch of token ids."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(1, VOCAB, (world * ROWS, SEQ), generator=g)
    return ids[rank * ROWS : (rank + 1) * ROWS]


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's and HF's two groups: matrices decay; vectors do not, another lr."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2]},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0,
             "lr": LR_VECTORS}]  # fmt: skip


def train(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, world: int,
    rank: int, ddp: torch.nn.Module | None, loss_of: Loss,
) -> list[float]:  # fmt: skip
    """The loop both sides share; this rank's loss of every micro-batch."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    losses = []
    for step in range(steps):
        for micro in range(2):
            ids = batch(step, micro, world, rank)
            quiet = ddp is not None and micro == 0
            with ddp.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[union-attr]
                loss = loss_of(ddp or module, ids)
                loss.backward()
            losses.append(loss.item())
        if ddp is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses


def generated(name: str, model: torch.nn.Module) -> list[list[int]]:
    """Greedy continuation of two fixed prompts ([] for an encoder)."""
    generate = MODELS[name][2]
    if generate is None:
        return []
    with torch.no_grad():
        return generate(model, torch.arange(1, 9).reshape(2, 4)).tolist()


def run_ddp(name: str, comm: MPI.Intracomm, steps: int) -> dict[str, Any]:
    """DDP + AdamW + clip_grad_norm_: final parameters, losses, generated tokens."""
    model = make(name, comm.rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=init_gloo(comm))
    optimizer = torch.optim.AdamW(groups(model), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = train(model, optimizer, steps, comm.size, comm.rank, ddp, MODELS[name][1])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = generated(name, model)
    return {"params": params, "losses": losses, "tokens": tokens}


def run_zerompi(
    name: str, comm: MPI.Intracomm, steps: int, settings: dict[str, Any], dtype: Any
) -> dict[str, Any]:
    """``shard()`` with the same settings: final parameters, losses, generated tokens."""
    model = make(name, comm.rank)
    model, opt = shard(model, comm=comm, lr=LR, weight_decay=WEIGHT_DECAY, max_norm=MAX_NORM,
                       param_groups=groups(model), param_dtype=dtype, **settings)  # fmt: skip
    try:
        losses = train(model, opt, steps, comm.size, comm.rank, None, MODELS[name][1])
        with opt.full_parameters():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        if dtype is None:
            params = {n: torch.from_numpy(v) for n, v in opt.zero.full_params().items()}
        tokens = generated(name, model)
        return {"params": params, "losses": losses, "tokens": tokens}
    finally:
        opt.close()


def _key_bias(name: str, value: torch.Tensor) -> torch.Tensor | None:
    """The elements of an attention *key* bias, or ``None``. Softmax is invariant to
    adding the same number to every score of a query, so the key bias's exact gradient
    is zero: what reaches it is rounding noise, which Adam (``m / sqrt(v)``) scales up
    to full-size steps, different for any two implementations that round one bit
    differently anywhere (DDP against DDP with another bucket order too). Left out of
    the comparison and reported on their own."""
    if name.endswith("attention.self.key.bias"):  # BERT
        return torch.ones_like(value, dtype=torch.bool)
    if name.endswith("attn.c_attn.bias"):  # GPT-2: [query | key | value]
        mask = torch.zeros_like(value, dtype=torch.bool)
        third = value.numel() // 3
        mask[third : 2 * third] = True
        return mask
    return None


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Largest difference of any parameter relative to its largest magnitude, key
    biases left out (:func:`_key_bias`); and of the key biases alone (0.0: none)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    worst, keys = 0.0, 0.0
    for name, w in want.items():
        diff = (got[name].float() - w).abs()
        scale = w.abs().max().clamp_min(1e-30)
        key = _key_bias(name, w)
        if key is not None:
            keys = max(keys, float(diff[key].max() / scale))
            diff = diff[~key]
        if diff.numel():
            worst = max(worst, float(diff.max() / scale))
    return worst, keys


def loss_rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, want, strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default=",".join(available()))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rows: list[dict[str, Any]] = []
    if comm.rank == 0:
        print(f"zerompi.torch.shard vs torch DDP (gloo), W={comm.size}, torch {torch.__version__},"
              f" transformers {transformers.__version__}, {args.steps} steps of 2 backward() "
              "each, AdamW 2 groups, clip 0.5, StepLR", flush=True)  # fmt: skip
        print("| model | stage | dtype | params vs DDP | params vs stage 0 | loss vs DDP "
              "| loss vs stage 0 | generate() = DDP's | key biases vs DDP |\n"
              "|---|---|---|---:|---:|---:|---:|---|---:|", flush=True)  # fmt: skip
    for name in args.models.split(","):
        ref = run_ddp(name, comm, args.steps)
        first: dict[str, dict[str, Any]] = {}
        for dtype in args.dtypes.split(","):
            for stage, settings in STAGES:
                got = run_zerompi(name, comm, args.steps, settings,
                                  None if dtype == "float32" else dtype)  # fmt: skip
                zero = first.setdefault(dtype, got)
                params, keys = relative(got["params"], ref["params"])
                row = {"model": name, "stage": stage, "dtype": dtype,
                       "params": comm.allreduce(params, MPI.MAX),
                       "key_bias": comm.allreduce(keys, MPI.MAX),
                       "params_vs_stage0": comm.allreduce(
                           relative(got["params"], zero["params"])[0], MPI.MAX),
                       "loss": comm.allreduce(loss_rel(got["losses"], ref["losses"]), MPI.MAX),
                       "vs_stage0": comm.allreduce(loss_rel(got["losses"], zero["losses"]),
                                                   MPI.MAX),
                       "generate": comm.allreduce(got["tokens"] == ref["tokens"],
                                                  MPI.LAND)}  # fmt: skip
                rows.append(row)
                if comm.rank == 0:
                    print(f"| {name} | {stage} | {dtype} | {row['params']:.1e} | "
                          f"{row['params_vs_stage0']:.1e} | "
                          f"{row['loss']:.1e} | {row['vs_stage0']:.1e} | "
                          f"{'yes' if row['generate'] else 'NO'} | {row['key_bias']:.1e} |",
                          flush=True)  # fmt: skip
    destroy_gloo()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"world": comm.size, "rows": rows}), flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
