"""RequestBook: the connector's scheduler-side view of vLLM's requests, driven the way vLLM's
scheduler drives a connector (matched -> allocated -> scheduled steps; preempt -> matched again
-> allocated -> resumed), with no vLLM."""

from __future__ import annotations

import pytest

from dualpath_ray.runtime.vllm_engine.request_book import RequestBook


def test_a_new_request_loads_its_external_tokens_past_vllms_prefix_cache_once() -> None:
    book = RequestBook()
    assert book.matched("r", "chunk-1", external=300, local_hits=128) == 172, (
        "the connector offers what vLLM's cache does not hold of the external tokens"
    )
    book.allocated("r", 172)
    first = book.new_request("r", [4, 7, 1, 9, 2], computed=300, scheduled=20)
    assert (first.key, first.load_from, first.loading, first.first) == ("chunk-1", 128, 172, True), (
        "the first step loads tokens [local hits, computed) under our key"
    )
    later = book.cached_request("r", [5], computed=320, scheduled=1, resumed=False)
    assert later.loading == 0 and not later.first, "a later step of a running request loads nothing"
    assert later.block_ids == (4, 7, 1, 9, 2, 5), "a running request's added pages are appended"


def test_vllms_cache_holding_every_external_token_means_no_load() -> None:
    book = RequestBook()
    assert book.matched("r", "k", external=128, local_hits=192) == 0, "nothing is loaded past a longer local hit"
    book.allocated("r", 0)
    step = book.new_request("r", [0, 1, 2, 3], computed=192, scheduled=8)
    assert step.loading == 0 and step.load_from == 192, "all of [0, computed) came from vLLM's cache"


def test_a_resumed_request_gets_its_new_pages_and_loads_again() -> None:
    book = RequestBook()
    book.matched("r", "seq", external=200, local_hits=0)
    book.allocated("r", 200)
    book.new_request("r", [1, 2, 3, 4], computed=200, scheduled=1)
    book.cached_request("r", None, computed=201, scheduled=1, resumed=False)
    # vLLM preempts it (every page freed), asks again and allocates anew: 64 tokens are still in its cache.
    assert book.matched("r", "seq", external=200, local_hits=64) == 136, "a resumed request is matched again"
    book.allocated("r", 136)
    resumed = book.cached_request("r", [8, 6, 5, 0], computed=200, scheduled=2, resumed=True)
    assert resumed.block_ids == (8, 6, 5, 0), "a resumed request's pages are replaced, never appended to the freed ones"
    assert (resumed.load_from, resumed.loading, resumed.first) == (64, 136, True), (
        "a resumed request loads its external tokens again past what vLLM's cache holds"
    )


def test_a_request_that_only_waits_keeps_no_load_for_later() -> None:
    book = RequestBook()
    book.matched("r", "k", external=64, local_hits=0)
    book.matched("r", "k", external=64, local_hits=0)  # asked again while it waits for pages
    book.allocated("r", 64)
    assert book.new_request("r", [3], computed=64, scheduled=1).loading == 64, "the allocation's load is the step's"
    assert book.cached_request("r", None, 65, 1, resumed=False).loading == 0, "the load was consumed by that step"


def test_finished_requests_are_forgotten_and_bad_figures_refused() -> None:
    book = RequestBook()
    book.matched("r", "k", external=64, local_hits=0)
    with pytest.raises(ValueError, match="plans to load 65 tokens"):
        book.allocated("r", 65)
    with pytest.raises(KeyError, match="never matched"):
        book.allocated("other", 0)
    book.finished("r")
    assert len(book) == 0, "a finished request leaves nothing behind"


def test_a_running_requests_steps_share_its_page_list_until_vllm_adds_pages() -> None:
    book = RequestBook()
    book.matched("r", "seq", external=64, local_hits=0)
    book.allocated("r", 64)
    pages = [3, 1]
    first = book.new_request("r", pages, computed=64, scheduled=1)
    pages.append(99)  # vLLM's list is its own: the book keeps what it was told
    steps = [book.cached_request("r", None, computed=65 + i, scheduled=1, resumed=False) for i in range(3)]
    assert all(step.block_ids is first.block_ids for step in steps), (
        "a decode step that adds no page copies no page list (one per block_size steps at most)"
    )
    grown = book.cached_request("r", [7], computed=68, scheduled=1, resumed=False)
    assert grown.block_ids == (3, 1, 7) and first.block_ids == (3, 1), (
        "added pages make a new list; the earlier steps' lists stay as they were"
    )
