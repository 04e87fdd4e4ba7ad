"""``mlxq make-model``: write a random-weight model (offline tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import click

from mlxq.cli.support import fail
from mlxq.wire import json_encoder


@click.command("make-model")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--preset",
    default="tiny",
    show_default=True,
    help="Model shape: tiny (and tiny-qwen2, tiny-qwen3, tiny-mistral, tiny-phi3, "
    "tiny-gemma3, tiny-wide-heads), cpu-small, smollm2-135m, llama-3.2-1b, llama-3.1-8b, "
    "qwen2.5-0.5b; tiny-tp and cpu-small-tp split evenly over 2 or 3 hosts (--hosts).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the path and shape as JSON.")
def make_model_cmd(dest: Path, preset: str, seed: int, as_json: bool) -> None:
    """Write a random-weight model that mlx_lm.load reads (offline tests and benchmarks)."""
    from mlxq.engine.models.make import PRESETS, make_model
    from mlxq.engine.models.source import resolve_model

    if preset not in PRESETS:
        fail(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    path = make_model(dest, preset=preset, seed=seed)
    resolve_model(str(path))  # what `mlxq run --model` will check: refuse a bad output now
    if as_json:
        click.echo(
            json_encoder.encode({"path": str(path), "preset": preset, "seed": seed}).decode()
        )
    else:
        click.echo(f"wrote a random-weight {preset} model to {path}")
