"""GPU-only: the trainer's weight group on CUDA members (runtime/weights/sync.py). Two
members on one GPU agree on gloo (NCCL refuses two ranks on one GPU) and still deliver CUDA
weights exactly; members on two GPUs agree on NCCL and broadcast through it."""

from __future__ import annotations

import threading

import pytest
import torch

from dualpath_ray.runtime.weights.sync import WeightGroup, WeightSender, manifest_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

HOST = "127.0.0.1"


def broadcast(trainer: torch.device, engine: torch.device, name: str) -> tuple[str, str, dict[str, torch.Tensor], dict]:
    """One trainer and one engine (a thread each); returns both backends, what was sent and received."""
    state = {"w": torch.randn(256, 128, device=trainer, dtype=torch.bfloat16), "b": torch.arange(7, device=trainer)}
    sender = WeightSender.listen(2, host=HOST, group_name=name, timeout_s=60.0, device=trainer)
    box: dict[str, object] = {}

    def engine_side() -> None:
        group = WeightGroup.join(HOST, sender.port, 2, 1, name, 60.0, engine, HOST)
        box["backend"] = group.backend
        box["state"] = group.receive(manifest_of(state))

    thread = threading.Thread(target=engine_side)
    thread.start()
    sender.connect()
    sender.send(state)
    thread.join(timeout=120)
    return sender.backend, str(box["backend"]), state, box["state"]  # type: ignore[return-value]


def test_a_trainer_sharing_the_engines_gpu_agrees_on_gloo_and_delivers_exactly() -> None:
    gpu = torch.device("cuda", 0)
    trainer_backend, engine_backend, sent, received = broadcast(gpu, gpu, "one-gpu")
    assert trainer_backend == engine_backend == "gloo", "two ranks on one GPU cannot form NCCL; both pick gloo"
    assert all(torch.equal(received[k], v.cpu()) for k, v in sent.items()), "CUDA weights arrive byte for byte"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs here: it refuses two ranks on one GPU")
def test_members_on_two_gpus_agree_on_nccl_and_broadcast_through_it() -> None:
    trainer_backend, engine_backend, sent, received = broadcast(torch.device("cuda", 0), torch.device("cuda", 1), "two-gpus")
    assert trainer_backend == engine_backend == "nccl", "a trainer and an engine on their own GPUs use NCCL"
    assert all(torch.equal(received[k], v.cpu()) for k, v in sent.items()), "the NCCL broadcast is byte-exact"
