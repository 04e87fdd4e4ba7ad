"""Shared-prefix KV reuse: a trie of prompt blocks holding their KV cache, bounded by bytes.

Batch jobs often share a long system prompt or few-shot preamble. The engine keeps the KV
cache of such prefixes here and starts later jobs from a copy, so only their unshared
suffix is prefilled.

- **Blocks.** Prompts are cut into blocks of ``block_size`` tokens (16, as vLLM's). A
  trie node is one block after a given prefix (its parent) and holds that block's keys
  and values for every layer. Prompts sharing a prefix share its nodes, so a system
  prompt is stored once however many different prompts extend it. Blocks bound the
  bookkeeping (one dict lookup per block, no per-token trie) at the cost of re-prefilling
  the part of a match short of a block: with 64-token blocks a 1,000-token prefix left
  40 tokens to every job, twice its unique suffix (prefill 1.3x slower on this CPU).
- **Lookup** (:meth:`PrefixCache.plan`) walks the prompt's full blocks, leaving at least
  its last token to prefill, and returns the longest stored chain. A job whose next block
  is still being computed by another job (*pending*) waits for it rather than computing
  it again (``plan`` returns None).
- **What is stored.** Every admitted prompt is counted (:meth:`PrefixCache.observe`: a
  hash per block boundary). A job stores its prompt up to the longest block boundary seen
  in at least two prompts, if that is at least ``min_store_tokens`` long (one block by
  default: a chat template's default system prompt is about that, and on a CPU every
  prompt token prefilled costs as much as any other): prefixes that recur, not every
  job's unique text. The engine counts a burst of jobs before planning
  any of them, so the first job of a burst already stores the shared prefix, and the
  others wait for it. The job is inserted with the stored part as its own prompt segment;
  when mlx-lm ends that segment, its cache holds exactly the prefix and is copied here
  block by block (:meth:`PrefixCache.store`).
- **Memory.** ``nbytes`` counts the stored blocks' arrays exactly (each block is its own
  copy). After every store, least recently used leaves are evicted until ``nbytes <=
  max_bytes``: a hit touches its path leaf first, so a block is always more recent than
  its descendants; a block with pending children stays. A job never plans to store more
  than ``max_bytes`` holds (``block_bytes``), so no job waits for a prefix that cannot stay.
- **Copies.** A job gets new arrays (the blocks concatenated, lazily, so they take memory
  only once its prefill batch runs): mlx-lm merges them into its batch cache and never
  writes to the stored ones. They are the job's own KV, which the scheduler reserves per
  job anyway; ``max_bytes`` comes on top of that.

Only models whose cache is plain ``KVCache`` per layer can share prefixes
(:func:`reusable`); sliding-window and recurrent caches cannot be cut at a block.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxq.wire import ModelInfo

log = logging.getLogger("mlxq.engine.prefix_cache")
Block = tuple[int, ...]
# One block's keys and values, per layer.
BlockKV = list[tuple[mx.array, mx.array]]
DEFAULT_BLOCK = 16


@dataclass(eq=False)  # hashed by identity: nodes are keys of the LRU order
class _Node:
    key: Block
    parent: _Node | None
    children: dict[Block, _Node] = field(default_factory=dict)
    kv: BlockKV | None = None  # None while pending
    nbytes: int = 0
    pending: bool = True


@dataclass
class Plan:
    """How one job uses the cache: blocks it starts from, blocks it will store."""

    owner: PrefixCache
    reused: list[_Node]
    store: list[_Node]  # pending blocks this job computes; emptied once stored or dropped
    store_to: int = 0  # prompt length up to the end of ``store`` (0: nothing to store)

    @property
    def reused_tokens(self) -> int:
        return self.tokens(len(self.reused))

    def tokens(self, blocks: int) -> int:
        """The prompt tokens that ``blocks`` of the cache hold."""
        return blocks * self.owner.block_size

    def cut(self, blocks: int) -> None:
        """Reuse only the first ``blocks`` of the stored prefix: the job's prefill group
        shares no more (:func:`~mlxq.engine.slots.joins.pick_group`); the rest is
        prefilled again. The blocks it stores stay where they are in the prompt."""
        self.owner.reused_tokens -= self.tokens(len(self.reused) - blocks)
        self.reused = self.reused[:blocks]

    def segments(self, prompt: list[int]) -> list[list[int]]:
        """The prompt left to prefill, split where the stored prefix ends."""
        start = self.reused_tokens
        if not self.store:
            return [prompt[start:]]
        return [prompt[start : self.store_to], prompt[self.store_to :]]

    def start(self, prompt: list[int]) -> tuple[list[list[int]], list[KVCache] | None, list[int]]:
        """``BatchGenerator.insert_segments`` arguments for the job: segments, cache, tokens.

        The cache (a new copy, or None) holds the reused tokens, which are given too.
        """
        return self.segments(prompt), self.owner.kv_cache(self), prompt[: self.reused_tokens]

    def release(self) -> None:
        """The job ended (or failed to start): drop the blocks it did not store."""
        self.owner.release(self)


class PrefixCache:
    """Prompt-prefix KV blocks in a trie, LRU-evicted beyond ``max_bytes``."""

    def __init__(
        self,
        max_bytes: int,
        *,
        block_size: int = DEFAULT_BLOCK,
        block_bytes: int = 0,
        min_store_tokens: int = DEFAULT_BLOCK,
        max_counts: int = 1 << 18,
    ) -> None:
        """``block_bytes`` estimates a block's KV size (updated from the blocks stored):
        a job never plans to store more than ``max_bytes`` holds, so jobs do not wait for
        a prefix that would be evicted as soon as it is stored. ``max_counts`` bounds the
        block prefixes counted (LRU; 2^18 blocks of 16 tokens: 4M prompt tokens seen)."""
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.max_bytes, self.block_size, self.block_bytes = max_bytes, block_size, block_bytes
        self.min_store_tokens, self.max_counts = min_store_tokens, max_counts
        self._root = _Node((), None, pending=False)
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # stored nodes, oldest first
        self._counts: OrderedDict[int, int] = OrderedDict()  # block-chain hash -> prompts
        self.nbytes = 0
        self.hits = self.reused_tokens = self.stored_tokens = self.evictions = 0
        self.seconds = 0.0  # spent copying KV in and out (store, kv_cache)

    @property
    def blocks(self) -> int:
        """Stored blocks."""
        return len(self._lru)

    def counts(self) -> dict[str, int]:
        """Hits, reused and stored tokens, bytes held and evictions (``EngineStats`` names)."""
        return {
            "prefix_hits": self.hits,
            "reused_tokens": self.reused_tokens,
            "stored_tokens": self.stored_tokens,
            "prefix_cache_bytes": self.nbytes,
            "prefix_evictions": self.evictions,
        }

    # -- bookkeeping (no MLX) --

    def _blocks(self, tokens: list[int]) -> list[Block]:
        """The prompt's full blocks, always leaving its last token out."""
        b = self.block_size
        return [tuple(tokens[i : i + b]) for i in range(0, (len(tokens) - 1) // b * b, b)]

    @staticmethod
    def _chain(blocks: list[Block]) -> list[int]:
        h, out = 0, []
        for block in blocks:
            h = hash((h, block))
            out.append(h)
        return out

    def observe(self, tokens: list[int]) -> None:
        """Count a prompt's block prefixes (call once per admitted job)."""
        for h in self._chain(self._blocks(tokens)):
            self._counts[h] = self._counts.pop(h, 0) + 1
        while len(self._counts) > self.max_counts:
            self._counts.popitem(last=False)

    def uncached_length(self, tokens: list[int]) -> int:
        """How much of a prompt is likely left to prefill: what follows its longest prefix
        that is stored or being stored. Read-only (no counting, no LRU touch)."""
        node, matched = self._root, 0
        for block in self._blocks(tokens):
            child = node.children.get(block)
            if child is None:
                break
            node, matched = child, matched + 1
        return len(tokens) - matched * self.block_size

    def plan(self, tokens: list[int]) -> Plan | None:
        """The longest stored prefix to start from and what to store; None: wait.

        None means the prompt's next block is pending (another job is computing it):
        plan again after that job's prefix is stored or dropped.
        """
        b, n = self.block_size, (len(tokens) - 1) // self.block_size
        node, reused = self._root, []
        while len(reused) < n:  # cut blocks only as far as they match: waiting is cheap
            start = len(reused) * b
            child = node.children.get(tuple(tokens[start : start + b]))
            if child is None:
                break
            if child.pending:
                return None
            node = child
            reused.append(child)
        blocks = self._blocks(tokens)
        chain = self._chain(blocks)
        k = min(n, self.max_bytes // self.block_bytes) if self.block_bytes else n
        while k > len(reused) and (
            k * b < self.min_store_tokens or self._counts.get(chain[k - 1], 0) < 2
        ):
            k -= 1
        store = []
        for block in blocks[len(reused) : k]:
            child = _Node(block, node)
            node.children[block] = child
            store.append(child)
            node = child
        if reused:
            self.hits += 1
            self.reused_tokens += len(reused) * b
            self._touch(reused)
        return Plan(self, reused, store, k * b if store else 0)

    def fill(self, plan: Plan, payloads: list[tuple[BlockKV, int]]) -> None:
        """Store the plan's pending blocks: one ``(kv, nbytes)`` each, then evict."""
        for node, (kv, nbytes) in zip(plan.store, payloads, strict=True):
            node.kv, node.nbytes, node.pending = kv, nbytes, False
            self.nbytes += nbytes
            self.block_bytes = max(self.block_bytes, nbytes)
            self._lru[node] = None
        self.stored_tokens += len(plan.store) * self.block_size
        self._touch(plan.reused + plan.store)
        plan.store = []
        self._evict()

    def release(self, plan: Plan) -> None:
        """Drop the plan's pending blocks (its job ended before storing them)."""
        for node in reversed(plan.store):
            if node.pending and node.parent is not None:
                node.parent.children.pop(node.key, None)
        plan.store = []

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):  # leaf first: ancestors end up more recent
            if node in self._lru:
                self._lru.move_to_end(node)

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes:
            victim = next((n for n in self._lru if not n.children), None)
            if victim is None or victim.parent is None:
                return
            del self._lru[victim]
            del victim.parent.children[victim.key]
            self.nbytes -= victim.nbytes
            victim.kv, victim.nbytes = None, 0
            self.evictions += 1

    def clear(self) -> None:
        """Forget everything (pending blocks too)."""
        self._root.children.clear()
        self._lru.clear()
        self._counts.clear()
        self.nbytes = 0

    # -- KV copies (MLX) --

    def kv_cache(self, plan: Plan) -> list[KVCache] | None:
        """A new per-layer cache holding the plan's reused blocks, or None if none."""
        if not plan.reused:
            return None
        tic = time.perf_counter()
        cache = []
        for layer in zip(*(node.kv for node in plan.reused), strict=True):
            c = KVCache()
            c.keys = mx.concatenate([k for k, _ in layer], axis=2)
            c.values = mx.concatenate([v for _, v in layer], axis=2)
            c.offset = c.keys.shape[2]
            cache.append(c)
        self.seconds += time.perf_counter() - tic
        return cache

    def store(self, plan: Plan, cache: list[KVCache], tokens: list[int], prompt: list[int]) -> None:
        """Copy the plan's pending blocks out of a job's cache, which holds ``tokens``."""
        if not plan.store:
            return
        if list(tokens) != prompt[: plan.store_to]:  # not where expected: store nothing
            self.release(plan)
            return
        tic = time.perf_counter()
        b, payloads = self.block_size, []
        for start in range(plan.store_to - len(plan.store) * b, plan.store_to, b):
            kv = [
                (
                    mx.contiguous(c.keys[..., start : start + b, :]),
                    mx.contiguous(c.values[..., start : start + b, :]),
                )
                for c in cache
            ]
            payloads.append((kv, sum(k.nbytes + v.nbytes for k, v in kv)))
        mx.eval([kv for kv, _ in payloads])
        self.fill(plan, payloads)
        self.seconds += time.perf_counter() - tic


def reusable(model: nn.Module) -> bool:
    """Whether the model's prompt cache can be shared by prefix (plain KVCache layers)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def make_prefix_cache(model: nn.Module, info: ModelInfo, max_bytes: int) -> PrefixCache | None:
    """The engine's prefix cache: None if ``max_bytes`` is 0 or the model cannot share."""
    if max_bytes <= 0:
        return None
    if not reusable(model):
        log.warning("prefix cache off: the KV cache of %s cannot be shared by prefix", info.name)
        return None
    return PrefixCache(max_bytes, block_bytes=info.kv_bytes_per_token * DEFAULT_BLOCK)
