"""A GGUF file's tokenizer and chat template, rebuilt with ``tokenizers`` from its metadata.

A GGUF carries no tokenizer.json: only ``tokenizer.ggml.*`` (model, pre-tokenizer name,
tokens, merges or scores, token types, special ids) and ``tokenizer.chat_template``. Two
vocabularies are rebuilt: byte-level BPE (``gpt2``: GPT-2, Llama 3, Qwen, SmolLM) with the
split its pre-tokenizer name implies, and SentencePiece BPE (``llama``: Llama 2, Mistral,
Phi-3) with byte fallback and merges recovered from the scores when the file has none.
Control tokens are special (kept whole, skipped when decoding); EOS, end-of-turn and BOS
come from the metadata.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

log = logging.getLogger("mlxq.engine")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre: the split before byte-level BPE (llama.cpp's llama-vocab.cpp names).
SPLITS = {
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
DIGIT_SPLITS = ("smollm", "starcoder", "refact", "codeshell")  # digits one by one, then GPT-2's
GPT2_SPLITS = ("default", "gpt2", "gpt-2")
# Metadata ids that end a generation.
EOS_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")


def write_tokenizer(meta: Any, folder: Path) -> dict[str, Any]:
    """Write tokenizer.json and tokenizer_config.json for ``meta`` (a
    :class:`mlxq.engine.models.gguf.Metadata`) into ``folder``; the config.json entries it
    implies (EOS and BOS ids)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens")]
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    if kind == "gpt2":
        tokenizer = byte_level(tokens, meta.get("tokenizer.ggml.merges") or [], meta)
    elif kind == "llama":
        tokenizer = sentencepiece(tokens, meta)
    else:
        raise ValueError(
            f"GGUF tokenizer {kind!r} is not supported; mlxq rebuilds 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece) vocabularies"
        )
    _add_special(tokenizer, tokens, types)
    ids = {key: meta.get(f"tokenizer.ggml.{key}") for key in (*EOS_KEYS, "bos_token_id")}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    bos = _token(tokens, ids["bos_token_id"])
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, ids["bos_token_id"])],
        )
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": _token(tokens, ids["eos_token_id"]),
        "unk_token": _token(tokens, meta.get("tokenizer.ggml.unknown_token_id")),
        "pad_token": _token(tokens, meta.get("tokenizer.ggml.padding_token_id")),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.arch_value("context_length", 4096)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        settings["chat_template"] = str(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    eos = sorted({int(ids[k]) for k in EOS_KEYS if ids[k] is not None})
    found = {"eos_token_id": eos}
    if ids["bos_token_id"] is not None:
        found["bos_token_id"] = int(ids["bos_token_id"])
    log.info(
        "gguf: tokenizer %s (%s), %d tokens, EOS %s, %s",
        kind,
        meta.get("tokenizer.ggml.pre", "-"),
        len(tokens),
        ", ".join(repr(tokens[i]) for i in eos),
        "a chat template" if template else "no chat template",
    )
    return found


def _token(tokens: list[str], index: Any) -> str | None:
    return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]


def byte_level(tokens: list[str], merges: list[Any], meta: Any) -> Tokenizer:
    """Byte-level BPE, split before merging as its pre-tokenizer name says."""
    name = str(meta.get("tokenizer.ggml.pre", "default"))
    pairs = [tuple(str(m).split(" ", 1)) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    tokenizer = Tokenizer(
        models.BPE(vocab, pairs, ignore_merges=name in SPLITS and "llama" in name)
    )
    gpt2 = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in SPLITS:
        split = pre.Split(Regex(SPLITS[name]), behavior="isolated")
        tokenizer.pre_tokenizer = pre.Sequence([split, pre.ByteLevel(False, use_regex=False)])
    elif name in DIGIT_SPLITS:
        tokenizer.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True), gpt2])
    else:
        if name not in GPT2_SPLITS:
            log.warning(
                "gguf: pre-tokenizer %r unknown to mlxq: splitting as GPT-2 does (tokens of "
                "some texts may differ from llama.cpp's)",
                name,
            )
        tokenizer.pre_tokenizer = gpt2
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece(tokens: list[str], meta: Any) -> Tokenizer:
    """SentencePiece BPE with byte fallback; merges from the file or from the scores."""
    vocab = {t: i for i, t in enumerate(tokens)}
    given = meta.get("tokenizer.ggml.merges")
    if given:
        pairs = [tuple(str(m).split(" ", 1)) for m in given]
    else:
        pairs = merges_from_scores(tokens, [float(s) for s in meta.get("tokenizer.ggml.scores")])
    unk = _token(tokens, meta.get("tokenizer.ggml.unknown_token_id", 0))
    model = models.BPE(vocab, pairs, unk_token=unk, byte_fallback=True, fuse_unk=True)
    tokenizer = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges implied by a vocabulary: every split of a token into two
    tokens, the higher the merged token's score the earlier its merge."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _add_special(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special ones (whole in text, skipped when decoding); user-defined
    ones (``<think>``) as plain added tokens, so they too are never cut."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL
    ]
    plain = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
