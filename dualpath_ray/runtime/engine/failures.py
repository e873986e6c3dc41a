"""What kind of failure an exception is, wherever it was raised (in this process or, wrapped by
Ray, in another actor): the engines put the kind and the bad block keys into the failed
TurnResult, and the scheduler decides from them whether and how to retry."""

from __future__ import annotations

import logging

from dualpath_ray.faults.injector import InjectedFault
from dualpath_ray.kv.errors import BadBlockError, BlockCorruptedError, BlockNotFoundError, IncompatibleBlockError
from dualpath_ray.protocol.messages import ErrorKind, RequestSpec, TurnResult, failed_result
from dualpath_ray.runtime.engine.held_weights import StaleWeightsError
from dualpath_ray.runtime.engine.ports import Pending
from dualpath_ray.runtime.transport.moves import PeerDiedError, TransportError


class KVMismatchError(RuntimeError):
    """The decode side's check found assembled KV that differs from the store / a recompute."""


class ReadFailed(Exception):
    """A read of a request's hits failed on `node`'s reader with `cause` (classified as the
    cause is); the failed result names the node, so the retry can read through the other side."""

    def __init__(self, node: str, cause: BaseException) -> None:
        super().__init__(node, cause)
        self.node, self.cause = node, cause

    def __str__(self) -> str:
        return f"the read on {self.node}'s reader failed: {self.cause!r}"


def _cause(error: BaseException) -> BaseException:
    # A RayTaskError is an instance of its cause's class but does not carry its attributes;
    # the original exception is its `cause`.
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def read_done(pending: Pending, node: str) -> bool:
    """Whether a read of hits on `node`'s reader (a staging call) ended; its failure raised as
    ReadFailed naming the node."""
    try:
        return bool(pending.done())
    except Exception as exc:  # noqa: BLE001 - classified where the failed result is made
        raise ReadFailed(node, exc) from exc


def classify(error: BaseException) -> tuple[ErrorKind, tuple[str, ...]]:
    """The kind of `error` and the stored blocks it names."""
    if isinstance(error, ReadFailed):
        return classify(error.cause)
    cause = _cause(error)
    if isinstance(cause, BadBlockError):
        # An unreadable block (the file system's I/O error on its file: a bad sector) is repaired
        # as a corrupt one: it leaves the index with its successors and its file is deleted.
        # Deleted, not kept: a file still there makes the retry's persist of the same key a
        # no-op (put finds the block's header in place), so the block would be indexed again and
        # every later turn on that prefix would read it, fail and retry; a fresh file is written
        # elsewhere on the disk (and a rewritten sector is remapped by the drive).
        kinds = {"missing": ErrorKind.KV_MISSING, "corrupt": ErrorKind.KV_CORRUPT, "unreadable": ErrorKind.KV_UNREADABLE}
        return kinds[cause.kind], (cause.key,)
    if isinstance(cause, BlockNotFoundError):
        return ErrorKind.KV_MISSING, ()
    if isinstance(cause, (BlockCorruptedError, IncompatibleBlockError)):
        # A block of another KV layout or format version is unusable like a corrupt one, and
        # retryable: not a bug (INTERNAL), which would fail every turn on that prefix.
        return ErrorKind.KV_CORRUPT, ()
    if isinstance(cause, KVMismatchError):
        return ErrorKind.KV_MISMATCH, ()
    if isinstance(cause, StaleWeightsError):
        return ErrorKind.STALE_WEIGHTS, ()
    if isinstance(cause, PeerDiedError) or _is_dead_actor(cause):
        return ErrorKind.PEER_DIED, ()
    if isinstance(cause, (TransportError, TimeoutError)):
        return ErrorKind.TRANSFER, ()
    if isinstance(cause, InjectedFault):
        return _INJECTED_KINDS.get(cause.site, ErrorKind.TRANSFER), ()
    if isinstance(cause, OSError):
        return ErrorKind.STORE_IO, ()
    return ErrorKind.INTERNAL, ()


# The store sites inject OSError(EIO) instead (runtime/reader/core.py), so an injected
# storage fault takes the path of a real one; only lost calls are InjectedFaults of their own.
_INJECTED_KINDS = {"actor_call": ErrorKind.CALL_FAILED}


_DEAD_ACTOR_ERRORS = frozenset({"RayActorError", "ActorDiedError", "ActorUnavailableError"})


def _is_dead_actor(error: BaseException) -> bool:
    # By class name, so the engine cores that classify their failures never import Ray.
    return any(cls.__name__ in _DEAD_ACTOR_ERRORS for cls in type(error).__mro__)


def failure_of(spec: RequestSpec, engine: str, error: BaseException) -> TurnResult:
    """The failed TurnResult of `spec`, classified."""
    kind, keys = classify(error)
    node = error.node if isinstance(error, ReadFailed) else ""
    return failed_result(spec, engine, error.cause if isinstance(error, ReadFailed) else error, kind, keys, node)


def log_failure(log: logging.Logger, what: str, error: BaseException) -> None:
    """A failure the scheduler retries (a dead peer, a failed transfer, a bad block) is one
    warning line; only an unexpected one (INTERNAL: a bug) carries its traceback."""
    kind, _ = classify(error)
    if kind is ErrorKind.INTERNAL:
        log.exception("%s failed", what)
    else:
        log.warning("%s failed (%s): %s", what, kind.value, error)
