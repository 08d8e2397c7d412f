"""zerompi for PyTorch CPU models: ``model, optimizer = shard(model, stage=S, lr=...)``.

After :func:`shard` the ordinary torch loop runs unchanged under ``mpiexec``:
``loss.backward()`` (several times to accumulate), ``optimizer.step()``,
``optimizer.zero_grad()``, with torch DDP + ``torch.optim.AdamW`` semantics
(gradients summed over backward calls, averaged over ranks; ``Adam`` with an L2
term when ``decoupled_weight_decay=False``). The module's parameters become views
of zerompi's flat buffers (``torch.from_numpy``: no copy), and gradients land in
zerompi's buffers: at stages 0-1 ``.grad`` *is* the buffer (autograd adds into it in
place), at stage 2 a post-accumulate-grad hook hands each gradient over as it is
computed, so a bucket's reduction starts during the backward, as with the numpy
API. torch is an optional extra (``pip install -e ".[torch]"``): ``import zerompi``
never imports it; this package does.

Modules: :mod:`._shard` (validation, zero-copy parameters, hooks) and
:mod:`._optim` (the ``torch.optim.Optimizer`` over a :class:`zerompi.ZeroOptimizer`).
"""

from ._optim import ShardedOptimizer
from ._shard import shard

__all__ = ["ShardedOptimizer", "shard"]
