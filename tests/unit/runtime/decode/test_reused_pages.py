"""A filled block whose page holds other KV by the time the reader pulls it (vLLM preempted the
sequence after the block was captured, freed the page and gave it to another request:
runtime/vllm_engine/compute.py) is refused by its digest, taken from the page when the block
filled, and never published; the turn is served all the same."""

from __future__ import annotations

from pathlib import Path

from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.runtime.decode.filled_blocks import PagePulls
from dualpath_ray.runtime.decode.job import DecodeJob
from tests.engine_harness import EngineHarness, Request, served_alone
from tests.unit.runtime.prefill.test_prefill_core import BLOCK, config, tokens


class ReusedPage(PagePulls):
    """The first block filled while decoding is pulled from `other`, a page holding another
    request's KV: what a pull reads once vLLM reused the page it was captured from."""

    def __init__(self, pages: PagedKVPool, other: int) -> None:
        super().__init__(pages)
        self.other = other
        self.reused: list[tuple[str, int]] = []

    def capture(self, job: DecodeJob, block: int) -> int:
        if not self.reused and block >= job.prompt_len // BLOCK:
            self.reused.append((job.owner, block))
            return self.other
        return super().capture(job, block)


def test_a_block_pulled_from_a_reused_page_is_refused_by_its_digest_and_not_published(tmp_path: Path) -> None:
    prompt = tokens(50, 5)
    want = served_alone(config(), tmp_path / "reference", Request("r", prompt, "pe", max_new_tokens=60))
    h = EngineHarness(config(), tmp_path / "run")
    try:
        h.pages.reserve("other#0", 1)
        (other,) = h.pages.ensure("other#0", BLOCK)
        h.pages.page(other).fill_(0x5A)  # another request's KV
        pulls = ReusedPage(h.pages, other)
        h.decode.persistence.filled = pulls
        (result,) = h.serve([Request("r", prompt, "pe", max_new_tokens=60)])
        ((_, reused),) = pulls.reused
        assert reused == len(prompt) // BLOCK, "the first block filled while decoding was pulled from the reused page"
        assert result.error is None and result.output_tokens == want.output_tokens, (
            "the turn is served, with the tokens of a run whose pages were never reused"
        )
        assert [b.key for b in result.persisted] == [b.key for b in want.persisted[:reused]], (
            "the turn publishes its chain only up to the block read from the reused page"
        )
        assert not h.store.contains(want.persisted[reused].key), "the reused page's bytes are not published under its key"
        assert h.readers.cores["d0"].persist_mismatches == 1, "the reader refused it by its digest, and counted it"
        h.pages.release("other#0")
        h.assert_idle()
    finally:
        h.close()
