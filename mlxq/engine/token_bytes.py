"""Each token's UTF-8 bytes, as the tokenizer's decoder would write them.

OpenAI-style logprobs name every token with its ``bytes``: a token can hold part of a
multi-byte character, so its bytes come from its vocabulary entry, not from decoding it
alone. Three vocabularies are read exactly: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM:
each character of the entry stands for one byte through GPT-2's ``bytes_to_unicode``),
SentencePiece (``▁`` is a space, ``<0xNN>`` a byte when the decoder has byte fallback) and
added tokens (their content as written). Any other tokenizer falls back to decoding the
token alone, which turns a partial character into U+FFFD.

Plain Python over the tokenizer's vocabulary (no MLX): the worker calls it on its main
thread when it builds the result of a job that asked for logprobs.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec

from mlxq.wire import TokenLogprob

SPM_SPACE = "\u2581"


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: a byte-level BPE character to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """A tokenizer's token ids to their UTF-8 bytes (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._kind = decoder_kind(getattr(tokenizer, "backend_tokenizer", None))
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # Added tokens are stored as written, whatever the vocabulary's own encoding.
        self._cache = {i: getattr(t, "content", str(t)).encode() for i, t in added.items()}

    @property
    def kind(self) -> str:
        """``byte_level``, ``sentencepiece``, ``sentencepiece_bytes`` or ``decode``."""
        return self._kind

    def __call__(self, token_id: int) -> bytes:
        """The bytes of ``token_id``."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if self._kind == "decode":
            return self._tokenizer.decode([token_id]).encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the vocabulary (a padded embedding)
            return b""
        if self._kind == "byte_level":
            table = byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if self._kind == "sentencepiece_bytes" and _is_byte_piece(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace(SPM_SPACE, " ").encode()

    def named(self, logprobs: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """``logprobs`` with every chosen token's and alternative's ``bytes`` filled in."""
        if logprobs is None:
            return None
        return [
            msgspec.structs.replace(
                lp,
                bytes=list(self(lp.token_id)),
                top_bytes=[list(self(t.token_id)) for t in lp.top],
            )
            for lp in logprobs
        ]


@functools.lru_cache(maxsize=4)
def token_bytes_for(tokenizer: Any) -> TokenBytes:
    """The (one, cached) :class:`TokenBytes` of ``tokenizer``."""
    return TokenBytes(tokenizer)


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def decoder_kind(backend: Any) -> str:
    """How a ``tokenizers.Tokenizer``'s decoder turns vocabulary entries into bytes."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "decode"
    spec = json.loads(decoder.__getstate__())
    parts = (spec.get("decoders") or []) if spec.get("type") == "Sequence" else [spec]
    types = {p.get("type") for p in parts}
    if "ByteLevel" in types:
        return "byte_level"
    spm = "Metaspace" in types or any(
        p.get("type") == "Replace" and p.get("pattern", {}).get("String") == SPM_SPACE
        for p in parts
    )
    if not spm:
        return "decode"
    return "sentencepiece_bytes" if "ByteFallback" in types else "sentencepiece"
