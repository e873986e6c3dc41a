"""NIXL backend of the KV transport: one-sided READs through Ray Direct Transport.

Behaviours of Ray 2.60 + nixl 1.5.1 this relies on (checked on a CPU-only `Cluster`, UCX over
TCP/shm):
* A ref made by ``ray.put(views, _tensor_transport="nixl")`` inside the source actor can ride
  nested in any message (a dataclass, a list) through third parties (scheduler, driver) and be
  pulled by an endpoint several hops away.
* ``set_target_for_ref`` keeps only weakrefs to the targets: if they die before ``ray.get``,
  Ray silently reads into fresh tensors. `_fetch` holds them and checks data_ptr identity.
* The READ does not ask the source: after a release (and slot reuse) it would return the new
  bytes silently, hence the liveness confirmation after every read.
* Two live offers with overlapping but unequal slot sets work once the pool is registered with
  ``register_nixl_memory`` (registration is per storage, counted).
* A dead source surfaces as ``OwnerDiedError`` from ``ray.get`` within milliseconds.
* A borrower never drops the RDT metadata it registered when deserialising the ref (Ray's TODO
  #57962), about 0.7 KB per ticket here; a successful pull drops it. So a deserialised ticket is
  pulled at most once per process; sent on after its pull it travels as a plain ref, which its
  source can still release but nobody can pull. Non-endpoint relays (the scheduler) still leak.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
import torch
from ray.experimental import (
    deregister_nixl_memory,
    register_nixl_memory,
    set_target_for_ref,
)

from dualpath_ray.runtime.transport import (
    SourceDiedError,
    TransferTicket,
    Transport,
    TransportError,
)

_UCX_SERVICE_LEVELS = range(16)
_UCX_TRAFFIC_CLASSES = range(256)


def ucx_environment(
    *,
    service_level: int | None = None,
    traffic_class: int | None = None,
    tls: str | None = None,
    net_devices: str | None = None,
) -> dict[str, str]:
    """The UCX variables that place KV traffic on its own IB service level / RoCE class."""
    env: dict[str, str] = {}
    if service_level is not None:
        if service_level not in _UCX_SERVICE_LEVELS:
            raise TransportError(f"service_level must be an IB SL in 0..15 (got {service_level})")
        env["UCX_IB_SL"] = str(service_level)
    if traffic_class is not None:
        if traffic_class not in _UCX_TRAFFIC_CLASSES:
            raise TransportError(
                f"traffic_class must be in 0..255 (DSCP << 2 on RoCE; got {traffic_class})"
            )
        env["UCX_IB_TRAFFIC_CLASS"] = str(traffic_class)
    if tls is not None:
        if not tls.strip():
            raise TransportError("ucx_tls must name transports, e.g. 'rc,cuda_copy' or 'tcp'")
        env["UCX_TLS"] = tls
    if net_devices is not None:
        if not net_devices.strip():
            raise TransportError("ucx_net_devices must name devices, e.g. 'mlx5_0:1'")
        env["UCX_NET_DEVICES"] = net_devices
    return env


def apply_ucx_environment(env: dict[str, str]) -> None:
    """Set UCX variables for this process; refuses to silently override a different value."""
    for name, value in env.items():
        existing = os.environ.get(name)
        if existing is not None and existing != value:
            raise TransportError(
                f"{name} is already {existing!r} in this process; refusing to change it to "
                f"{value!r} (UCX reads it once, when the NIXL agent starts)"
            )
    os.environ.update(env)


def _forget_borrowed_rdt_metadata(ref: ray.ObjectRef) -> None:
    """Drop the RDT metadata Ray 2.60 leaves behind on a borrower after a pull."""
    manager = ray._private.worker.global_worker.rdt_manager
    lock = getattr(manager, "_lock", None)
    table = getattr(manager, "_managed_rdt_metadata", None)
    if lock is None or table is None:
        return
    with lock:
        table.pop(ref.hex(), None)


class NixlTransport(Transport):
    """Source: ``ray.put(views, _tensor_transport="nixl")``; puller: a one-sided READ."""

    kind = "nixl"

    def __init__(self, endpoint_name: str, namespace: str, timeout_s: float, verify_bytes: bool) -> None:
        super().__init__(endpoint_name, namespace, timeout_s, verify_bytes)
        # Ray 2.60's NIXL fetch path keeps a per-process cache of remote agents that concurrent
        # fetches race on (seen: NIXL_ERR_INVALID_PARAM when two threads add the same agent,
        # NIXL_ERR_NOT_FOUND when one evicts it under another's transfer), so one pull at a time.
        self._fetch_lock = threading.Lock()

    def _register_backend(self, pool: torch.Tensor) -> None:
        try:
            register_nixl_memory(pool)
        except Exception as exc:
            raise TransportError(f"register_nixl_memory failed for {self.endpoint_name}: {exc}") from exc

    def _deregister_backend(self, pool: torch.Tensor) -> None:
        deregister_nixl_memory(pool)

    def _publish(self, transfer_id: str, tensors: tuple[torch.Tensor, ...]) -> object:
        try:
            return ray.put(list(tensors), _tensor_transport="nixl")
        except Exception as exc:
            raise TransportError(f"offer {transfer_id}: NIXL put failed: {exc}") from exc

    def _fetch(self, ticket: TransferTicket, targets: list[torch.Tensor]) -> None:
        ref = ticket.handle
        if not isinstance(ref, ray.ObjectRef):
            raise TransportError(
                f"pull {ticket.transfer_id}: handle is {type(ref).__name__}, not a NIXL RDT ref "
                "(a ticket from another backend?)"
            )
        with self._fetch_lock:
            try:
                set_target_for_ref(ref, targets)
            except ValueError as exc:
                raise TransportError(
                    f"pull {ticket.transfer_id}: no RDT metadata for this ref here (it was already "
                    "pulled in this process, or forwarded after a pull); offer again"
                ) from exc
            landed = self._read(ticket, ref)
        if len(landed) != len(targets) or any(
            got.data_ptr() != want.data_ptr() for got, want in zip(landed, targets)
        ):
            raise TransportError(
                f"pull {ticket.transfer_id}: Ray read into fresh buffers instead of the targets"
            )
        self._confirm_remote(ticket, targets)
        _forget_borrowed_rdt_metadata(ref)

    def _read(self, ticket: TransferTicket, ref: ray.ObjectRef) -> list[Any]:
        try:
            landed = ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TransportError(f"pull {ticket.transfer_id}: no data within {self.timeout_s}s") from exc
        except ray.exceptions.OwnerDiedError as exc:
            raise SourceDiedError(
                f"pull {ticket.transfer_id}: source {ticket.source} died; its offer is gone"
            ) from exc
        except (ray.exceptions.RayError, ValueError, RuntimeError, TimeoutError) as exc:
            raise TransportError(
                f"pull {ticket.transfer_id} from {ticket.source} failed (source dead or ticket "
                f"freed?): {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(landed, list):
            raise TransportError(f"pull {ticket.transfer_id}: the ref does not hold a tensor list")
        return landed

    def _serve_backend(self, request: object) -> object:
        raise TransportError(f"nixl endpoint {self.endpoint_name} cannot serve {request!r}")

    def _close_backend(self) -> None:
        return None
