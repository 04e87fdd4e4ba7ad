"""One process of the distributed engine tests (tests/engine/test_distributed.py).

``python distributed_rank.py MODEL OUT.json [TEMPERATURE [tensor|pipeline]]`` runs the
same jobs (joining and finishing mid-batch: more jobs than rows, varied prompts and
lengths) through a slot engine and writes every job's token ids to OUT.json. With
``MLX_RANK`` set it is one rank of a group: tensor parallel (rank 0 drives a lockstep
engine, the others follow) or pipeline parallel (a stage and one engine per micro-batch
on each rank, rank 0 driving them); each rank writes what its own engines produced
(OUT.json.RANK). Without, it is the one-process run, with mlx-lm's single-request greedy
tokens beside (``reference``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from engine_reference import reference, run_all

from mlxq.engine.prompts import WARMUP_KEY
from mlxq.engine.sampling import Completion
from mlxq.engine.slots.engine import SlotEngine
from mlxq.wire import JsonSchemaFormat, JsonSchemaSpec, Request

MAX_BATCH = 4


def jobs(temperature: float) -> dict[str, Request]:
    """Ten jobs for a 4-row batch, and one constrained to a JSON schema (its mask applied
    where rank 0 samples); at a temperature, every other job has no seed."""
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    schema = JsonSchemaFormat(JsonSchemaSpec(schema=person, name="person", strict=True))
    out = {"json": Request(prompt="A person:", max_tokens=40, response_format=schema, seed=7)}
    for i in range(10):
        prompt = list(range(5 + i, 5 + i + 3 + 7 * (i % 4)))
        seed = None if temperature and i % 2 else 1000 + i
        out[f"job{i}"] = Request(
            prompt=prompt, max_tokens=4 + 5 * (i % 3), temperature=temperature, seed=seed
        )
    return out


class Recording:
    """A follower's engine that keeps what its steps finished (the follower drops it)."""

    def __init__(self, inner: SlotEngine) -> None:
        self.inner, self.done = inner, {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step(self) -> list[Completion]:
        finished = self.inner.step()
        self.done.update({c.key: c.token_ids for c in finished})
        return finished


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    parallel = sys.argv[4] if len(sys.argv) > 4 else "tensor"
    todo = jobs(temperature)
    if "MLX_RANK" not in os.environ:
        import mlx_lm

        model, tokenizer = mlx_lm.load(model_dir)
        engine = SlotEngine(model, tokenizer, "m", max_batch=MAX_BATCH, prefill_batch=2)
        done = {k: c.token_ids for k, c in run_all(engine, todo, join_every=2).items()}
        ref = {}
        for key, r in todo.items() if not temperature else ():
            if r.response_format is not None:
                continue  # (mlx-lm's greedy knows no constraint)
            ref[key] = reference(model, tokenizer, engine.encode(r), r)["tokens"]
        out.write_text(json.dumps({"tokens": done, "reference": ref}))
        return
    from mlxq.engine.distributed.channel import Channel
    from mlxq.engine.distributed.lockstep import LockstepEngine, follow
    from mlxq.engine.distributed.split import load_split
    from mlxq.engine.distributed.start import greet, join

    channel = Channel(join("ring"))
    greet(channel, model_dir, Path(model_dir))
    if parallel == "pipeline":
        done = pipeline_rank(model_dir, channel.group, todo)
        out.with_suffix(f".{channel.rank}").write_text(json.dumps({"tokens": done}))
        return
    model, tokenizer, _, _ = load_split(model_dir, Path(model_dir), None, channel.group, "tensor")
    engine = SlotEngine(model, tokenizer, "m", max_batch=MAX_BATCH, prefill_batch=2)
    if channel.rank:
        recording = Recording(engine)
        follow(recording, channel)  # type: ignore[arg-type]
        done = recording.done
    else:
        done = drive(LockstepEngine(engine, channel), todo)
    done.pop(WARMUP_KEY, None)
    out.with_suffix(f".{channel.rank}").write_text(json.dumps({"tokens": done}))


def pipeline_rank(model_dir: str, group: Any, todo: dict[str, Request]) -> dict[str, list[int]]:
    """This rank's stage and micro-batch engines (as many as ranks, 2 rows each, so jobs
    join and finish mid-batch in each); rank 0 drives, the others follow."""
    from mlxq.engine.distributed.pipeline import PipelineEngine, follow
    from mlxq.engine.distributed.relay import Relay
    from mlxq.engine.distributed.split import load_split

    model, tokenizer, _, _ = load_split(model_dir, Path(model_dir), None, group, "pipeline")
    engines = [
        SlotEngine(model, tokenizer, "m", max_batch=2, prefill_batch=2) for _ in range(group.size())
    ]
    for e in engines:
        e.as_stage(samples=group.rank() == 0)
    relay = Relay(group)
    if group.rank():
        recording = [Recording(e) for e in engines]
        follow(recording, relay)  # type: ignore[arg-type]
        done = {k: v for r in recording for k, v in r.done.items()}
    else:
        done = drive(PipelineEngine(engines, relay), todo)
    done.pop(WARMUP_KEY, None)
    return done


def drive(engine: Any, todo: dict[str, Request]) -> dict[str, list[int]]:
    """Rank 0: warm up, run the jobs (one joining every other step), close; the tokens."""
    engine.warmup()
    done = {k: c.token_ids for k, c in run_all(engine, todo, join_every=2).items()}
    engine.close()
    return done


if __name__ == "__main__":
    main()
