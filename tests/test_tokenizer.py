from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest

from braid.models.gguf_loader import gguf_to_hf_folder
from braid.models.loader import model_folder
from braid.sampling_params import bad_words_token_ids
from braid.tokenizer import (
    ContinuationError,
    IncrementalDetokenizer,
    Tokenizer,
    compile_chat_template,
)
from tests.conftest import CHAT_TEMPLATE, tiny_vocab, write_gguf

TEXTS = [
    "hello the world",
    "naïve café — ünïcödé",
    "日本語のテキストと中文",
    "emoji 🚀👩‍💻🇫🇷 end",
    "def f(x):\n    return x ** 2  # ✓\n",
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tmp = tmp_path_factory.mktemp("tok")
    embed = np.zeros((len(tiny_vocab()), 32), np.float32)
    path = write_gguf(tmp / "tok.gguf", "qwen2", {"token_embd.weight": (embed, None)},
                      {"embedding_length": 32, "head_count": 4, "feed_forward_length": 64,
                       "block_count": 0})
    return Tokenizer.from_folder(gguf_to_hf_folder(path))


def stream(tokenizer: Tokenizer, ids: list[int], step: int = 1) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return "".join(pieces) + detok.flush()


def test_gguf_tokenizer_encodes_with_merges(tiny_tokenizer: Tokenizer) -> None:
    vocab = tiny_vocab()
    ids = tiny_tokenizer.encode("hello the")
    assert [vocab[i] for i in ids] == ["hello", "Ġthe"]
    im_start = vocab.index("<|im_start|>")
    assert tiny_tokenizer.encode("<|im_start|>hello")[0] == im_start
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("<|im_start|>hello")) == "hello"
    assert tiny_tokenizer.decode([im_start], skip_special_tokens=False) == "<|im_start|>"
    assert tiny_tokenizer.vocab_size == len(vocab)
    assert tiny_tokenizer.eos_token_id == vocab.index("<|im_end|>")
    assert tiny_tokenizer.eos_token_ids == {vocab.index("<|im_end|>"), vocab.index("<|endoftext|>")}
    assert tiny_tokenizer.all_special_ids == [vocab.index(t) for t in
                                              ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]


def test_gguf_tokenizer_matches_transformers(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    embed = np.zeros((len(tiny_vocab()), 32), np.float32)
    path = write_gguf(tmp_path / "tok.gguf", "qwen2", {"token_embd.weight": (embed, None)},
                      {"embedding_length": 32, "head_count": 4})
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, "<|im_start|>user\nhello<|im_end|>"]:
        assert tiny_tokenizer.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenizer_equals_full_decode(tiny_tokenizer: Tokenizer, text: str,
                                                    step: int) -> None:
    ids = tiny_tokenizer.encode(text)
    assert stream(tiny_tokenizer, ids, step) == tiny_tokenizer.decode(ids) == text


def test_incremental_detokenizer_holds_back_partial_characters(tiny_tokenizer: Tokenizer) -> None:
    ids = tiny_tokenizer.encode("€")  # three byte-level tokens for one character
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert [detok.add(i) for i in ids] == ["", "", "€"]


def test_a_character_cut_at_the_end_is_dropped_not_replaced(tiny_tokenizer: Tokenizer) -> None:
    """Output that max_tokens ends partway through a character ends before it (as vLLM's),
    not with U+FFFD; a byte that can start no character is still U+FFFD. token_bytes gives
    each byte-level token's own bytes (logprobs' `bytes`), a special token its text's."""
    euro = tiny_tokenizer.encode("€")
    assert [tiny_tokenizer.token_bytes(i) for i in euro] == [b"\xe2", b"\x82", b"\xac"]
    end = tiny_tokenizer.eos_token_id
    assert end is not None and tiny_tokenizer.token_bytes(end) == b"<|im_end|>"
    ab = tiny_tokenizer.encode("ab")
    for cut in (1, 2):
        detok = IncrementalDetokenizer(tiny_tokenizer)
        assert detok.add(ab + euro[:cut]) + detok.flush() == "ab"
        detok = IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=True)
        assert detok.add(ab + euro[:cut] + [end]) + detok.flush() == "ab"
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert detok.add(ab + euro[1:2]) + detok.flush() == "ab\ufffd"  # a lone continuation


def test_incremental_detokenizer_after_prompt(tiny_tokenizer: Tokenizer) -> None:
    prompt = tiny_tokenizer.encode("hello")
    output = tiny_tokenizer.encode(" the 日本")
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt_ids=prompt)
    assert "".join(detok.add(i) for i in output) + detok.flush() == " the 日本"


def test_chat_template(tiny_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tiny_tokenizer.chat_template == CHAT_TEMPLATE
    assert tiny_tokenizer.apply_chat_template(messages) == expected
    assert tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        expected.removesuffix("<|im_start|>assistant\n"))


