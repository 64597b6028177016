from __future__ import annotations

import pytest

from braid.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy


@pytest.mark.parametrize(
    ("stop", "expected"), [(None, []), ("###", ["###"]), (["a", "b"], ["a", "b"]), (("x",), ["x"])]
)
def test_stop_is_normalized_to_a_list(stop: object, expected: list[str]) -> None:
    assert SamplingParams(stop=stop).stop == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [({"temperature": 0.0}, True), ({"top_k": 1}, True), ({"top_k": -1}, False), ({}, False)],
)
def test_greedy(kwargs: dict[str, float], greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -2),  # -1: the whole vocabulary, as vLLM
        ("prompt_logprobs", -2),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-5]),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_min_tokens_with_structured_outputs_is_refused() -> None:
    """A grammar ends the output where it completes; min_tokens could not hold."""
    from braid.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=r"^min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(json_object=True))
    SamplingParams(min_tokens=0, structured_outputs=StructuredOutputsParams(json_object=True))


@pytest.mark.parametrize("field, value", [
    ("n", 2.0), ("top_k", 1.5), ("max_tokens", 2.5), ("min_tokens", True), ("logprobs", "3"),
    ("seed", 1.0), ("temperature", float("inf")), ("top_p", float("nan")),
    ("repetition_penalty", "2"), ("presence_penalty", True)])
def test_wrong_types_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be (an integer|a finite number)"):
        SamplingParams(**{field: value})


def test_choice_seeds_wrap_into_64_bits() -> None:
    from braid.sampling_params import choice_seed

    assert choice_seed(None, 3) is None
    assert choice_seed(5, 2) == 7
    assert choice_seed(2**64 - 1, 1) == 0 and choice_seed(2**64 - 2, 3) == 1


def test_message_shows_the_value() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_seed_range() -> None:
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_detokenize_and_output_kind_are_checked() -> None:
    from braid import RequestOutputKind

    with pytest.raises(ValueError, match="stop strings need the output's text: set "
                       "detokenize=True or use stop_token_ids, got stop=\\['x'\\]"):
        SamplingParams(stop="x", detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be true or false, got 'no'"):
        SamplingParams(detokenize="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE


@pytest.mark.parametrize("fields, message", [
    ({"stop": [1]}, "stop must be a string or a list of strings, got \\[1\\]"),
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must be a list of token ids \\(integers\\)"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
])
def test_stop_fields_of_the_wrong_type_are_refused(fields: dict, message: str) -> None:
    """They used to pass and fail inside the engine's step (the request ended "error")."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]


@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (1e-300, True), (1e-45, True), (9.9e-6, True), (1e-5, False), (0.5, False)])
def test_a_temperature_below_sampling_eps_is_greedy(temperature: float, greedy: bool) -> None:
    """vLLM's _SAMPLING_EPS: below it, logits / T could overflow float32."""
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("field, value, moved_to", [
    ("top_p", 1e-300, 1e-8), ("top_p", 1e-9, 1e-8), ("top_p", 0.3, 0.3),
    ("repetition_penalty", 1e-300, 1e-5), ("repetition_penalty", 1e-45, 1e-5),
    ("repetition_penalty", 1e300, 1e5), ("repetition_penalty", 1.2, 1.2),
    ("min_p", 1e-300, 1e-300), ("presence_penalty", 1e-300, 1e-300)])
def test_values_whose_float32_arithmetic_degenerates_move_onto_safe_bounds(
    field: str, value: float, moved_to: float
) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == moved_to  # type: ignore[arg-type]


def test_bad_words_are_tokenized_in_one_call() -> None:
    """Every word bare and after a space, in one batch: a long list costs one tokenizer call
    at admission, not two per word."""
    from braid.sampling_params import bad_words_token_ids

    calls: list[list[str]] = []

    vocab = {"hi": [1, 2], "ab": [3], " hi": [1, 2], " ab": [4], " cd": [5, 6], "cd": [7]}

    def encode(texts: list[str]) -> list[list[int]]:
        calls.append(texts)
        return [vocab[t] for t in texts]

    # " hi" starts like "hi" and " cd" has another count of tokens: only " ab" is added
    assert bad_words_token_ids(["  hi", "ab", "cd"], encode) == [[1, 2], [3], [4], [7]]
    assert calls == [["hi", "ab", "cd", " hi", " ab", " cd"]]
