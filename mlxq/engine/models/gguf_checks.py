"""A GGUF file checked before it is converted: its header, its layout and its shapes.

GGUF has no checksum, and ``gguf``'s reader trusts the header: a changed shape or data
offset loads as a different model, garbage counts end in an ``IndexError``. So the header
is read here first, every read bounded by the file's size: the counts must fit the file,
each tensor's data must lie where llama.cpp's writer puts it (and its loader requires) and
inside the file, and each shape must be the one the metadata implies. Every failure is one
line (:class:`GGUFError`) naming the tensor or key, what was found and what was expected.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mlxq.errors import one_line

HEADER_BYTES = 24  # magic, version, tensor_count, kv_count
MIN_KV_BYTES = 13  # key length (8), value type (4), the smallest value (1)
MIN_TENSOR_INFO_BYTES = 24  # name length (8), dims count (4), type (4), data offset (8)
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
MAX_NAME_BYTES = 63  # GGML_MAX_NAME less its terminating zero
DEFAULT_ALIGNMENT = 32
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# GGUF value types (gguf.GGUFValueType) that are fixed-size scalars: their struct format.
SCALARS = dict(zip([*range(8), 10, 11, 12], "BbHhIif?Qqd", strict=True))
FIX = "the file is damaged: download it again, or convert it again from the original model"
TOKENS = "tokenizer.ggml.tokens"


class GGUFError(ValueError):
    """A GGUF file this converter cannot honour; the message says which part and why."""


def damaged(what: str) -> GGUFError:
    """The one-line error for damage found in ``what``, with what to do about it."""
    return GGUFError(f"{what}; {FIX}")


@dataclass(frozen=True)
class Array:
    """An array value: its element type and length (the elements are not kept)."""

    type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry; ``dims`` in GGUF order (the row length first)."""

    name: str
    dims: tuple[int, ...]
    type: int
    offset: int  # from the start of the data section

    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type)]
        return math.prod(self.dims) // block * size


@dataclass(frozen=True)
class Header:
    """What a GGUF file's header says, every part of it inside the file."""

    size: int
    values: dict[str, Any]  # scalars as Python values, arrays as :class:`Array`
    tensors: list[TensorInfo]
    data_start: int
    alignment: int


