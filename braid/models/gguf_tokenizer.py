"""GGUF files carry no tokenizer.json: `write_gguf_tokenizer` rebuilds the byte-level BPE
tokenizer from the GGUF metadata the way transformers' GGUF converter does, and saves HF-style
files (tokenizer.json, tokenizer_config.json) that braid.tokenizer reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from braid.files import ModelLoadError
from braid.tokenizer import SPECIAL_NAMES, SPM_SPACE, bytes_to_unicode

# Split regexes by `tokenizer.ggml.pre`, applied one after the other (llama.cpp's regex_exprs
# per pre-tokenizer type, in the forms the models' own tokenizer.json files spell them).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (  # o200k: Phi-4-mini, Llama 4
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (  # Mistral Nemo, Ministral
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)  # every digit alone, then GPT-2's
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (QWEN2_SPLIT,)),
    "qwen35": (QWEN35_SPLIT,),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "pixtral",
                     "lfm2"), (LLAMA3_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "exaone", "command-r"),
                    DIGITS_THEN_GPT2),
    **dict.fromkeys(("gpt-4o", "llama4"), (GPT4O_SPLIT,)),
    "tekken": (TEKKEN_SPLIT,),
    "deepseek-v3": DEEPSEEK3_SPLITS,
}
# Pre-tokenizer types whose vocabulary takes a piece that is itself a token whole, merges
# aside (llama.cpp's ignore_merges; transformers' BPE(ignore_merges=True) for Llama 3)
IGNORE_MERGES = frozenset(("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "lfm2",
                           "tekken"))
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4
SPECIAL_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                    "pad": "padding_token_id"}


def _spell(token: str, alphabet: set[str]) -> str:
    if set(token) <= alphabet:
        return token
    return "".join(bytes_to_unicode()[b] for b in token.encode("utf-8"))


class NoUsableTokenizer(ModelLoadError):
    """A GGUF without a tokenizer braid can build: the model still loads, and `--tokenizer`
    gives it one."""


def gguf_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
        backend = _sentencepiece_backend(meta)
    elif model != "gpt2":
        raise NoUsableTokenizer(f"unsupported GGUF tokenizer model {model!r}: byte-level BPE "
                                "('gpt2') and SentencePiece BPE ('llama') are supported")
    else:
        backend = _byte_level_backend(meta)
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS by default to SentencePiece vocabularies (Llama 2's files say nothing)
    if meta.get("tokenizer.ggml.add_bos_token", model == "llama") and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return backend


def _sentencepiece_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """SentencePiece BPE (llama.cpp's "llama" vocabularies: Gemma, Llama 2, Mistral v0.1) as a
    tokenizers BPE with byte fallback. The file has no merges: they are rebuilt from the
    vocabulary as transformers' GGUF loader does, every split of a token into two tokens,
    the better token's first (by score; Gemma's scores do not follow its merge order, its
    file order does). Spaces are spelled U+2581; CONTROL tokens are special, USER_DEFINED
    ones (Gemma's runs of spaces and of newlines) are matched whole, as SentencePiece and
    llama.cpp do."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated token: its first id
    by_position = str(meta.get("general.architecture", "")).startswith("gemma")
    scores = meta.get("tokenizer.ggml.scores") or []
    rank: dict[str, float] = (
        {t: float(i) for t, i in vocab.items()} if by_position or len(scores) != len(tokens)
        else {t: -float(scores[i]) for t, i in vocab.items()})
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(BPE(
        vocab=vocab, merges=_merges_from_vocabulary(vocab, rank, types), dropout=None,
        unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):  # llama.cpp's default for SPM
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE,
                                                         prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.normalizer = normalizers.Replace(" ", SPM_SPACE)
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_special_tokens(backend, tokens, types, vocab, byte_level=False)
    return backend


def _merges_from_vocabulary(vocab: dict[str, int], rank: dict[str, float], types: list[int]
                            ) -> list[tuple[str, str]]:
    """Every pair of normal tokens whose concatenation is a token, ordered by that token's
    rank (then the shorter left side first, as transformers' generate_merges)."""
    def normal(i: int) -> bool:
        return i >= len(types) or types[i] == TOKEN_TYPE_NORMAL

    merges = []
    for token, i in vocab.items():
        if len(token) < 2 or not normal(i):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and normal(vocab[left]) and normal(vocab[right]):
                merges.append((rank[token], cut, left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def _byte_level_backend(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    alphabet = set(bytes_to_unicode().values())
    vocab = {_spell(t, alphabet): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre")
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None,
                                       continuing_subword_prefix="", end_of_word_suffix="",
                                       fuse_unk=False, ignore_merges=pre in IGNORE_MERGES))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [], vocab)
    return backend


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    splits = PRE_TOKENIZER_SPLITS.get(pre or "")
    if splits is None:  # plain GPT-2 regex ("gpt-2", "olmo", "default", unknown names)
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], vocab: dict[str, int],
    byte_level: bool = True,
) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens, so both
    are matched whole in text instead of being cut into bytes."""
    alphabet = set(bytes_to_unicode().values())
    # In a byte-level vocabulary, a CONTROL token outside the byte alphabet is a llama.cpp
    # mislabel; adding it would grow the vocabulary past the model's embedding (transformers
    # skips them too).
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types, strict=False)
               if ty == TOKEN_TYPE_CONTROL and (not byte_level or set(t) <= alphabet)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def gguf_tokenizer_config(meta: dict[str, Any], backend: tokenizers.Tokenizer) -> dict[str, Any]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name in SPECIAL_NAMES:
        token_id = meta.get(f"tokenizer.ggml.{SPECIAL_ID_KEYS[name]}")
        config[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "special": t.special, "normalized": False,
                 "lstrip": False, "rstrip": False, "single_word": False}
        for i, t in sorted(backend.get_added_tokens_decoder().items())
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def write_gguf_tokenizer(meta: dict[str, Any], folder: Path) -> None:
    """Save tokenizer.json and tokenizer_config.json built from GGUF metadata into `folder`."""
    if "tokenizer.ggml.tokens" not in meta:
        raise NoUsableTokenizer("GGUF has no tokenizer metadata (tokenizer.ggml.tokens)")
    backend = gguf_backend(meta)
    backend.save(str(folder / "tokenizer.json"))
    config = gguf_tokenizer_config(meta, backend)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
