"""mlxq's greedy continuations on a GGUF next to llama.cpp's own on the same file.

For each prompt (plain questions through the file's chat template, encoded once by mlxq
and passed as the same token ids to both sides), both generate greedily; the table says how
many tokens agree before the first divergence and, there, the top two logits on each side.
mlxq runs as its worker runs the file: ``--model x.gguf`` converted, the weights
dequantized to float32 as its decision takes them on a CPU (``--weights float32``; ``auto``
decides by timing a layer) or kept quantized (``off``), tokens from its batch engine.
llama.cpp runs through ``llama-cpp-python`` in a Python of its own (``--llama-python``;
see bench/README.md), through ``llama_cpp_side.py``.

``--make-q4km OUT.gguf`` first writes an F32 GGUF of ``--model``'s dequantized weights
with ``gguf``, quantizes it to Q4_K_M with llama.cpp's quantizer, then compares on OUT;
``--memory`` reports the MLX memory of the quantized load against the file's size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

SIDE = Path(__file__).with_name("llama_cpp_side.py")
PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are in a week?",
    "What is 2 + 2?",
    "What is the largest ocean on Earth?",
    "Who wrote Romeo and Juliet?",
    "What color is the sky on a clear day?",
    "Name three fruits.",
    "What is water made of?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Explain what a computer is in one sentence.",
    "Write a short poem about the sea.",
    "Why do leaves change color in autumn?",
    "Give me a tip for learning a new language.",
    "What is photosynthesis?",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", sys.executable))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts")
    p.add_argument(
        "--weights",
        default="float32",
        help="mlxq's weight formats to run, comma-separated: float32 or bfloat16 (dequantized "
        "at load), auto (mlxq's own timed decision), off (kept quantized)",
    )
    p.add_argument("--llama-json", help="llama.cpp's answer: read if it exists, else written")
    p.add_argument("--make-q4km", metavar="OUT", help="quantize --model to Q4_K_M first")
    p.add_argument("--memory", action="store_true", help="MLX memory of the quantized load")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args()


def llama_call(python: str, request: dict[str, Any]) -> dict[str, Any]:
    """One request to ``llama_cpp_side.py`` in ``python``; exits with its error."""
    done = subprocess.run(
        [python, str(SIDE)], input=json.dumps(request), capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"llama.cpp side ({python}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_f32(source: Path, dest: Path) -> None:
    """An F32 GGUF of ``source``'s dequantized tensors, its metadata copied."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType, dequantize

    reader = GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(dest), arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (
            "general.architecture",
            "general.file_type",
        ):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_q4km(source: Path, dest: Path, python: str) -> None:
    """``dest``: ``source`` as Q4_K_M, by llama.cpp's quantizer from an F32 copy."""
    f32 = dest.with_suffix(".f32.gguf")
    write_f32(source, f32)
    request = {"op": "quantize", "source": str(f32), "dest": str(dest)}
    llama_call(python, {**request, "ftype": "LLAMA_FTYPE_MOSTLY_Q4_K_M"})
    f32.unlink()
    print(f"{dest}: Q4_K_M by llama.cpp from {source.name} ({dest.stat().st_size / 2**20:.1f} MiB)")


def tensor_types(path: Path) -> str:
    """``Q4_K x 15, Q5_0 x 180, ...``: the file's tensor types."""
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))


def load(model: str, weights: str) -> tuple[Any, Any, str]:
    """The model as ``mlxq worker --model`` loads it, with ``--dequantize weights`` (auto,
    off) or dequantized to the dtype ``weights`` names (float32, bfloat16)."""
    import mlx.core as mx

    from mlxq.engine.hardware import device_facts
    from mlxq.engine.models.source import load_model, resolve_model
    from mlxq.engine.models.weights import _dequantize, _quantized, prepare_weights

    loaded, tokenizer = load_model(model, resolve_model(model))
    facts = device_facts()
    if weights in ("float32", "bfloat16") and _quantized(loaded):  # auto's CPU choices
        loaded = _dequantize(loaded, getattr(mx, weights), f"--weights {weights}")
    else:
        loaded = prepare_weights(loaded, facts.backend, facts.memory_bytes, weights)
    layers = _quantized(loaded)
    if layers:
        bits = sorted({m.bits for m in layers})
        what = f"quantized ({'/'.join(map(str, bits))}-bit)"
    else:
        what = str(loaded.model.layers[0].mlp.down_proj.weight.dtype).removeprefix("mlx.core.")
    return loaded, tokenizer, f"{facts.backend}, --weights {weights}: {what}"


