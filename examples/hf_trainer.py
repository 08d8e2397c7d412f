"""Train a small GPT-2 with the Hugging Face ``Trainer`` on zerompi's ZeRO stages.

Every process is one rank: the ``Trainer`` runs as usual on each, zerompi slices the
training data by rank, shards the model and the AdamW state, reduces the gradients
over MPI and clips their global norm; ``save_model`` writes full weights from rank 0
and the checkpoints resume at any number of ranks. ::

    mpiexec -n 2 python examples/hf_trainer.py                  # 2 ranks, stage 2
    mpiexec -n 4 python examples/hf_trainer.py --stage 3
    srun --ntasks=8 --cpus-per-task=4 python examples/hf_trainer.py --stage 3
    mpiexec -n 3 python examples/hf_trainer.py --resume          # from the last checkpoint

(``srun`` needs Slurm's PMI plugin for your MPI, e.g. ``srun --mpi=pmi2``.) The model
has random weights and the data are random tokens, so that it runs offline; replace
``build_model`` and ``build_dataset`` with ``from_pretrained`` and your tokenized
data. It prints one ``RESULT {json}`` line on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zerompi import ZeroConfig
from zerompi.hf import ZeroMPITrainer


class RandomTokens(torch.utils.data.Dataset):
    """``size`` sequences of ``length`` random tokens, each its own label (the model
    shifts the labels)."""

    def __init__(self, size: int, length: int, vocab: int, seed: int) -> None:
        self.tokens = torch.randint(0, vocab, (size, length),
                                    generator=torch.Generator().manual_seed(seed))  # fmt: skip

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def build_model() -> GPT2LMHeadModel:
    """A small GPT-2 with random weights (every rank builds it; rank 0's values win)."""
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=64)
    return GPT2LMHeadModel(config)


def build_dataset(size: int = 256, seed: int = 0) -> RandomTokens:
    return RandomTokens(size=size, length=32, vocab=512, seed=seed)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, default=2, help="zerompi's ZeRO stage (0-3)")
    parser.add_argument("--max-steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--output-dir", default="hf_trainer_out", help="checkpoints and model")
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    return parser.parse_args()


def main() -> None:
    options = parse()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args = TrainingArguments(
        output_dir=options.output_dir,
        use_cpu=True,                      # zerompi trains CPU models
        per_device_train_batch_size=4,     # per rank: the global batch is 4 x ranks x 2
        gradient_accumulation_steps=2,
        max_steps=options.max_steps,
        learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0,
        lr_scheduler_type="cosine", warmup_steps=max(1, options.max_steps // 10),
        logging_steps=max(1, options.max_steps // 4),
        save_strategy="steps", save_steps=max(1, options.max_steps // 2), save_total_limit=2,
        report_to="none", disable_tqdm=True,
    )  # fmt: skip
    trainer = ZeroMPITrainer(
        model=build_model(), args=args, train_dataset=build_dataset(),
        eval_dataset=build_dataset(size=32, seed=1),  # every rank evaluates all of it
        zero_config=ZeroConfig(), stage=options.stage,  # or zero_config=ZeroConfig(stage=3, ...)
    )  # fmt: skip
    output = trainer.train(resume_from_checkpoint=True if options.resume else None)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(options.output_dir, "final"))  # full weights, any stage
    if trainer.is_world_process_zero():
        print("RESULT " + json.dumps({"ranks": trainer.comm.size, "steps": output.global_step,
                                      "loss": output.training_loss,
                                      "eval_loss": metrics["eval_loss"]}), flush=True)  # fmt: skip
    trainer.close()


if __name__ == "__main__":
    main()
