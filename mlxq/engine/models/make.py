"""Random-weight models that ``mlx_lm.load`` reads, built fully offline.

``make_model(dest, preset)`` writes a model folder (config, random weights, a small
byte-level BPE tokenizer with a chat template) for tests and demos; ``build_model``
gives the same model in memory, for benchmarks that should not write gigabytes of
weights. The real-shape presets copy the published configs of their namesakes, so
memory use and speed match the real models; their text is of course nonsense.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
END = "<|end_of_text|>"
# The trainer numbers special tokens first, in this order: their ids are fixed.
SPECIAL_TOKENS = [BOS, END, EOT, "<|start_header_id|>", "<|end_header_id|>"]
BOS_ID, EOS_IDS = 0, [2, 1]
TOKENIZER_VOCAB = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ROPE |= {"original_max_position_embeddings": 8192, "rope_type": "llama3"}


# Small enough for unit tests; float32 so greedy argmax is stable across batch shapes.
_TINY: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": TOKENIZER_VOCAB,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _tiny(model_type: str, **extra: Any) -> dict[str, Any]:
    """The ``tiny`` shape in another model family."""
    return {**_TINY, "model_type": model_type, **extra}


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    # Tiny members of other families (the slot engine's tests; gemma3 runs on the fallback).
    "tiny-qwen2": _tiny("qwen2"),
    # Heads of 32 values: a quantized KV cache needs whole groups of 32 (tests of kv_bits).
    "tiny-wide-heads": _tiny("llama", head_dim=32),
    "tiny-qwen3": _tiny("qwen3", head_dim=16),
    "tiny-mistral": _tiny("mistral", head_dim=16),
    "tiny-phi3": _tiny(
        "phi3",
        rope_scaling={"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8},
        original_max_position_embeddings=1024,
    ),
    "tiny-gemma3": _tiny(
        "gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        sliding_window_pattern=2,
    ),
    # Heads, KV heads and MLP divisible by 2 and 3, and 4 layers: split over 2 or 3 ranks
    # by heads or by layers (distributed).
    "tiny-tp": _tiny(
        "llama",
        hidden_size=96,
        intermediate_size=192,
        num_attention_heads=6,
        num_key_value_heads=6,
        num_hidden_layers=4,
    ),
    # A CPU benchmark model: big enough that compute, not per-op overhead, sets the pace.
    "cpu-small": {
        **_TINY,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
    },
    # cpu-small's size, split over 2 or 3 ranks (bench/distributed.py).
    "cpu-small-tp": {
        **_TINY,
        "hidden_size": 384,
        "intermediate_size": 1152,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE},
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, **_LLAMA3_ROPE},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # SmolLM2-135M's shape: a real small model that soaks and CPU benchmarks can afford
    # (float32: the CPU backend is far slower in bfloat16).
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
}

# Built-in training text for the tokenizer: plain English so common words merge into
# multi-byte tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model is a good model for tests.
Once upon a time there was a little town by the sea, where the people worked hard and
the children played in the streets until the sun went down. Every morning the baker
opened his shop and the smell of fresh bread filled the air. The teacher walked to the
school, the fisherman went to his boat, and the old woman in the house on the hill
watched the ships come and go. What is the capital of France? The capital of France is
Paris. How many days are there in a week? There are seven days in a week. Please write
a short story about a robot who learns to paint. The robot looked at the colors and
thought about the world. It was the best of times, it was the worst of times. Water is
made of hydrogen and oxygen. The weather today is sunny with a light wind from the west.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, 2024, 3.14, 100%.
Questions and answers, lists and tables, code and prose: a tokenizer should see them all.
def hello(name): return "Hello, " + name  # a line of code for good measure
"""


# Model types mlx-lm runs with another family's module (as its loader remaps them).
_MODULES = {"mistral": "llama"}


def preset_config(preset: str) -> dict[str, Any]:
    """The full ``config.json`` of a preset, including the tokenizer's special ids."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    arch = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }
    config = dict(PRESETS[preset])
    config["architectures"] = [arch[config["model_type"]]]
    config["bos_token_id"] = BOS_ID
    config["eos_token_id"] = list(EOS_IDS)
    return config


def _init_std(name: str, shape: tuple[int, ...], fan_in_init: bool) -> float:
    """Standard deviation of one random weight.

    ``fan_in_init`` (tiny model): unit-scale activations so every layer and the context
    matter; otherwise the usual 0.02, which keeps deep bf16 models finite.
    """
    if not fan_in_init:
        return 0.02
    if name.endswith("embed_tokens.weight"):
        return 1.0
    return shape[-1] ** -0.5


def _random_params(model: nn.Module, dtype: mx.Dtype, seed: int, fan_in_init: bool) -> dict:
    """Random parameters shaped like ``model``'s: norms are 1, biases 0, weights normal."""
    flat = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = []
    for (name, value), key in zip(flat, keys, strict=True):
        if "norm" in name:
            new = mx.ones(value.shape, dtype=dtype)
        elif name.endswith(".bias"):
            new = mx.zeros(value.shape, dtype=dtype)
        else:
            std = _init_std(name, value.shape, fan_in_init)
            new = mx.random.normal(value.shape, dtype=dtype, key=key) * std
        mx.eval(new)  # one tensor at a time keeps the peak memory at the model's size
        params.append((name, new))
    return tree_unflatten(params)


def build_model(preset: str, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """The preset's model with random weights, in memory, and its config."""
    config = preset_config(preset)
    kind = _MODULES.get(config["model_type"], config["model_type"])
    arch = importlib.import_module(f"mlx_lm.models.{kind}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    dtype = getattr(mx, config["torch_dtype"])
    # The constructor's own (lazy) initial weights are replaced before ever being computed.
    model.update(_random_params(model, dtype, seed, fan_in_init=preset.startswith("tiny")))
    model.eval()
    return model, config


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer trained on the built-in text (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    if tok.token_to_id(BOS) != BOS_ID or [tok.token_to_id(t) for t in (EOT, END)] != EOS_IDS:
        raise RuntimeError("special tokens did not get their fixed ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def _write_tokenizer(dest: Path) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tok = build_tokenizer()
    tok.save(str(dest / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOT, "pad_token": END}
    tokenizer_config = {
        **specials,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    _write_json(dest / "special_tokens_map.json", specials)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_model(dest: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight model folder that ``mlx_lm.load(dest)`` reads offline."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model, config = build_model(preset, seed)
    _write_json(dest / "config.json", config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_tokenizer(dest)
    return dest
