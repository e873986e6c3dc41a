"""The trainer's weight group (runtime/weights/sync.py) without Ray: the backend follows
the members' devices, every member agrees on it through the group's store, and a gloo broadcast
between threads of this process delivers the manifest byte for byte. NCCL itself needs GPUs:
tests/gpu/test_weight_sync_cuda.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dualpath_ray.runtime.weights.sync import (
    WeightGroup,
    WeightSender,
    WeightSyncError,
    agree_backend,
    manifest_of,
    member_device,
    transfer_device,
    weight_group_backend,
)

HOST = "127.0.0.1"


@pytest.mark.parametrize(
    ("members", "backend"),
    [
        (["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"], "nccl"),  # trainer and engines, each on its own GPU
        (["cpu", "cuda:GPU-b", "cuda:GPU-c"], "gloo"),  # a trainer without a GPU cannot join NCCL
        (["cuda:GPU-a", "cuda:GPU-a"], "gloo"),  # NCCL refuses two ranks on one GPU
        (["cuda:GPU-a", "cpu"], "gloo"),  # a CPU engine
        (["cpu", "cpu"], "gloo"),
    ],
)
def test_the_backend_follows_every_members_device(members: list[str], backend: str) -> None:
    assert weight_group_backend(members) == backend, f"{members}: the group must use {backend}"


def test_an_empty_group_is_refused_and_cpu_members_name_the_cpu() -> None:
    with pytest.raises(WeightSyncError, match="at least the trainer"):
        weight_group_backend([])
    assert member_device(torch.device("cpu")) == "cpu", "a CPU member says cpu"
    assert transfer_device("gloo", torch.device("cuda", 0)) == torch.device("cpu"), (
        "under gloo a CUDA member stages its tensors in host memory"
    )
    assert transfer_device("nccl", torch.device("cuda", 0)) == torch.device("cuda", 0), "under NCCL tensors stay on the GPU"


def agree_all(members: list[str]) -> list[str]:
    """Every member's `agree_backend` over one real TCPStore, concurrently, as separate processes would."""
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    clients = [master] + [dist.TCPStore(HOST, master.port, is_master=False, timeout=timedelta(seconds=10))
                          for _ in members[1:]]
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(agree_backend, dist.PrefixStore("g", store), rank, len(members), member, 10.0)
                   for rank, (store, member) in enumerate(zip(clients, members))]
        return [f.result() for f in futures]


def test_the_trainer_and_cuda_engines_agree_on_nccl_through_the_store() -> None:
    assert agree_all(["cuda:GPU-t", "cuda:GPU-1", "cuda:GPU-2"]) == ["nccl"] * 3, (
        "the trainer and every CUDA engine form the same NCCL group (a gloo trainer with NCCL engines hangs both)"
    )
    assert agree_all(["cpu", "cuda:GPU-1"]) == ["gloo"] * 2, "one member without a GPU moves every member to gloo"


def test_a_member_that_never_says_its_device_fails_the_join_with_a_clear_error() -> None:
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(WeightSyncError, match="said its device"):
        agree_backend(dist.PrefixStore("lonely", master), 0, 2, "cpu", 0.5)


def test_a_gloo_broadcast_delivers_the_manifest_exactly() -> None:
    state = {"w": torch.randn(8, 4), "b": torch.arange(6, dtype=torch.int64), "h": torch.randn(3).to(torch.bfloat16)}
    sender = WeightSender.listen(2, host=HOST, group_name="unit", timeout_s=20.0, device="cpu")
    joined: dict[str, WeightGroup] = {}
    engine = threading.Thread(target=lambda: joined.setdefault(
        "g", WeightGroup.join(HOST, sender.port, 2, 1, "unit", 20.0, torch.device("cpu"), HOST)))
    engine.start()
    sender.connect()
    engine.join(timeout=30)
    group = joined["g"]
    assert sender.backend == group.backend == "gloo", "CPU members agree on gloo"
    received: dict[str, dict[str, torch.Tensor]] = {}
    receiver = threading.Thread(target=lambda: received.setdefault("s", group.receive(manifest_of(state))))
    receiver.start()
    sent = sender.send(state)
    receiver.join(timeout=30)
    assert sent == sum(t.numel() * t.element_size() for t in state.values()), "every byte of the manifest was sent"
    assert all(torch.equal(received["s"][name], tensor) for name, tensor in state.items()), (
        "the engine received every tensor exactly, in manifest order"
    )
