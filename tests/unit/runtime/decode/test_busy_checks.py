"""A decode engine whose compute keeps the KV in pages of its own (vLLM's) and has none free for a
call yet raises ComputeBusy (runtime/compute/engine_compute.py); the decode intake
(runtime/decode/intake.py) then waits and tries again in a later round, never failing the request:

- runtime.verify_kv's recompute of a prompt's expected KV, run before the prompt lands
  (`_expect_then_load`): the job waits RESERVED, the jobs after it with it, in order;
- the digest check of a landed prompt reading it back (`poll_loads`): the job waits LOADING;
- oracle mode: the check's recompute, run before the compute computes the prompt, and the
  prompt's compute itself (`_materialise`), also when the compute has pages for some of the
  handoffs of a round only.

Each test serves its requests with the first tries of one call busy (tests/held_compute.py) and
shows the turns served with the tokens of a compute that never was busy, every check run and
passed, `busy_checks` counting the waits, and nothing left held (pages, buffer slots, the
compute's pages)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.messages import TurnResult
from dualpath_ray.runtime.compute.engine_compute import ModelCompute
from tests.engine_harness import EngineHarness, Request
from tests.held_compute import HeldPagesCompute
from tests.unit.runtime.prefill.test_prefill_core import config, tokens

N_PAGES = 64  # the held compute's pages: ample, so every ComputeBusy here is an injected one
REQUESTS = [Request(f"r{i}", tokens(40 + 9 * i, 30 + i), "pe", max_new_tokens=24) for i in range(3)]
PROMPTS = {tuple(r.prompt): r.request_id for r in REQUESTS}


def model_config() -> DualPathConfig:
    """The native model's tokens and KV (runtime.verify_kv on), so a check compares real KV."""
    return config().with_overrides(emulation={"compute": "model"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, ...]]:
    """The requests' tokens on an engine pair whose compute keeps no KV of its own and never is busy."""
    h = EngineHarness(model_config(), tmp_path_factory.mktemp("reference"))
    try:
        return {r.request_id: tuple(r.output_tokens) for r in h.serve(REQUESTS)}
    finally:
        h.close()


def served(
    tmp_path: Path, busy: dict[str, int], oracle: bool = False, prompt_page_limit: int | None = None,
) -> tuple[EngineHarness, HeldPagesCompute, list[TurnResult]]:
    """REQUESTS, submitted at once, on a held-KV compute whose first `busy[site]` calls at each
    site raise ComputeBusy; the harness is left idle-checked and closed."""
    cfg = model_config()
    compute = HeldPagesCompute(ModelCompute(cfg, KVLayout.from_model(cfg.model, cfg.store.block_size), torch.device("cpu")), N_PAGES)
    compute.busy.update(busy)
    compute.prompt_page_limit = prompt_page_limit
    h = EngineHarness(cfg, tmp_path, compute=compute)
    try:
        results = h.serve(REQUESTS, oracle=oracle)
        assert all(left == 0 for left in compute.busy.values()), f"every injected ComputeBusy was met: {compute.busy}"
        h.assert_idle()
        assert compute.free_pages() == N_PAGES, "every sequence's pages in the compute went back"
        return h, compute, results
    finally:
        h.close()


def assert_served_exactly(h: EngineHarness, results: list[TurnResult], reference: dict[str, tuple[int, ...]]) -> None:
    assert [r.error for r in results] == [None] * len(REQUESTS), f"a busy compute fails no request: {[r.error for r in results]}"
    assert {r.request_id: tuple(r.output_tokens) for r in results} == reference, (
        "the tokens equal those of a compute that never was busy"
    )
    assert all(r.kv_bytes_verified > 0 and r.kv_mismatches == 0 for r in results), (
        f"runtime.verify_kv checked every prompt, and it passed: {[(r.kv_bytes_verified, r.kv_mismatches) for r in results]}"
    )
    assert h.decode.stats.verify_mismatches == 0 and h.decode.stats.failures == 0, f"no check failed: {h.decode.stats}"


def calls(compute: HeldPagesCompute, *sites: str) -> list[tuple[str, str]]:
    """The compute's calls at `sites` (busy ones too), in order, by request."""
    return [(site, PROMPTS[prompt]) for site, prompt in compute.events if site.split()[0] in sites]


