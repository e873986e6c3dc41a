"""The wait-or-compute rule of in-flight sharing: pure, one comparison of two estimated ends.

A request about to be placed whose next blocks (past its stored hit) are promised by a
producer in flight (kv/promised.py) can

- compute them itself, now:  end = engine_wait + prefill_s(hit, promised + miss)
- wait for the producer:      end = max(ready_in + (read_queue + promised) / read_rate, engine_wait)
                                    + prefill_s(hit + promised, miss)

where engine_wait is the time the prefill engines need for the tokens they hold before it
(engine_queue_tokens at the compute rate), ready_in the time until the producer publishes the
blocks (its estimate, scheduling/sharing.py), the promised blocks are then read through a
reader whose queue holds read_queue_tokens, and prefill_s is the latency model's time of one
request's prefill given (cached, new) tokens (scheduling/compute_path.py's ComputePathModel: the
same estimates as the compute path). The hit is read in both cases and left out of both.

It waits only if waiting ends strictly sooner: of equal ends computing wins (no dependency on
another request, nothing to release if that one fails). `tests/unit/scheduling/test_share_rule.py`
checks it against the rule written out literally.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath_ray.scheduling.compute_path import ComputePathModel


@dataclass(frozen=True)
class ShareInputs:
    """One request's figures when it is considered for a prefill engine."""

    hit_tokens: int  # stored already (its late hit)
    promised_tokens: int  # the producer's run right after the hit
    miss_tokens: int  # the rest of its prompt (at least one: the token that yields the logits)
    ready_in_s: float  # until the producer publishes the promised blocks (0 if it is late)
    read_queue_tokens: int  # queued on the reader the promised blocks would be read through
    engine_queue_tokens: int  # prefill tokens the engines it may land on hold before it

    def __post_init__(self) -> None:
        if min(self.hit_tokens, self.promised_tokens, self.read_queue_tokens, self.engine_queue_tokens) < 0 or (
            self.miss_tokens < 1 or self.ready_in_s < 0
        ):
            raise ValueError(f"share inputs must be >= 0 (miss >= 1): {self}")


def end_if_computed(inputs: ShareInputs, model: ComputePathModel) -> float:
    """Seconds from now to the end of its prefill when it computes the promised blocks itself."""
    engine_wait = inputs.engine_queue_tokens / model.compute_tokens_per_s
    return engine_wait + model.prefill_s(inputs.hit_tokens, inputs.promised_tokens + inputs.miss_tokens)


def end_if_waiting(inputs: ShareInputs, model: ComputePathModel) -> float:
    """Seconds from now to the end of its prefill when it waits for the producer and reads them."""
    engine_wait = inputs.engine_queue_tokens / model.compute_tokens_per_s
    read_done = inputs.ready_in_s + (inputs.read_queue_tokens + inputs.promised_tokens) / model.read_tokens_per_s
    return max(read_done, engine_wait) + model.prefill_s(inputs.hit_tokens + inputs.promised_tokens, inputs.miss_tokens)


def should_wait(inputs: ShareInputs, model: ComputePathModel) -> bool:
    """Whether waiting for the producer ends the request strictly sooner (module doc)."""
    if inputs.promised_tokens == 0:
        return False
    return end_if_waiting(inputs, model) < end_if_computed(inputs, model)
