"""Tokenizer: a `tokenizers.Tokenizer` plus the model's chat template and streaming detokenizer
(a GGUF's tokenizer files are built by braid.models.gguf_tokenizer)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cache, cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from braid.files import ModelLoadError, read_json_object

SPECIAL_NAMES = ("bos", "eos", "unk", "pad")  # the special tokens a tokenizer config names
_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for one byte
SPM_SPACE = "\u2581"  # SentencePiece's spelling of a space


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    chars = keep + [256 + i for i in range(len(extra))]
    return dict(zip(keep + extra, map(chr, chars), strict=True))


# Tokens that end a turn or a document; any of them present as a special token stops generation
# (what generation_config.json lists for Qwen2.5, Llama 3, Gemma 3 and Phi-3 instruct models;
# llama.cpp's end-of-generation tokens by text).
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
              "<end_of_turn>", "<|end|>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")


# ---------------------------------------------------------------------------------------------
# Chat templates (rendered like transformers' apply_chat_template)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not expect.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# Fill-in-the-middle tokens (prefix, suffix, middle) as code models spell them.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))  # StarCoder, SantaCoder

# apply_chat_template's own arguments: not template variables a request may pass.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "chat_template",
                                "continue_final_message"})


class ContinuationError(ValueError):
    """continue_final_message cannot be honoured for this conversation and template."""


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """`text` cut right after the last message's content (as transformers does it): what
    the template writes after it (an end-of-turn token) is left out."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ContinuationError("continue_final_message: the last message has no text to "
                                "continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise ContinuationError("continue_final_message: the chat template does not write the "
                                "last message's content as it is")
    # a template that keeps the content's spacing keeps its trailing spaces too
    kept = final.lstrip()
    return text[:at + (len(kept) if text[at:at + len(kept)] == kept else len(final.strip()))]


