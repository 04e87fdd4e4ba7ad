"""When waiting jobs join the slot engine's batch, and which of them prefill together.

Plain Python (no MLX): the slot engine hands in its waiting list and counts.

- :func:`join_due`: a group joins when it is worth a prefill call while others decode
  (hysteresis, :class:`JoinPolicy`): at least ``join_group`` waiting, nothing decoding,
  the free slots idled as long as a call's fixed cost is worth, or the oldest has waited
  long enough.
- :func:`pick_group`: up to ``limit`` waiting jobs in arrival order that share one prefill
  call: a cached prefix (if any: the blocks their stored prefixes share, a job whose own
  goes further prefilling the rest, so that prompts sharing a chat template's system
  prompt but not their questions' first words still join together) and prompts left to
  prefill within 2x (or 64 tokens) of the first one's, so right-padding wastes little;
  with a token budget, as many as one prefill call of that many tokens holds; a job of
  ``n`` samples takes ``n`` of the free slots; a job whose group's prefill failed
  (:attr:`Waiting.alone`) goes in a group of its own, so that a failure one job causes
  fails that job only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxq.engine.prefix_cache import Plan, PrefixCache
    from mlxq.engine.sampling import RunningJob


@dataclass
class Waiting:
    """A job admitted to the engine and not yet prefilled."""

    run: RunningJob
    plan: Plan | None = None  # its prefix-cache plan, once made
    planned: bool = False
    since_step: int = 0  # the engine's step count when it arrived
    rows: int = 1  # slots it takes: one per sample (its prompt is prefilled once)
    alone: bool = False  # prefilled in a group of its own (its group's prefill failed)


def similar(n: int, base: int) -> bool:
    """Whether prompts left to prefill of ``n`` and ``base`` tokens share a prefill call
    (right-padded to the longer: within 2x, or 64 tokens, of each other)."""
    return n <= 2 * base + 64 and base <= 2 * n + 64


@dataclass(frozen=True)
class JoinPolicy:
    """When fewer jobs than ``join_group`` join while other rows decode.

    A prefill call has a fixed cost besides its tokens (on a GPU it reads every weight,
    as a decode step does); a free slot left idle costs a row of every step. When every
    free slot has a job waiting (a deep queue), a group joins once its slots have idled
    ``idle_budget`` slot-steps in all, the fixed cost of a call: one call a step becomes
    one every ~sqrt(2 x budget / finishes a step) steps (joining at once made a call
    nearly every step on a deep queue: bench/RESULTS.md, ``MLXQ_JOIN_COST``).
    ``max_wait`` bounds the oldest job's wait; with fewer jobs than free slots (more may
    be on their way) it waits ``wait`` steps.
    """

    wait: int = 4
    idle_budget: float = 0.0  # 0: a group that fills every free slot joins at once
    max_wait: int = 32


def join_due(
    waiting: list[Waiting],
    decoding: int,
    free: int,
    join_group: int,
    step: int,
    policy: JoinPolicy = JoinPolicy(),
) -> bool:
    """Whether the next group of ``waiting`` jobs should be prefilled at decode step ``step``."""
    if not waiting or not free:
        return False
    if not decoding or len(waiting) >= join_group:
        return True
    oldest = step - waiting[0].since_step
    if len(waiting) < free:
        return oldest >= policy.wait
    idle = sum(step - w.since_step for w in waiting[:free])
    return idle >= policy.idle_budget or oldest >= policy.max_wait


def pick_group(
    waiting: list[Waiting],
    limit: int,
    prefix: PrefixCache | None,
    tokens: int | None = None,
    step: int = 2048,
    free: int | None = None,
) -> list[Waiting]:
    """The next prefill group, taken out of ``waiting``; ``prefix`` is the engine's prefix
    cache (its ``plan(prompt)`` says which stored prefix a job reuses), or None. With
    ``free``, the group's rows (a job's samples, :attr:`Waiting.rows`) fit in that many
    slots: in arrival order, so a job of many samples is not passed over for good.

    With ``tokens``, the group also stops where one prefill call (its rows times its
    longest prompt left to prefill, in chunks of ``step``) would pass that many tokens: a
    group is sized on what it really prefills, a cached prefix taken off, which is only
    known here (when the job arrived, the prefix it reuses may not have been stored yet).
    """
    group: list[Waiting] = []
    path: list[object] = []  # the stored blocks every job of the group starts from
    first, longest, rows = 0, 0, 0  # prompt lengths: the first job's, the longest
    for w in waiting:
        if len(group) >= limit or (free is not None and rows + w.rows > free):
            break
        if prefix is not None and not w.planned:
            w.plan = prefix.plan(w.run.prompt)
            if w.plan is None:
                continue  # its prefix is being computed by another job: wait
            w.planned = True
        reused = w.plan.reused if w.plan is not None else []
        depth = _shared(path, reused) if group else len(reused)
        if group and (w.alone or ((path or reused) and not depth)):
            continue  # alone, or another cached prefix: later
        cut = w.plan.tokens(depth) if w.plan is not None else 0
        n, top = len(w.run.prompt), max(longest, len(w.run.prompt))
        if group and not similar(n - cut, first - cut):
            continue  # padding it would waste: later
        if group and tokens and (len(group) + 1) * min(top - cut, step) > tokens:
            break
        if not group:
            first = n
        path, longest, rows = reused[:depth], top, rows + w.rows
        group.append(w)
        if w.alone:
            break
    for w in group:
        if w.plan is not None:
            w.plan.cut(len(path))
        waiting.remove(w)
    return group


def _shared(a: list[object], b: list[object]) -> int:
    """How many leading blocks two stored prefixes share (the same nodes)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x is not y:
            break
        n += 1
    return n
