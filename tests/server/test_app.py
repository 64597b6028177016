"""The server against the official openai client and httpx: responses, streams, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from braid import LLM
from braid.sampling_params import SamplingParams
from tests.server.conftest import ENGINE_FLAGS, ENGINE_OPTIONS, ServerProcess
from tests.server.metrics_util import scrape
from tests.tiny import save_tiny_model


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(server: ServerProcess) -> LLM:
    return LLM(server.model, **ENGINE_OPTIONS)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert (card["root"], card["parent"], card["max_model_len"]) == (server.model, None, 256)
    [permission] = card["permission"]  # vLLM's card entry
    assert permission["object"] == "model_permission" and permission["allow_sampling"]
    assert permission["id"].startswith("modelperm-")


def test_sagemaker_ping_and_invocations_as_vllm(server: ServerProcess, client: openai.OpenAI
                                                ) -> None:
    """/ping is /health (GET and POST); /invocations answers a chat request (messages) or a
    completion request (prompt) as their own routes do, streams too; errors name the field."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    fields = {"model": server.model, "max_tokens": 6, "temperature": 0}
    chat = {**fields, "messages": [{"role": "user", "content": "hi"}]}
    got = httpx.post(f"{server.url}/invocations", json=chat, timeout=60).json()
    reply = client.chat.completions.create(**chat).choices[0].message.content  # type: ignore[call-overload]
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"]["content"] == reply
    got = httpx.post(f"{server.url}/invocations", json={**fields, "prompt": "abc"},
                     timeout=60).json()
    want = client.completions.create(**fields, prompt="abc")
    assert got["object"] == "text_completion" and got["choices"][0]["text"] == want.choices[0].text
    with httpx.stream("POST", f"{server.url}/invocations", json={**chat, "stream": True},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in lines[:-1])
    assert text == reply
    for body, param in (({"model": server.model}, "body"), ({**chat, "messages": 5}, "messages"),
                        ({**fields, "prompt": "abc", "bogus": 1}, "bogus")):
        r = httpx.post(f"{server.url}/invocations", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completion_matches_offline(server: ServerProcess, client: openai.OpenAI,
                                    offline: LLM) -> None:
    res = client.completions.create(model=server.model, prompt="Hello, braid", max_tokens=12,
                                    temperature=0)
    ref = offline.generate("Hello, braid", greedy(12), use_tqdm=False)[0]
    assert res.choices[0].text == ref.outputs[0].text
    assert res.choices[0].finish_reason == "length"
    assert res.usage is not None
    assert res.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert res.usage.completion_tokens == 12
    assert res.model_extra is not None and res.model_extra["braid"]["num_preemptions"] == 0


def test_completion_token_ids_prompt_and_logprobs(client: openai.OpenAI, server: ServerProcess,
                                                  offline: LLM) -> None:
    res = client.completions.create(model=server.model, prompt=[72, 105, 33], max_tokens=5,
                                    temperature=0, logprobs=2)
    ref = offline.generate([[72, 105, 33]], greedy(5), use_tqdm=False)[0]
    choice = res.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 5
    for top, lp in zip(choice.logprobs.top_logprobs or [], choice.logprobs.token_logprobs or [],
                       strict=True):
        assert top is not None and len(top) == 2
        assert lp is not None and lp <= 0  # greedy: the sampled token is the top one
        assert max(top.values()) == pytest.approx(lp, abs=1e-5)


def test_echo_with_max_tokens_0_scores_the_prompt(client: openai.OpenAI,
                                                  server: ServerProcess) -> None:
    """As vLLM: echo with max_tokens 0 returns the prompt and its logprobs, generates
    nothing (the loglikelihood request of evaluation harnesses), streamed or not; without
    echo max_tokens 0 stays a 400."""
    args = dict(model=server.model, prompt="hello there", temperature=0, logprobs=1,
                echo=True)
    scored = client.completions.create(max_tokens=0, **args)  # type: ignore[call-overload]
    longer = client.completions.create(max_tokens=3, **args)  # type: ignore[call-overload]
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == "hello there" and choice.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert lp is not None and longer.choices[0].logprobs is not None
    n = scored.usage.prompt_tokens
    assert len(lp.tokens or []) == n and lp.token_logprobs and lp.token_logprobs[0] is None
    assert lp.token_logprobs == (longer.choices[0].logprobs.token_logprobs or [])[:n]
    stream = client.completions.create(max_tokens=0, stream=True,  # type: ignore[call-overload]
                                       **args)
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == "hello there"
    assert sum(len(c.logprobs.tokens or []) for c in chunks if c.logprobs) == n
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=server.model, prompt="hi", max_tokens=0)