def test_a_check_recompute_with_no_pages_waits_with_the_jobs_after_it_in_order(tmp_path: Path, reference) -> None:
    h, compute, results = served(tmp_path, {"fill": 3})
    assert_served_exactly(h, results, reference)
    assert h.decode.stats.busy_checks == 3, f"each busy recompute counted one wait: {h.decode.stats}"
    assert calls(compute, "fill") == [("fill busy", "r0")] * 3 + [("fill", "r0"), ("fill", "r1"), ("fill", "r2")], (
        "the first job's recompute is tried again until it runs; the jobs after it are not tried before it"
    )
    assert calls(compute, "fill", "load") == [("fill busy", "r0")] * 3 + [
        ("fill", "r0"), ("load", "r0"), ("fill", "r1"), ("load", "r1"), ("fill", "r2"), ("load", "r2"),
    ], "no prompt lands before its check's expected KV is recomputed, and they land in arrival order"


def test_a_landed_prompt_that_cannot_be_read_back_yet_waits_loading(tmp_path: Path, reference) -> None:
    h, compute, results = served(tmp_path, {"read": 4})
    assert_served_exactly(h, results, reference)
    stats = h.decode.stats
    assert stats.busy_checks == 4, f"each busy read-back of a landed prompt counted one wait: {stats}"
    assert stats.loads == len(REQUESTS) and stats.digest_mismatches == 0 and stats.digest_reloads == 0, (
        f"a busy digest check counts no load and no mismatch, and loads nothing again: {stats}"
    )
    reads = calls(compute, "read", "load")
    for request in REQUESTS:
        mine = [site for site, name in reads if name == request.request_id]
        assert mine[0] == "load" and "read busy" not in mine[mine.index("read"):], (
            f"{request.request_id}: its prompt landed, was read back busy until it could be, then checked: {mine}"
        )


def test_oracle_prompts_the_compute_has_no_pages_for_wait_and_are_computed_later(tmp_path: Path, reference) -> None:
    """Oracle mode with runtime.verify_kv: a prompt compute that finds no pages is tried again (it
    failed the requests with ComputeBusy before)."""
    h, compute, results = served(tmp_path, {"prompts": 2}, oracle=True)
    assert_served_exactly(h, results, reference)
    assert h.decode.stats.busy_checks == 2, f"each busy prompt compute counted one wait: {h.decode.stats}"
    prompts = calls(compute, "prompts")
    assert prompts[:2] == [("prompts busy", "r0")] * 2 and sorted(name for _, name in prompts[2:]) == ["r0", "r1", "r2"], (
        f"the busy compute was tried again, and then computed every prompt once: {prompts}"
    )


def test_oracle_checks_recompute_before_the_prompt_is_computed_and_wait_when_busy(tmp_path: Path, reference) -> None:
    """Oracle mode with runtime.verify_kv: the check's expected KV is recomputed before the compute
    holds the prompt in its pages (as a landing prompt's is), and a busy recompute waits (it
    failed the requests with ComputeBusy before)."""
    h, compute, results = served(tmp_path, {"fill": 2}, oracle=True)
    assert_served_exactly(h, results, reference)
    assert h.decode.stats.busy_checks == 2, f"each busy recompute counted one wait: {h.decode.stats}"
    order = calls(compute, "fill", "prompts")
    assert order[:2] == [("fill busy", "r0")] * 2, f"the first job's recompute waited: {order}"
    for request in REQUESTS:
        mine = [site for site, name in order if name == request.request_id and "busy" not in site]
        assert mine == ["fill", "prompts"], f"{request.request_id}: recomputed for its check, then computed into pages: {mine}"


def test_oracle_prompts_that_do_not_fit_together_are_computed_and_run_in_turn(tmp_path: Path, reference) -> None:
    """Oracle mode: the compute has pages for the first two prompts of a round (3 + 4 pages) but
    not the third (4 more beyond its 10): the two it computed run, and end, before the third is
    computed. Retrying the round's batch as a whole would wait for ever, the two computed
    sequences holding the pages and never running (a vLLM decode engine under preemption failed
    them: "vLLM left 1 of 2 decode sequences out of 3 steps ... no other sequence to free any")."""
    h, compute, results = served(tmp_path, {}, oracle=True, prompt_page_limit=10)
    assert_served_exactly(h, results, reference)
    order = [(site, name) for site, name in calls(compute, "prompts") if site != "prompts"]
    assert order and all(name == "r2" for _, name in order), f"only the third prompt waited for pages: {order}"
    assert h.decode.stats.busy_checks >= 1, f"its waits were counted: {h.decode.stats}"
