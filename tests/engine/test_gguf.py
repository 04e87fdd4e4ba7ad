"""GGUF files as models: blocks in MLX's layout, names, q/k rows and tokenizer, on small
files written here with ``gguf``'s own writer (the real model's tier: test_real_model.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, dequantize, quantize
from mlx.utils import tree_flatten

from mlxq.broker.keys import queue_name_for_model
from mlxq.engine.models import gguf as gguf_model
from mlxq.engine.models.gguf_quant import EXACT, REQUANT_BITS, Quantized, convert
from mlxq.engine.models.make import BOS_ID, CHAT_TEMPLATE, EOS_IDS, build_model, build_tokenizer
from mlxq.engine.models.source import ModelError, resolve_model

BLOCK_BYTES = {Q.Q6_K: 210, Q.Q3_K: 110}
# Where each type keeps its float16 scale (and minimum): (byte offset, how many).
F16_FIELDS = {Q.Q8_0: (0, 1), Q.Q4_0: (0, 1), Q.Q5_0: (0, 1), Q.Q6_K: (208, 1), Q.Q3_K: (108, 1)}


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv(gguf_model.CACHE_ENV, str(cache))
    return cache


def random_blocks(kind: Q, rows: int, cols: int) -> np.ndarray:
    """Random raw blocks of ``kind`` with small finite float16 scales (every bit pattern
    of the quants is a valid value)."""
    size, per_block = EXACT[kind][:2] if kind in EXACT else (BLOCK_BYTES[kind], 256)
    rng = np.random.default_rng(int(kind))
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    at, count = F16_FIELDS.get(kind, (0, 2))
    scales = rng.uniform(0.001, 0.05, (*raw.shape[:2], count)).astype(np.float16)
    raw[..., at : at + 2 * count] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def mlx_values(q: Quantized) -> np.ndarray:
    """The values MLX computes from ``q`` (in float32, as the CPU path dequantizes)."""
    scales, biases = (mx.array(a).astype(mx.float32) for a in (q.scales, q.biases))
    return np.array(mx.dequantize(mx.array(q.weight), scales, biases, q.group_size, q.bits))


@pytest.mark.parametrize("kind", list(EXACT), ids=lambda k: k.name)
def test_exact_types_keep_their_values_in_mlx_affine_layout(kind: Q) -> None:
    raw = random_blocks(kind, 8, 512)
    q = convert(raw, kind, (8, 512))
    assert isinstance(q, Quantized) and q.how == "kept" and q.group_size == 32
    assert q.bits == {Q.Q8_0: 8, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5}.get(kind, 4)
    want = dequantize(raw, kind).reshape(8, 512)
    # K-quants' scale d*sc is rounded to float16 (2^-11 relative); the others are exact.
    tol = 2e-3 if kind in (Q.Q4_K, Q.Q5_K) else 1e-6
    np.testing.assert_allclose(mlx_values(q), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("kind", [Q.Q6_K, Q.Q3_K], ids=lambda k: k.name)
def test_other_types_are_requantized_to_8_bits_never_float16(kind: Q) -> None:
    raw = random_blocks(kind, 4, 512)
    q = convert(raw, kind, (4, 512))
    assert isinstance(q, Quantized) and q.bits == REQUANT_BITS and q.how == "re-quantized"
    want = dequantize(raw, kind).reshape(4, 512)
    step = (want.max() - want.min()) / 255
    np.testing.assert_allclose(mlx_values(q), want, atol=step)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (halves -> pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


Blocks = Callable[[str, tuple[int, ...]], tuple[np.ndarray, Q | None]]


def gguf_names() -> dict[str, str]:
    """mlx-lm name -> llama.cpp name, for the tiny llama's and cpu-small's tensors."""
    names = {f"{v}": k for k, v in gguf_model.TOP_NAMES.items()}
    for layer in range(4):
        for short, long in gguf_model.LAYER_NAMES.items():
            names[f"model.layers.{layer}.{long}"] = f"blk.{layer}.{short}"
    return names


def write_tiny_gguf(
    path: Path,
    kind: Q = Q.F32,
    arch: str = "llama",
    blocks: Blocks | None = None,
    preset: str = "tiny",
) -> tuple[Any, dict]:
    """The tiny llama (or ``preset``; random weights, seed 0) written as llama.cpp writes a
    GGUF: its names, q/k rows permuted, 2-D weights as ``kind`` (or as ``blocks`` makes them
    from the GGUF name and shape: data and its type, None for float); the model, its config."""
    model, config = build_model(preset)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    tok = json.loads(build_tokenizer().to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t.startswith("<|") else 1 for t, _ in vocab])
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    )
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_IDS[0])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf_names()
    for name, value in tree_flatten(model.parameters()):
        w = np.array(value.astype(mx.float32))
        layer, suffix = name.rsplit(".", 1)
        if layer.endswith("q_proj"):
            w = llama_permute(w, config["num_attention_heads"])
        elif layer.endswith("k_proj"):
            w = llama_permute(w, config["num_key_value_heads"])
        if w.ndim == 2 and blocks is not None:
            data, raw = blocks(f"{names[layer]}.{suffix}", w.shape)
            writer.add_tensor(f"{names[layer]}.{suffix}", data, raw_dtype=raw)
        elif w.ndim == 2 and kind != Q.F32:
            writer.add_tensor(f"{names[layer]}.{suffix}", quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(f"{names[layer]}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, config


def test_a_llama_gguf_loads_as_the_model_it_was_written_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tiny.gguf"
    original, _ = write_tiny_gguf(path)
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        folder = resolve_model(str(path))
    assert "F32 kept as float32" in caplog.text and "tokenizer gpt2" in caplog.text
    model, tokenizer = mlx_lm.load(str(folder))
    tokens = mx.array([[BOS_ID, 5, 17, 99, 300, 42]])
    # Names, q/k rows (RoPE sees the same pairs) and config all round-trip: equal logits.
    assert mx.allclose(model(tokens), original(tokens), atol=1e-4).item()
    reference = build_tokenizer()
    text = "Hello, wörld 123 🙂"
    assert tokenizer.encode(text) == reference.encode(text).ids
    assert tokenizer.eos_token_ids == {EOS_IDS[0]}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.startswith("<|begin_of_text|><|start_header_id|>user")


def test_q8_0_and_q4_0_blocks_equal_mlx_own_gguf_reading(tmp_path: Path) -> None:
    for kind in (Q.Q8_0, Q.Q4_0):
        path = tmp_path / f"tiny-{kind.name}.gguf"
        write_tiny_gguf(path, kind)
        theirs = mx.load(str(path))
        ours = mx.load(str(resolve_model(str(path)) / "model.safetensors"))
        names = gguf_names()
        heads = {"q_proj": 4, "k_proj": 2}
        for name, value in ours.items():
            layer, suffix = name.rsplit(".", 1)
            proj = layer.rsplit(".", 1)[-1]
            if proj in heads:  # back to llama.cpp's row order, as MLX reads the file
                value = value[
                    mx.array(np.argsort(gguf_model.unpermute(value.shape[0], heads[proj])))
                ]
            assert mx.array_equal(value, theirs[f"{names[layer]}.{suffix}"].astype(value.dtype)), (
                name
            )


def test_the_converted_copy_is_cached_and_reused(tmp_path: Path, gguf_cache: Path, caplog) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    first = resolve_model(str(path))
    assert first.parent == gguf_cache and first.name.startswith("tiny-")
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        assert resolve_model(str(path)) == first
    assert "converted before" in caplog.text and "tensors" not in caplog.text
    assert [p.name for p in gguf_cache.iterdir()] == [first.name]  # no half-written copies


def test_unsupported_architectures_and_bad_files_are_refused_in_one_line(tmp_path: Path) -> None:
    gemma = tmp_path / "g.gguf"
    write_tiny_gguf(gemma, arch="gemma2")
    with pytest.raises(ModelError, match="architecture 'gemma2' is not supported") as e:
        resolve_model(str(gemma))
    assert "\n" not in str(e.value) and "llama, mistral, qwen2, qwen3, phi3" in str(e.value)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelError, match="GGUF version 0, expected one of") as e:
        resolve_model(str(broken))
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_a_gguf_model_queue_is_its_file_stem() -> None:
    assert queue_name_for_model("models/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert queue_name_for_model("SmolLM2-135M-Instruct.Q4_1") == "SmolLM2-135M-Instruct.Q4_1"


# llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output and for attn_v and ffn_down in some
# layers (here layer 0), and its fallbacks where a row is not a multiple of 256 (Q5_0 for
# Q4_K, Q8_0 for Q6_K; here attn_output and token_embd stand for them).
Q4_K_M = {"attn_output": Q.Q5_0, "token_embd": Q.Q8_0, "output": Q.Q6_K}
# The largest float16 scale each type gets, so that weights stay under ~0.5.
SCALE_TOP = {Q.Q4_K: 5e-4, Q.Q6_K: 1e-4, Q.Q5_0: 0.02, Q.Q8_0: 3e-3}


def q4_k_m_kind(name: str) -> Q:
    parts = name.split(".")
    if parts[0] == "blk" and parts[1] == "0" and parts[2] in ("attn_v", "ffn_down"):
        return Q.Q6_K
    return Q4_K_M.get(parts[-2], Q.Q4_K)


def small_blocks(kind: Q, rows: int, cols: int) -> np.ndarray:
    """:func:`random_blocks` with their float16 scales cut to :data:`SCALE_TOP`."""
    raw = random_blocks(kind, rows, cols)
    blocks = raw.reshape(rows, -1, EXACT[kind][0] if kind in EXACT else BLOCK_BYTES[kind])
    at, count = F16_FIELDS.get(kind, (0, 2))
    field = np.ascontiguousarray(blocks[..., at : at + 2 * count]).view(np.float16)
    smaller = (field.astype(np.float32) * (SCALE_TOP[kind] / 0.05)).astype(np.float16)
    blocks[..., at : at + 2 * count] = smaller.view(np.uint8)
    return raw


def test_a_q4_k_m_shaped_file_loads_per_layer_in_mlx_layouts_near_the_file_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Types mixed per tensor as llama.cpp's Q4_K_M mixes them: each layer keeps its own
    bits and group size, the weights take under 1.15x the file's bytes, and the logits are
    those of an F32 file of the same dequantized values."""

    def mixed(name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, Q | None]:
        return small_blocks(q4_k_m_kind(name), *shape), q4_k_m_kind(name)

    def as_f32(name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, Q | None]:
        data, kind = mixed(name, shape)
        return dequantize(data, kind).reshape(shape), None

    paths = {"mixed": tmp_path / "tiny-q4km.gguf", "f32": tmp_path / "tiny-f32.gguf"}
    # cpu-small: rows of 256 and 768 values, whole K-quant super-blocks
    write_tiny_gguf(paths["mixed"], blocks=mixed, preset="cpu-small")
    write_tiny_gguf(paths["f32"], blocks=as_f32, preset="cpu-small")
    with caplog.at_level(logging.INFO, logger="mlxq.engine"):
        folders = {k: resolve_model(str(p)) for k, p in paths.items()}
    for line in ("Q4_K kept as 4-bit g32", "Q5_0 kept as 5-bit g32", "Q8_0 kept as 8-bit g32"):
        assert line in caplog.text
    assert "Q6_K re-quantized as 8-bit g64" in caplog.text and "float16" not in caplog.text
    model, _ = mlx_lm.load(str(folders["mixed"]))
    reference, _ = mlx_lm.load(str(folders["f32"]))
    layers = model.model.layers
    layouts = {
        "v0": (layers[0].self_attn.v_proj.bits, layers[0].self_attn.v_proj.group_size),
        "v1": (layers[1].self_attn.v_proj.bits, layers[1].self_attn.v_proj.group_size),
        "o": (layers[1].self_attn.o_proj.bits, layers[1].self_attn.o_proj.group_size),
        "embed": (model.model.embed_tokens.bits, model.model.embed_tokens.group_size),
    }
    assert layouts == {"v0": (8, 64), "v1": (4, 32), "o": (5, 32), "embed": (8, 32)}
    from gguf import GGUFReader

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(paths["mixed"])).tensors)
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert held <= 1.15 * file_bytes, held / file_bytes
    tokens = mx.array([[BOS_ID, 5, 17, 99, 300, 42]])
    ours, want = model(tokens), reference(tokens)
    # Q4_K's scale d*sc rounds to float16 and Q6_K is re-quantized to 8 bits: close, not equal.
    err = mx.abs(ours - want).max().item()
    assert err <= 0.02 * mx.abs(want).max().item(), err
