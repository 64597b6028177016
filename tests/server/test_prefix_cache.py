"""Prefix caching over a real server: a chat client resending its history gets the cached
tokens in usage.prompt_tokens_details and in /metrics, the same text, and the flag turns it
off."""

from __future__ import annotations

from pathlib import Path

import openai

from braid import LLM
from braid.sampling_params import SamplingParams
from tests.server.conftest import ENGINE_FLAGS, ENGINE_OPTIONS, ServerProcess
from tests.server.metrics_util import scrape

SYSTEM = "You are a careful assistant. " * 6


def turns(client: openai.OpenAI, model: str, stream: bool = False) -> list[tuple[str, int, int]]:
    """Two turns of one conversation: (answer, prompt tokens, cached tokens) each."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    out = []
    for question in ("and then?", None):
        if stream:
            chunks = list(client.chat.completions.create(
                model=model, messages=messages, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            res = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                 temperature=0)
            text, usage = res.choices[0].message.content or "", res.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        out.append((text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": text}]
        if question:
            messages += [{"role": "user", "content": question}]
    return out


def test_multi_turn_chat_reports_cached_tokens(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                           timeout=60)
    before = scrape(server.url)
    first, second = turns(client, server.model)
    after = scrape(server.url)
    # the second turn resends the first: all its full blocks but the last are cached
    assert second[2] >= first[1] - 8 and second[2] % 4 == 0
    assert after["braid:prefix_cache_queries_total"] - before.get(
        "braid:prefix_cache_queries_total", 0) == first[1] + second[1]
    assert after["braid:prefix_cache_hits_total"] - before.get(
        "braid:prefix_cache_hits_total", 0) == first[2] + second[2]
    assert 0 < after["braid:prefix_cache_hit_rate"] <= 1
    streamed = turns(client, server.model, stream=True)
    assert [t[0] for t in streamed] == [first[0], second[0]]
    assert streamed[0][2] > 0 and streamed[1][2] >= second[2]  # the whole history is cached


def test_the_flag_turns_caching_off(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = ServerProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS, "--no-enable-prefix-caching")
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0,
                               timeout=60)
        plain = turns(client, proc.model)
        assert [t[2] for t in plain] == [0, 0]
        assert scrape(proc.url)["braid:prefix_cache_hits_total"] == 0
    finally:
        assert proc.stop() == 0, proc.log()


def test_cached_text_equals_uncached(server: ServerProcess, tiny_model_dir: Path,
                                     tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                           timeout=60)
    prompt = SYSTEM + "Q: why?"
    cached = [client.completions.create(model=server.model, prompt=prompt, max_tokens=8,
                                        temperature=0) for _ in range(2)]
    assert cached[1].usage is not None and cached[1].usage.prompt_tokens_details is not None
    assert cached[1].usage.prompt_tokens_details.cached_tokens > 0
    offline = LLM(server.model, **ENGINE_OPTIONS, enable_prefix_caching=False)
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert cached[0].choices[0].text == cached[1].choices[0].text == ref[0].outputs[0].text


def test_every_streamed_usage_reports_the_cached_tokens(server: ServerProcess) -> None:
    """With continuous_usage_stats each chunk's usage has the prompt's cached tokens, not 0
    until the last chunk."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                           timeout=60)
    prompt = SYSTEM + "Q: what now?"
    client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(
        model=server.model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    cached = {c.usage.prompt_tokens_details.cached_tokens for c in chunks
              if c.usage is not None and c.usage.prompt_tokens_details is not None}
    assert len(cached) == 1 and cached.pop() > 0
