"""Weights from a trainer to every engine over a torch.distributed broadcast group, the way verl
and OpenRLHF sync a policy: the trainer is rank 0, the engines ranks 1..N, and each tensor of
the manifest is broadcast in order. gloo on host memory (CPU engines); NCCL where the engines
compute on CUDA and the trainer sends CUDA tensors.

The group is a private ProcessGroup on a TCPStore the trainer hosts (not torch's default group),
so it coexists with the trainer's own process groups and with the engines' KV transport.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from dualpath_ray.protocol.messages import TensorSpec

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32)}


class WeightSyncError(RuntimeError):
    """The group could not be formed, or what was sent does not match the manifest."""


def manifest_of(state_dict: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The manifest of a state dict (its order is the broadcast order)."""
    specs = []
    for name, tensor in state_dict.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise WeightSyncError(f"{name}: dtype {dtype} cannot be synced; use one of {sorted(_DTYPES)}")
        specs.append(TensorSpec(name, tuple(tensor.shape), dtype))
    return specs


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _group(
    store: Any, rank: int, world_size: int, group_name: str, timeout_s: float, device: torch.device, local_host: str
) -> Any:
    """The group's ProcessGroup; gloo binds its pairs to `local_host` (an address of this host
    the other members reach)."""
    prefixed = dist.PrefixStore(f"dualpath-weights/{group_name}", store)
    timeout = timedelta(seconds=timeout_s)
    if _backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


class WeightGroup:
    """An engine's membership of the trainer's broadcast group."""

    def __init__(self, group: Any, rank: int, device: torch.device) -> None:
        self.group = group
        self.rank = rank
        self.device = device

    @classmethod
    def join(
        cls, host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float, device: torch.device,
        local_host: str,
    ) -> WeightGroup:
        if not 1 <= rank < world_size:
            raise WeightSyncError(f"an engine's rank must be in [1, world_size={world_size}) (got {rank}); rank 0 is the trainer")
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            return cls(_group(store, rank, world_size, group_name, timeout_s, device, local_host), rank, device)
        except (RuntimeError, OSError) as exc:
            raise WeightSyncError(f"joining weight group {group_name!r} at {host}:{port} as rank {rank} failed: {exc}") from exc

    def receive(self, manifest: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Every tensor of the manifest, broadcast by rank 0, in order (on this engine's device)."""
        state = {}
        for spec in manifest:
            if spec.dtype not in _DTYPES:
                raise WeightSyncError(f"{spec.name}: unknown dtype {spec.dtype!r}")
            tensor = torch.empty(spec.shape, dtype=_DTYPES[spec.dtype], device=self.device)
            self.group.broadcast(tensor, 0).wait()
            state[spec.name] = tensor if self.device.type == "cpu" else tensor.cpu()
        return state


class WeightSender:
    """The trainer's side: hosts the group's store and broadcasts as rank 0.

    `WeightSender.listen(world_size)` opens the store at once (engines can start joining), then
    `connect()` joins as rank 0, which returns once every engine has joined."""

    def __init__(self, host: str, store: Any, world_size: int, group_name: str, timeout_s: float, device: torch.device) -> None:
        self.host = host
        self.store = store
        self.world_size = world_size
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.device = device
        self.group: Any = None

    @property
    def port(self) -> int:
        return int(self.store.port)

    @classmethod
    def listen(
        cls, world_size: int, *, host: str | None = None, group_name: str = "policy", timeout_s: float = 300.0,
        device: str | torch.device = "cpu",
    ) -> WeightSender:
        if world_size < 2:
            raise WeightSyncError(f"world_size must count the trainer and at least one engine (got {world_size})")
        host = host or socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return cls(host, store, world_size, group_name, timeout_s, torch.device(device))

    def connect(self) -> None:
        if self.group is None:
            self.group = _group(self.store, 0, self.world_size, self.group_name, self.timeout_s, self.device, self.host)

    def send(self, state_dict: Mapping[str, torch.Tensor], manifest: Sequence[TensorSpec] | None = None) -> int:
        """Broadcast the state dict in manifest order (its own order by default); returns bytes sent."""
        if self.group is None:
            raise WeightSyncError("send before connect(): the engines have not joined yet")
        manifest = list(manifest) if manifest is not None else manifest_of(state_dict)
        sent = 0
        for spec in manifest:
            tensor = state_dict.get(spec.name)
            if tensor is None or tuple(tensor.shape) != spec.shape or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                raise WeightSyncError(f"{spec.name}: the state dict does not match the manifest ({spec})")
            tensor = tensor.detach().contiguous().to(self.device)
            self.group.broadcast(tensor, 0).wait()
            sent += tensor.numel() * tensor.element_size()
        return sent
