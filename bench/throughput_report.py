"""The report of a throughput run: its tables and notes, its JSON, and each varied
workload's ratio to its uniform twin (``bench/throughput.py``)."""

from __future__ import annotations

from typing import Any

from common import fmt_num, fmt_ratio, table
from modes import ModeResult
from workloads import Workload, context_per_token, step_bound


def model_line(info: Any) -> str:
    """One line naming the model: type, layers, hidden size, dtype, size."""
    size = info.param_bytes / 2**30
    return (
        f"model {info.name} ({info.model_type}, {info.num_layers} layers, hidden "
        f"{info.hidden_size}, {info.dtype}, {size:.2f} GiB)"
    )


def report(header: str, results: list[ModeResult], wl: Workload) -> str:
    """The workload's table of modes and its notes (extrapolated, short, where mlxq's time went)."""
    by_mode = {r.mode: r for r in results}
    base_bg = by_mode["batch_generate"].gen_tps if "batch_generate" in by_mode else None
    base_raw = by_mode["raw"].gen_tps if "raw" in by_mode else None
    headers = ["mode", "gen tok/s", "prompt tok/s", "wall s", "gen tokens", "peak GB"]
    headers += ["vs batch_generate", "vs raw"]
    rows, notes = [], []
    for r in results:
        mark = "*" if r.extrapolated else ""
        if not r.extrapolated and (r.gen_tokens != r.expected_gen_tokens or r.errors):
            mark = "!"
            notes.append(
                f"! {r.mode}: generated {r.gen_tokens:,} of {r.expected_gen_tokens:,} "
                f"expected tokens, {r.errors} requests failed or unfinished"
            )
        rows.append(
            [
                r.mode + mark,
                fmt_num(r.gen_tps),
                fmt_num(r.prompt_tps),
                fmt_num(r.wall_s, 2),
                f"{r.gen_tokens:,}",
                fmt_num(r.peak_gb, 2),
                fmt_ratio(r.gen_tps, base_bg),
                fmt_ratio(r.gen_tps, base_raw),
            ]
        )
        if r.extrapolated:
            notes.append(
                f"* {r.mode}: timed on the first {r.timed_requests} of {len(wl.prompts)} "
                f"requests ({r.extra['timed_gen_tokens']:,} tokens in "
                f"{r.extra['timed_wall_s']:.2f} s); wall s and gen tok/s are extrapolated to "
                f"all {wl.gen_tokens:,} tokens from its prefill and decode rates"
            )
        if r.mode.startswith("mlxq"):
            e = r.extra
            if "submit_s" in e:  # (through Redis; mlxq-direct hands its jobs over in-process)
                notes.append(
                    f"  {r.mode}: submit {e['submit_s']:.2f} s + worker {e['worker_s']:.2f} s + "
                    f"read results {e['read_s']:.2f} s (then the worker's exit, not counted: "
                    f"{e['worker_exit_s']:.2f} s)"
                )
            if e.get("decode_steps"):  # the slot engine: where the worker's time went
                notes.append(
                    f"  {r.mode}: prefill {e['prefill_s']:.2f} s in {e['prefill_calls']:,} calls, "
                    f"{e['decode_steps']:,} decode "
                    f"steps {e['decode_seconds']:.2f} s (building and launching them on the "
                    f"host {e['launch_seconds']:.2f} s), the rest outside the engine "
                    f"{e['worker_s'] - e['prefill_s'] - e['decode_seconds']:.2f} s, of "
                    f"which the MLX thread idle with no job {e['idle_s']:.2f} s; the slot "
                    f"cache laid out anew {e['cache_copies']} times "
                    f"({e['cache_copy_seconds']:.2f} s), the compiled forward traced "
                    f"{e['forward_traces']} times"
                )
    if (off := by_mode.get("mlxq")) and (on := by_mode.get("mlxq+prefix")):
        e = on.extra
        notes.append(
            f"  prefix cache ({e['prefix_cache_bytes'] / 2**20:.0f} MiB): effective prompt "
            f"tok/s {fmt_num(off.prompt_tps)} -> {fmt_num(on.prompt_tps)} "
            f"({fmt_ratio(on.prompt_tps, off.prompt_tps)}); prefilled "
            f"{off.extra['prefilled_tokens']:,} -> {e['prefilled_tokens']:,} tokens, "
            f"{e['reused_tokens']:,} reused in {e['prefix_hits']} hits, "
            f"{e['stored_tokens']:,} stored, {e['prefix_evictions']} evictions"
        )
    lines = [header, table(headers, rows), *notes]
    return "\n".join(lines)


