"""The one place that spells the names processes find each other by.

Actors are named in the deployment's Ray namespace (`ray.get_actor(name, namespace=...)`), and the
same strings label metrics, log lines, fault plans (`actors: reader/*`) and heartbeats, so a name
spelled twice is a lookup that silently finds nothing once one spelling changes. Transports
register memory pools by name; a peer addresses a pool with the name the owner registered.
"""

from __future__ import annotations

from typing import Final

SCHEDULER = "scheduler"  # the singleton Scheduler actor (runtime/control/scheduler.py)
ROLLOUT_SERVER = "rollout-server"  # the RolloutServer front end (api/server.py), when deployed
OPENAI_SERVER = "openai-server"  # the OpenAI-compatible HTTP front end (api/openai_server.py)


READER_PREFIX = "reader/"
ENGINE_PREFIXES = ("prefill/", "decode/")


def reader_name(node_id: str) -> str:
    """The storage reader of a node: one per node, prefill and decode alike."""
    return f"{READER_PREFIX}{node_id}"


def is_reader(name: str) -> bool:
    return name.startswith(READER_PREFIX)


def reader_node(name: str) -> str:
    """The node of a reader's name (reader_name's inverse)."""
    return name.removeprefix(READER_PREFIX)


def engine_name(role: str, node_id: str, gpu: int) -> str:
    """An engine: role ("prefill" or "decode"), node and GPU index, e.g. prefill/p0/g1."""
    return f"{role}/{node_id}/g{gpu}"


class Pool:
    """Memory pools a transport endpoint registers, by who owns them. Plain strings (not an
    enum): they travel in every `Region` of every move and read as themselves in errors."""

    BUFFER: Final = "buffer"  # a reader's host buffer (kv/pool.py): staged hit KV and outgoing blocks
    HBM: Final = "hbm"  # a decode engine's KV pages (kv/paged.py)
    WINDOW: Final = "window"  # a prefill engine's layer window (kv/window.py)
    COMPUTE_KV: Final = "compute_kv"  # a compute's own KV pages (vLLM's backing buffer, runtime/compute/held_kv.py)
