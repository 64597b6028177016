"""Offline LLM API."""

from __future__ import annotations


def test_n_completions_per_prompt(tmp_path) -> None:
    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(["hello", "bye"], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # seeds 7, 8, 9 differ
    again = llm.generate("hello", params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[0].outputs]


def test_structured_output_offline(tmp_path) -> None:
    """SamplingParams(structured_outputs=...) through LLM.generate and LLM.chat, n = 2."""
    import re

    from braid import LLM, SamplingParams
    from braid.sampling_params import StructuredOutputsParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    regex = StructuredOutputsParams(regex=r"[a-f]{3}\d")
    out = llm.generate(["hello"], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20,
                                                 structured_outputs=regex), use_tqdm=False)
    assert all(re.fullmatch(r"[a-f]{3}\d", c.text) for c in out[0].outputs)
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    chat = llm.chat([{"role": "user", "content": "pick"}],
                    SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice),
                    use_tqdm=False)
    assert chat[0].outputs[0].text in ("alpha", "beta")


def test_a_stop_token_text_is_kept_only_with_include_stop_str_in_output(tmp_path) -> None:
    """vLLM's semantics: a stop_token_ids token is cut from the text unless
    include_stop_str_in_output, which keeps it as it keeps a stop string."""
    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)

    def first(**fields: object):  # noqa: ANN202
        params = SamplingParams(temperature=0, ignore_eos=True, **fields)  # type: ignore[arg-type]
        return llm.generate("stop here", params, use_tqdm=False)[0].outputs[0]

    ref = first(max_tokens=12).token_ids
    at = 4
    stop = ref[at]
    at = ref.index(stop)
    for keep, upto in ((False, at), (True, at + 1)):
        out = first(max_tokens=12, stop_token_ids=[stop], include_stop_str_in_output=keep)
        assert out.token_ids == ref[: at + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (first(max_tokens=upto).text if upto else "")