def sweep_report(results: list[ModeResult], wl: Workload) -> str:
    """A batch sweep's rows side by side, mode by mode: gen tok/s, the decode step (the
    slot engine's), and each against the mode's first batch size."""
    by_mode: dict[str, list[ModeResult]] = {}
    for r in results:
        if "@" in r.mode:
            by_mode.setdefault(r.mode.split("@")[0], []).append(r)
    headers = ["mode", "batch", "gen tok/s", "decode step ms", "steps", "wall s", "peak GB"]
    headers.append("vs first")
    rows = []
    for runs in by_mode.values():
        first = runs[0].gen_tps
        for r in runs:
            steps = r.extra.get("decode_steps")
            step_ms = 1000 * r.extra["decode_seconds"] / steps if steps else None
            rows.append(
                [
                    r.mode,
                    f"{r.extra['batch']:,}",
                    fmt_num(r.gen_tps),
                    fmt_num(step_ms, 2),
                    f"{steps:,}" if steps else "-",
                    fmt_num(r.wall_s, 2),
                    fmt_num(r.peak_gb, 2),
                    fmt_ratio(r.gen_tps, first),
                ]
            )
    return f"batch sweep on {wl.name} ({len(wl.prompts):,} requests):\n" + table(headers, rows)


def twin_ratios(workloads: list[dict[str, Any]], batch: int) -> str:
    """Each varied workload's gen tok/s over its uniform twin's, mode by mode, and the best
    ratio a fixed cost per decode step allows (:func:`workloads.step_bound`)."""
    by_name = {w["workload"]: {m["mode"]: m["gen_tps"] for m in w["modes"]} for w in workloads}
    bounds = {w["workload"]: step_bound(w["max_tokens"], batch) for w in workloads}
    context = {
        w["workload"]: context_per_token(w["prompt_lengths"], w["max_tokens"]) for w in workloads
    }
    lines = []
    for name, modes in by_name.items():
        twin = by_name.get(f"{name}-twin")
        if twin is None:
            continue
        pairs = [
            f"{mode} {fmt_ratio(tps, twin.get(mode))}"
            for mode, tps in modes.items()
            if mode in twin
        ]
        lines.append(
            f"{name} vs its uniform twin (gen tok/s): " + ", ".join(pairs) + f" (bound at a "
            f"fixed cost per step, batch {batch}: {bounds[name]:.2f}x; positions a token "
            f"attends: {context[name] / context[f'{name}-twin']:.2f}x the twin's, which "
            "costs more where attention is much of a step, as on a CPU)"
        )
    return "\n".join(lines)


def struct_dict(obj: Any) -> dict[str, Any]:
    """A msgspec struct as plain JSON values."""
    import msgspec

    return msgspec.to_builtins(obj)


def workload_json(wl: Workload, results: list[ModeResult]) -> dict[str, Any]:
    """The workload and its modes' figures, for ``--json``."""
    by_mode = {r.mode: r.gen_tps for r in results}
    rows = []
    for r in results:
        row = {
            "mode": r.mode,
            "gen_tps": r.gen_tps,
            "prompt_tps": r.prompt_tps,
            "wall_s": r.wall_s,
            "gen_tokens": r.gen_tokens,
            "expected_gen_tokens": r.expected_gen_tokens,
            "prompt_tokens": r.prompt_tokens,
            "peak_gb": r.peak_gb,
            "errors": r.errors,
            "extrapolated_from_requests": r.timed_requests,
            "vs_batch_generate": _ratio(r.gen_tps, by_mode.get("batch_generate")),
            "vs_raw": _ratio(r.gen_tps, by_mode.get("raw")),
            **r.extra,
        }
        rows.append(row)
    return {
        "workload": wl.name,
        "label": wl.label,
        "requests": len(wl.prompts),
        "max_tokens": wl.max_tokens,
        "prompt_lengths": [len(p) for p in wl.prompts],
        "prompt_tokens": wl.prompt_tokens,
        "gen_tokens": wl.gen_tokens,
        "modes": rows,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
