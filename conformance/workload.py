"""Deterministic token-ID workloads built from the engine geometry and a prefix pattern.

A workload is a list of passes; each pass is submitted as one ``LLM.generate`` call (its
requests run concurrently), and passes run one after another on the same engine so later
passes hit the prefix cache filled by earlier ones.

Shapes (h = hash granularity, b = block size, L = each labelled prompt length):

* ``warm3``   pass 1 caches three root prompts (the three longest lengths); pass 2 runs, for
  every L, a root-prefixed prompt (``root[:L-1] + fresh``) and an independent one
  (``fresh(L)``), plus the three warm prompts again (full hits).
* ``partial`` needs h < b. Boundaries P ∈ {h, b+h, 2b-h} lie on hash boundaries strictly
  inside blocks. Pass 1 caches ``root[:P + h//2]`` for each P, which makes vLLM register a
  partial entry at P (its final prompt hash boundary). Pass 2 runs ``root[:P] + fresh(t)``
  for t ∈ {1, h+1} (partial hits at P, so the shared tail block is copied on write), the
  root-prefixed length-set prompts and the warm prompts again.
* ``shared``  pass 1 runs, concurrently, three groups of three requests that share a prefix
  (2b-1, b+1 and the page straddle) plus an independent prompt per length; pass 2 repeats
  the same requests (now cached).
* ``fill``    (fault plans only, `conformance.reach`): a leading pass of fresh prompts of one
  length, whose blocks make the plan's site certain to be reached; the pattern's passes
  follow, their prompts unchanged (the fill draws from a token source of its own).

Invariants:
* The same (pattern, lengths, geometry, seed) always gives the same token IDs.
* Token IDs lie in [FIRST_FREE_TOKEN, VOCAB_SIZE): no pad/bos/eos token appears.
* Every prompt is at most ``max_prompt_len`` tokens; request IDs are unique.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from conformance.cases import PrefixPattern
from conformance.geometry import Geometry
from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE


@dataclass(frozen=True)
class Prompt:
    rid: str
    label: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    """Crosses the process boundary as itself: `conformance.results` validates it with
    pydantic (unknown, missing or mistyped fields refused), so it has no JSON twin."""

    passes: tuple[tuple[Prompt, ...], ...]
    lengths: tuple[tuple[str, int], ...]
    partial_boundaries: tuple[int, ...] = ()
    # The negative KV control corrupts the cached block(s) whose primary hash covers
    # exactly this many leading tokens (the first block of the shared root).
    corrupt_prefix_tokens: int = 0

    @property
    def prompts(self) -> list[Prompt]:
        return [p for ps in self.passes for p in ps]


@dataclass(frozen=True)
class FillPass:
    """``requests`` fresh prompts of ``prompt_len`` tokens, run as the workload's first pass
    (planned by `conformance.reach.plan_fill`)."""

    requests: int
    prompt_len: int


def stable_seed(text: str) -> int:
    """A process-independent seed (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


class _Tokens:
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def fresh(self, n: int) -> list[int]:
        return [self._rng.randrange(FIRST_FREE_TOKEN, VOCAB_SIZE) for _ in range(n)]


class _Builder:
    def __init__(self) -> None:
        self.passes: list[list[Prompt]] = []

    def new_pass(self) -> None:
        self.passes.append([])

    def add(self, label: str, tokens: Sequence[int]) -> None:
        assert tokens, "empty prompt"
        n = len(self.passes)
        self.passes[-1].append(Prompt(f"p{n}-{len(self.passes[-1]):02d}", label, tuple(tokens)))

    def freeze(self) -> tuple[tuple[Prompt, ...], ...]:
        return tuple(tuple(ps) for ps in self.passes)


def partial_boundaries(geo: Geometry, max_prompt_len: int) -> list[int]:
    """Hash boundaries strictly inside blocks, where partial-prefix hits can land."""
    h, b = geo.hash_block_size, geo.block_size
    if h >= b:
        return []
    cands = sorted({h, b + h, 2 * b - h})
    # Room for the warm prompt (P + h//2) and the longest pass-2 tail (h + 1).
    return [p for p in cands if p % b and p + h + 1 <= max_prompt_len]


@dataclass
class _Draft:
    """What the pattern builders share: the token source, the root prompt and the passes."""

    tok: _Tokens
    root: list[int]
    bld: _Builder
    lengths: Sequence[tuple[str, int]]
    geo: Geometry
    max_prompt_len: int

    def root_prefixed(self, n: int) -> list[int]:
        # Shares the root up to n-1 tokens and ends in a fresh token, so the hit is bounded
        # by the prompt and not by vLLM's "recompute the last token" cap alone.
        return self.root[: n - 1] + self.tok.fresh(1)

    @property
    def longest(self) -> list[int]:
        return sorted((n for _, n in self.lengths), reverse=True)[:3]


def _warm_then_all(d: _Draft) -> list[int]:
    d.bld.new_pass()
    for n in d.longest:
        d.bld.add(f"warm:{n}", d.root[:n])
    d.bld.new_pass()
    for label, n in d.lengths:
        d.bld.add(f"root:{label}", d.root_prefixed(n))
        d.bld.add(f"fresh:{label}", d.tok.fresh(n))
    for n in d.longest:
        d.bld.add(f"rewarm:{n}", d.root[:n])
    return []


def _partial_cow(d: _Draft) -> list[int]:
    h, b = d.geo.hash_block_size, d.geo.block_size
    bounds = partial_boundaries(d.geo, d.max_prompt_len)
    if not bounds:
        raise ValueError(f"no hash boundary inside a block (hash {h}, block {b})")
    d.bld.new_pass()
    for p in bounds:
        d.bld.add(f"warm-partial:{p}", d.root[: p + max(1, h // 2)])
    d.bld.new_pass()
    for p in bounds:
        for t in (1, h + 1):
            d.bld.add(f"partial:{p}+{t}", d.root[:p] + d.tok.fresh(t))
    for label, n in d.lengths:
        d.bld.add(f"root:{label}", d.root_prefixed(n))
    for p in bounds:
        d.bld.add(f"rewarm-partial:{p}", d.root[: p + max(1, h // 2)])
    return bounds


def _shared_concurrent(d: _Draft) -> list[int]:
    h, b = d.geo.hash_block_size, d.geo.block_size
    prefix_lens = [n for n in (2 * b - 1, b + 1, dict(d.lengths).get("page-straddle", 0)) if 1 < n]
    groups = []
    for plen in prefix_lens:
        shared = d.tok.fresh(plen)
        for t in (1, h, b // 2 + 1):
            if plen + t <= d.max_prompt_len:
                groups.append((f"shared:{plen}+{t}", shared + d.tok.fresh(t)))
    singles = [(f"fresh:{label}", d.tok.fresh(n)) for label, n in d.lengths]
    for _ in range(2):
        d.bld.new_pass()
        for label, toks in groups + singles:
            d.bld.add(label, toks)
    return []


_PATTERNS = {
    PrefixPattern.WARM_THEN_ALL: _warm_then_all,
    PrefixPattern.PARTIAL_COW: _partial_cow,
    PrefixPattern.SHARED_CONCURRENT: _shared_concurrent,
}


def _fill(bld: _Builder, fill: FillPass, hash_block: int, seed: int) -> None:
    """The fill pass: fresh prompts, no two agreeing on their first hash block (so none can
    hit another's blocks; shorter prompts cannot hit at all)."""
    tok = _Tokens(stable_seed(f"fill:{seed}"))
    seen: set[tuple[int, ...]] = set()
    bld.new_pass()
    for _ in range(fill.requests):
        tokens = tok.fresh(fill.prompt_len)
        while fill.prompt_len > hash_block and tuple(tokens[:hash_block]) in seen:
            tokens = tok.fresh(fill.prompt_len)
        seen.add(tuple(tokens[:hash_block]))
        bld.add(f"fill:{fill.prompt_len}", tokens)


def build_workload(
    pattern: PrefixPattern,
    lengths: Sequence[tuple[str, int]],
    geo: Geometry,
    max_prompt_len: int,
    seed: int,
    fill: FillPass | None = None,
) -> Workload:
    tok = _Tokens(seed)
    draft = _Draft(tok, tok.fresh(max_prompt_len), _Builder(), lengths, geo, max_prompt_len)
    if fill is not None:
        _fill(draft.bld, fill, geo.hash_block_size, seed)
    bounds = _PATTERNS[pattern](draft)
    b = geo.block_size
    return Workload(
        passes=draft.bld.freeze(),
        lengths=tuple(lengths),
        partial_boundaries=tuple(bounds),
        corrupt_prefix_tokens=b if pattern is PrefixPattern.WARM_THEN_ALL and max(draft.longest) > b else 0,
    )
