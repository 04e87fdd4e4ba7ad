"""make_model: random-weight models that mlx_lm loads offline."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from mlxq.engine.models import make as mm


def _greedy(model, tokens: list[int], n: int) -> list[int]:
    return [t for t, _ in generate_step(mx.array(tokens), model, max_tokens=n)]


def test_load_offline(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "special_tokens_map.json"} <= names
    model, tokenizer, config = mlx_lm.load(str(tiny_model_dir), return_config=True)
    assert config["hidden_size"] == 64 and config["model_type"] == "llama"
    assert type(tokenizer._detokenizer).__name__ == "BPEStreamingDetokenizer"
    assert len(tokenizer) <= config["vocab_size"]
    assert tokenizer.eos_token_ids == set(mm.EOS_IDS)
    assert tokenizer.bos_token == mm.BOS
    assert model.model.embed_tokens.weight.dtype == mx.float32
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, config["vocab_size"])
    assert mx.all(mx.isfinite(logits)).item()


def test_tokenizer_roundtrip(tiny) -> None:
    _, tokenizer = tiny
    for text in ["The capital of France is Paris.", "déjà vu ✓ 漢字", "  two  spaces\n\tand tab"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("The capital of France is")
    assert ids[0] == mm.BOS_ID
    assert len(ids) == 6  # BOS + five whole-word tokens: words merge into multi-byte tokens


def test_chat_template_renders(tiny) -> None:
    _, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == mm.BOS_ID and ids.count(mm.BOS_ID) == 1
    assert tokenizer.decode(ids) == text


def test_deterministic_given_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = mm.make_model(tmp_path / "again", "tiny", seed=0)
    other = mm.make_model(tmp_path / "other", "tiny", seed=1)
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_build_model_matches_files(tiny) -> None:
    loaded, _ = tiny
    built, config = mm.build_model("tiny", seed=0)
    assert config == mm.preset_config("tiny")
    a, b = dict(tree_flatten(loaded.parameters())), dict(tree_flatten(built.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_generations_are_diverse(tiny) -> None:
    model, tokenizer = tiny
    prompts = ["The capital of France is", "Once upon a time", "def hello(name):", "1 2 3"]
    outs = [_greedy(model, tokenizer.encode(p), 16) for p in prompts]
    assert len({tuple(o) for o in outs}) == len(prompts)
    assert all(len(set(o)) >= 4 for o in outs), outs
    # The context matters, not only the last token.
    a = _greedy(model, [40, 41, 42, 99], 8)
    b = _greedy(model, [70, 71, 72, 99], 8)
    assert a != b


# Published sizes: parameters (with the embedding) of the real models.
EXPECTED = {
    "llama-3.2-1b": (16, 2048, 8, 64, 1.236e9),
    "llama-3.1-8b": (32, 4096, 8, 128, 8.030e9),
    "qwen2.5-0.5b": (24, 896, 2, 64, 0.494e9),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_real_shape_presets(preset: str) -> None:
    config = mm.preset_config(preset)
    layers, hidden, kv_heads, head_dim, params = EXPECTED[preset]
    assert config["num_hidden_layers"] == layers and config["hidden_size"] == hidden
    assert config["num_key_value_heads"] == kv_heads
    assert config.get("head_dim", hidden // config["num_attention_heads"]) == head_dim
    assert config["torch_dtype"] == "bfloat16"
    assert config["vocab_size"] >= mm.TOKENIZER_VOCAB
    # Build the architecture lazily: shapes only, no weights are ever computed.
    arch = __import__(f"mlx_lm.models.{config['model_type']}", fromlist=["Model"])
    model = arch.Model(arch.ModelArgs.from_dict(config))
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert count == pytest.approx(params, rel=0.01)


def test_small_real_shape_for_cpu_soaks() -> None:
    config = mm.preset_config("smollm2-135m")  # SmolLM2-135M's shape, in float32 for CPUs
    arch = __import__(f"mlx_lm.models.{config['model_type']}", fromlist=["Model"])
    model = arch.Model(arch.ModelArgs.from_dict(config))
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert count == pytest.approx(134.5e6, rel=0.01) and config["torch_dtype"] == "float32"


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="tiny"):
        mm.preset_config("gpt-5")


def test_config_json_is_the_preset(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config == mm.preset_config("tiny")
    assert config["eos_token_id"] == mm.EOS_IDS


def test_make_model_help_names_every_preset() -> None:
    import click

    from mlxq.cli.make_model import make_model_cmd

    wide = click.Context(make_model_cmd, terminal_width=1000, max_content_width=1000)
    shown = make_model_cmd.get_help(wide)
    assert [p for p in mm.PRESETS if p not in shown] == []
