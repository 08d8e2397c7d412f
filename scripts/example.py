"""The README's "Using it" example, runnable as it stands there (tests/test_example.py
checks that the README shows this code and runs it): mpiexec -n 4 python scripts/example.py

A two-layer MLP learns a linear teacher's classes, written in numpy by hand, stage 3
(switch ``stage=`` to 0-2: the same model code runs). Rank 0 prints the loss."""

import numpy as np
from mpi4py import MPI

from zerompi import ZeroOptimizer

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)                         # the same on every rank
params = {"layer0.weight": rng.standard_normal((512, 256), dtype=np.float32) * 0.05,
          "layer0.bias": np.zeros(256, np.float32),
          "layer1.weight": rng.standard_normal((256, 10), dtype=np.float32) * 0.05,
          "layer1.bias": np.zeros(10, np.float32)}
opt = ZeroOptimizer(params, stage=3, lr=3e-3, weight_decay=0.01,
                    decoupled_weight_decay=True)       # AdamW; default comm is COMM_WORLD
layers = ["layer0", "layer1"]                          # groups: the prefix before the last dot
teacher = rng.standard_normal((512, 10), dtype=np.float32)  # the task: argmax(x @ teacher)


def micro_batches(step, count=2, rows=32):
    """This rank's rows of the step's micro-batches (different on every rank)."""
    data = np.random.default_rng([step, comm.rank])
    for _ in range(count):
        x = data.standard_normal((rows, 512), dtype=np.float32)
        yield x, np.argmax(x @ teacher, axis=1)


def forward(name, p, a):                               # ReLU on all but the last layer
    z = a @ p[f"{name}.weight"] + p[f"{name}.bias"]
    return z if name == layers[-1] else np.maximum(z, 0)


def loss_grad(logits, y):                              # softmax cross-entropy, batch mean
    prob = np.exp(logits - logits.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    loss = -np.log(prob[np.arange(len(y)), y]).mean()
    prob[np.arange(len(y)), y] -= 1
    return prob / len(y), loss


def backward(name, p, g, acts, delta):                 # adds this layer's gradients into g
    i = layers.index(name)
    if name != layers[-1]:
        delta = delta * (acts[i + 1] > 0)
    g[f"{name}.weight"] += acts[i].T @ delta
    g[f"{name}.bias"] += delta.sum(axis=0)
    return delta @ p[f"{name}.weight"].T


for step in range(100):
    for x, y in micro_batches(step):                   # this rank's rows of each micro-batch
        acts = [x]
        for name in layers:                            # forward
            with opt.gathered(name) as p:              # stage 3: Allgatherv of this layer only
                acts.append(forward(name, p, acts[-1]))
        delta, loss = loss_grad(acts[-1], y)
        for name in reversed(layers):                  # backward
            with opt.gathered(name) as p, opt.gradients(name) as g:
                delta = backward(name, p, g, acts, delta)   # adds into g[...]
            # leaving opt.gradients: stages 2-3 reduce-scatter the bucket, keep the shard
        opt.accumulate()                               # after every micro-batch, the last too
    opt.step()                                         # Adam on the shard (+ Allgatherv in 1-2)
    if step % 20 == 0 or step == 99:
        loss = comm.allreduce(loss) / comm.size        # the last micro-batch's, over ranks
        if comm.rank == 0:
            print(f"step {step:3d}  loss {loss:.4f}")
opt.close()
