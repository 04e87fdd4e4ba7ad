"""LoRA adapters: a BatchGeneratorEngine given ``adapter_path`` generates what mlx-lm does
with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from engine_reference import reference, run_all
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from mlxq.engine.mlx_lm_batch import BatchGeneratorEngine
from mlxq.wire import Request

LORA_KEYS = ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]


def make_adapter(
    model_dir: Path, dest: Path, *, seed: int = 0, rank: int = 4, scale: float = 4.0
) -> Path:
    """Write a LoRA adapter for the model in ``model_dir`` to ``dest``, offline.

    The folder is what ``mlx_lm.load(..., adapter_path=dest)`` reads: an
    ``adapter_config.json`` for ``linear_to_lora_layers`` and ``adapters.safetensors``
    with every ``lora_a`` / ``lora_b`` of the converted layers. Both are random and
    non-zero (trained adapters start with ``lora_b`` at zero), so outputs change.
    """
    model, _ = mlx_lm.load(str(model_dir))
    lora = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": LORA_KEYS}
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": lora}
    linear_to_lora_layers(model, len(model.layers), lora)
    names = [
        (name, value.shape)
        for name, value in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    ]
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights = {
        name: 0.2 * mx.random.normal(shape, key=key)
        for (name, shape), key in zip(names, keys, strict=True)
    }
    assert weights, "no LoRA layers were made"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(dest / "adapters.safetensors"), weights)
    return dest


JOBS = {
    "capital": Request(prompt="The capital of France is", max_tokens=16),
    "story": Request(prompt="Once upon a time", max_tokens=12),
    "ids": Request(prompt=[5, 6, 7, 8], max_tokens=10),
}


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "lora")


def test_adapter_files(adapter: Path) -> None:
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == 4
    weights = mx.load(str(adapter / "adapters.safetensors"))
    # 2 layers x 3 projections x (lora_a, lora_b)
    assert len(weights) == 12 and "model.layers.0.self_attn.q_proj.lora_b" in weights
    assert all(mx.any(w != 0).item() for w in weights.values())


@pytest.mark.parametrize("prefix_cache_bytes", [0, 1 << 20])
def test_engine_with_adapter_equals_mlx_lm(
    tiny_model_dir: Path, tiny: Any, adapter: Path, prefix_cache_bytes: int
) -> None:
    engine = BatchGeneratorEngine(
        str(tiny_model_dir), adapter_path=str(adapter), prefix_cache_bytes=prefix_cache_bytes
    )
    done = run_all(engine, dict(JOBS))
    lora_model, tokenizer = mlx_lm.load(str(tiny_model_dir), adapter_path=str(adapter))
    base_model, _ = tiny
    changed = 0
    for key, request in JOBS.items():
        tokens = engine.encode(request)
        with_adapter = reference(lora_model, tokenizer, tokens, request)["tokens"]
        assert done[key].token_ids == with_adapter, key
        changed += with_adapter != reference(base_model, tokenizer, tokens, request)["tokens"]
    assert changed == len(JOBS)  # the adapter changes every output
    plain = run_all(BatchGeneratorEngine(str(tiny_model_dir)), dict(JOBS))
    assert all(plain[k].token_ids != done[k].token_ids for k in JOBS)
    engine.close()
