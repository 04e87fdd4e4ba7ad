"""GGUF quantized blocks in MLX's affine layout (``w = scale * q + bias``, groups of 32).

llama.cpp's block formats are read as raw bytes (``gguf``'s reader hands each tensor's rows
of blocks) and mapped where the mapping is exact: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are one
scale (and minimum) per 32 values, and the K-quants Q4_K and Q5_K are super-blocks of eight
32-value sub-blocks, each with its own 6-bit scale and minimum, so they too are affine 4- and
5-bit groups of 32 (the scale ``d * sc`` rounds to float16, 2^-11 relative). Every other type
(Q6_K, Q2_K, Q3_K, the IQ types) is dequantized with ``gguf``'s own code and re-quantized to
8 bits, never kept as float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import dequantize

GROUP = 32
REQUANT_BITS = 8
REQUANT_GROUP = 64  # 8.5 bits a weight with float16 scales and biases; error ~range/255
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: None}


@dataclass
class Quantized:
    """One matrix in MLX's affine layout: packed uint32 rows, float16 scales and biases."""

    weight: np.ndarray  # uint32, (rows, cols * bits / 32)
    scales: np.ndarray  # float16, (rows, cols / group)
    biases: np.ndarray
    bits: int
    group_size: int
    how: str  # "kept" (mapped exactly) or "re-quantized"

    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes

    def rows(self, order: np.ndarray) -> Quantized:
        """The same matrix with its rows (output features) reordered."""
        return Quantized(
            self.weight[order],
            self.scales[order],
            self.biases[order],
            self.bits,
            self.group_size,
            self.how,
        )


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-bit values (rows, cols) packed as MLX packs them: a little-endian
    bit stream per row, read as uint32 words."""
    values = values.astype(np.uint8)
    rows, cols = values.shape
    if bits == 8:
        return np.ascontiguousarray(values).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4)).view(np.uint32)
    stream = np.unpackbits(values[..., None], axis=-1, bitorder="little")[..., :bits]
    packed = np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view(np.uint32)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 32-value layout: the low nibbles are values 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: bit j of a little-endian uint32 is value j's."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _blocks(data: np.ndarray, rows: int, size: int) -> np.ndarray:
    return data.reshape(rows, -1, size)


def _affine(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> Quantized:
    """Values (rows, groups, 32) with one scale and bias per group, as a :class:`Quantized`."""
    rows = q.shape[0]
    return Quantized(
        pack(q.reshape(rows, -1), bits),
        scale.reshape(rows, -1).astype(np.float16),
        bias.reshape(rows, -1).astype(np.float16),
        bits,
        GROUP,
        "kept",
    )


def _q8_0(b: np.ndarray) -> Quantized:
    d = _f16(b, 0).astype(np.float32)
    q = b[..., 2:].view(np.int8).astype(np.int16) + 128
    return _affine(q, d, -128 * d, 8)


def _q4_0(b: np.ndarray) -> Quantized:
    d = _f16(b, 0).astype(np.float32)
    return _affine(_nibbles(b[..., 2:]), d, -8 * d, 4)


def _q4_1(b: np.ndarray) -> Quantized:
    return _affine(_nibbles(b[..., 4:]), _f16(b, 0), _f16(b, 2), 4)


def _q5_0(b: np.ndarray) -> Quantized:
    d = _f16(b, 0).astype(np.float32)
    q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
    return _affine(q, d, -16 * d, 5)


def _q5_1(b: np.ndarray) -> Quantized:
    q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
    return _affine(q, _f16(b, 0), _f16(b, 2), 5)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums packed in a K-quant's 12 bytes."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(b: np.ndarray, q: np.ndarray, bits: int) -> Quantized:
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
    sc, mn = _k_scales(b[..., 4:16])
    return _affine(q, d[..., None] * sc, -dmin[..., None] * mn, bits)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 256 values: four chunks of 32 bytes, low nibbles then high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: np.ndarray) -> Quantized:
    return _k_affine(b, _k_nibbles(b[..., 16:144]), 4)


def _q5_k(b: np.ndarray) -> Quantized:
    high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")  # (.., 32, 8)
    high = np.moveaxis(high, -1, -2)  # sub-block k's fifth bits are bit k of each byte
    return _k_affine(b, _k_nibbles(b[..., 48:176]) | (high << 4), 5)


# type: (bytes per block, values per block, converter)
EXACT = {
    Q.Q8_0: (34, 32, _q8_0),
    Q.Q4_0: (18, 32, _q4_0),
    Q.Q4_1: (20, 32, _q4_1),
    Q.Q5_0: (22, 32, _q5_0),
    Q.Q5_1: (24, 32, _q5_1),
    Q.Q4_K: (144, 256, _q4_k),
    Q.Q5_K: (176, 256, _q5_k),
}


def requantize(values: np.ndarray) -> Quantized:
    """A float matrix quantized by MLX to :data:`REQUANT_BITS` bits."""
    import mlx.core as mx

    w, s, b = mx.quantize(
        mx.array(values, dtype=mx.float32), group_size=REQUANT_GROUP, bits=REQUANT_BITS
    )
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    mx.eval(w, s16, b16)
    return Quantized(
        np.array(w),
        np.array(s16),
        np.array(b16),
        REQUANT_BITS,
        REQUANT_GROUP,
        "re-quantized",
    )


def convert(data: np.ndarray, kind: Q, shape: tuple[int, ...]) -> np.ndarray | Quantized:
    """A GGUF tensor (``shape`` in row-major order, rows first) as a float array (float
    types, kept as stored) or as MLX affine blocks (quantized types)."""
    if kind in FLOAT_TYPES:
        if kind == Q.BF16:
            return dequantize(data, kind).reshape(shape)
        return np.asarray(data).view(FLOAT_TYPES[kind]).reshape(shape)
    if len(shape) != 2:
        raise ValueError(f"a quantized tensor of {len(shape)} dimensions ({kind.name})")
    rows, cols = shape
    if kind in EXACT and cols % GROUP == 0:
        size, _, make = EXACT[kind]
        return make(_blocks(np.asarray(data), rows, size))
    values = dequantize(np.asarray(data), kind).reshape(rows, cols)
    return requantize(values)
