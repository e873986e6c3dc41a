"""RequestSteps (request_steps.py): the continuous prefill loop's StepKV dispatches each step's hooks
to the chunks vLLM scheduled in it, fails a chunk alone, and keeps vLLM's prefix cache honest
(a failed chunk's blocks are suspect; a request served one of them from the cache fails too)."""

from __future__ import annotations

import torch

from dualpath_ray.runtime.compute.prefill_kv import PrefillMoved
from dualpath_ray.runtime.transport.moves import TransportError
from dualpath_ray.runtime.vllm_engine.request_steps import RequestSteps
from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV

B = 4  # block size


class ChunkStep:
    """One chunk's step (a PagedPrefillStep's hooks), recording them; `fail_at` layer raises."""

    def __init__(self, fail_at: int | None = None, reads: int = 1) -> None:
        self.fail_at = fail_at
        self.calls: list[str] = []
        self.moved = PrefillMoved(reads=reads, block_layers_in=2, cnic_in={"de": 10})
        self.per_peer: dict[tuple[int, str], int] = {(0, "reader/d0"): 1}

    def begin(self, requests: list[ScheduledKV], layers: list[torch.Tensor], codec: object) -> None:
        self.calls.append(f"begin {[r.key for r in requests]}")

    def before_layer(self, layer: int) -> None:
        self.calls.append(f"before {layer}")
        if layer == self.fail_at:
            raise TransportError(f"layer {layer}'s landing differs from its digests after a second read")

    def after_layer(self, layer: int) -> None:
        self.calls.append(f"after {layer}")

    def end(self) -> None:
        self.calls.append("end")

    def recover(self) -> None:
        self.calls.append("recover")


def run_step(steps: RequestSteps, requests: list[ScheduledKV], n_layer: int = 2) -> dict[str, BaseException]:
    """The hooks vLLM's forward calls in one step (connector.py), in order."""
    steps.new_step()
    steps.begin(requests, [], None)  # type: ignore[arg-type]
    for layer in range(n_layer):
        steps.before_layer(layer)
        steps.after_layer(layer)
    steps.end()
    return steps.take_failed()


def test_a_step_of_two_admissions_is_mixed_and_a_failed_landing_fails_its_chunk_alone() -> None:
    steps = RequestSteps(B)
    good, bad, later = ChunkStep(), ChunkStep(fail_at=1), ChunkStep()
    steps.add("a", 1, good)  # type: ignore[arg-type]
    steps.add("b", 2, bad)  # type: ignore[arg-type]
    failed = run_step(steps, [ScheduledKV("a", (0, 1), 4, 4, 0, True), ScheduledKV("b", (2, 3, 4), 8, 4, 0, True)])
    assert steps.mixed_steps == 1 and steps.steps == 1, "one step held chunks of two admissions"
    assert set(failed) == {"b"} and isinstance(failed["b"], TransportError), "the failed landing fails its own chunk"
    assert good.calls == ["begin ['a']", "before 0", "after 0", "before 1", "after 1", "end"], (
        "the other chunk of the step went through every hook"
    )
    assert bad.calls == ["begin ['b']", "before 0", "after 0", "before 1", "recover"], (
        "the failed chunk took no hook after its failure, and its transfers ended and pages settled at the step's end"
    )
    assert steps.tainted == {2, 3, 4} and steps.suspect(), "every block the failed chunk held is suspect"

    steps.add("c", 3, later)  # type: ignore[arg-type]
    steps.add("d", 3, ChunkStep())  # type: ignore[arg-type]
    failed = run_step(steps, [
        ScheduledKV("c", (2, 3, 9), 8, 2, 8, True),  # its first 8 tokens came from vLLM's cache: the failed chunk's blocks
        ScheduledKV("d", (2, 7), 4, 2, 0, True),  # block 2 handed to it fresh (nothing cached): its own
        ScheduledKV("a", (0, 1), 8, 1, 8, False),
    ])
    assert set(failed) == {"c"}, (
        "a request vLLM's prefix cache served a suspect block fails; one given a freed block fresh, and one running, go on"
    )
    assert later.calls == ["recover"], "the tainted chunk computed nothing of ours and ended clean"
    assert steps.mixed_steps == 2, "that step mixed admissions 1 and 3"

    for key in ("a", "b", "c", "d"):
        steps.pop(key)
    moved = steps.take_moved()
    assert moved.reads == 4 and moved.block_layers_in == 8 and moved.cnic_in == {"de": 40}, (
        f"every popped chunk's transfers fold into the loop's figures: {moved}"
    )
    assert moved.max_transfers_per_layer_peer == 2, "per step, the chunks' transfers per layer and peer add up"
    assert steps.take_moved().reads == 0, "taken once"
    steps.clear_suspect()
    assert not steps.suspect(), "an emptied prefix cache holds nothing suspect"


def test_a_failure_cascades_to_a_request_of_the_same_step_that_attends_over_its_blocks() -> None:
    """vLLM may serve a request of a step blocks another of the same step is landing (it caches
    blocks when it allocates them): when that landing fails, both fail."""
    steps = RequestSteps(B)
    steps.add("a", 1, ChunkStep(fail_at=0))  # type: ignore[arg-type]
    steps.add("b", 1, ChunkStep())  # type: ignore[arg-type]
    steps.add("c", 1, ChunkStep())  # type: ignore[arg-type]
    failed = run_step(steps, [
        ScheduledKV("a", (5, 6), 0, 8, 0, True),
        ScheduledKV("b", (5, 8), 4, 4, 4, True),  # block 5 from vLLM's cache: a's, landing in this step
        ScheduledKV("c", (9,), 0, 4, 0, True),
    ])
    assert set(failed) == {"a", "b"} and "attends over blocks of a" in str(failed["b"]), (
        "the request attending over the failed chunk's blocks fails with it, naming why; the third goes on"
    )
