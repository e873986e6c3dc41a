"""A block of another KV layout or format version, met on any read path (oracle hits, a decode
engine's store read), is a retryable KV failure, never INTERNAL (a bug, never retried)."""

from __future__ import annotations

from dualpath_ray.kv.errors import IncompatibleBlockError
from dualpath_ray.protocol.messages import ErrorKind
from dualpath_ray.runtime.engine.failures import classify


def test_an_incompatible_block_is_a_retryable_kv_failure() -> None:
    kind, keys = classify(IncompatibleBlockError("block written with another KV layout: dtype='bfloat16'"))
    assert kind is ErrorKind.KV_CORRUPT, "an unusable stored block is treated like a corrupt one"
    assert kind.retryable and kind.about_stored_kv, "and so retried under the kv_failure_policy"
    assert keys == (), "a bare store error names no block"