@pytest.mark.parametrize("logprobs", [0, 1])
def test_completion_top_logprobs_hold_the_chosen_token(client: openai.OpenAI,
                                                       server: ServerProcess,
                                                       logprobs: int) -> None:
    """As vLLM and OpenAI's legacy completions: each position's top_logprobs hold its own
    token (sampled, or an echoed prompt token) besides the top n: up to n + 1 entries (they
    held only the top n, so logprobs=0 gave {} and a sampled token outside the top was
    missing)."""
    res = client.completions.create(model=server.model, prompt="hello there", max_tokens=8,
                                    temperature=1.5, seed=3, logprobs=logprobs, echo=True)
    lp = res.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs
    assert lp.top_logprobs[0] is None  # the prompt's first token has no logprobs
    for token, top, value in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:],
                                 strict=True):
        assert top is not None and value is not None
        assert token in top and 1 <= len(top) <= logprobs + 1
        assert max(top.values()) >= value


def test_chat_matches_offline(server: ServerProcess, client: openai.OpenAI,
                              offline: LLM) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    res = client.chat.completions.create(model=server.model, messages=messages,  # type: ignore[arg-type]
                                         max_completion_tokens=10, temperature=0)
    ref = offline.chat(messages, greedy(10), use_tqdm=False)[0]
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == ref.outputs[0].text
    assert res.usage is not None and res.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_n_choices_with_seed(server: ServerProcess, client: openai.OpenAI) -> None:
    kwargs = dict(model=server.model, prompt="abc", max_tokens=8, temperature=1.0, seed=7, n=3,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # seeds seed, seed + 1, seed + 2
    assert first.usage is not None and first.usage.completion_tokens == 24


def test_chat_stream_with_usage(server: ServerProcess, client: openai.OpenAI,
                                offline: LLM) -> None:
    messages = [{"role": "user", "content": "stream please"}]
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=20, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    ref = offline.chat(messages, greedy(20), use_tqdm=False)[0]
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(content) == ref.outputs[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats(server: ServerProcess, client: openai.OpenAI,
                                route: str) -> None:
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far,
    of its own choice where n > 1; only beside include_usage."""
    def chunks(options: dict, n: int = 1) -> list:  # type: ignore[type-arg]
        args = dict(model=server.model, max_tokens=12, temperature=0, stream=True, n=n,
                    stream_options=options, extra_body={"ignore_eos": True})
        if route == "chat":
            return list(client.chat.completions.create(
                messages=[{"role": "user", "content": "usage?"}], **args))  # type: ignore[call-overload]
        return list(client.completions.create(prompt="usage?", **args))  # type: ignore[call-overload]

    every = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None for c in every)
    done = [c.usage.completion_tokens for c in every]
    assert done == sorted(done) and done[-1] == 12
    assert len({c.usage.prompt_tokens for c in every}) == 1
    plain = chunks({"include_usage": False, "continuous_usage_stats": True})
    assert all(c.usage is None for c in plain)
    two = chunks({"include_usage": True, "continuous_usage_stats": True}, n=2)
    for j in (0, 1):
        done = [c.usage.completion_tokens for c in two if c.choices and c.choices[0].index == j]
        assert done == sorted(done) and done[-1] == 12, done
    assert two[-1].choices == [] and two[-1].usage.completion_tokens == 24
    assert {c.usage.prompt_tokens for c in two} == {every[0].usage.prompt_tokens}


def test_stream_sends_only_new_text_and_done(server: ServerProcess) -> None:
    body = {"model": server.model, "prompt": "xyz", "max_tokens": 16, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = [p["choices"][0]["text"] for p in payloads]
    full = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False},
                      timeout=30).json()["choices"][0]["text"]
    assert "".join(texts) == full
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def _ascii_stop(client: openai.OpenAI, model: str) -> tuple[str, str, str]:
    """A prompt and a printable ASCII character its greedy output contains (the random byte
    model also emits invalid UTF-8), with the text before that character."""
    for prompt in ("stop test", "find a stop", "abc", "0123", "zz top"):
        full = client.completions.create(model=model, prompt=prompt, max_tokens=32,
                                         temperature=0).choices[0].text
        for ch in full[1:]:
            if ch.isascii() and ch.isprintable() and full.index(ch) > 0:
                return prompt, ch, full[: full.index(ch)]
    pytest.skip("the tiny model emitted no printable ASCII")


def test_stop_string_is_cut(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt, stop, expected = _ascii_stop(client, server.model)
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=32,
                                      temperature=0, stop=[stop])
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=32,
                                       temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_offsets_match_the_response_while_a_stop_is_held_back(
        server: ServerProcess, client: openai.OpenAI, echo: bool) -> None:
    """A stream holds back text that may begin a stop string; its logprobs' text_offset must
    still count every token sent, as the whole response does: a stop that is hit (its first
    characters held, then cut) and one that is not (held, then released)."""
    prompt, ch, before = _ascii_stop(client, server.model)
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=24,
                                     temperature=0).choices[0].text
    start = len(before)
    for stop, reason in ((full[start:start + 3], "stop"), (ch + "\x00\x00", "length")):
        args = dict(model=server.model, prompt=prompt, max_tokens=24, temperature=0,
                    stop=[stop], logprobs=1, echo=echo)
        whole = client.completions.create(**args).choices[0]  # type: ignore[call-overload]
        assert whole.finish_reason == reason
        tokens, offsets, text = [], [], []
        for chunk in client.completions.create(stream=True, **args):  # type: ignore[call-overload]
            c = chunk.choices[0]
            text.append(c.text)
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
        assert "".join(text) == whole.text
        assert whole.logprobs is not None
        assert tokens == whole.logprobs.tokens
        assert offsets == whole.logprobs.text_offset


def test_32_concurrent_streams_match_offline(server: ServerProcess, offline: LLM) -> None:
    prompts = [f"request number {i}: " for i in range(32)]
    refs = offline.generate(prompts, greedy(16), use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await client.completions.create(model=server.model, prompt=prompt,
                                                 max_tokens=16, temperature=0, stream=True)
        text, reason = [], None
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(text), reason

    async def run_all() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), timeout=180)

    results = asyncio.run(run_all())
    assert [r[0] for r in results] == [ref.outputs[0].text for ref in refs]
    assert all(r[1] == "length" for r in results)


def _wait_for(url: str, predicate, timeout_s: float = 15.0) -> dict[str, float]:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    values = scrape(url)
    while not predicate(values) and time.monotonic() < deadline:
        time.sleep(0.1)
        values = scrape(url)
    return values


def test_client_disconnect_aborts_and_frees_blocks(server: ServerProcess) -> None:
    aborted = "braid:request_success_total{finished_reason=abort}"
    before = scrape(server.url).get(aborted, 0.0)
    body = {"model": server.model, "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):  # role chunk + a few tokens
            assert next(lines).startswith("data: ")
            next(lines)
        busy = scrape(server.url)
        assert busy["braid:num_requests_running"] == 1
        assert busy["braid:kv_cache_usage_perc"] > 0
    values = _wait_for(server.url, lambda v: v.get(aborted, 0.0) > before
                       and v["braid:kv_cache_usage_perc"] == 0)
    assert values.get(aborted, 0.0) == before + 1
    assert values["braid:kv_cache_usage_perc"] == 0
    assert values["braid:num_requests_running"] == 0


def test_metrics_counters_move(server: ServerProcess, client: openai.OpenAI) -> None:
    before = scrape(server.url)
    res = client.completions.create(model=server.model, prompt="count me", max_tokens=9,
                                    temperature=0)
    after = scrape(server.url)
    assert res.usage is not None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("braid:prompt_tokens_total") == res.usage.prompt_tokens
    assert delta("braid:generation_tokens_total") == 9
    assert delta("braid:request_success_total{finished_reason=length}") == 1
    assert delta("braid:time_to_first_token_seconds_count") == 1
    assert delta("braid:e2e_request_latency_seconds_count") == 1
    assert delta("braid:inter_token_latency_seconds_count") == 8
    # vLLM's per-request histograms: its tokens, and where its time went
    assert delta("braid:request_prompt_tokens_sum") == res.usage.prompt_tokens
    assert delta("braid:request_generation_tokens_sum") == 9
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time",
                 "time_per_output_token"):
        assert delta(f"braid:request_{name}_seconds_count") == 1, name
    assert delta("braid:request_inference_time_seconds_sum") <= delta(
        "braid:e2e_request_latency_seconds_sum")
    assert delta("braid:request_params_n_count") == delta("braid:request_params_n_sum") == 1
    assert delta("braid:request_params_max_tokens_sum") == 9
    assert delta("braid:iteration_tokens_total_count") >= 9  # a step per token at least
    assert delta("braid:iteration_tokens_total_sum") >= 9
    assert after["braid:num_requests_waiting"] == 0
    for name in ("braid:num_preemptions_total", "braid:spec_decode_num_drafts_total",
                 "braid:spec_decode_num_draft_tokens_total",
                 "braid:spec_decode_num_accepted_tokens_total"):
        assert name in after
    # prompt tokens found in the prefix cache count too, as vLLM counts them
    before = after
    again = client.completions.create(model=server.model, prompt="count me", max_tokens=1)
    after = scrape(server.url)
    assert again.usage is not None and delta("braid:prefix_cache_hits_total") > 0
    assert delta("braid:prompt_tokens_total") == again.usage.prompt_tokens


def test_request_params_and_cache_config_metrics(server: ServerProcess) -> None:
    """vLLM's request_params_n and request_params_max_tokens (an unset max_tokens is what the
    model length leaves), and cache_config_info's labels."""
    before = scrape(server.url)
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "max_tokens": 3}
    res = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert res.status_code == 200, res.text
    del body["max_tokens"], body["n"]
    res = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert res.status_code == 200, res.text
    prompt_tokens = res.json()["usage"]["prompt_tokens"]
    after = scrape(server.url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("braid:request_params_n_count") == 2  # one per prompt
    assert delta("braid:request_params_n_sum") == 3
    assert delta("braid:request_params_n_bucket{le=2.0}") == 2
    assert delta("braid:request_params_max_tokens_count") == 3  # one per engine request
    assert delta("braid:request_params_max_tokens_sum") == 2 * 3 + 256 - prompt_tokens
    [info] = [k for k in after if k.startswith("braid:cache_config_info{")]
    assert after[info] == 1
    labels = dict(kv.split("=") for kv in info[info.index("{") + 1:-1].split(","))
    assert labels == {"block_size": "4", "cache_dtype": "float32", "num_gpu_blocks": "256",
                      "enable_prefix_caching": "True", "kv_cache_gib": labels["kv_cache_gib"]}
    assert 0 < float(labels["kv_cache_gib"]) < 0.01  # 256 blocks of 4 tokens of a tiny model


def test_chat_template_from_chat_template_jinja(tmp_path: Path) -> None:
    """A folder saved by current transformers keeps its chat template in chat_template.jinja,
    not in tokenizer_config.json: chat completions use it."""
    folder = save_tiny_model(tmp_path / "model")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    (folder / "chat_template.jinja").write_text(config.pop("chat_template"))
    config_file.write_text(json.dumps(config))
    (tmp_path / "log").mkdir()
    server = ServerProcess(folder, tmp_path / "log", *ENGINE_FLAGS)
    try:
        res = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": server.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}]})
    finally:
        assert server.stop() == 0, server.log()
    assert res.status_code == 200, res.text
    # "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n": 3 special tokens and 21
    # bytes (one token each in the tiny byte-level tokenizer).
    assert res.json()["usage"]["prompt_tokens"] == 24
