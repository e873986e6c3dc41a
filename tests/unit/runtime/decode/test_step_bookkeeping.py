"""The decode core's per-step bookkeeping, which it keeps on the job rather than asking again
every step: the stop rules read once as a sequence starts running (`StepLimits`), and its page
table, for which the engine's books are asked only when the sequence grows past its last page."""

from __future__ import annotations

from pathlib import Path

from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.protocol.types import StopReason
from tests.engine_harness import EngineHarness, Request
from tests.unit.runtime.prefill.test_prefill_core import BLOCK, config, tokens


class CountingPool(PagedKVPool):
    """The engine's real page books, counting the tables `ensure` grew or returned."""

    ensures = 0

    def ensure(self, owner: str, tokens: int) -> tuple[int, ...]:
        CountingPool.ensures += 1
        return super().ensure(owner, tokens)


def test_stop_ids_length_and_context_stop_a_sequence_where_its_tokens_say(tmp_path: Path) -> None:
    cfg = config()
    h = EngineHarness(cfg, tmp_path / "h")
    try:
        (reference,) = h.serve([Request("ref", tokens(40, 1), "pe", max_new_tokens=12)])
        stop = reference.output_tokens[5]
        first = reference.output_tokens.index(stop)
        near_end = cfg.model.max_context - 3
        stopped, long, context = h.serve([
            Request("stop", tokens(40, 1), "pe", max_new_tokens=12, stop_token_ids=(stop,)),
            Request("long", tokens(40, 1), "pe", max_new_tokens=12),
            Request("context", tokens(near_end, 2), "pe", max_new_tokens=12),
        ])
    finally:
        h.close()
    assert reference.stop_reason is StopReason.LENGTH and len(reference.output_tokens) == 12, (
        "a sequence with no stop id runs to max_new_tokens"
    )
    assert stopped.stop_reason is StopReason.STOP and stopped.output_tokens == reference.output_tokens[: first + 1], (
        "a stop id ends the sequence at its first occurrence, the stop token included"
    )
    assert long.output_tokens == reference.output_tokens and long.stop_reason is StopReason.LENGTH, (
        "the same request decodes the same tokens and stops at its length again"
    )
    assert context.stop_reason is StopReason.CONTEXT and len(context.output_tokens) == 3, (
        "a sequence whose tokens fill model.max_context stops there, before its max_new_tokens"
    )


def test_the_page_books_are_asked_once_per_page_a_sequence_grows_into(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("tests.engine_harness.PagedKVPool", CountingPool)
    CountingPool.ensures = 0
    h = EngineHarness(config(), tmp_path / "h")
    try:
        prompt, new = 40, 60
        seen: list[bool] = []
        h.prefill.accept([h.task(Request("r", tokens(prompt, 3), "pe", max_new_tokens=new))])
        while not h.collector.results:
            h.prefill.step()
            h.decode.step()
            seen += [job.page_table == h.pages.table(job.owner) for job in h.decode.jobs.values() if job.page_table]
        (result,) = h.collector.results
    finally:
        h.close()
    assert result.error is None and len(result.output_tokens) == new, "the request decodes all its tokens"
    assert seen and all(seen), "the table a job keeps is the engine's books' table after every step"
    # The intake's ensure at the load, then one per page the decode steps reach: positions
    # prompt .. prompt + new - 2 take a token's KV each (the last sampled token's KV is never computed).
    pages_decoded = (prompt + new - 2) // BLOCK - prompt // BLOCK + 1
    assert CountingPool.ensures == 1 + pages_decoded, (
        f"the books are asked once per page the sequence grows into ({CountingPool.ensures} asks for "
        f"{pages_decoded} pages of decode)"
    )
