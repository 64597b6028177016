"""The default target through braid gives the same greedy tokens as transformers on the same
GGUF."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPT = "Write a Python function that returns the sum of the squares of a list of integers."


def test_greedy_tokens_equal_transformers(default_target: Any, target_gguf: Path) -> None:
    model, tokenizer = default_target
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]),
                           add_special_tokens=False)
    engine = LLMEngine(EngineConfig(max_model_len=512, kv_cache_gib=0.25, log_stats_interval=0),
                       model=model, tokenizer=tokenizer)
    engine.add_request("r", ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    ours = [o for o in engine.run_until_done() if o.finished][0].outputs[0].token_ids

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_gguf.parent), gguf_file=target_gguf.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          min_new_tokens=32)[0, len(ids):].tolist()
    del hf
    gc.collect()
    assert ours == ref
