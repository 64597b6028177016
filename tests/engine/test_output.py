"""The output side: stop strings (an automaton fed the new text) judged exactly as the plain
search over the text judges them, the streaming hold-back, stop ids and logprobs' texts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from braid.core.request import Request
from braid.engine.output import OutputProcessor, StopStrings
from braid.outputs import Logprob
from braid.sampling_params import SamplingParams
from braid.tokenizer import Tokenizer
from tests.tiny import byte_tokenizer

# Plain references, written for readability: vLLM's check_stop_strings and hold-back.


def find_stop(text: str, new: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string in list order found in the text's last `new` characters (with
    the overlap a stop spans from the text before), and where it starts."""
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new - len(stop) + 1))
        if at >= 0:
            return stop, at
    return None


def held_back(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string."""
    return max((n for stop in stops for n in range(1, min(len(stop), len(text) + 1))
                if text.endswith(stop[:n])), default=0)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=6),
       chunks=st.lists(st.text("abc", max_size=3), max_size=12))
def test_stop_strings_find_what_the_plain_search_finds(stops: list[str],
                                                       chunks: list[str]) -> None:
    """Fed chunk by chunk (a token's text each, possibly empty): the same stop string at the
    same place as the search over the whole text, and the same text held back, with stops
    that overlap, repeat, and begin one another."""
    matcher, text = StopStrings(stops), ""
    for chunk in chunks:
        text += chunk
        found = matcher.feed(chunk)
        expected = find_stop(text, len(chunk), stops)
        assert (found if found is None else (found[0], len(text) - len(chunk) + found[1])
                ) == expected
        assert matcher.held == held_back(text, stops)


def processor_and_request(**fields: object) -> tuple[OutputProcessor, Request]:
    tokenizer = Tokenizer(byte_tokenizer(), {"eos_token": "<|endoftext|>"})
    processor = OutputProcessor(tokenizer, frozenset({256}), 1000)
    req = Request("r", [104, 105], SamplingParams(max_tokens=None, **fields))  # type: ignore[arg-type]
    processor.add(req)
    return processor, req


def feed(processor: OutputProcessor, req: Request, text: str) -> list[str]:
    """Append `text` byte by byte until a stop; the streamed text after each byte."""
    shown = []
    for token in text.encode():
        req.output_token_ids.append(token)
        if processor.check_stop(req, token) is not None:
            req.status = req.status.FINISHED
            processor.finish(req)
            shown.append(processor.make_output(req).outputs[0].text)
            break
        shown.append(processor.make_output(req).outputs[0].text)
    return shown


def test_stop_strings_cut_the_text_in_list_order_past_min_tokens() -> None:
    """The first stop string in the list wins among those ending in the same token's text;
    text before min_tokens is not searched, but a stop spanning into it is; the text held
    back while a stop may still be forming is never shown."""
    processor, req = processor_and_request(stop=["zq", "yz", "xyz"])
    assert feed(processor, req, "abxyzq") == ["a", "ab", "ab", "ab", "abx"]
    assert req.stop_reason == "yz"  # "yz" and "xyz" end together; "zq" would end later
    processor, req = processor_and_request(stop=["xyz", "yz"])
    assert feed(processor, req, "abxyzq")[-1] == "ab" and req.stop_reason == "xyz"
    processor, req = processor_and_request(stop=["zq", "xyz"], include_stop_str_in_output=True)
    assert feed(processor, req, "abxyzq")[-1] == "abxyz"
    processor, req = processor_and_request(stop=["ab", "bcd"], min_tokens=3)
    assert feed(processor, req, "abcde")[-1] == "a" and req.stop_reason == "bcd"


def test_stop_token_ids_and_logprob_texts() -> None:
    """A stop id in a long list stops the request; each logprob entry gets its token's
    text, special tokens included."""
    processor, req = processor_and_request(stop_token_ids=list(range(1000, 50_000)) + [99])
    req.output_token_ids.append(99)
    assert processor.check_stop(req, 99) == "stop" and req.stop_reason == 99
    processor, req = processor_and_request(logprobs=1)
    req.output_token_ids.append(104)
    processor.add_logprobs(req, [{104: Logprob(-0.5, 1), 256: Logprob(-1.0, 2)}])
    assert [lp.decoded_token for lp in req.logprobs[0].values()] == ["h", "<|endoftext|>"]
