"""``mlx_lm.batch_generate`` on an ``mlxq run`` input file: the baseline for a file run.

Reads a JSONL file of requests whose ``prompt`` is token ids (``throughput.py
--export-jsonl`` writes them), runs them with ``batch_generate`` (its default batch sizes,
greedy, EOS as the model's tokenizer says, like ``mlxq run``) and prints one JSON line:
generated tokens, seconds (after loading the model) and tokens per second.

Usage: ``python bench/batch_generate_file.py FILE.jsonl --model MODEL_DIR``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import set_up_like_mlxq


def main(argv: list[str] | None = None) -> int:
    set_up_like_mlxq()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--model", required=True)
    args = ap.parse_args(argv)
    import mlx_lm
    from mlx_lm import batch_generate

    lines = [json.loads(line) for line in open(args.file) if line.strip()]
    if not all(isinstance(r.get("prompt"), list) for r in lines):
        sys.exit(f"{args.file}: every line needs a `prompt` of token ids")
    model, tokenizer = mlx_lm.load(args.model)
    start = time.perf_counter()
    out = batch_generate(
        model,
        tokenizer,
        [r["prompt"] for r in lines],
        max_tokens=[r.get("max_tokens", 256) for r in lines],
        return_token_ids=True,
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(t) for t in out.token_ids or [])
    print(
        json.dumps(
            {
                "generated_tokens": tokens,
                "seconds": round(seconds, 3),
                "tok_s": round(tokens / seconds, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