def test_continue_final_message_template_and_variables(tiny_tokenizer: Tokenizer) -> None:
    """vLLM's chat extras: an assistant prefill left open, another template, more variables."""
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:  "}]
    assert tiny_tokenizer.apply_chat_template(
        prefill, add_generation_prompt=False, continue_final_message=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure:  ")
    stripping = "{% for m in messages %}<{{ m.content | trim }}>{% endfor %}"
    assert tiny_tokenizer.apply_chat_template(
        prefill, False, chat_template=stripping, continue_final_message=True) == "<hi><Sure:"
    with pytest.raises(ContinuationError, match="cannot both be true"):
        tiny_tokenizer.apply_chat_template(prefill, True, continue_final_message=True)
    for last in ({"role": "assistant", "content": " "}, {"role": "assistant"}):
        with pytest.raises(ContinuationError, match="no text to continue"):
            tiny_tokenizer.apply_chat_template([prefill[0], last], False,
                                               continue_final_message=True)
    with pytest.raises(ContinuationError, match="does not write"):
        tiny_tokenizer.apply_chat_template(prefill, False, chat_template="{{ messages | length }}",
                                           continue_final_message=True)
    # more template variables, which may replace a special token's
    template = "{{ greeting }} {{ messages | length }} {{ eos_token }}"
    eos = tiny_tokenizer.apply_chat_template(prefill, chat_template="{{ eos_token }}")
    assert eos and tiny_tokenizer.apply_chat_template(
        prefill, chat_template=template, greeting="hello") == f"hello 2 {eos}"
    assert tiny_tokenizer.apply_chat_template(
        prefill, chat_template=template, greeting="", eos_token="E") == " 2 E"


def test_no_fill_in_the_middle_without_its_tokens(tiny_tokenizer: Tokenizer) -> None:
    assert tiny_tokenizer.fill_in_middle("a", "b") is None


def test_chat_template_helpers() -> None:
    template = compile_chat_template(
        "{% if tools %}{{ tools | tojson }}{% endif %}\n"
        "  {% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    tools: list[dict[str, Any]] = [{"name": "f", "description": "<a> & é"}]
    assert template.render(messages=[{"role": "user"}], tools=tools) == (
        '[{"name": "f", "description": "<a> & é"}]ok')
    with pytest.raises(jinja2.TemplateError, match="user first"):
        template.render(messages=[{"role": "system"}])


REAL_TEXT = ("Hello, world! Привет мир. 你好，世界。こんにちは 🚀🔥👩‍💻 naïve café\n"
             "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
             "<|im_start|>user\n\t  tabs   and spaces 12345 3.14159<|im_end|>")


@pytest.mark.real_model
def test_real_tokenizer_matches_transformers(target_gguf: Path, reference_tokenizer: Any) -> None:
    tokenizer = Tokenizer.from_folder(model_folder(str(target_gguf)))
    ids = tokenizer.encode(REAL_TEXT)
    assert ids == reference_tokenizer.encode(REAL_TEXT)
    for skip in (True, False):
        expected = reference_tokenizer.decode(ids, skip_special_tokens=skip)
        assert tokenizer.decode(ids, skip) == expected
    assert stream(tokenizer, ids) == tokenizer.decode(ids)
    assert tokenizer.vocab_size == len(reference_tokenizer)
    assert tokenizer.eos_token_id == reference_tokenizer.eos_token_id
    assert {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")} <= (
        tokenizer.eos_token_ids)


def long_text(seed: int) -> str:
    """~200k characters of words, digits, punctuation, runs of spaces and newlines, special
    tokens' text and non-Latin letters: every kind of boundary a cut could fall near."""
    import random

    words = ["hello", "the", "ünïcode", "日本語", "x", "'s", "don't", "  ", "\n", "\t", "123",
             "a.b", "<|im_end|>", "émoji😀", "CamelCase", "-->", " "]
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(40_000))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_long_text_encodes_in_pieces_as_whole(tiny_tokenizer: Tokenizer, seed: int) -> None:
    """Long texts are encoded in pieces cut at spaces between letters (the GIL is held
    while each piece's ids become a list): the ids are the whole text's."""
    text = long_text(seed)
    assert tiny_tokenizer._splits_words
    assert tiny_tokenizer.encode(text, False) == tiny_tokenizer.backend.encode(
        text, add_special_tokens=False).ids


@pytest.mark.real_model
def test_a_long_text_encodes_in_pieces_as_whole_with_the_real_tokenizer(
        target_gguf: Path) -> None:
    tokenizer = Tokenizer.from_folder(model_folder(str(target_gguf)))
    for text in (long_text(2), REAL_TEXT * 2000):
        assert tokenizer.encode(text, False) == tokenizer.backend.encode(
            text, add_special_tokens=False).ids


@pytest.mark.real_model
def test_bad_words_tokenized_as_vllm_does(target_gguf: Path) -> None:
    """A bad word bare and, where it spells the same count of other tokens, after a space
    (as inside a sentence): vLLM's SamplingParams.update_from_tokenizer."""
    tokenizer = Tokenizer.from_folder(model_folder(str(target_gguf)))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = bad_words_token_ids(["  hello", "print(x)"], lambda texts: list(map(encode, texts)))
    assert ids[:2] == [encode("hello"), encode(" hello")] and encode("hello") != encode(" hello")
    assert encode("print(x)") in ids
    assert all(len(w) >= 1 for w in ids)


@pytest.mark.real_model
def test_real_chat_template_matches_transformers(
    target_gguf: Path, reference_tokenizer: Any
) -> None:
    tokenizer = Tokenizer.from_folder(model_folder(str(target_gguf)))
    messages = [{"role": "system", "content": "You are a helpful coding assistant."},
                {"role": "user", "content": "Write a Python function that reverses a string. 🙂"}]
    expected = reference_tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == expected
    prefill = [*messages, {"role": "assistant", "content": "def reverse(s: str) -> str:\n"}]
    assert tokenizer.apply_chat_template(prefill, False, continue_final_message=True) == (
        reference_tokenizer.apply_chat_template(prefill, tokenize=False,
                                                continue_final_message=True))
    assert tokenizer.fill_in_middle("def f(", "):") == (
        "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>")
    user_only = messages[1:]
    assert tokenizer.apply_chat_template(user_only) == reference_tokenizer.apply_chat_template(
        user_only, tokenize=False, add_generation_prompt=True)
