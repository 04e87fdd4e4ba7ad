"""The slot engine's join and ordering policy alone: plain Python, no model."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from mlxq.engine.slots.joins import JoinPolicy, Waiting, join_due, pick_group, similar


@dataclass
class _Run:
    prompt: list[int]


@dataclass
class _Plan:
    reused: list[str]
    reused_tokens: int

    def tokens(self, blocks: int) -> int:
        return self.reused_tokens * blocks // max(1, len(self.reused))

    def cut(self, blocks: int) -> None:
        self.reused_tokens = self.tokens(blocks)
        self.reused = self.reused[:blocks]


@dataclass
class _Prefix:
    """Plans by prompt length: a stored prefix for long prompts, one still being computed
    (no plan yet) for prompts of length 13."""

    asked: list[int] = field(default_factory=list)

    def plan(self, prompt: list[int]) -> _Plan | None:
        self.asked.append(len(prompt))
        if len(prompt) == 13:
            return None
        return _Plan(["sys"], 100) if len(prompt) > 100 else _Plan([], 0)


def _waiting(*lengths: int, since: int = 0) -> list[Waiting]:
    return [Waiting(_Run([1] * n), since_step=since) for n in lengths]  # type: ignore[arg-type]


def test_join_due_is_hysteresis() -> None:
    w = _waiting(10, 10)
    at_once = JoinPolicy(wait=4)
    assert not join_due([], decoding=0, free=4, join_group=4, step=0, policy=at_once)
    assert not join_due(w, decoding=3, free=0, join_group=4, step=9, policy=at_once)  # no slot
    assert join_due(w, decoding=0, free=4, join_group=4, step=0, policy=at_once)  # none decode
    assert join_due(w, decoding=3, free=4, join_group=2, step=0, policy=at_once)  # a full group
    assert not join_due(w, decoding=3, free=4, join_group=4, step=3, policy=at_once)  # small
    assert join_due(w, decoding=3, free=4, join_group=4, step=4, policy=at_once)  # waited enough
    assert join_due(w, decoding=3, free=2, join_group=4, step=0, policy=at_once)  # fills slots


def test_join_due_holds_a_deep_queue_until_its_free_slots_idled_a_calls_worth() -> None:
    """Every free slot has a job waiting: a group joins when the slot-steps they idled reach
    the budget, or the oldest reaches ``max_wait``; never earlier."""
    policy = JoinPolicy(wait=4, idle_budget=10, max_wait=8)
    w = _waiting(10, 10, 10)
    for i, since in enumerate((0, 2, 3)):
        w[i].since_step = since
    # At step 4: idled 4 + 2 + 1 = 7 slot-steps; at step 5: 5 + 3 + 2 = 10.
    assert not join_due(w, decoding=5, free=3, join_group=8, step=4, policy=policy)
    assert join_due(w, decoding=5, free=3, join_group=8, step=5, policy=policy)
    # Only the first `free` waiting jobs have a slot to idle in.
    assert not join_due(w, decoding=5, free=1, join_group=8, step=7, policy=policy)
    assert join_due(w, decoding=5, free=1, join_group=8, step=8, policy=policy)  # max_wait
    assert join_due(w, decoding=5, free=1, join_group=8, step=10, policy=policy)  # budget 10


def test_pick_group_takes_similar_prompts_in_order() -> None:
    assert similar(100, 200) and similar(10, 70) and not similar(10, 300)
    w = _waiting(100, 400, 150, 90, 60)
    group = pick_group(w, limit=3, prefix=None)
    assert [len(g.run.prompt) for g in group] == [100, 150, 90]
    assert [len(x.run.prompt) for x in w] == [400, 60]  # left for later groups


def test_pick_group_keeps_one_cached_prefix_per_group() -> None:
    prefix = _Prefix()
    w = _waiting(150, 20, 13, 160, 30)
    group = pick_group(w, limit=8, prefix=prefix)
    # 150 and 160 reuse the stored prefix (50 and 60 tokens left); 13 has no plan yet.
    assert [len(g.run.prompt) for g in group] == [150, 160]
    assert all(g.planned for g in group)
    assert [len(x.run.prompt) for x in w] == [20, 13, 30]
    assert [len(x.run.prompt) for x in pick_group(w, 8, prefix)] == [20, 30]
    assert prefix.asked.count(150) == 1  # a plan is made once


def test_pick_group_sizes_a_group_on_the_tokens_it_prefills() -> None:
    """With a token budget, a group holds as many rows as one call of that many tokens
    (rows x longest left to prefill, chunks capped at ``step``), counted after the cached
    prefix is taken off: prompts of 150-160 reusing 100 tokens cost 50-60 each."""
    w = _waiting(150, 150, 160, 150, 150)
    group = pick_group(w, limit=8, prefix=_Prefix(), tokens=180)
    assert [len(g.run.prompt) for g in group] == [150, 150, 160]  # 3 x 60 = 180
    assert len(w) == 2
    assert len(pick_group(_waiting(150, 150, 160), 8, None, tokens=200)) == 1  # 2 x 150 > 200
    # Long prompts count one chunk: 3 x min(3000, 1000) = 3000 fits, a fourth would not.
    assert len(pick_group(_waiting(*[3000] * 5), 8, None, tokens=3000, step=1000)) == 3
    assert len(pick_group(_waiting(5000), 8, None, tokens=10)) == 1  # always one row


@dataclass
class _Stored:
    """Plans by prompt length, as given: stored blocks of 16 tokens."""

    plans: dict[int, list[str]]

    def plan(self, prompt: list[int]) -> _Plan:
        blocks = self.plans[len(prompt)]
        return _Plan(list(blocks), 16 * len(blocks))


def test_pick_group_joins_prompts_on_the_blocks_their_prefixes_share() -> None:
    """Chat prompts share a template's system prompt (a block) and some share their
    questions' first words too (a deeper block each): they prefill in one call from the
    block they all share, each plan cut to it; another prefix, or none, waits for its own."""
    stored = _Stored(
        {
            40: ["sys", "what is"],
            41: ["sys", "how do"],
            42: ["sys"],
            43: ["other"],
            44: [],
            45: ["sys", "what is"],
        }
    )
    w = _waiting(40, 41, 42, 43, 44, 45)
    group = pick_group(w, limit=8, prefix=stored)
    assert [len(g.run.prompt) for g in group] == [40, 41, 42, 45]
    assert all(g.plan.reused == ["sys"] and g.plan.reused_tokens == 16 for g in group)
    assert [len(x.run.prompt) for x in pick_group(w, 8, stored)] == [43]
    assert [len(x.run.prompt) for x in pick_group(w, 8, stored)] == [44]
    # A group keeps what its jobs share: two on the same deeper block keep both blocks.
    pair = _waiting(40, 45)
    assert all(g.plan.reused == ["sys", "what is"] for g in pick_group(pair, 8, stored))
    # Padding is judged on what is left once the shared blocks are cut: 40 tokens less
    # 16 against 200 less 16 is too much padding, the long one waits.
    stored.plans[200] = ["sys", "what is"]
    w = _waiting(40, 200)
    assert [len(g.run.prompt) for g in pick_group(w, 8, stored)] == [40]


def test_the_policy_modules_import_no_mlx() -> None:
    """Scheduling policy is plain Python: importing it loads no MLX."""
    code = (
        "import sys; import mlxq.engine.slots.joins, mlxq.engine.slots.order, "
        "mlxq.engine.scheduler; "
        "sys.exit(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_pick_group_seats_samples_in_free_slots_in_arrival_order() -> None:
    """A job of several samples takes a slot per sample; one that does not fit the free
    slots stops the group there (it is next, not passed over)."""
    jobs = _waiting(10, 10, 10, 10)
    jobs[1].rows = 4
    first, second, rest = jobs[0], jobs[1], jobs[2:]
    assert pick_group(jobs, 8, None, free=4) == [first]
    assert jobs == [second, *rest]
    assert pick_group(jobs, 8, None, free=5) == [second, rest[0]]
    assert pick_group(jobs, 8, None) == rest[1:]  # (no slot count: as many as ``limit``)


def test_pick_group_prefills_a_job_marked_alone_by_itself() -> None:
    """The jobs of a group whose prefill failed are marked ``alone``: each is a group of
    one, so a failure one of them causes fails no other; the rest group as before."""
    jobs = _waiting(10, 12, 11, 10)
    for w in jobs[:2]:
        w.alone = True
    first, second, rest = jobs[0], jobs[1], jobs[2:]
    assert pick_group(jobs, 8, None) == [first]
    assert pick_group(jobs, 8, None) == [second]
    assert pick_group(jobs, 8, None) == rest
    later = _waiting(10, 10, 10)
    later[1].alone = True
    a, alone, c = later
    assert pick_group(later, 8, None) == [a, c]  # it waits for its own call
    assert later == [alone]