# ---------------------------------------------------------------------------------------------
# The tokenizer


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content ({} without the file); ModelLoadError naming it
    otherwise."""
    return read_json_object(path) if path.is_file() else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class PromptTooLong(ValueError):
    """A text with more tokens than allowed (the message starts with "prompt")."""


_GIL_FREE_CHARS = 4096
_BATCH_SLICE = 4096  # texts per encode_batch call (encode_batch)


_PIECE_CHARS = 32768  # characters per piece of a long text (Tokenizer._encode_long)


def _cut_between_words(text: str, size: int) -> list[str]:
    """`text` in pieces of about `size` characters, each cut before a space that stands
    between two letters (uncut where no such space is near)."""
    pieces, start = [], 0
    while len(text) - start > size:
        at = text.find(" ", start + size, start + 2 * size)
        while at > 0 and not (text[at - 1].isalpha() and text[at + 1: at + 2].isalpha()):
            at = text.find(" ", at + 1, start + 2 * size)
        if at <= 0:
            break
        pieces.append(text[start:at])
        start = at
    pieces.append(text[start:])
    return pieces


class Tokenizer:
    """Encode/decode, special ids and the chat template of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any],
                 extra_eos_ids: Iterable[int] = (), file: Path | None = None) -> None:
        self.backend = backend
        self.config = config
        self.file = file  # the tokenizer.json it was read from, if any
        self.chat_template: str | None = config.get("chat_template")
        self._special = {n: _token_content(config.get(f"{n}_token")) for n in SPECIAL_NAMES}
        self._special_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items()
                                   if t.special)
        self._eos_ids = frozenset(self._find_eos_ids(extra_eos_ids))

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face style folder with tokenizer.json and tokenizer_config.json."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ModelLoadError(f"{folder / 'tokenizer.json'}: cannot read it ({e})") from None
        config = _read_json(folder / "tokenizer_config.json")
        if isinstance(config.get("chat_template"), list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in config["chat_template"]}
            config["chat_template"] = named.get("default")
        if (folder / "chat_template.jinja").is_file():  # where transformers >= 4.51 saves it
            config["chat_template"] = (folder / "chat_template.jinja").read_text()
        eos = [*_as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id")),
               *_as_id_list(_read_json(folder / "config.json").get("eos_token_id"))]
        return cls(backend, config, eos, folder / "tokenizer.json")

    def _find_eos_ids(self, extra: Iterable[int]) -> set[int]:
        ids = set(extra)
        for token in (self._special["eos"], *END_TOKENS):
            token_id = self.token_to_id(token) if token else None
            if token_id is not None and (token == self._special["eos"]
                                         or token_id in self._special_ids):
                ids.add(token_id)
        return ids

    def encode(self, text: str, add_special_tokens: bool = True,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. A long text is encoded with the GIL released (other threads,
        such as a server's event loop, keep running). With `max_tokens`, a text with more
        tokens raises `PromptTooLong` before its ids are built, and one whose length alone
        proves it too long raises without being encoded."""
        if max_tokens is not None and len(text) > self.max_token_chars * max_tokens:
            raise PromptTooLong(f"prompt is at least {len(text) // self.max_token_chars} "
                                f"tokens, the maximum is {max_tokens}")
        if len(text) < _GIL_FREE_CHARS:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            ids = self._encode_long(text, add_special_tokens)
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(f"prompt is {len(ids)} tokens, the maximum is {max_tokens}")
        return ids

    def _encode_long(self, text: str, add_special_tokens: bool) -> list[int]:
        """encode_batch lets go of the GIL while it works, but holds it while the ids become
        a Python list (~40 ms a MB of text, every other thread stopped). A byte-level BPE
        never merges across a space between two letters (its pre-tokenizer splits there), so
        a long text is encoded in pieces cut at such spaces, each list short."""
        if self._splits_words and not (add_special_tokens and self._adds_special_tokens):
            pieces = _cut_between_words(text, _PIECE_CHARS)
            return [i for ids in self.encode_batch(pieces, False) for i in ids]
        [encoding] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    @cached_property
    def _splits_words(self) -> bool:
        """Whether the tokenizer is byte-level BPE that pre-tokenizes with a regex (GPT-2's,
        or a Split rule such as Qwen's and Llama 3's): no token spans a space between two
        letters."""
        if not self.byte_level:
            return False
        spec = json.loads(self.backend.to_str()).get("pre_tokenizer") or {}
        steps = spec.get("pretokenizers", [spec])
        return any(step.get("type") == "Split" and "Regex" in (step.get("pattern") or {})
                   or step.get("type") == "ByteLevel" and step.get("use_regex")
                   for step in steps)

    @cached_property
    def _adds_special_tokens(self) -> bool:
        """Whether encoding with add_special_tokens adds any (a BOS, say)."""
        return bool(self.backend.encode("", add_special_tokens=True).ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """Token ids of each text, in calls that let go of the GIL while they work: in
        slices, as the GIL is held while a call's results become Python lists (~1.5 us a
        word, every other thread stopped)."""
        out: list[list[int]] = []
        for start in range(0, len(texts), _BATCH_SLICE):
            encodings = self.backend.encode_batch(texts[start:start + _BATCH_SLICE],
                                                  add_special_tokens=add_special_tokens)
            out += [e.ids for e in encodings]
        return out

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (`decode([token_id],
        skip_special_tokens=False)`), decoded once per id and kept."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    @cached_property
    def _token_texts(self) -> dict[int, str]:
        return {}

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token spells (a token never covers more of a text)."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's own spelling of each id (byte-level: "Ġ" for a space)."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special_id(self, name: str) -> int | None:
        token = self._special[name]
        return self.token_to_id(token) if token else None

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the eos token, generation_config's, end-of-turn tokens."""
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def fill_in_middle(self, prefix: str, suffix: str) -> str | None:
        """The prompt that asks a code model for the text between `prefix` and `suffix`
        (prefix-suffix-middle order, in the model's own fill-in-the-middle tokens: Qwen2.5-Coder's
        or StarCoder's spelling), or None for a model without them."""
        for pre, suf, mid in FIM_TOKENS:
            if all(self.token_to_id(t) in self._special_ids for t in (pre, suf, mid)):
                return f"{pre}{prefix}{suf}{suffix}{mid}"
        return None

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._special_ids)

    @cached_property
    def _byte_decoder(self) -> dict[str, int] | None:
        """Byte-level BPE's alphabet, character -> byte (None for other vocabularies: no
        ByteLevel decoder, alone or in a sequence)."""
        if "ByteLevel" not in repr(self.backend.decoder):
            return None
        return {ch: b for b, ch in bytes_to_unicode().items()}

    @property
    def byte_level(self) -> bool:
        """Whether the vocabulary is byte-level BPE (GPT-2's alphabet, one character a byte)."""
        return self._byte_decoder is not None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. A byte-level token can be part of a UTF-8 character
        (its text alone is U+FFFD): these are its own bytes, as OpenAI's logprobs `bytes`
        give them (and llguidance's view of the vocabulary, braid/structured). A SentencePiece
        byte-fallback token (<0xE2>) is its byte. Added tokens and other vocabularies: their
        text's UTF-8."""
        token = self.backend.id_to_token(token_id)
        alphabet = self._byte_decoder
        if alphabet is None and token is not None and token_id not in self._added_ids:
            if byte := _FALLBACK_BYTE.fullmatch(token):
                return bytes([int(byte.group(1), 16)])
            if SPM_SPACE in token:  # (decoding it alone may strip a leading space)
                return token.replace(SPM_SPACE, " ").encode()
        if (alphabet is None or token is None or token_id in self._added_ids
                or not set(token) <= alphabet.keys()):
            return self.decode([token_id], skip_special_tokens=False).encode()
        return bytes(alphabet[ch] for ch in token)

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The conversation as text, like transformers' apply_chat_template: through
        `chat_template` (default: the model's), with `kwargs` as more template variables.
        `continue_final_message` ends the text with the last message's content, open, for
        the model to continue (an assistant prefill) instead of closing its turn. Unlike
        transformers' defaults, the text comes back (`tokenize=True`: its token ids) and a
        generation prompt is added (add_generation_prompt=False leaves it out)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template (a base model's file; give "
                             "one with --chat-template, or use completions)")
        if continue_final_message and add_generation_prompt:
            raise ContinuationError("continue_final_message and add_generation_prompt cannot "
                                    "both be true: one continues the last message, the other "
                                    "starts a new one")
        special = {f"{name}_token": token for name, token in self._special.items() if token}
        text = compile_chat_template(template).render({
            **special, **kwargs, "messages": messages, "tools": tools,
            "add_generation_prompt": add_generation_prompt})
        text = _open_final_message(text, messages) if continue_final_message else text
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # transformers' names, for code written against the Hugging Face tokenizer vLLM returns

    def __call__(self, text: str | list[str], add_special_tokens: bool = True
                 ) -> dict[str, Any]:
        """{"input_ids": ids (a list of them for a list of texts)}."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend.get_vocab(with_added_tokens=True))

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.token_to_id(tokens)
        return [self.token_to_id(t) for t in tokens]

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True
                     ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos"]

    @property
    def bos_token(self) -> str | None:
        return self._special["bos"]

    @property
    def pad_token(self) -> str | None:
        return self._special["pad"]

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad")


# ---------------------------------------------------------------------------------------------
# Streaming detokenization


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (vLLM's prefix/read offsets).

    Text is decoded over a small window `ids[prefix_offset:]`; the part already emitted is
    `decode(ids[prefix_offset:read_offset])`. A window ending in "\\ufffd" is an incomplete
    UTF-8 character split over byte-level tokens: hold it back until the next token completes it.
    """

    INITIAL_PREFIX = 5  # prompt tokens kept as context, so a first word's leading space survives

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - self.INITIAL_PREFIX, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append token ids; return the newly completed text (possibly empty)."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (e.g. a truly invalid byte),
        less a last character the output stops partway through (max_tokens cut it): it is
        dropped, as vLLM drops it, not sent as U+FFFD."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        delta = self._decode(self.prefix_offset)[len(prefix_text):]
        if delta.endswith("\ufffd") and self._ends_mid_character():
            delta = delta[:-1]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _ends_mid_character(self) -> bool:
        """Whether the held-back tokens' bytes end with the start of a UTF-8 character that
        needs more bytes than follow it."""
        skipped = set(self.tokenizer.all_special_ids) if self.skip_special_tokens else set()
        tail = b"".join(self.tokenizer.token_bytes(i) for i in self.ids[self.read_offset:]
                        if i not in skipped)[-4:]
        for back in range(1, len(tail) + 1):
            lead = tail[-back]
            if lead & 0xC0 != 0x80:  # not a continuation byte: the character's first
                needs = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4
                return lead >= 0xC0 and needs > back
        return False
