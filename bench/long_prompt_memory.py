"""Peak memory of one long prompt, mlxq's slot engine against mlx-lm, on the same weights.

    python bench/long_prompt_memory.py --model path/to/model.gguf --prompt-tokens 8111

Each side generates ``--max-tokens`` greedy tokens after a prompt of ``--prompt-tokens``
(token ids spread over the vocabulary); the peak is MLX's peak memory over what was held
before the run (the weights). Prints one JSON line: both peaks, their ratio, whether the
tokens agree, and the engine's batch cap (the cache must not be sized for it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import common


def peak(run: Callable[[], Any]) -> tuple[int, float, Any]:
    """(peak bytes over what was held before, seconds, what ``run`` returned)."""
    import mlx.core as mx

    mx.clear_cache()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    out = run()
    return mx.get_peak_memory() - held, time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a .gguf file or an mlx-lm folder")
    p.add_argument("--prompt-tokens", type=int, default=8111)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=256, help="the engine's cap, as a worker's")
    args = p.parse_args()
    common.set_up_like_mlxq()
    common.quiet_logs()
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxq.engine.factory import make_engine
    from mlxq.engine.sampling import EngineJob
    from mlxq.wire import Request

    model, tokenizer, facts = common.load_as_worker(args.model)
    vocab = tokenizer.vocab_size
    prompt = [(7 + 31 * i) % (vocab - 8) + 4 for i in range(args.prompt_tokens)]

    def mlx_lm() -> list[int]:
        steps = generate_step(mx.array(prompt), model, max_tokens=args.max_tokens)
        return [int(t) for t, _ in steps]

    def mlxq() -> list[int]:
        engine = make_engine(model, tokenizer, "long", max_batch=args.max_batch)
        failed = engine.add(EngineJob("long", Request(prompt=prompt, max_tokens=args.max_tokens)))
        assert failed is None, failed.error
        done = []
        while engine.active:
            done += engine.step()
        return done[0].token_ids

    ref_peak, ref_s, ref = peak(mlx_lm)
    ours_peak, ours_s, ours = peak(mlxq)
    eos = set(tokenizer.eos_token_ids)
    ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        json.dumps(
            {
                "model": os.path.basename(args.model),
                "backend": facts.backend,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "engine_max_batch": args.max_batch,
                "mlx_lm_peak_mib": round(ref_peak / 2**20, 1),
                "mlxq_peak_mib": round(ours_peak / 2**20, 1),
                "ratio": round(ours_peak / max(1, ref_peak), 3),
                "same_tokens": ours == ref,
                "seconds_mlx_lm": round(ref_s, 1),
                "seconds_mlxq": round(ours_s, 1),
                "commit": commit.stdout.strip(),
            }
        )
    )


if __name__ == "__main__":
    main()
