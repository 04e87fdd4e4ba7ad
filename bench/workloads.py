"""The requests benchmarks run: prompts as token ids and their ``max_tokens``, seeded.

Realistic batches end every output at a different length (as EOS makes them), queue far
more requests than the batch holds and mix prompt lengths. Each such workload has a
*uniform twin*: the same prompts, every ``max_tokens`` set to the workload's mean, so the
two generate the same number of tokens and their ratio shows what the variation costs.

- ``uniform``: ``--prompt-tokens`` + ``--gen-tokens`` each (the ceiling, EOS-free).
- ``varied``: ``--prompt-tokens`` prompts, ``max_tokens`` log-uniform in 16..256.
- ``mixed``: prompts log-uniform in 16..1024, ``max_tokens`` log-uniform in 16..256.
- ``prefix``: one shared ``--prefix-tokens`` prefix + a unique 8..32-token suffix each.
- ``NAME-twin``: the uniform twin of ``varied`` or ``mixed``.

The queue depth is ``--requests``, or ``--queue-factor`` times the batch.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

WORKLOADS = ("uniform", "varied", "varied-twin", "mixed", "mixed-twin", "prefix")
# Ranges (inclusive) that lengths are drawn from, log-uniformly.
VARIED_GEN = (16, 256)
MIXED_PROMPT = (16, 1024)
# prefix: unique suffix lengths after the shared prefix.
PREFIX_SUFFIX = (8, 32)
SEED = 0


@dataclass
class Workload:
    """The requests every mode runs: prompts as token ids and their ``max_tokens``."""

    name: str
    label: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def gen_tokens(self) -> int:
        return sum(self.max_tokens)

    def twin(self) -> Workload:
        """The same prompts, each generating the mean ``max_tokens`` (same total, within
        rounding)."""
        mean = round(self.gen_tokens / len(self.prompts))
        label = f"{self.label}; uniform twin: every output {mean}"
        return Workload(f"{self.name}-twin", label, self.prompts, [mean] * len(self.prompts))

    def jsonl(self) -> list[dict[str, object]]:
        """The requests as ``mlxq run`` input lines."""
        return [
            {"custom_id": f"r{i}", "prompt": p, "max_tokens": m}
            for i, (p, m) in enumerate(zip(self.prompts, self.max_tokens, strict=True))
        ]


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def _mean_label(lens: list[int], gens: list[int]) -> str:
    return f"mean {sum(lens) / len(lens):.0f}+{sum(gens) / len(gens):.0f}"


def make_workload(kind: str, args: argparse.Namespace, pool: list[int], n: int) -> Workload:
    """The ``n`` requests of one workload, the same on every run (fixed seed)."""
    if kind.endswith("-twin"):
        return make_workload(kind.removesuffix("-twin"), args, pool, n).twin()
    rng = random.Random(f"{kind}-{SEED}")
    p, g = args.prompt_tokens, args.gen_tokens
    if kind == "uniform":
        prompts = [rng.choices(pool, k=p) for _ in range(n)]
        return Workload(kind, f"uniform {n} x ({p}+{g})", prompts, [g] * n)
    if kind == "varied":
        gens = [log_uniform(rng, *VARIED_GEN) for _ in range(n)]
        prompts = [rng.choices(pool, k=p) for _ in range(n)]
        lo, hi = VARIED_GEN
        label = f"varied {n} x ({p} + {lo}..{hi} log-uniform, {_mean_label([p], gens)})"
        return Workload(kind, label, prompts, gens)
    if kind == "mixed":
        lens = [log_uniform(rng, *MIXED_PROMPT) for _ in range(n)]
        gens = [log_uniform(rng, *VARIED_GEN) for _ in range(n)]
        prompts = [rng.choices(pool, k=k) for k in lens]
        label = (
            f"mixed {n} x ({MIXED_PROMPT[0]}..{MIXED_PROMPT[1]} + {VARIED_GEN[0]}.."
            f"{VARIED_GEN[1]} log-uniform, {_mean_label(lens, gens)})"
        )
        return Workload(kind, label, prompts, gens)
    if kind == "prefix":
        shared = rng.choices(pool, k=args.prefix_tokens)
        prompts = [shared + rng.choices(pool, k=rng.randint(*PREFIX_SUFFIX)) for _ in range(n)]
        lo, hi = PREFIX_SUFFIX
        label = f"prefix {n} x ({args.prefix_tokens} shared + {lo}..{hi} unique + {g})"
        return Workload(kind, label, prompts, [g] * n)
    raise ValueError(f"unknown workload {kind!r}")


def step_bound(max_tokens: list[int], batch: int) -> float:
    """The best varied / uniform-twin ratio when every decode step costs the same whatever
    its rows (a GPU's regime): twin steps over the steps of an ideal schedule that refills
    each slot the moment its job ends, jobs in order. The tail, where the last long jobs
    run with few rows, is what keeps it below 1."""
    queue, active = list(max_tokens), []
    steps = 0
    while queue or active:
        while queue and len(active) < batch:
            active.append(queue.pop(0))
        steps += 1
        active = [n - 1 for n in active if n > 1]
    mean = round(sum(max_tokens) / len(max_tokens))
    twin = mean * -(-len(max_tokens) // batch)
    return twin / steps


def context_per_token(prompt_lengths: list[int], max_tokens: list[int]) -> float:
    """Positions a generated token attends, on average, with no padding: a job of prompt
    P and L tokens attends P, P+1, ..., P+L-1. Varied outputs raise it above their twin's
    (a job's share of the steps grows with its length); where attention is a large part
    of a step (a CPU, a small model), each varied token costs that much more."""
    attended = sum(p * n + n * (n - 1) / 2 for p, n in zip(prompt_lengths, max_tokens, strict=True))
    return attended / sum(max_tokens)
