"""Where the model reads its parameters: one access strategy per engine, chosen from
the plan (:class:`zerompi.plan.Access`), and the blocks it hands out.

* :class:`Resident` (stages 0-2): every rank holds every parameter; ``opt.params``
  and ``opt.gathered`` are persistent views of them.
* :class:`NodeCopy` (stage 3 on one node with node memory): the node's one copy is
  read in place, one layer at a time, recorded in the step's fingerprint as the
  gather it replaces (so ranks that read different layers fail the step alike on one
  node or many).
* :class:`Gathered` (stage 3): ``opt.gathered`` gathers the layer's bucket into one of
  zerompi's gather buffers (:mod:`zerompi.prefetch`: the next one started ahead).
* :class:`CallerGathers` (stage 3 without gather buffers): the caller gathers into
  its own memory with ``opt.gather_into`` (the torch adapter).

Per call the cost is O(1) in the size of the model: name lookups (:class:`Names`)
and the views handed out are made once per bucket. The gradient side (``opt.grads``,
``opt.gradients``) is :mod:`zerompi.reducer`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import FlatArrays

if TYPE_CHECKING:
    from .mpi.collectives import Comm
    from .partition import Layout
    from .prefetch import LayerGather
    from .timings import Phase

#: ``ZEROMPI_DEBUG=1``: fill a stage-3 gather buffer with NaN when its block ends, so
#: an array kept past its ``gathered`` block shows NaN instead of the next layer.
DEBUG = os.environ.get("ZEROMPI_DEBUG", "") not in ("", "0")

#: A lookup's result: the bucket of some names (-1 if they span several), their
#: parameter names, and whether they are all of the bucket's parameters.
Found = tuple[int, list[str], bool]


class Block:
    """What ``with opt.gathered(...)`` / ``with opt.gradients(...)`` enter: the arrays
    (a fresh dict of them per entry), what to do on any exit (``always``) and on a
    normal one (``on_exit``). A plain class, not a generator: it is entered three
    times per layer and step, and a whole bucket's blocks are made once and reused."""

    __slots__ = ("always", "arg", "on_exit", "views")

    def __init__(
        self, views: Mapping[str, np.ndarray], on_exit: Callable[[Any], None] | None = None,
        arg: Any = None, always: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.views, self.on_exit, self.arg, self.always = views, on_exit, arg, always

    def __enter__(self) -> dict[str, np.ndarray]:
        return dict(self.views)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.always is not None:
            self.always()
        if exc_type is None and self.on_exit is not None:
            self.on_exit(self.arg)


class Names:
    """Parameter and group names of a layout, looked up once and cached: the
    hand-over of a layer costs O(1), not O(model)."""

    def __init__(self, layout: Layout, order: Sequence[str]) -> None:
        self.layout = layout
        #: Parameter names in the model's order (the mapping's).
        self.order = list(order)
        self.specs = {spec.name: spec for spec in layout.params}
        self._found: dict[tuple[str, ...], Found] = {}

    def find(self, names: tuple[str, ...]) -> Found:
        """The bucket of ``names`` (parameter or group names), cached."""
        found = self._found.get(names)
        if found is None:
            resolved = self.resolve(names)
            indices = {self.layout.bucket_of[n] for n in resolved}
            index = indices.pop() if len(indices) == 1 else -1
            whole = index >= 0 and set(resolved) == set(self.layout.buckets[index].names)
            found = self._found[names] = (index, resolved, whole)
        return found

    def resolve(self, names: Sequence[str]) -> list[str]:
        """Parameter names for a mix of parameter and group names."""
        out: list[str] = []
        for name in names:
            if name in self.specs:
                out.append(name)
            elif name in self.layout.groups:
                out.extend(self.layout.groups[name])
            else:
                raise KeyError(f"{name!r} is neither a parameter nor a group of this model")
        return out

    def view(self, flat: Mapping[np.dtype, np.ndarray], name: str) -> np.ndarray:
        """Parameter ``name``'s view of the full flat buffers ``flat`` (by dtype)."""
        spec = self.specs[name]
        return flat[spec.dtype][spec.offset : spec.offset + spec.size].reshape(spec.shape)

    def flat_arrays(self, flat: Mapping[np.dtype, np.ndarray], what: str,
                    read_only: bool = False) -> FlatArrays:  # fmt: skip
        """Every parameter's view of ``flat``, in the model's order."""
        return FlatArrays({n: self.view(flat, n) for n in self.order}, what, read_only)

    def bucket_view(self, buf: np.ndarray, index: int, name: str) -> np.ndarray:
        """Parameter ``name``'s view of ``buf``, a buffer of bucket ``index``'s size."""
        spec = self.specs[name]
        lo = spec.offset - self.layout.buckets[index].start
        return buf[lo : lo + spec.size].reshape(spec.shape)

    def views(self, buf: np.ndarray, index: int, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Name -> view of ``buf`` (bucket ``index``'s buffer) for ``names``."""
        return {n: self.bucket_view(buf, index, n) for n in names}


def single_bucket(layout: Layout, names: list[str], what: str, in_stage: int) -> None:
    """Refuse ``names`` that span several buckets (stage 3's gathers and stages 2-3's
    hand-overs take one bucket at a time)."""
    count = len({layout.bucket_of[n] for n in names})
    raise ValueError(
        f"opt.{what}() takes the parameters of one bucket at a time in stage "
        f"{in_stage}; {names} span {count} buckets"
    )


_NO_PARAMS = (
    "stage 3 keeps only parameter shards: read parameters inside "
    "`with opt.gathered(names) as p`, or copy them all with opt.full_params()"
)


class Resident:
    """Stages 0-2: ``params`` are persistent views of the full parameters (the node's
    copy with node memory: a write through them is what every rank of the node reads)."""

    #: The block open now, as ``(bucket, slot)`` (stage 3 only; ``None``: none).
    in_use: tuple[int, int] | None = None

    def __init__(self, params: FlatArrays) -> None:
        self._params = params

    @property
    def params(self) -> FlatArrays:
        return self._params

    @property
    def resident(self) -> FlatArrays | None:
        """The full parameters where this rank holds all of them all the time."""
        return self._params

    def gathered(self, found: Found) -> Block:
        _, names, _ = found
        return Block({n: self._params[n] for n in names})

    def finish(self, step: bool = True) -> None:
        """Before the shards change or the buffers go: nothing is in flight here."""


class NodeCopy(Resident):
    """Stage 3 on one node: the node's one copy, read in place, one layer at a time
    (the rules of stage 3 apply; an array kept after its block shows the current
    values, and ``ZEROMPI_DEBUG=1`` cannot poison a buffer the node shares)."""

    def __init__(self, params: FlatArrays, comm: Comm, layout: Layout) -> None:
        super().__init__(params)
        self.comm, self.layout = comm, layout
        self.in_use = None

    @property
    def params(self) -> FlatArrays:
        raise AttributeError(_NO_PARAMS)

    def gathered(self, found: Found) -> Block:
        index, names, _ = found
        _one_at_a_time(self.in_use)
        if index < 0:
            single_bucket(self.layout, names, "gathered", 3)
        self.comm.record_shared("allgatherv", index, self.layout.buckets[index].size)
        self.in_use = (index, 0)
        return Block({n: self._params[n] for n in names}, always=self.release)

    def release(self) -> None:
        self.in_use = None


def _one_at_a_time(in_use: tuple[int, int] | None) -> None:
    if in_use is not None:
        raise RuntimeError(
            "opt.gathered() blocks cannot nest in stage 3: one layer's parameters are "
            "gathered at a time"
        )


class Gathered:
    """Stage 3: a layer's bucket gathered into a gather buffer for the block."""

    resident = None

    def __init__(self, layers: LayerGather, names: Names, timing: Phase) -> None:
        self.layers, self.names, self.timing = layers, names, timing
        self.layout = names.layout
        self.in_use: tuple[int, int] | None = None
        #: per slot, a whole bucket's cached blocks
        self.blocks: list[list[Block | None]] = [
            [None] * len(self.layout.buckets) for _ in range(layers.slots)
        ]

    @property
    def params(self) -> FlatArrays:
        raise AttributeError(_NO_PARAMS)

    def gathered(self, found: Found) -> Block:
        index, names, whole = found
        _one_at_a_time(self.in_use)
        if index < 0:
            single_bucket(self.layout, names, "gathered", 3)
        with self.timing:
            slot = self.layers.gather(index)
        self.in_use = (index, slot)
        cache = self.blocks[slot]
        block = cache[index] if whole else None
        if block is None:
            views = self.names.views(self.layers.bufs[slot][index], index, names)
            block = Block(views, always=self.release)
            if whole:
                cache[index] = block
        return block

    def release(self) -> None:
        layers = self.layers  # (a node's shared buffer is not this rank's to poison)
        if DEBUG and self.in_use is not None and layers.node is None:
            index, slot = self.in_use
            layers.bufs[slot][index].fill(np.nan)
        self.in_use = None

    def finish(self, step: bool = True) -> None:
        """The gather in flight completes; a ``step`` also ends the order's recording
        and starts the next step's from the top."""
        if step:
            self.layers.end_step()
        else:
            self.layers.finish()


class CallerGathers:
    """Stage 3 without gather buffers: the caller gathers with ``opt.gather_into``."""

    resident = None
    in_use = None

    @property
    def params(self) -> FlatArrays:
        raise AttributeError(_NO_PARAMS)

    def gathered(self, found: Found) -> Block:
        raise RuntimeError(
            "opt.gathered(): this optimizer has no gather buffers (gather_buffers="
            "False): its owner gathers with opt.gather_into()"
        )

    def finish(self, step: bool = True) -> None:
        pass


#: What the engine holds as its parameter access.
Access = Resident | NodeCopy | Gathered | CallerGathers
