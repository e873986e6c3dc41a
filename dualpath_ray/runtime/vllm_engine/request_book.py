"""What the connector's scheduler side knows of each vLLM request, without vLLM: `RequestBook`.

vLLM's scheduler tells a KV connector about a request in three moments, and the book turns
them into one `ScheduledKV` per request per step (runtime/vllm_engine/step_kv.py):

1. `matched(request_id, key, external, local_hits)`: vLLM asks how many tokens beyond its own
   prefix-cache hit (`local_hits`, block-aligned) the connector can load. Our requests say how
   many of their first tokens have KV outside vLLM (`external`: a prefill chunk's hit and
   earlier-chunk tokens, a decode sequence's prompt); the answer is what of those vLLM's cache
   does not hold. vLLM may ask again and again while the request waits for pages.
2. `allocated(request_id, loading)`: vLLM gave the request pages and will compute it in the
   coming step with `loading` tokens loaded first (vLLM's figure, after its own adjustments).
3. Each step: `new_request` for a request scheduled for the first time (its full page list),
   `cached_request` for one scheduled again (its added pages, or, when `resumed`, its new full
   page list after a preemption, which freed every page it had).

Invariants the book keeps (tests/unit/runtime/vllm_engine/test_request_book.py):
- a request's page list is what vLLM says: appended for a running request, replaced for a
  new or resumed one (vLLM's `resumed_req_ids` contract), never a mix of old and new pages;
- a load is planned exactly once per allocation: a step loads [computed - loading, computed)
  where `loading` is what `allocated` recorded for it, and a later step loads nothing;
- a resumed request loads its external tokens again (its old pages are gone) past what vLLM's
  prefix cache holds for it then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from dualpath_ray.runtime.vllm_engine.step_kv import ScheduledKV


@dataclass
class _BookEntry:
    key: str
    external: int
    # A tuple, rebuilt only when vLLM adds or replaces pages (once every block_size decode
    # steps): every step's ScheduledKV shares it rather than copying the list.
    block_ids: tuple[int, ...] = ()
    loading: int = 0  # recorded at allocation, consumed by the request's next scheduled step


@dataclass
class RequestBook:
    """See the module doc."""

    _entries: dict[str, _BookEntry] = field(default_factory=dict)

    def matched(self, request_id: str, key: str, external: int, local_hits: int) -> int:
        """Tokens the connector loads beyond vLLM's own `local_hits`: 0 when its cache holds
        every external token."""
        if external < 0 or local_hits < 0:
            raise ValueError(f"request {request_id}: external {external} and local hits {local_hits} must be >= 0")
        entry = self._entries.get(request_id)
        if entry is None:
            self._entries[request_id] = _BookEntry(key, external)
        return max(0, external - local_hits)

    def allocated(self, request_id: str, loading: int) -> None:
        """vLLM allocated the request's pages; its coming step loads `loading` tokens first."""
        entry = self._entry(request_id)
        if not 0 <= loading <= entry.external:
            raise ValueError(f"request {request_id}: vLLM plans to load {loading} tokens of its {entry.external} external ones")
        entry.loading = loading

    def new_request(self, request_id: str, block_ids: Sequence[int], computed: int, scheduled: int) -> ScheduledKV:
        """The request's first step: `computed` = vLLM's prefix-cache hits + the tokens loaded now."""
        entry = self._entries.setdefault(request_id, _BookEntry(request_id, 0))
        entry.block_ids = tuple(block_ids)
        return self._scheduled(request_id, entry, computed, scheduled, first=True)

    def cached_request(
        self, request_id: str, added_block_ids: Sequence[int] | None, computed: int, scheduled: int, resumed: bool,
    ) -> ScheduledKV:
        """A later step of the request; `resumed`: its first since vLLM preempted it, with
        `added_block_ids` its whole new page list."""
        entry = self._entries.setdefault(request_id, _BookEntry(request_id, 0))
        if resumed:
            entry.block_ids = tuple(added_block_ids or ())
        elif added_block_ids:
            entry.block_ids += tuple(added_block_ids)
        return self._scheduled(request_id, entry, computed, scheduled, first=resumed)

    def finished(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._entries)

    def _scheduled(self, request_id: str, entry: _BookEntry, computed: int, scheduled: int, first: bool) -> ScheduledKV:
        loading, entry.loading = (entry.loading, 0) if first else (0, entry.loading)
        if loading > computed:
            raise ValueError(f"request {request_id}: loads {loading} tokens but vLLM counts {computed} computed")
        return ScheduledKV(entry.key, entry.block_ids, computed, scheduled, computed - loading, first)

    def _entry(self, request_id: str) -> _BookEntry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise KeyError(f"vLLM allocated pages for request {request_id}, which it never matched through this connector")
        return entry
