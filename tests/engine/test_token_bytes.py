"""Logprobs in OpenAI's schema: each token's UTF-8 bytes from its vocabulary entry
(mlxq/engine/token_bytes.py), stored with the result by the worker, and OpenAI's shapes out
of ``mlxq results --format openai`` and ``mlxq api`` (parsed with the openai SDK's types)."""

from __future__ import annotations

import json
import random
from typing import Any

from api_servers import (
    CHAT,
    COMPLETIONS,
    chat_line,
    completion_line,
    create,
    read_jsonl,
    run_tiny_worker,
    upload,
    wait_final,
)
from helpers import run_mlxq
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mlxq.engine.token_bytes import TokenBytes, byte_decoder


def joined(raws: list[list[int] | None]) -> bytes:
    assert all(raw is not None for raw in raws), raws
    return b"".join(bytes(raw) for raw in raws)


def assert_bytes_spell(raws: list[list[int] | None], text: str) -> None:
    """The tokens' bytes joined are the text's: exactly where they decode, else as the
    engine decodes (invalid bytes replaced, a character cut at the end dropped)."""
    data = joined(raws)
    try:
        assert data.decode("utf-8") == text
    except UnicodeDecodeError:
        assert data.decode("utf-8", "replace").rstrip("\ufffd") == text


# -- the vocabularies ---------------------------------------------------------------------


def test_byte_decoder_inverts_the_byte_level_alphabet():
    table = byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert (table["Ġ"], table["Ċ"], table["a"], table["Ā"]) == (32, 10, 97, 0)


def test_byte_level_bytes_decode_as_the_tokenizer_decodes_any_ids(tiny):
    """Random ids (the tiny model's output is random too): the bytes joined, decoded with
    replacement, are the tokenizer's own decode, special tokens included."""
    tokenizer = tiny[1]
    names = TokenBytes(tokenizer)
    assert names.kind == "byte_level"
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        data = b"".join(names(i) for i in ids)
        assert data.decode("utf-8", "replace") == tokenizer.decode(ids), ids
    text = "naïve café — 🎉 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(names(i) for i in ids) == text.encode()
    assert any(len(names(i).decode("utf-8", "ignore")) < len(names(i)) for i in ids)  # parts


def spm_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary with byte fallback (Llama 2, Mistral's decoder)."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({p: len(vocab) + i for i, p in enumerate(["▁", "▁Hi", "é", "▁th", "ere"])})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_sentencepiece_spaces_and_byte_pieces():
    tokenizer = spm_tokenizer()
    names = TokenBytes(tokenizer)
    assert names.kind == "sentencepiece_bytes"
    vocab = tokenizer.get_vocab()
    assert names(vocab["▁Hi"]) == b" Hi" and names(vocab["é"]) == "é".encode()
    assert names(vocab["<0xF0>"]) == b"\xf0"
    emoji = [vocab[f"<0x{b:02X}>"] for b in "🎉".encode()]
    ids = [vocab["▁Hi"], vocab["▁th"], vocab["ere"], *emoji]
    data = b"".join(names(i) for i in ids)
    assert data == " Hi there🎉".encode()
    assert tokenizer.decode(ids) == data.decode()[1:]  # its decoder strips one leading space


def test_an_unknown_decoder_decodes_each_token_alone():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    names = TokenBytes(PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"))
    assert names.kind == "decode" and names(1) == b"hello"


# -- through the worker and out as OpenAI lines -------------------------------------------


def token_text(raw: list[int]) -> str:
    """OpenAI's ``token`` for these bytes: their text, else ``bytes:`` and escapes."""
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        return "bytes:" + bytes(raw).decode("utf-8", "backslashreplace")


def check_chat(body: dict[str, Any], top: int) -> ChatCompletion:
    """A chat body as the openai SDK reads it: each choice's tokens named by text and
    bytes, with ``top`` alternatives each, and the bytes spelling the message."""
    parsed = ChatCompletion.model_validate(body)
    for choice in parsed.choices:
        content = choice.logprobs.content
        assert content, choice
        for entry in content:
            assert entry.bytes is not None
            assert entry.token == token_text(entry.bytes)
            assert len(entry.top_logprobs) == top
            assert all(alt.bytes is not None for alt in entry.top_logprobs)
            assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5
        assert_bytes_spell([e.bytes for e in content], choice.message.content)
    return parsed


def test_mlxq_results_format_openai_names_tokens(valkey_url, conn, tmp_path, tiny_model):
    src = tmp_path / "chat.jsonl"
    lines = [
        chat_line("one", "Hi", max_tokens=12, logprobs=True, top_logprobs=3),
        chat_line("two", "Bonjour", max_tokens=12, logprobs=True, top_logprobs=2, n=2, seed=1),
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ("submit", str(src), "--queue", "lp", "--json", "--ignore-line-models")
    submitted = run_mlxq(*args, url=valkey_url)
    batch = json.loads(submitted.stdout)["batch_id"]
    worker = run_mlxq("worker", "--model", tiny_model, "-q", "lp", "--burst", url=valkey_url)
    assert worker.returncode == 0, worker.stderr
    out = tmp_path / "out.jsonl"
    res = run_mlxq("results", batch, "--format", "openai", "-o", str(out), url=valkey_url)
    assert res.returncode == 0, res.stderr
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    check_chat(rows["one"]["response"]["body"], top=3)
    two = check_chat(rows["two"]["response"]["body"], top=2)
    assert [c.index for c in two.choices] == [0, 1]


def test_mlxq_api_output_files_name_tokens(client, conn, tiny_model):
    chat = [chat_line("c", "Hello", max_tokens=12, logprobs=True, top_logprobs=4, n=2)]
    comp = [completion_line("t", "Once upon", max_tokens=12, logprobs=3)]
    chat_batch = create(client, upload(client, chat), CHAT)
    comp_batch = create(client, upload(client, comp), COMPLETIONS)
    run_tiny_worker(tiny_model, conn)

    chat_rows = read_jsonl(client, wait_final(client, chat_batch.id).output_file_id)
    parsed = check_chat(chat_rows["c"]["response"]["body"], top=4)
    assert len(parsed.choices) == 2
    body = read_jsonl(client, wait_final(client, comp_batch.id).output_file_id)["t"]
    choice = Completion.model_validate(body["response"]["body"]).choices[0]
    lps, raw = choice.logprobs, body["response"]["body"]["choices"][0]["logprobs"]
    assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.text_offset) > 0
    assert all(len(top) <= 3 for top in lps.top_logprobs)  # two alternatives may share a text
    assert lps.tokens != [str(i) for i in raw["token_ids"]]  # text, not ids
    texts, offsets = lps.tokens, lps.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    if all(not t.startswith("bytes:") for t in texts):
        assert "".join(texts) == choice.text
        assert offsets == [len("".join(texts[:i])) for i in range(len(texts))]
    assert raw["token_ids"]  # the non-standard ids next to OpenAI's fields
