"""zerompi for PyTorch CPU models: ``model, optimizer = shard(model, stage=S, lr=...)``.

After :func:`shard` the ordinary torch loop runs unchanged under ``mpiexec``:
``loss.backward()`` (several times to accumulate), ``optimizer.step()``,
``optimizer.zero_grad()``, with torch DDP + ``torch.optim.AdamW`` semantics
(gradients summed over backward calls, averaged over ranks; ``Adam`` with an L2
term when ``decoupled_weight_decay=False``). The module's parameters become views
of zerompi's flat buffers (``torch.from_numpy``: no copy), and gradients land in
zerompi's buffers: at stages 0-1 ``.grad`` *is* the buffer (autograd adds into it in
place), at stages 2-3 a post-accumulate-grad hook hands each gradient over as it
is computed, so a bucket's reduction starts during the backward, as with the numpy
API. Stage 3 (without a node copy) gathers a module's parameters into a storage of
its own before its forward and its backward and frees it after (FSDP2's storage
handling). ``param_dtype=torch.bfloat16`` computes with zerompi's rounded copy and
keeps the float32 master and reduction. torch is an optional extra (``pip install
-e ".[torch]"``): ``import zerompi`` never imports it; this package does.

Modules: :mod:`._shard` (validation, zero-copy parameters, routing), :mod:`._units`
(stage 3's per-bucket storages and the hooks that gather and free them; the gradient
hand-over hooks), :mod:`._tensors` (numpy <-> torch for every dtype, resizable
storages) and :mod:`._optim` (the ``torch.optim.Optimizer`` over a
:class:`zerompi.ZeroOptimizer`).
"""

from ._optim import ShardedOptimizer
from ._shard import TORCH_DEFAULTS, shard

__all__ = ["TORCH_DEFAULTS", "ShardedOptimizer", "shard"]
