"""The one guard of every public method that communicates: :func:`communicates`.

An elastic optimizer (``elastic=True``) must turn a failed peer seen *anywhere*
inside zerompi into a recovery on every survivor (:mod:`zerompi.recovery`). Every
method of :class:`zerompi.optimizer.ZeroOptimizer` that can start a collective is
decorated with :func:`communicates`; ``tests/test_structure.py`` runs every public
method and fails if any collective is started outside a guarded call, so a new
method that communicates cannot be left unguarded by mistake.

Without ``elastic`` the guard costs one Python call: the ``try`` is free until
something raises, and then the exception goes on unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Recovers(Protocol):
    """What a guard needs: whether an exception is a failed peer, and the recovery
    that turns it into the exception every survivor raises."""

    def is_failure(self, exc: BaseException, owner: Any) -> bool: ...

    def recover(self, owner: Any) -> BaseException: ...


def communicates(method: F) -> F:
    """Decorate a method that may communicate: a failed peer seen inside it becomes a
    recovery by its owner's ``_recovery`` (``None`` without ``elastic``), and the
    survivors raise what the recovery returns (:class:`zerompi.elastic.RankLost`)."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            recovery = self._recovery
            if recovery is None or not recovery.is_failure(exc, self):
                raise
            raise recovery.recover(self) from exc

    guarded.communicates = True  # type: ignore[attr-defined]
    return guarded  # type: ignore[return-value]


#: The code of every guarded call: what the structure test looks for on the stack.
GUARD_CODE = communicates(lambda self: None).__code__


def is_guarded(method: object) -> bool:
    """Whether ``method`` (a function, or a property's getter) is decorated."""
    if isinstance(method, property):
        method = method.fget
    return bool(getattr(method, "communicates", False))


@contextmanager
def survive(owner: Any) -> Iterator[None]:
    """The guard as a block, around the caller's own collectives on ``owner``'s
    communicator (``ZeroOptimizer.survive``)."""
    try:
        yield
    except Exception as exc:
        recovery = owner._recovery
        if recovery is None or not recovery.is_failure(exc, owner):
            raise
        raise recovery.recover(owner) from exc
