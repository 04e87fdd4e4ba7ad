"""Greedy agreement with mlx-lm on a real model, as a user runs mlxq: many chat requests of
varied lengths through the slot engine at its batch (rows joining, ending on EOS, sorted by
length), each compared token for token with mlx-lm's single-request greedy generation.

    python bench/real_model_agreement.py --model path/to/model.gguf --requests 256 \
        --max-tokens 128 --reference 256

``--reference N`` compares the first N outputs with mlx-lm one request at a time (slow on a
CPU); the rest are compared with a second mlxq run with sorting off, which the issue that
found the stale-token bug saw agree with mlx-lm 256/256. Prints one JSON line of counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from typing import Any

import common

TOPICS = [
    "the moon", "bread", "rivers", "a lighthouse", "autumn", "chess", "bees", "the ocean",
    "volcanoes", "trains", "music", "winter", "gardens", "clocks", "maps", "owls",
]  # fmt: skip
ASKS = [
    "What is {t}?",
    "Write one sentence about {t}.",
    "Give me three facts about {t}.",
    "Write a short poem about {t}.",
    "Explain {t} to a child in two sentences.",
    "Why do people like {t}? Answer in a paragraph.",
    "Name one word that rhymes with {t}.",
    "Describe {t} in detail.",
]


def requests(n: int, max_tokens: int) -> list[Any]:
    """``n`` chat requests: the prompts vary in length, and so do the answers (EOS)."""
    from mlxq.wire import Message, Request

    out = []
    for i in range(n):
        text = ASKS[i % len(ASKS)].format(t=TOPICS[(i // len(ASKS)) % len(TOPICS)])
        if i >= len(ASKS) * len(TOPICS):
            text += f" (variant {i})"
        out.append(Request(messages=[Message("user", text)], max_tokens=max_tokens))
    return out


def run_mlxq(model: Any, tokenizer: Any, reqs: list[Any], max_batch: int) -> dict[str, Any]:
    from mlxq.engine.factory import make_engine
    from mlxq.engine.sampling import EngineJob

    engine = make_engine(model, tokenizer, "agreement", max_batch=max_batch)
    engine.warmup()
    for i, r in enumerate(reqs):
        failed = engine.add(EngineJob(str(i), r))
        assert failed is None, failed
    done: dict[str, Any] = {}
    while engine.active:
        for c in engine.step():
            done[c.key] = c
    stats = engine.stats()
    return {"done": done, "sorts": getattr(stats, "sorts", None), "engine": engine}


def mlx_lm_greedy(model: Any, tokenizer: Any, tokens: list[int], max_tokens: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(tokens), model, max_tokens=max_tokens):
        if token in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file or an mlx-lm folder")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--reference", type=int, default=44, help="outputs checked against mlx-lm")
    args = p.parse_args()
    common.set_up_like_mlxq()
    common.quiet_logs()
    from mlxq.engine.slots.choices import COMPILE_ENV, SORT_ENV

    os.environ[COMPILE_ENV] = "0"  # (rows are sorted by the eager forward only)

    model, tokenizer, facts = common.load_as_worker(args.model)
    reqs = requests(args.requests, args.max_tokens)
    runs = {}
    for sort in ("1", "0"):
        os.environ[SORT_ENV] = sort
        start = time.perf_counter()
        runs[sort] = run_mlxq(model, tokenizer, reqs, args.max_batch)
        runs[sort]["seconds"] = time.perf_counter() - start
    on, off = runs["1"]["done"], runs["0"]["done"]
    engine = runs["1"]["engine"]
    same_as_unsorted = sum(on[k].token_ids == off[k].token_ids for k in on)
    checked = agree = 0
    for i, r in enumerate(reqs[: args.reference]):
        ref = mlx_lm_greedy(model, tokenizer, engine.encode(r), r.max_tokens)
        checked += 1
        agree += on[str(i)].token_ids == ref
    reasons = [c.finish_reason for c in on.values()]
    lengths = sorted(len(c.token_ids) for c in on.values())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        json.dumps(
            {
                "model": os.path.basename(args.model),
                "backend": facts.backend,
                "requests": len(reqs),
                "max_tokens": args.max_tokens,
                "max_batch": args.max_batch,
                "sorts": runs["1"]["sorts"],
                "sorted_equal_unsorted": same_as_unsorted,
                "checked_against_mlx_lm": checked,
                "equal_to_mlx_lm": agree,
                "ended_on_eos": reasons.count("stop"),
                "output_tokens_min_median_max": [
                    lengths[0],
                    lengths[len(lengths) // 2],
                    lengths[-1],
                ],
                "seconds_sorted": round(runs["1"]["seconds"], 1),
                "seconds_unsorted": round(runs["0"]["seconds"], 1),
                "commit": commit.stdout.strip(),
            }
        )
    )


if __name__ == "__main__":
    main()
