"""The engine section at the YAML boundary: tensor parallelism is refused, by name and with why,
until the per-rank connector is wired (docs/architecture.md, the vLLM engine backend); the
decode engines' vLLM page count, and the settings it cannot run with."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath_ray.config import ConfigError, load_config, parse_config
from dualpath_ray.protocol.types import Role
from dualpath_ray.runtime.vllm_engine.host import engine_kwargs


def test_a_tensor_parallel_vllm_engine_is_refused_at_load_naming_the_field_and_why(tmp_path: Path) -> None:
    path = tmp_path / "tp2.yaml"
    path.write_text("engine:\n  backend: vllm\n  vllm_tensor_parallel_size: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "engine.vllm_tensor_parallel_size" in message and str(path) in message, (
        f"the error names the file and the field: {message}"
    )
    assert "worker process" in message and "vllm_tensor_parallel_size: 1" in message, (
        f"the error says why (vLLM's ranks run in worker processes of their own) and the fix: {message}"
    )


def test_one_rank_is_the_default_and_loads() -> None:
    assert parse_config({"engine": {"backend": "vllm"}}).engine.vllm_tensor_parallel_size == 1, (
        "a vLLM engine runs one rank unless told otherwise"
    )
    assert parse_config({"engine": {"backend": "vllm", "vllm_tensor_parallel_size": 1}}).engine.vllm_tensor_parallel_size == 1, (
        "an explicit single rank is accepted"
    )


def test_a_tensor_parallel_size_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="engine.vllm_tensor_parallel_size"):
        parse_config({"engine": {"vllm_tensor_parallel_size": 0}})


def test_a_vllm_token_budget_below_max_num_seqs_is_refused_naming_both_fields_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"engine": {"backend": "vllm", "vllm_max_num_seqs": 32, "vllm_max_num_batched_tokens": 16}})
    message = str(err.value)
    assert "engine.vllm_max_num_batched_tokens" in message and "engine.vllm_max_num_seqs" in message, (
        f"the error names the budget and the field it must reach: {message}"
    )
    assert "at least 32" in message, f"the error says the fix (the smallest budget vLLM takes): {message}"


def test_the_vllm_token_budget_reaches_vllms_engine_arguments() -> None:
    pytest.importorskip("vllm")
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.vllm_engine.host import engine_kwargs

    base = {"model": {"n_layer": 2, "hidden_size": 128, "n_head": 4, "n_kv_head": 2, "head_dim": 32},
            "engine": {"backend": "vllm", "vllm_max_num_seqs": 8}}
    unset = parse_config(base)
    assert unset.engine.vllm_max_num_batched_tokens is None, "unset by default"
    window = unset.cluster.prefill_hbm_tokens
    for role in (Role.PREFILL, Role.DECODE):
        assert engine_kwargs(unset, role)["max_num_batched_tokens"] == window, (
            "unset, a prefill batch is one vLLM step: the budget is the prefill window's tokens"
        )
    chunked = parse_config({**base, "engine": {**base["engine"], "vllm_max_num_batched_tokens": 40}})
    assert engine_kwargs(chunked, Role.PREFILL)["max_num_batched_tokens"] == 40, (
        "set, it is the prefill engines' vLLM per-step token budget"
    )
    assert engine_kwargs(chunked, Role.DECODE)["max_num_batched_tokens"] == window, (
        "a decode engine keeps the window's budget (its recomputes into pages stay one step)"
    )
    with pytest.raises(ConfigError, match="engine.vllm_max_num_batched_tokens"):
        parse_config({**base, "engine": {**base["engine"], "vllm_max_num_batched_tokens": 0}})


def test_vllm_kv_pages_sizes_the_decode_engines_vllm_pages_and_refuses_what_cannot_progress() -> None:
    base = {"model": {"max_context": 512}, "store": {"block_size": 64}, "engine": {"backend": "vllm"}}
    cfg = parse_config({**base, "engine": {"backend": "vllm", "vllm_kv_pages": 8}})
    assert engine_kwargs(cfg, Role.DECODE)["num_gpu_blocks_override"] == 8, "the decode engine's vLLM gets exactly 8 pages"
    default = parse_config(base)
    assert engine_kwargs(cfg, Role.PREFILL)["num_gpu_blocks_override"] == engine_kwargs(default, Role.PREFILL)[
        "num_gpu_blocks_override"
    ], "a prefill engine's pages stay sized to its window (a prefill batch is one step: it must never preempt)"
    with pytest.raises(ConfigError, match=r"engine.vllm_kv_pages \(7\).*>= 8"):
        parse_config({**base, "engine": {"backend": "vllm", "vllm_kv_pages": 7}})
    with pytest.raises(ConfigError, match=r"runtime.verify_kv recomputes one beside them.*>= 16"):
        parse_config({**base, "engine": {"backend": "vllm", "vllm_kv_pages": 8}, "runtime": {"verify_kv": True}})
    verified = parse_config({**base, "engine": {"backend": "vllm", "vllm_kv_pages": 16}, "runtime": {"verify_kv": True}})
    assert verified.engine.vllm_kv_pages == 16, "two longest sequences' pages run runtime.verify_kv beside a sequence"
    with pytest.raises(ConfigError, match="runtime.kv_digests: true"):
        parse_config({**base, "engine": {"backend": "vllm", "vllm_kv_pages": 8}, "runtime": {"kv_digests": False}})
    with pytest.raises(ConfigError, match="engine.vllm_kv_pages"):
        parse_config({"engine": {"vllm_kv_pages": 0}})


def test_continuous_batching_off_the_vllm_backend_is_refused_naming_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"engine": {"backend": "native", "vllm_continuous_batching": True}})
    message = str(err.value)
    assert "engine.vllm_continuous_batching" in message and "engine.backend: vllm" in message, (
        f"the error names the field and the fix: {message}"
    )
    assert parse_config({"engine": {"backend": "vllm", "vllm_continuous_batching": True}}).engine.vllm_continuous_batching, (
        "on the vllm backend it is taken"
    )
