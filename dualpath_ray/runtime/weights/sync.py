"""Weights from a trainer to every engine over a torch.distributed broadcast group, the way verl
and OpenRLHF sync a policy: the trainer is rank 0, the engines ranks 1..N, and each tensor of
the manifest is broadcast in order.

The backend follows the members' devices: before the group is formed every member (trainer and
engines alike) writes its device into the group's store, and each picks the backend from the
same list with `weight_group_backend`: NCCL when every member has a GPU of its own, gloo (on host
memory) otherwise. So a trainer and CUDA engines never disagree, which would hang both.

The group is a private ProcessGroup on a TCPStore the trainer hosts (not torch's default group),
so it coexists with the trainer's own process groups and with the engines' KV transport.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from dualpath_ray.protocol.weights import TensorSpec

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


def member_device(device: torch.device) -> str:
    """How a member names its device to the others: "cpu", or "cuda:" and the GPU's identity
    (its UUID where torch reports one, else host and PCI address), so that two members on one
    physical GPU name the same thing."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"cuda:{uuid}"
    pci = ":".join(str(getattr(props, f, "?")) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return f"cuda:{socket.gethostname()}/{pci}/{device.index}"


def weight_group_backend(members: Sequence[str]) -> str:
    """The group's backend from every member's `member_device` (the trainer's and each engine's):
    nccl when every member computes on a GPU of its own, else gloo.

    NCCL needs a CUDA tensor on every rank and refuses two ranks on one GPU ("Duplicate GPU
    detected"), as when a trainer shares its GPU with an engine; gloo works on any mix, the CUDA
    members staging each tensor through host memory. Every member computes this from the same
    list, so all of them form the same kind of group."""
    if not members:
        raise WeightSyncError("a weight group has at least the trainer and one engine")
    gpus = [m for m in members if m.startswith("cuda:")]
    return "nccl" if len(gpus) == len(members) and len(set(gpus)) == len(gpus) else "gloo"


def transfer_device(backend: str, device: torch.device) -> torch.device:
    """Where a member's broadcast tensors live: its GPU under NCCL, host memory under gloo."""
    return device if backend == "nccl" else torch.device("cpu")


def agree_backend(store: Any, rank: int, world_size: int, member: str, timeout_s: float) -> str:
    """Publish this member's device in the group's store, wait for every other member's, and
    return the backend they all pick (`weight_group_backend`)."""
    store.set(f"device/{rank}", member)
    keys = [f"device/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise WeightSyncError(
            f"rank {rank}: not every member of the weight group said its device within {timeout_s} s: {exc}"
        ) from exc
    return weight_group_backend([store.get(key).decode() for key in keys])


def _group(store: Any, rank: int, world_size: int, timeout_s: float, backend: str, local_host: str) -> Any:
    """The group's ProcessGroup on its prefixed store; gloo binds its pairs to `local_host` (an
    address of this host the other members reach)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _form(
    store: Any, rank: int, world_size: int, group_name: str, timeout_s: float, device: torch.device, local_host: str,
) -> tuple[Any, str]:
    """(ProcessGroup, backend) of one member: the backend agreed through the store first."""
    prefixed = dist.PrefixStore(f"dualpath-weights/{group_name}", store)
    backend = agree_backend(prefixed, rank, world_size, member_device(device), timeout_s)
    return _group(prefixed, rank, world_size, timeout_s, backend, local_host), backend


class WeightGroup:
    """An engine's membership of the trainer's broadcast group."""

    def __init__(self, group: Any, rank: int, device: torch.device, backend: str) -> None:
        self.group = group
        self.rank = rank
        self.device = device
        self.backend = backend

    @classmethod
    def join(
        cls, host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float, device: torch.device,
        local_host: str,
    ) -> WeightGroup:
        if not 1 <= rank < world_size:
            raise WeightSyncError(f"an engine's rank must be in [1, world_size={world_size}) (got {rank}); rank 0 is the trainer")
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            group, backend = _form(store, rank, world_size, group_name, timeout_s, device, local_host)
        except (RuntimeError, OSError) as exc:
            raise WeightSyncError(f"joining weight group {group_name!r} at {host}:{port} as rank {rank} failed: {exc}") from exc
        return cls(group, rank, device, backend)

    def receive(self, manifest: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Every tensor of the manifest, broadcast by rank 0, in order, in host memory (the engine
        loads it onto its device)."""
        state = {}
        on = transfer_device(self.backend, self.device)
        for spec in manifest:
            if spec.dtype not in _DTYPES:
                raise WeightSyncError(f"{spec.name}: unknown dtype {spec.dtype!r}")
            tensor = torch.empty(spec.shape, dtype=_DTYPES[spec.dtype], device=on)
            self.group.broadcast(tensor, 0).wait()
            state[spec.name] = tensor if on.type == "cpu" else tensor.cpu()
        return state


def _trainer_device(device: str | torch.device | None) -> torch.device:
    """The trainer's device: as given, else this process's current GPU where it has one."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class WeightSender:
    """The trainer's side: hosts the group's store and broadcasts as rank 0.

    `WeightSender.listen(world_size)` opens the store at once (engines can start joining), then
    `connect()` joins as rank 0, which returns once every engine has joined; the backend is then
    the one every member agreed on from their devices (`weight_group_backend`)."""

    def __init__(self, host: str, store: Any, world_size: int, group_name: str, timeout_s: float, device: torch.device) -> None:
        self.host = host
        self.store = store
        self.world_size = world_size
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.device = device
        self.group: Any = None
        self.backend = ""  # set by connect()

    @property
    def port(self) -> int:
        return int(self.store.port)

    @classmethod
    def listen(
        cls, world_size: int, *, host: str | None = None, group_name: str = "policy", timeout_s: float = 300.0,
        device: str | torch.device | None = None,
    ) -> WeightSender:
        """`device`: where the trainer's tensors are (default: its current GPU, else the CPU)."""
        if world_size < 2:
            raise WeightSyncError(f"world_size must count the trainer and at least one engine (got {world_size})")
        host = host or socket.gethostbyname(socket.gethostname())
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return cls(host, store, world_size, group_name, timeout_s, _trainer_device(device))

    def connect(self) -> None:
        if self.group is None:
            self.group, self.backend = _form(
                self.store, 0, self.world_size, self.group_name, self.timeout_s, self.device, self.host
            )

    def send(self, state_dict: Mapping[str, torch.Tensor], manifest: Sequence[TensorSpec] | None = None) -> int:
        """Broadcast the state dict in manifest order (its own order by default); returns bytes sent."""
        if self.group is None:
            raise WeightSyncError("send before connect(): the engines have not joined yet")
        manifest = list(manifest) if manifest is not None else manifest_of(state_dict)
        on = transfer_device(self.backend, self.device)
        sent = 0
        for spec in manifest:
            tensor = state_dict.get(spec.name)
            if tensor is None or tuple(tensor.shape) != spec.shape or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                raise WeightSyncError(f"{spec.name}: the state dict does not match the manifest ({spec})")
            tensor = tensor.detach().contiguous().to(on)
            self.group.broadcast(tensor, 0).wait()
            sent += tensor.numel() * tensor.element_size()
        return sent