def memory(model: str) -> dict[str, Any]:
    """The quantized load's weight bytes in MLX against the file's size."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    before = mx.get_active_memory()
    loaded, _, what = load(model, "off")
    mx.eval(loaded.parameters())
    held = sum(v.nbytes for _, v in tree_flatten(loaded.parameters()))
    size = Path(model).stat().st_size
    active = mx.get_active_memory() - before
    print(
        f"{Path(model).name}: {size / 2**20:.1f} MiB file; MLX weights {held / 2**20:.1f} MiB "
        f"= {held / size:.3f}x ({what}); MLX active memory +{active / 2**20:.1f} MiB "
        f"= {active / size:.3f}x"
    )
    return {"file_bytes": size, "weight_bytes": held, "active_bytes": active, "format": what}


def mlxq_greedy(engine: Any, prompts: list[list[int]], max_tokens: int) -> list:
    """mlxq's batch engine's greedy tokens for each prompt, ``None`` appended on EOS."""
    from mlxq.engine.sampling import EngineJob
    from mlxq.wire import Request

    for i, ids in enumerate(prompts):
        engine.add(EngineJob(str(i), Request(prompt=ids, max_tokens=max_tokens)), tokens=ids)
    done = {}
    while engine.active:
        done.update((c.key, c) for c in engine.step())
    return [
        list(done[str(i)].token_ids) + ([None] if done[str(i)].finish_reason == "stop" else [])
        for i in range(len(prompts))
    ]


def mlxq_top2(loaded: Any, ids: list[int]) -> list[list[float]]:
    """mlxq's model's top two ``[id, logit]`` after ``ids`` (one forward, no cache)."""
    import mlx.core as mx

    logits = loaded(mx.array([ids]))[0, -1].astype(mx.float32)
    best = mx.argsort(-logits)[:2]
    return [[int(t), float(logits[t])] for t in best.tolist()]


def compare(loaded: Any, tokenizer: Any, prompts: list, ours: list, theirs: list) -> list:
    """Per prompt: tokens agreeing before the first divergence, and both top-2s there."""
    eos = set(tokenizer.eos_token_ids)
    rows = []
    for ids, mine, run in zip(prompts, ours, theirs, strict=True):
        other = [None if t in eos else t for t in run["tokens"]]
        agree = next(
            (i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b),
            min(len(mine), len(other)),
        )
        row = {"mlxq": len(mine), "llama": len(other), "agree": agree, "text": ""}
        if agree < max(len(mine), len(other)):
            row["mlxq_top2"] = mlxq_top2(loaded, ids + mine[:agree])
            row["llama_top2"] = run["top2"][agree]
        row["text"] = tokenizer.decode([t for t in mine if t is not None])
        rows.append(row)
    return rows


def show(tokenizer: Any, label: str, rows: list[dict[str, Any]], max_tokens: int) -> None:
    def top(pair: list[list[float]] | None) -> str:
        if not pair:
            return "-"
        parts = [f"{tokenizer.decode([int(t)])!r} {v:.3f}" for t, v in pair]
        return f"{' / '.join(parts)} (gap {pair[0][1] - pair[1][1]:.3f})"

    table = [
        [str(i), str(r["mlxq"]), str(r["llama"]), str(r["agree"]), top(r.get("mlxq_top2")),
         top(r.get("llama_top2"))]
        for i, r in enumerate(rows)
    ]  # fmt: skip
    print(f"\n{label} (max {max_tokens} new tokens; lengths count an EOS as one token)")
    print(common.table(["#", "mlxq", "llama", "agree", "mlxq top-2", "llama.cpp top-2"], table))
    same = sum(r["agree"] == r["mlxq"] == r["llama"] for r in rows)
    agree = sorted(r["agree"] for r in rows)
    print(
        f"identical: {same}/{len(rows)}; tokens agreeing before the first divergence: "
        f"min {agree[0]}, median {agree[len(agree) // 2]}, total {sum(agree)} of "
        f"{sum(max(r['mlxq'], r['llama']) for r in rows)}"
    )


def llama_runs(args: argparse.Namespace, prompts: list, eos: list[int]) -> dict[str, Any]:
    """llama.cpp's answer, read from ``--llama-json`` when it is there, else computed."""
    cached = Path(args.llama_json) if args.llama_json else None
    if cached is not None and cached.is_file():
        answer = json.loads(cached.read_text())
        if answer["prompts"] == prompts and answer["max_tokens"] == args.max_tokens:
            return answer
    request = {"op": "generate", "model": str(Path(args.model).resolve()), "prompts": prompts}
    start = time.perf_counter()
    answer = llama_call(args.llama_python, {**request, "max_tokens": args.max_tokens, "eos": eos})
    print(f"llama.cpp {answer['llama_cpp']}: {time.perf_counter() - start:.1f} s")
    answer.update(prompts=prompts, max_tokens=args.max_tokens)
    if cached is not None:
        cached.write_text(json.dumps(answer))
    return answer


def main() -> None:
    args = parse_args()
    if args.make_q4km:
        make_q4km(Path(args.model), Path(args.make_q4km), args.llama_python)
        args.model = args.make_q4km
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("mlxq.engine").setLevel(logging.INFO)  # the converter's choices
    print(f"{args.model}: {tensor_types(Path(args.model))}")
    figures: dict[str, Any] = {"model": args.model, "max_tokens": args.max_tokens}
    if args.memory:
        figures["memory"] = memory(args.model)
    from mlxq.engine.factory import make_engine
    from mlxq.wire import Message, Request

    prompts = None
    for weights in args.weights.split(","):
        loaded, tokenizer, what = load(args.model, weights)
        engine = make_engine(loaded, tokenizer, "reference", max_batch=args.prompts)
        if prompts is None:  # encoded once (chat template), the same ids to both sides
            chats = [Request(messages=[Message("user", q)]) for q in PROMPTS[: args.prompts]]
            prompts = [engine.encode(r) for r in chats]
            theirs = llama_runs(args, prompts, sorted(tokenizer.eos_token_ids))["runs"]
        start = time.perf_counter()
        ours = mlxq_greedy(engine, prompts, args.max_tokens)
        print(f"mlxq ({what}): {time.perf_counter() - start:.1f} s")
        rows = compare(loaded, tokenizer, prompts, ours, theirs)
        show(tokenizer, f"mlxq ({what}) against llama.cpp", rows, args.max_tokens)
        figures[weights] = {"format": what, "rows": rows}
    if args.json:
        common.write_json(args.json, figures)


if __name__ == "__main__":
    common.set_up_like_mlxq()
    main()
