"""Where a model comes from: a local folder or a hub id, checked before anything loads it.

``resolve_model`` turns what the user typed into a local folder (downloading a hub id
as ``mlx_lm.load`` would) and checks that it is a model mlx-lm can load; ``load_model``
then loads it with ``mlx_lm.load``. Every failure is a :class:`ModelError` whose one-line
message names the model, the cause and the fix, so commands fail before they submit or
serve anything, without a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path
from typing import Any

from mlxq.engine.models.gguf import GGUFError, converted_folder, is_gguf
from mlxq.errors import StartupError, one_line

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
DOWNLOAD_HINT = "download it first with `hf download {id}` (or `huggingface-cli download {id}`)"


class ModelError(StartupError):
    """A model (or adapter) that cannot be loaded; the message says why and what to do."""


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a folder rather than a hub id (``namespace/name``)."""
    return (
        name.startswith(("/", ".", "~"))
        or "\\" in name
        or name.count("/") != 1
        or HUB_ID.fullmatch(name) is None
    )


def resolve_model(name: str) -> Path:
    """The local folder of model ``name``: the folder itself, a hub id's snapshot
    (downloaded if it is not cached) or a GGUF file's converted copy. Raises
    :class:`ModelError` in one line."""
    path = Path(name).expanduser()
    if is_gguf(name):
        return gguf_folder(path, name)
    if path.exists():
        check_model_folder(path, name)
        return path
    if looks_like_path(name):
        raise ModelError(
            f"model {name}: no such folder; check the path, pass a hub id such as "
            "mlx-community/Llama-3.2-1B-Instruct-4bit, or make a test model with "
            f"`mlxq make-model {name} --preset tiny`"
        )
    folder = _download(name)
    check_model_folder(folder, name)
    return folder


def gguf_folder(path: Path, name: str) -> Path:
    """The mlx-lm folder converted from GGUF file ``path`` (see :mod:`mlxq.engine.models.gguf`)."""
    if not path.is_file():
        raise ModelError(f"model {name}: no such GGUF file; check the path")
    try:
        folder = converted_folder(path)
    except ImportError as e:
        raise ModelError(f"model {name}: reading GGUF needs {one_line(e)}") from e
    except GGUFError as e:  # a damaged or unsupported file, already one line naming it
        raise ModelError(" ".join(str(e).split())) from e
    except (ValueError, KeyError, IndexError, TypeError, OSError, RuntimeError, struct.error) as e:
        # What the checks do not foresee (the tokenizer's metadata, an unreadable file).
        raise ModelError(f"model {name}: cannot read this GGUF file: {one_line(e)}") from e
    check_model_folder(folder, name)
    return folder


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS  # what `mlx_lm.load` fetches

    hint = DOWNLOAD_HINT.format(id=repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except GatedRepoError as e:
        raise ModelError(
            f"model {repo_id} is gated on the Hugging Face hub: accept its terms on "
            f"https://huggingface.co/{repo_id} and log in with `hf auth login` (or set "
            "HF_TOKEN), or pass a local folder"
        ) from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelError(
            f"model {repo_id}: no such folder here, and no such repo on the Hugging Face hub "
            "(or it is private): check the path or the id "
            "(e.g. mlx-community/Llama-3.2-1B-Instruct-4bit), or log in for a private repo"
        ) from e
    except LocalEntryNotFoundError as e:
        raise ModelError(
            f"model {repo_id}: no such folder here, not in the local Hugging Face cache, and "
            f"the hub cannot be reached (offline or no network): {hint} on a machine with "
            "network, or pass a local folder"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelError(
            f"model {repo_id} could not be downloaded ({one_line(e)}): {hint}, or pass a "
            "local folder"
        ) from e


def check_model_folder(path: Path, name: str) -> None:
    """Refuse a folder that holds no mlx-lm model: no config, no weights, or an
    architecture this mlx-lm does not implement."""
    if not path.is_dir():
        raise ModelError(f"model {name}: {path} is a file, not a model folder; pass its folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(
            f"model {name}: {path} has no config.json, so it is not a model folder; pass the "
            "folder that holds config.json and *.safetensors (or a hub id)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"model {name}: {config_file} is not valid JSON ({one_line(e)})") from e
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelError(
            f"model {name}: {config_file} names no `model_type`; it is not a model config"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelError(
            f"model {name}: {path} has no weights (*.safetensors); download the whole model "
            "or convert it with `mlx_lm.convert`"
        )
    check_architecture(config, name)


def check_architecture(config: dict[str, Any], name: str) -> None:
    """Refuse a ``model_type`` that this mlx-lm has no module for."""
    from mlx_lm import __version__ as mlx_lm_version
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = str(config["model_type"])
    module = MODEL_REMAPPING.get(model_type, model_type)
    if importlib.util.find_spec(f"mlx_lm.models.{module}") is None:
        raise ModelError(
            f"model {name}: its model_type {model_type!r} is not supported by mlx-lm "
            f"{mlx_lm_version} (no mlx_lm.models.{module}); pick a model of a supported "
            "architecture (llama, qwen2, qwen3, mistral, phi3, gemma3, ...)"
        )


def check_adapter(adapter_path: str) -> None:
    """Refuse an adapter folder without mlx-lm's adapter files."""
    path = Path(adapter_path)
    for needed in ("adapter_config.json", "adapters.safetensors"):
        if not (path / needed).is_file():
            raise ModelError(
                f"adapter {adapter_path} has no {needed}: pass the folder that "
                "`mlx_lm.lora` wrote (adapter_config.json and adapters.safetensors)"
            )


def load_model(
    name: str, path: Path, adapter_path: str | None = None, *, lazy: bool = False
) -> tuple[Any, Any]:
    """``mlx_lm.load`` of a folder from :func:`resolve_model`, then the adapter, if any, as
    ``mlx_lm.load`` applies it; :class:`ModelError` if the weights or the adapter do not
    fit the model. ``lazy``: weights are read when first evaluated (a model split over
    ranks reads only its part)."""
    import mlx_lm
    from mlx_lm.utils import load_adapters

    if adapter_path is not None:
        check_adapter(adapter_path)
    try:
        model, tokenizer = mlx_lm.load(str(path), lazy=lazy)[:2]
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as e:
        # RuntimeError: MLX's loaders (a truncated or corrupt safetensors file).
        raise ModelError(f"model {name} could not be loaded: {one_line(e)}") from e
    if adapter_path is None:
        return model, tokenizer
    try:
        model = load_adapters(model, adapter_path)
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RuntimeError) as e:
        raise ModelError(
            f"adapter {adapter_path} does not fit model {name} ({one_line(e)}): use an "
            "adapter trained for this model"
        ) from e
    model.eval()
    return model, tokenizer
