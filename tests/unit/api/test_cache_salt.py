"""Cache salts reach the block keys (api/cache_salt.py): the rollout-server keys a turn with a
`cache_salt` under a namespace of its own, a caller without one as before, and refuses a bad salt
naming it. A RolloutServer without its actor runs `_prepare`, so each namespace checked is the
RequestSpec.namespace the scheduler would get."""

from __future__ import annotations

from typing import Any

import pytest

from dualpath_ray.api.server import RolloutServer
from dualpath_ray.api.sessions import SessionIds
from dualpath_ray.api.validation import RequestError
from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.kv.index import unsalted_namespace

PROMPT = [5, 6, 7, 8]


def bare_server(cfg: DualPathConfig) -> Any:
    """A RolloutServer without its actor: what `_prepare` reads, nothing that needs Ray."""
    server = object.__new__(RolloutServer.__ray_actor_class__)
    server.cfg = cfg
    server.weight_version = cfg.model.weight_version
    server.sessions = SessionIds()
    server.in_flight = {}
    return server


def test_the_rollout_server_salts_the_namespace_checks_the_salt_and_its_old_callers_are_unsalted() -> None:
    cfg = parse_config({"model": {"vocab_size": 512}})
    server = bare_server(cfg)
    weights = cfg.kv_namespace(server.weight_version)
    spec, _ = server._prepare("plain", PROMPT, {"max_tokens": 2}, None)
    assert spec.namespace == weights, "a caller without cache_salt is keyed as before"
    first, _ = server._prepare("a", PROMPT, {"max_tokens": 2}, None, None, "tenant-a")
    again, _ = server._prepare("b", PROMPT, {"max_tokens": 2}, None, None, "tenant-a")
    other, _ = server._prepare("c", PROMPT, {"max_tokens": 2}, None, None, "tenant-b")
    assert first.namespace == again.namespace != weights, "one salt: one namespace of its own, shared by its turns"
    assert other.namespace != first.namespace, "another salt: another namespace (no shared cached prefix)"
    assert unsalted_namespace(other.namespace) == weights, "the weights' namespace is still read out of a salted one"
    with pytest.raises(RequestError) as refused:
        server._prepare("bad", PROMPT, {"max_tokens": 2}, "conv-1", None, 7)
    assert refused.value.field == "cache_salt", "a bad salt is the caller's error naming the field"
    assert len(server.sessions) == 0, "and the refused turn left no session turn counted"
