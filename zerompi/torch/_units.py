"""Stage 3 for torch modules: a parameter's full value exists only while a module that
uses it runs its forward or its backward (FSDP2's scheme; zerompi's buckets are the
units: at stage 3 a bucket is the parameters one module registers, of one dtype).

Each bucket has one flat torch tensor of its size, in ``param_dtype``. While the
bucket is *resident* its parameters' data are views into that tensor; otherwise a
parameter's data is an empty tensor, so reading it between steps gives a 0-element
tensor, never freed memory. Releasing resizes the flat tensor's storage to 0
(the memory goes back); gathering resizes it again and fills it with ``Allgatherv``
(:meth:`zerompi.ZeroOptimizer.gather_into`). The storage *object* stays the same, so
views that autograd saved in the forward (``weight.t()``) read the re-gathered values
in the backward: FSDP2's storage handling.

When, on every rank alike (torch runs the same hooks in the same order everywhere):

* a forward pre-hook on every module that registers a trainable parameter (a tied
  one: on each module that registers it) gathers its parameters' buckets; its forward
  hook releases them and, with grad enabled, hooks the outputs, so the first gradient
  that reaches one gathers them again before the module's backward (pre-backward);
* a parameter's post-accumulate-grad hook hands its gradient to zerompi (a bucket is
  reduce-scattered when complete) and releases the bucket once each of its parameters
  has its gradient of this backward;
* the end of every backward (an autograd engine callback) releases what is still
  resident for it (a parameter that got no gradient);
* ``step()``, ``load()`` release everything first (the shards change).

Prefetch: the first step records the order in which buckets are gathered (forward,
then backward); from the next step on, as a bucket's gather completes, the gather of
the one that came next in that order is started (nonblocking, into its own storage,
if it has at least :data:`zerompi.prefetch.PREFETCH_MIN_ELEMS` elements), so it moves
while the module computes; the module hooks let MPI progress it. At most two gathers
are in flight (the one waited for and the one ahead). A gather that departs from the
order completes the one in flight (every rank started it) and frees it, and
prefetching stops for the rest of that step; each step's order is the next one's, so
a changed order is learned again. A bucket whose release comes right before the
order's next gather of it (the forward's last module, where the backward begins; the
first module after the backward of an accumulated micro-batch) is kept instead, one
at most, and freed if the order departs. Values are the same either way, only the
overlap and the number of gathers change.

Holds are counted: a bucket that two running modules use (a parent's parameter read
while a child runs, a tied weight) is released by the last of them.

A model may also read a parameter outside the forward of the module that registers it
(``logits = h @ self.embed.weight.t()`` in the top module's forward, a parent passing
its child's weight to ``F.linear``). While the top module's forward runs, a torch
function mode (``_Borrow``) sees every torch call; one that is given a released
parameter gathers its bucket first (every rank runs the same forward, so every rank
gathers the same bucket at the same point) and holds it until the top forward ends,
then, with grad enabled, through the backward like a module's own (its saved tensors
read the storage there). So the value is always the full one, never an empty tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..prefetch import PREFETCH_MIN_ELEMS
from ._tensors import storage_array, to_numpy, torch_dtype


class Units:
    """The resident/released state of every stage-3 bucket of ``zero`` and the hooks
    that drive it (``named``: the trainable parameters by their zerompi names)."""

    def __init__(
        self, zero: Any, model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]],
        hand_over: Callable[[str], Callable[[torch.nn.Parameter], None]],
    ) -> None:  # fmt: skip
        self.zero = zero
        self.named = named
        self.prefetched = 0  # gathers served by a prefetch (tests, reports)
        self.reused = 0  # gathers saved by keeping a bucket the order needed next
        self.gathers = 0  # storages filled by a gather, prefetches included (reports)
        #: Counts :meth:`rebind` calls: a block entered before one leaves its holds alone.
        self.generation = 0
        #: Storages of gathers a recovery abandoned in flight (MPI may still own them).
        self.abandoned: list[torch.Tensor] = []
        self.quiet = False  # re-binding: torch calls are not reads of the model's
        self._bind()
        for name, param in named:
            param.register_post_accumulate_grad_hook(self._after_grad(name, hand_over(name)))
        self._borrow = _Borrow(self)
        self._depth = 0  # top forwards running (a model may call itself)
        self._hook_modules(model)
        model.register_forward_pre_hook(self._enter_top, prepend=True)
        model.register_forward_hook(self._exit_top, always_call=True)

    def _bind(self) -> None:
        """Per engine: one flat storage per bucket, the parameters' views of it, and
        every bucket released, nothing learned (at construction and :meth:`rebind`)."""
        zero, layout = self.zero, self.zero.layout
        count = len(layout.buckets)
        #: what the hooks' bucket indices stand for (a recovery must keep it)
        self.buckets = [(b.dtype, b.start, b.stop, b.names) for b in layout.buckets]
        self.dtypes = [zero.engine.precisions[b.dtype].param for b in layout.buckets]
        self.flats = [torch.empty(b.size, dtype=torch_dtype(d))
                      for b, d in zip(layout.buckets, self.dtypes, strict=True)]  # fmt: skip
        #: per bucket: (parameter, its full view of the flat tensor, its empty stand-in)
        self.members: list[list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(count)
        ]
        self.bucket_of: dict[torch.nn.Parameter, int] = {}
        specs = {spec.name: spec for spec in layout.params}
        with torch.no_grad():
            for name, param in self.named:
                index = layout.bucket_of[name]
                spec, flat = specs[name], self.flats[index]
                lo = spec.offset - layout.buckets[index].start
                view = flat[lo : lo + spec.size].view(spec.shape)
                self.members[index].append((param, view, flat.new_empty(0)))
                self.bucket_of[param] = index
                param.grad = None
        self.holds = [0] * count  # forward holds
        self.backward = [False] * count  # resident for the backward running now
        self.pending = [0] * count  # gradients still to come in this backward
        self.resident = [False] * count
        self._callback_queued = False
        self.borrowed: list[int] = []  # buckets gathered for a read outside their modules
        # prefetch: the gathers in flight, the order learned, this step's order so far
        self.worth = [b.size >= PREFETCH_MIN_ELEMS for b in layout.buckets]
        self.ahead: dict[int, Any] = {}
        self.order: list[int] = []
        self.seen: list[int] = []
        self.following = False  # this step has kept to the order so far
        self.kept = -1  # a bucket not freed because the order gathers it next, or -1
        #: freed bucket memory kept for the next gathers (at most the largest two)
        self.spares = Spares(2 * max((f.numel() * f.element_size() for f in self.flats),
                                     default=0))  # fmt: skip
        for flat in self.flats:
            flat.untyped_storage().resize_(0)
        for index in range(count):
            self._stand_in(index)

    def rebind(self) -> None:
        """After a recovery (``zero`` runs on the survivors' engine): new storages for
        the same buckets, every one released (the next forward gathers from the new
        shards), holds and the learned prefetch order dropped. A gather in flight
        belonged to the old world: its storage is kept (:attr:`abandoned`), never
        freed under MPI. A forward the loss interrupted still ends through
        ``_exit_top`` (``always_call``), which only leaves the borrow mode."""
        fresh = [(b.dtype, b.start, b.stop, b.names) for b in self.zero.layout.buckets]
        if fresh != self.buckets:
            raise RuntimeError("zerompi.torch: the survivors' stage-3 buckets differ from "
                               "the ones the module's hooks were registered for")  # fmt: skip
        self.abandoned.extend(self.flats[index] for index in self.ahead)
        self.quiet = True
        try:
            for index, flat in enumerate(self.flats):
                storage = flat.untyped_storage()
                if index not in self.ahead and storage.resizable():
                    storage.resize_(0)
            self._bind()
        finally:
            self.quiet = False
        self.generation += 1

    # -- residency ---------------------------------------------------------------

    def _allocate(self, index: int) -> np.ndarray:
        self.gathers += 1
        flat = self.flats[index]
        self.spares.fill(flat.untyped_storage(), flat.numel() * flat.element_size())
        return storage_array(flat, self.dtypes[index])

    def _gather(self, index: int) -> None:
        if self.resident[index]:
            if index == self.kept:  # kept for this very gather: it counts as one
                self.kept = -1
                self.reused += 1
                self._prefetch_after(index)
            return
        pending = self.ahead.pop(index, None)
        if pending is not None:
            with self.zero.engine.timings.gather:
                pending.wait()
            self.prefetched += 1
        else:
            if self.ahead:  # the order changed: complete what every rank started
                self._depart()
            self.zero.gather_into(index, self._allocate(index))
        self.resident[index] = True
        for param, view, _ in self.members[index]:
            param.data = view
        self._prefetch_after(index)

    def _prefetch_after(self, index: int) -> None:
        """Bucket ``index`` was just gathered: if that is the order's next gather,
        start the one after it (every rank decides alike: same calls, same order)."""
        at = len(self.seen)
        self.seen.append(index)
        if not self.following:
            return
        order = self.order
        if at >= len(order) or order[at] != index:
            self._depart()
            return
        if at + 1 < len(order):
            upcoming = order[at + 1]
            idle = not self.resident[upcoming] and upcoming not in self.ahead
            if self.worth[upcoming] and idle:
                out = self._allocate(upcoming)
                self.ahead[upcoming] = self.zero.start_gather_into(upcoming, out)

    def _drain(self) -> None:
        """Complete the gathers in flight and free their storages (unused: the order
        departed from the learned one); no more prefetch in this step."""
        self.following = False
        for index, pending in self.ahead.items():
            pending.wait()
            self.spares.empty(self.flats[index].untyped_storage())
        self.ahead.clear()

    def _depart(self) -> None:
        """The order departed from the learned one: no more prefetch in this step, and
        the bucket kept for a gather that will not come is freed."""
        self._drain()
        kept, self.kept = self.kept, -1
        if kept >= 0:
            self._release(kept)

    def _next_in_order(self) -> int:
        """The bucket the learned order gathers next (-1: none, or not following)."""
        at = len(self.seen)
        return self.order[at] if self.following and at < len(self.order) else -1

    def _progress(self) -> None:
        if self.ahead:
            self.zero.comm.progress(list(self.ahead.values()))

    def _stand_in(self, index: int) -> None:
        for param, _, empty in self.members[index]:
            param.data = empty

    def _release(self, index: int, keep: bool = True) -> None:
        """Free bucket ``index`` if nothing holds it; unless (``keep``) the learned
        order gathers it next (the last module of the forward, which the backward
        starts with; the first one after an accumulation's backward): then it stays,
        one bucket at most, and that gather costs nothing."""
        if self.resident[index] and self.holds[index] == 0 and not self.backward[index]:
            if keep and self.kept < 0 and index == self._next_in_order():
                self.kept = index
                return
            self._stand_in(index)
            storage = self.flats[index].untyped_storage()
            if not storage.resizable():
                shapes = [tuple(p.shape) for p, _, _ in self.members[index]]
                raise RuntimeError(
                    f"stage 3 cannot free the storage of parameters {shapes}: something "
                    "called .numpy() on one of them while it was gathered (torch then "
                    "never lets that storage be resized); copy first: .clone().numpy()"
                )
            self.spares.empty(storage)
            self.resident[index] = False

    def release_all(self) -> None:
        """Before the shards change (``step()``, ``load()``): nothing stays gathered.
        A module still running (a step inside a forward) is an error."""
        if any(self.holds):
            raise RuntimeError("optimizer.step()/load() inside a module's forward")
        self._drain()
        self.order, self.seen = self.seen, []  # this step's order is the next one's
        self.following = bool(self.order)
        self.backward = [False] * len(self.backward)
        self._callback_queued = False  # (a backward that raised never ran it)
        self.kept = -1
        for index in range(len(self.flats)):
            self._release(index, keep=False)

    def gathered_all(self) -> None:
        """Collective: every bucket resident (``ShardedOptimizer.full_parameters``)."""
        for index in range(len(self.flats)):
            self.holds[index] += 1
            self._gather(index)

    def released_all(self) -> None:
        for index in range(len(self.flats)):
            self.holds[index] -= 1
            self._release(index, keep=False)

    # -- reads outside a module's own forward -------------------------------------

    def borrow(self, index: int) -> None:
        """Collective: gather bucket ``index`` for a read outside the forward of the
        modules that register it, held until the top forward ends."""
        self.holds[index] += 1
        self.borrowed.append(index)
        self._gather(index)

    def _enter_top(self, module: torch.nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth == 1:
            self._borrow.__enter__()

    def _exit_top(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._borrow.__exit__(None, None, None)
        borrowed, self.borrowed = self.borrowed, []
        grad = torch.is_grad_enabled()
        for index in borrowed:
            self.holds[index] -= 1
            if grad and not self.backward[index]:  # its saved tensors are read there
                self.backward[index] = True
                self.pending[index] = len(self.members[index])
            self._release(index)

    # -- hooks ---------------------------------------------------------------------

    def _hook_modules(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            buckets = sorted({self.bucket_of[p] for p in module._parameters.values()
                              if p is not None and p in self.bucket_of})  # fmt: skip
            if buckets:
                module.register_forward_pre_hook(self._pre_forward(buckets))
                module.register_forward_hook(self._post_forward(buckets))

    def _pre_forward(self, buckets: list[int]) -> Callable[..., None]:
        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            self._progress()
            for index in buckets:
                self.holds[index] += 1
                self._gather(index)

        return pre_forward

    def _post_forward(self, buckets: list[int]) -> Callable[..., None]:
        def post_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
            for index in buckets:
                self.holds[index] -= 1
                self._release(index)
            if torch.is_grad_enabled():
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(self._pre_backward(buckets))

        return post_forward

    def _pre_backward(self, buckets: list[int]) -> Callable[[torch.Tensor], None]:
        def pre_backward(grad: torch.Tensor) -> None:
            self._progress()
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            for index in buckets:
                if not self.backward[index]:
                    self.backward[index] = True
                    self.pending[index] = len(self.members[index])
                self._gather(index)

        return pre_backward

    def _after_grad(
        self, name: str, hand_over: Callable[[torch.nn.Parameter], None]
    ) -> Callable[[torch.nn.Parameter], None]:
        def after_grad(param: torch.nn.Parameter) -> None:
            hand_over(param)
            index = self.bucket_of[param]
            if self.backward[index]:
                self.pending[index] -= 1
                if self.pending[index] <= 0:
                    self.backward[index] = False
                    self._release(index)

        return after_grad

    def _end_backward(self) -> None:
        self._callback_queued = False
        for index, waiting in enumerate(self.backward):
            if waiting:
                self.backward[index] = False
                self._release(index)


class Spares:
    """The memory of released buckets, kept for the next gathers instead of going
    back to the C library (at most ``limit`` bytes; the oldest go first).

    A bucket's gather needs a fresh storage of its size every time a module runs. Got
    from ``malloc`` and freed after use, one of several MiB comes from ``mmap`` or a
    heap top that ``free`` trims, so every gather also faults in and zeroes every page
    again: on the whole-step bench's GPT at 64M (W = 2) the step with spares took
    0.90 of the time it takes without them, with 39,694 page faults per step
    against 66,156 (``scripts/prefetch_ab.py --toggle spares``). FSDP2 on a GPU has
    the CUDA caching allocator for this; here a storage of the released bucket hands
    its memory over to a spare one
    (``UntypedStorage._swap_data_ptr_``: the bucket's storage object stays, empty, so
    tensors autograd saved from it read the next gather), and the next gather of a
    bucket no larger takes it back. A spare serves buckets of half its size up (no
    big spare pinned under a small bucket). Where this torch has no
    ``_swap_data_ptr_`` nothing is kept: storages are resized as before.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit if hasattr(torch.UntypedStorage, "_swap_data_ptr_") else 0
        self.kept: list[torch.UntypedStorage] = []  # oldest first
        self.served = 0  # fills given a spare's memory (tests, reports)

    @property
    def nbytes(self) -> int:
        """Bytes kept now."""
        return sum(s.nbytes() for s in self.kept)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give empty ``storage`` ``nbytes`` of memory: the smallest spare that holds
        them (and is at most twice as large), else new memory."""
        fits = [s for s in self.kept if nbytes <= s.nbytes() <= 2 * nbytes]
        if not fits:
            storage.resize_(nbytes)
            return
        spare = min(fits, key=lambda s: s.nbytes())
        self.kept.remove(spare)
        storage._swap_data_ptr_(spare)
        self.served += 1

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory (it is left with 0 bytes) and keep it, dropping
        the oldest spares beyond :attr:`limit`."""
        if not self.limit or storage.nbytes() > self.limit:
            storage.resize_(0)
            return
        spare = torch.UntypedStorage(0)
        storage._swap_data_ptr_(spare)
        self.kept.append(spare)
        while self.nbytes > self.limit:
            self.kept.pop(0)

    def clear(self) -> None:
        """Drop every spare (the memory goes back to the C library)."""
        self.kept.clear()


class _Borrow(TorchFunctionMode):
    """Active while the top module's forward runs: a torch call given a released
    parameter of ``units`` (as an argument, or in a list/tuple argument) gathers its
    bucket first (:meth:`Units.borrow`)."""

    def __init__(self, units: Units) -> None:
        super().__init__()
        self.units = units

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        units = self.units
        if units.quiet:
            return func(*args, **kwargs)
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.nn.Parameter):
                    index = units.bucket_of.get(item)
                    if index is not None and not units.resident[index]:
                        units.borrow(index)
        return func(*args, **kwargs)


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []


class GradientHooks:
    """Hooks that add each parameter's gradient into zerompi's buffer as autograd
    computes it (stages 2-3, and any stage with ``param_dtype``/``reduce_dtype``):
    cast to ``reduce_dtype``, torch's copy dropped. Where zerompi holds 16-bit
    gradients in full buffers (stages 0-1) each backward ends with a fold
    (:meth:`zerompi.ZeroOptimizer.fold`), so backward calls are summed in float32."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        engine = zero.engine
        #: Stages 0-1: gradients go into the full buffers (``zero.grads``).
        self.full_grads = engine.plan.full_grads
        self.fold = self.full_grads and any(p.low_grads for p in engine.precisions.values())
        self._queued = False

    def __call__(self, name: str) -> Callable[[torch.nn.Parameter], None]:
        zero, full_grads = self.zero, self.full_grads

        def hand_over(param: torch.nn.Parameter) -> None:
            grad = to_numpy(param.grad)
            if full_grads:
                dst = zero.grads[name]
                np.add(dst, grad, out=dst)
                if self.fold and not self._queued:
                    self._queued = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._folded)
            else:  # one pass: copied where the staging region is fresh
                zero.add_gradients({name: grad})
            param.grad = None  # torch's copy is folded in

        return hand_over

    def reset(self) -> None:
        """A step or ``zero_grad()``: a fold queued by a backward that raised (and so
        never ran its callback) must not keep the next ones from being queued."""
        self._queued = False

    def _folded(self) -> None:
        self._queued = False
        self.zero.fold()
