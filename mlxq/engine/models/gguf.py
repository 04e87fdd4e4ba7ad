"""GGUF files (llama.cpp, Ollama, LM Studio) served as mlx-lm models.

``--model path/to/model.gguf`` is read once with ``gguf`` (llama.cpp's own reader) and
written as an mlx-lm folder (config.json, model.safetensors, tokenizer files) in a cache,
``~/.mlxq/gguf/<key>`` (or ``$MLXQ_GGUF_CACHE``), keyed by the file's path, size and
modification time, so the next start loads that folder directly. The conversion maps the
architecture to mlx-lm's model class, renames the tensors, undoes llama.cpp's permutation of
the q and k rows (for its interleaved rotary layout) on weights, scales and biases alike, and
keeps the quantized blocks in MLX's affine layout (:mod:`mlxq.engine.models.gguf_quant`); the
tokenizer and chat template come from the metadata (:mod:`mlxq.engine.models.gguf_tokenizer`).
Before any of that the file is checked (:mod:`mlxq.engine.models.gguf_checks`): a damaged
file is refused in one line rather than converted into a different model. A conversion
works in a ``.converting-<host>-<pid>-*`` folder beside the cache; the next conversion
removes those whose process is gone (killed midway).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from mlxq.engine.models.gguf_checks import GGUFError, open_reader, read_header
from mlxq.engine.models.gguf_quant import Quantized, convert

log = logging.getLogger("mlxq.engine")
CACHE_ENV = "MLXQ_GGUF_CACHE"
# Bumped when the converted folder's contents change, so old copies are not reused.
CONVERTER_VERSION = 1
# GGUF architecture: (mlx-lm model_type, q/k rows permuted by llama.cpp's converter).
ARCHITECTURES = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "phi3": ("phi3", False),
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3 keeps its gate and up projections fused in one tensor, as GGUF does.
PHI3_NAMES = {**LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors the mlx-lm model computes itself; their facts go into the config instead.
ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
WORK_PREFIX = ".converting-"
# A work folder named without a pid (before pids were in the name) is stale after this long.
UNOWNED_STALE_S = 24 * 3600


def is_gguf(name: str) -> bool:
    """Whether ``--model name`` names a GGUF file."""
    return name.lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted GGUF models are kept."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".mlxq" / "gguf").expanduser()


def cache_key(path: Path) -> str:
    """A key for ``path``'s converted copy: its place, size and modification time."""
    stat = path.stat()
    ident = f"{CONVERTER_VERSION}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def converted_folder(path: Path) -> Path:
    """The mlx-lm folder of GGUF file ``path``: the cached copy, converted first if absent.
    :class:`GGUFError` (one line, naming ``path``) if the file cannot be converted."""
    folder = cache_root() / cache_key(path)
    if (folder / "config.json").is_file():
        log.info("gguf: %s converted before, loading %s", path.name, folder)
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work(folder.parent)
    prefix = f"{WORK_PREFIX}{host_tag()}-{os.getpid()}-"
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=folder.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the copy is as readable as the file
    try:
        write_folder(path, work)
        try:
            work.rename(folder)
        except OSError:  # another process converted it meanwhile: use theirs
            if not (folder / "config.json").is_file():
                raise
    except GGUFError as e:
        e.args = (f"model {path}: {e}",)  # the same error (and cause), naming the file
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def host_tag() -> str:
    """This host's name as a work folder spells it (no ``-``: the name is split on it); a
    pid is only meaningful on its own host, and the cache may be on a shared disk."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def remove_stale_work(root: Path) -> None:
    """Remove the work folders of conversions that died midway: this host's whose process
    is gone, and unowned ones (no pid in the name) a day old. A live one is left alone."""
    for work in root.glob(f"{WORK_PREFIX}*"):
        host, _, rest = work.name[len(WORK_PREFIX) :].partition("-")
        pid = rest.partition("-")[0]
        if pid.isdigit():
            stale = host == host_tag() and not pid_alive(int(pid))
        else:
            try:
                stale = time.time() - work.stat().st_mtime > UNOWNED_STALE_S
            except OSError:
                continue
        if stale:
            log.info("gguf: removing %s, left by a conversion that did not finish", work)
            shutil.rmtree(work, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: signalling it is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def write_folder(path: Path, folder: Path) -> None:
    """Convert GGUF ``path`` into an mlx-lm folder at ``folder``."""
    import mlx.core as mx

    from mlxq.engine.models.gguf_tokenizer import write_tokenizer

    read_header(path, ARCHITECTURES)  # a damaged file stops here, in one line
    reader = open_reader(path)
    meta = Metadata(reader)
    model_type, permuted = architecture(meta)
    config = model_config(meta, model_type, reader)
    weights, quantized = tensors(reader, config, permuted)
    config.update(write_tokenizer(meta, folder))
    if quantized:
        bits = max(set(quantized.values()), key=list(quantized.values()).count)
        config["quantization"] = {"group_size": 32, "bits": bits, "mode": "affine"}
        # mlx-lm reads each layer's bits and group size from its scales' shape.
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    arrays = {k: mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})


class Metadata:
    """A GGUF file's key-value metadata, read on demand."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields
        self.arch = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``<architecture>.<key>``."""
        return self.get(f"{self.arch}.{key}", default)


def architecture(meta: Metadata) -> tuple[str, bool]:
    """mlx-lm's model_type for the file, and whether q/k rows are permuted; one-line refusal
    otherwise."""
    if meta.arch not in ARCHITECTURES:
        raise GGUFError(
            f"GGUF architecture {meta.arch or '(none)'!r} is not supported; "
            f"mlxq reads {', '.join(ARCHITECTURES)} GGUFs (or pass an mlx-lm folder or hub id)"
        )
    return ARCHITECTURES[meta.arch]


def model_config(meta: Metadata, model_type: str, reader: Any) -> dict[str, Any]:
    """The mlx-lm config.json of the file's model."""
    heads = int(meta.arch_value("attention.head_count"))
    hidden = int(meta.arch_value("embedding_length"))
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.arch_value("block_count")),
        "intermediate_size": int(meta.arch_value("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.arch_value("attention.head_count_kv", heads)),
        "head_dim": int(meta.arch_value("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.arch_value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.arch_value("context_length", 4096)),
        "vocab_size": len(meta.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    scaling = rope_scaling(meta, reader, config)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def rope_scaling(meta: Metadata, reader: Any, config: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's ``rope_scaling`` for the file's RoPE metadata and factor tensors."""
    found = {
        t.name: np.asarray(t.data, dtype=np.float32)
        for t in reader.tensors
        if t.name.split(".")[0] in ROPE_TENSORS
    }
    kind = meta.arch_value("rope.scaling.type")
    original = meta.arch_value("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in found:  # Phi-3's long-context RoPE
        config["original_max_position_embeddings"] = int(original or 4096)
        return {
            "type": "longrope",
            "long_factor": found["rope_factors_long.weight"].tolist(),
            "short_factor": found["rope_factors_short.weight"].tolist(),
        }
    if "rope_freqs.weight" in found:
        return llama3_scaling(found["rope_freqs.weight"], config)
    if kind in (None, "none"):
        return None
    if kind in ("linear", "yarn"):
        scaling = {"type": kind, "factor": float(meta.arch_value("rope.scaling.factor", 1.0))}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn, llama3 are)")


def llama3_scaling(freqs: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3's RoPE scaling, recovered from llama.cpp's ``rope_freqs`` factors: every
    Llama 3.x uses low/high frequency factors 1 and 4 over 8192 positions, so only the
    factor varies; refused if the stored factors are not those."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dim = config["head_dim"]
    inv = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expect = np.where(
        wavelen < high_wl,
        1.0,
        np.where(
            wavelen > low_wl, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)
        ),
    )
    if not np.allclose(expect, freqs, rtol=1e-3):
        raise GGUFError(
            "GGUF rope_freqs are not Llama 3's scaling (low 1, high 4, 8192 positions); "
            "this RoPE variant is not supported"
        )
    return scaling


def mlx_name(name: str, model_type: str = "llama") -> str | None:
    """The mlx-lm (Hugging Face) name of GGUF tensor ``name``; None for tensors dropped."""
    base, _, suffix = name.rpartition(".")
    layer_names = PHI3_NAMES if model_type == "phi3" else LAYER_NAMES
    if base in ROPE_TENSORS:
        return None
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    raise GGUFError(f"GGUF tensor {name!r} has no counterpart in mlx-lm's model")


def unpermute(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a q or k projection:
    each head's rows were reordered from halves (HF) to interleaved pairs (GGUF)."""
    head_dim = rows // heads
    order = np.arange(rows).reshape(heads, head_dim // 2, 2).swapaxes(1, 2)
    return order.reshape(rows)


def tensors(
    reader: Any, config: dict[str, Any], permuted: bool
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """The file's tensors under mlx-lm names (quantized ones as ``weight``/``scales``/
    ``biases``), and the bits of each quantized layer; logs each choice and its memory."""
    weights: dict[str, np.ndarray] = {}
    quantized: dict[str, int] = {}
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # count, file bytes, bytes
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for t in reader.tensors:
        name = mlx_name(t.name, config["model_type"])
        if name is None:
            continue
        value = convert(t.data, t.tensor_type, tuple(int(n) for n in reversed(t.shape)))
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            order = unpermute(int(t.shape[-1]), heads[proj])
            value = value.rows(order) if isinstance(value, Quantized) else value[order]
        layer = name.rsplit(".", 1)[0]
        if isinstance(value, Quantized):
            quantized[layer] = value.bits
            weights[f"{layer}.weight"] = value.weight
            weights[f"{layer}.scales"] = value.scales
            weights[f"{layer}.biases"] = value.biases
            label = f"{t.tensor_type.name} {value.how} as {value.bits}-bit g{value.group_size}"
            size = value.nbytes()
        else:
            weights[name] = value
            label, size = f"{t.tensor_type.name} kept as {value.dtype}", value.nbytes
        tally[label][0] += 1
        tally[label][1] += int(t.n_bytes)
        tally[label][2] += size
    _log_tally(tally)
    return weights, quantized


def _log_tally(tally: dict[str, list[int]]) -> None:
    total_file = sum(v[1] for v in tally.values())
    total = sum(v[2] for v in tally.values())
    for label, (count, file_bytes, size) in sorted(tally.items()):
        log.info(
            "gguf: %s: %d tensors, %.1f MiB (%.1f MiB in the file)",
            label,
            count,
            size / 2**20,
            file_bytes / 2**20,
        )
    log.info(
        "gguf: weights %.1f MiB in MLX, %.2fx the file's %.1f MiB",
        total / 2**20,
        total / max(total_file, 1),
        total_file / 2**20,
    )