class Cursor:
    """Reads a GGUF header front to back; a read past the file's end is a one-line error."""

    def __init__(self, buf: Any, size: int, endian: str, counts: str) -> None:
        self.buf, self.size, self.endian, self.counts = buf, size, endian, counts
        self.pos = 0

    def take(self, n: int, what: str) -> int:
        """Claim ``n`` bytes for ``what``; the offset they start at."""
        if n < 0 or self.pos + n > self.size:
            raise damaged(
                f"{what} ({n:,} bytes at byte {self.pos:,}) runs past the end of the file "
                f"({self.size:,} bytes; {self.counts}: is a count wrong?)"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        at = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(self.endian + fmt, self.buf, at)[0]

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"the length of {what}")
        at = self.take(length, what)
        try:
            return bytes(self.buf[at : at + length]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise damaged(f"{what} is not UTF-8 text") from e

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` strings, reading only their lengths (token lists are long)."""
        if 8 * count > self.size - self.pos:  # each has an 8-byte length at least
            self.take(8 * count, f"{what}: {count:,} strings")
        length = struct.Struct(self.endian + "Q")
        for i in range(count):
            at = self.take(8, f"the length of {what}'s string #{i + 1}")
            self.take(length.unpack_from(self.buf, at)[0], f"{what}'s string #{i + 1}")


def read_header(path: Path, architectures: Collection[str] = ()) -> Header:
    """Check ``path``'s header against its size, its layout and, for an architecture in
    ``architectures``, its shapes against its metadata; the header, or a one-line error."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise damaged(f"the file has {size} bytes, but a GGUF header alone takes {HEADER_BYTES}")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        header = parse(buf, size)
    if header.values.get("general.architecture") in architectures:
        check_shapes(header)
    check_layout(header)
    return header


def parse(buf: Any, size: int) -> Header:
    """The header in ``buf`` (``size`` bytes), every read bounded by the file's size."""
    if bytes(buf[:4]) != b"GGUF":
        raise damaged(f"it starts with {bytes(buf[:4])!r}, not GGUF's magic b'GGUF'")
    # The version's low half is 0 when read in the wrong byte order (a big-endian file).
    endian = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    version, tensor_count, kv_count = struct.unpack_from(endian + "IQQ", buf, 4)
    if version not in VERSIONS:
        raise damaged(f"GGUF version {version}, expected one of {VERSIONS}")
    check_counts(tensor_count, kv_count, size)
    counts = f"the header lists {tensor_count} tensors and {kv_count} keys"
    cur = Cursor(buf, size, endian, counts)
    cur.pos = HEADER_BYTES
    values: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"the name of key #{i + 1} of {kv_count}")
        if key in values:
            raise damaged(f"key {key!r} appears twice")
        kind = cur.scalar("I", f"the type of key {key!r}")
        values[key] = read_value(cur, kind, f"the value of key {key!r}")
    tensors: dict[str, TensorInfo] = {}
    for i in range(tensor_count):
        info = read_tensor_info(cur, i, tensor_count)
        if info.name in tensors:
            raise damaged(f"tensor {info.name!r} appears twice")
        tensors[info.name] = info
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise damaged(f"key 'general.alignment' is {alignment!r}, expected a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return Header(size, values, list(tensors.values()), data_start, alignment)


def check_counts(tensor_count: int, kv_count: int, size: int) -> None:
    """Refuse counts the file is too small to hold, before reading a single entry: each key
    and each tensor info takes at least a few bytes, so garbage counts never drive a loop."""
    room = size - HEADER_BYTES
    if tensor_count * MIN_TENSOR_INFO_BYTES > room:
        most = room // MIN_TENSOR_INFO_BYTES
        raise damaged(
            f"the header's tensor_count is {tensor_count:,}, but a file of {size:,} bytes "
            f"holds at most {most:,} tensor infos"
        )
    if kv_count * MIN_KV_BYTES + tensor_count * MIN_TENSOR_INFO_BYTES > room:
        most = (room - tensor_count * MIN_TENSOR_INFO_BYTES) // MIN_KV_BYTES
        raise damaged(
            f"the header's kv_count is {kv_count:,}, but a file of {size:,} bytes with "
            f"{tensor_count:,} tensors holds at most {most:,} keys"
        )


def read_value(cur: Cursor, kind: int, what: str) -> Any:
    """One metadata value of type ``kind``: a scalar, or an :class:`Array` stepped over."""
    if kind in SCALARS:
        return cur.scalar(SCALARS[kind], what)
    if kind == STRING:
        return cur.string(what)
    if kind != ARRAY:
        raise damaged(f"{what} has value type {kind}, expected one of GGUF's types 0-12")
    item = cur.scalar("I", f"the element type of {what}")
    length = cur.scalar("Q", f"the length of {what}")
    if item == STRING:
        cur.skip_strings(length, what)
    elif item in SCALARS:
        cur.take(struct.calcsize(SCALARS[item]) * length, f"{what}: {length:,} values")
    else:  # llama.cpp reads no arrays of arrays either
        raise damaged(f"{what} is an array of type {item}, expected scalars or strings")
    return Array(item, length)


def read_tensor_info(cur: Cursor, i: int, count: int) -> TensorInfo:
    """Tensor info ``i``: name, dims, type and data offset, each within llama.cpp's bounds."""
    name = cur.string(f"the name of tensor #{i + 1} of {count}")
    what = f"tensor {name!r} (#{i + 1} of {count})"
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise damaged(f"{what}: its name has {len(name.encode())} bytes, expected 1-63")
    n_dims = cur.scalar("I", f"the dimension count of {what}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise damaged(f"{what} has {n_dims} dimensions, expected 1 to {MAX_DIMS}")
    dims = tuple(cur.scalar("Q", f"the dimensions of {what}") for _ in range(n_dims))
    kind = cur.scalar("I", f"the type of {what}")
    offset = cur.scalar("Q", f"the data offset of {what}")
    try:
        block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError) as e:
        raise damaged(f"{what} has type {kind}, which is no GGML type") from e
    if min(dims) < 1 or dims[0] % block:
        raise damaged(
            f"{what} has shape {list(dims)}, expected sizes of at least 1 and rows of whole "
            f"{GGMLQuantizationType(kind).name} blocks of {block}"
        )
    return TensorInfo(name, dims, kind, offset)


def check_layout(header: Header) -> None:
    """Each tensor's data where llama.cpp's writer puts it, inside the file: in the header's
    order, each right after the previous, padded to the alignment (llama.cpp's loader
    refuses anything else), so no two overlap and a moved offset is caught."""
    expected, previous = 0, None
    for t in header.tensors:
        where = f"the data of tensor {t.name!r} starts at offset {t.offset:,}"
        if t.offset < expected:
            raise damaged(f"{where}, inside the data of tensor {previous!r} (up to {expected:,})")
        if t.offset != expected:
            after = f"right after tensor {previous!r}" if previous else "at the data's start"
            raise damaged(f"{where}, expected {expected:,} ({after}, padded to {header.alignment})")
        end = header.data_start + t.offset + t.nbytes()
        if end > header.size:
            raise damaged(
                f"the data of tensor {t.name!r} ends at byte {end:,}, but the file has "
                f"{header.size:,} bytes: it is truncated"
            )
        previous = t.name
        expected = t.offset + -(-t.nbytes() // header.alignment) * header.alignment
    extra = header.size - header.data_start - expected
    if extra >= header.alignment:  # the last tensor's padding may be left out
        raise damaged(
            f"{extra:,} bytes follow the last tensor's data, expected none: the header's "
            f"tensor_count ({len(header.tensors)}) or a tensor's shape is wrong"
        )


@dataclass(frozen=True)
class Sizes:
    """The sizes the metadata gives a model's tensors, each with the key it comes from."""

    embd: tuple[int, str]
    vocab: tuple[int, str]
    ff: tuple[int, str]
    q: tuple[int, str]
    kv: tuple[int, str]
    head: tuple[int, str]
    rot_half: tuple[int, str]
    blocks: int


def sizes(header: Header) -> Sizes:
    """The metadata's sizes, each present, of the right type and consistent."""
    arch = header.values["general.architecture"]
    values = header.values

    def number(key: str, default: int | None = None) -> int:
        full = f"{arch}.{key}"
        value = values.get(full, default)
        if value is None:
            raise damaged(f"key {full!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise damaged(f"key {full!r} is {value!r}, expected a positive integer")
        return value

    vocab = vocabulary(values)
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        value = values.get(f"{arch}.{key}", 1.0)  # NaN, inf or <= 0 is never a setting
        if isinstance(value, bool) or not isinstance(value, float | int) or not 0 < value < 1e30:
            raise damaged(f"key '{arch}.{key}' is {value!r}, expected a positive number")
    embd, heads = number("embedding_length"), number("attention.head_count")
    kv_heads = number("attention.head_count_kv", heads)
    # A damaged count shows as a wrong q/k/v shape below, naming what it came from.
    head = number("attention.key_length", embd // heads)
    rot = number("rope.dimension_count", head)
    return Sizes(
        embd=(embd, "embedding_length"),
        vocab=(vocab, "the vocabulary size"),
        ff=(number("feed_forward_length"), "feed_forward_length"),
        q=(heads * head, "head_count x head size"),
        kv=(kv_heads * head, "head_count_kv x head size"),
        head=(head, "the head size"),
        rot_half=(rot // 2, "rope.dimension_count / 2"),
        blocks=number("block_count"),
    )


def vocabulary(values: dict[str, Any]) -> int:
    """The vocabulary's size: the token list's length, which per-token lists share."""
    tokens = values.get(TOKENS)
    if not isinstance(tokens, Array) or tokens.type != STRING or tokens.length < 1:
        raise damaged(f"key {TOKENS!r} is {tokens!r}, expected the list of token strings")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        found = values.get(key)
        if isinstance(found, Array) and found.length != tokens.length:
            raise damaged(
                f"key {key!r} has {found.length:,} entries, expected {tokens.length:,} "
                f"(one per token of {TOKENS})"
            )
    return tokens.length


def shape_rules(s: Sizes, arch: str) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """Each tensor's expected shape (GGUF order, each size with its key): the model's own
    tensors, and each block's (phi3 fuses q/k/v into attn_qkv and gate/up into ffn_up)."""
    top = {
        "token_embd.weight": (s.embd, s.vocab),
        "output.weight": (s.embd, s.vocab),
        "output_norm.weight": (s.embd,),
        "rope_freqs.weight": (s.rot_half,),
        "rope_factors_long.weight": (s.rot_half,),
        "rope_factors_short.weight": (s.rot_half,),
    }
    qkv = (s.q[0] + 2 * s.kv[0], "(head_count + 2 x head_count_kv) x head size")
    up = (2 * s.ff[0], "2 x feed_forward_length") if arch == "phi3" else s.ff
    block = {
        "attn_norm.weight": (s.embd,),
        "ffn_norm.weight": (s.embd,),
        "attn_q.weight": (s.embd, s.q),
        "attn_k.weight": (s.embd, s.kv),
        "attn_v.weight": (s.embd, s.kv),
        "attn_q.bias": (s.q,),
        "attn_k.bias": (s.kv,),
        "attn_v.bias": (s.kv,),
        "attn_qkv.weight": (s.embd, qkv),
        "attn_qkv.bias": (qkv,),
        "attn_output.weight": (s.q, s.embd),
        "attn_output.bias": (s.embd,),
        "attn_q_norm.weight": (s.head,),
        "attn_k_norm.weight": (s.head,),
        "ffn_gate.weight": (s.embd, s.ff),
        "ffn_up.weight": (s.embd, up),
        "ffn_down.weight": (s.ff, s.embd),
    }
    return top, block


def required(arch: str, block: set[str]) -> list[str]:
    """The tensors every block must have (q/k/v fused or not, as the block has them)."""
    attn = ["attn_qkv"] if "attn_qkv.weight" in block else ["attn_q", "attn_k", "attn_v"]
    ffn = ["ffn_up"] if arch == "phi3" else ["ffn_gate", "ffn_up"]
    return [
        f"{n}.weight" for n in ("attn_norm", "ffn_norm", "attn_output", "ffn_down", *attn, *ffn)
    ]


def check_shapes(header: Header) -> None:
    """Every tensor named as the architecture names it, in a block the metadata has, of the
    shape its metadata implies; every block whole."""
    arch = header.values["general.architecture"]
    s = sizes(header)
    top, per_block = shape_rules(s, arch)
    blocks: list[set[str]] = [set() for _ in range(s.blocks)]
    for t in header.tensors:
        parts = t.name.split(".", 2)
        if t.name in top:
            want = top[t.name]
        elif len(parts) == 3 and parts[0] == "blk" and parts[2] in per_block:
            if not parts[1].isdigit() or int(parts[1]) >= s.blocks:
                raise damaged(
                    f"tensor {t.name!r} is in block {parts[1]}, but key "
                    f"'{arch}.block_count' is {s.blocks}"
                )
            blocks[int(parts[1])].add(parts[2])
            want = per_block[parts[2]]
        else:
            raise damaged(f"tensor {t.name!r} is not one of a {arch} model's tensors")
        if t.dims != tuple(n for n, _ in want):
            raise damaged(
                f"tensor {t.name!r} has shape {list(t.dims)} (GGUF order), expected "
                f"{[n for n, _ in want]}: [{', '.join(key for _, key in want)}] from its metadata"
            )
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in {t.name for t in header.tensors}:
            raise damaged(f"tensor {name!r} is missing")
    for i, found in enumerate(blocks):
        for part in required(arch, found):
            if part not in found:
                raise damaged(
                    f"tensor 'blk.{i}.{part}' is missing (key '{arch}.block_count' is {s.blocks})"
                )


def open_reader(path: Path) -> Any:
    """``gguf``'s reader on a checked file; anything it still raises on a damaged file
    (IndexError, ValueError, struct and numpy errors) becomes one line."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (IndexError, ValueError, KeyError, TypeError, OverflowError, struct.error) as e:
        raise damaged(f"gguf's reader cannot read it ({one_line(e)})") from e
