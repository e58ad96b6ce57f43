"""Token differences against native, and their retrial on a native server.

A served request whose greedy tokens differ from native's reference is not yet a defect: on
CPU, concurrent requests change batch shapes, kernels round by batch shape, and where
native's own choice is a near-tie (a tiny logprob margin of the greedy token over the
runner-up) another batch mix may flip it. A difference is *explained* only when native
itself, run again beside other requests arriving at random moments, chooses the differing
token at the first differing position (`retry`). The margin is reported beside it, as
information.

On a GPU in bf16 the retrial is not enough: a tiny random model's margins sit on bf16's steps
(0, 1/64, 1/32), and which of two tied tokens wins depends on the exact batch, which a retrial
rarely meets again. There the run's own native servers measure the noise: the same concurrent
bursts on native, against native alone, differ too (12-05, H100: 84 of 208 requests, at margins
up to 1/32). A served difference at a margin no larger than the largest of those
(`NoiseFloor`) is one native's own concurrency gives (`Difference.explained_by`).

The retrial must be able to fail: `plant` makes a difference native does not give (a native
output with one token changed where native's margin is ordinary), and the orchestrations
retry it the same way; it must stay unexplained. The soak (`soak`) and the sharing run
(`sharing`) both read their token comparisons this way.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from conformance.models import FIRST_FREE_TOKEN, VOCAB_SIZE
from conformance.serving.server import Server, ServerError

#: A reference margin (logprob of the greedy token over the runner-up) below which a
#: different choice is a near-tie (information only: float32 batch-shape differences move
#: logprobs by about 1e-5; the margins of a random tiny model are mostly 1e-2 and more).
TIE = 1e-3
PLANTED_MARGIN = 0.05  # the planted difference sits where native's margin is at least this
MAX_RETRIED = 20  # differences retried on native per run; any beyond stay unexplained
MAX_DELAY_S = 0.3  # each request of a retrial is sent after a random delay of up to this

#: One native reference: the greedy tokens and, at each position, the margin of each.
Reference = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Difference:
    """A request whose served tokens differ from native's reference, and what the retrial on
    native found."""

    position: int  # in the caller's list of compared requests
    request: int  # the caller's id of the request
    first: int  # the first differing token; -1: the served side failed or gave another length
    soaked_token: int  # the served side's token there
    native_token: int
    margin: float  # native's logprob margin at `first` (-1 with it)
    retrials: int = 0
    reproduced: int = 0  # retrials in which native chose `soaked_token` at `first`

    @property
    def explained(self) -> bool:
        """Native itself gives the served token there, in some batch mix."""
        return self.reproduced > 0

    def explained_by(self, noise: NoiseFloor) -> bool:
        """`explained`, or within ``noise``: native's own concurrent requests chose another
        token than native alone at a margin at least as large as this one's."""
        return self.explained or noise.covers(self)


@dataclass(frozen=True)
class NoiseFloor:
    """The largest native margin at which native's concurrent requests chose another token
    than native alone, in one run (None: they never did, and nothing is within it).

    Invariant: `covers` holds only for a difference at a real position (``first >= 0``)
    whose margin is at most ``margin``."""

    margin: float | None

    @classmethod
    def of(cls, native: Iterable[Difference]) -> NoiseFloor:
        """The floor of native's own differences (those of another length do not count)."""
        return cls(max((d.margin for d in native if d.first >= 0), default=None))

    def covers(self, d: Difference) -> bool:
        return self.margin is not None and d.first >= 0 and d.margin <= self.margin


def first_difference(got: Sequence[int], want: Sequence[int]) -> int:
    """The first position where two token lists of the same length differ (they must)."""
    return next(p for p, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)


def compare(position: int, request: int, got: Sequence[int] | None, ref: Reference) -> Difference | None:
    """``got`` against native's reference: None when equal, else where they first differ."""
    want, margins = ref
    if got is not None and list(got) == want:
        return None
    if got is None or len(got) != len(want):
        return Difference(position, request, -1, -1, -1, -1.0)
    first = first_difference(got, want)
    return Difference(position, request, first, got[first], want[first], round(margins[first], 8))


def differences(got: Sequence[Sequence[int] | None], refs: Sequence[Reference],
                requests: Sequence[int]) -> list[Difference]:
    """`compare` of each served output with its reference, the differing ones (``position``:
    the index in ``got``; ``request``: the matching entry of ``requests``)."""
    if not len(got) == len(refs) == len(requests):
        raise ServerError(f"{len(got)} results against {len(refs)} references ({len(requests)} requests)")
    found = (compare(pos, req, tokens, ref) for pos, (tokens, ref, req) in enumerate(zip(got, refs, requests, strict=True)))
    return [d for d in found if d is not None]


def plant(refs: Sequence[Reference], rng: random.Random) -> Difference:
    """A difference native does not give: the first reference with a margin of at least
    `PLANTED_MARGIN` somewhere (no batch mix flips that), its token there replaced by a
    random other one. ``position`` and ``request`` are the reference's index."""
    span = VOCAB_SIZE - FIRST_FREE_TOKEN
    for pos, (want, margins) in enumerate(refs):
        at = next((i for i, m in enumerate(margins) if m >= PLANTED_MARGIN), None)
        if at is None:
            continue
        other = FIRST_FREE_TOKEN + (want[at] - FIRST_FREE_TOKEN + rng.randrange(1, span)) % span
        found = compare(pos, pos, want[:at] + [other] + want[at + 1:], (want, margins))
        assert found is not None  # one token changed
        return found
    raise ServerError(f"no reference has a token with a native margin of {PLANTED_MARGIN} or more")


def retry(server: Server, prompt: Sequence[int], d: Difference, companions: Sequence[tuple[Sequence[int], int]],
          retrials: int, max_mix: int, rng: random.Random) -> Difference:
    """Run ``prompt`` (the request of ``d``) on native ``retrials`` times, the i-th beside
    ``i mod max_mix`` of ``companions`` (prompt, max tokens), each request sent after a random
    delay of up to `MAX_DELAY_S`, so that it meets other batch shapes each time; count the
    runs that choose the served token. A difference of another length is not retried."""
    if d.first < 0:
        return d
    hits, others = 0, list(companions)
    for i in range(retrials):
        mix = rng.sample(others, min(i % max_mix, len(others)))
        jobs = [(prompt, d.first + 1), *mix]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            runs = [pool.submit(_delayed, server, p, n, rng.uniform(0.0, MAX_DELAY_S)) for p, n in jobs]
            outputs = [f.result() for f in runs]  # every one: a failed companion is an error too
        hits += outputs[0][d.first] == d.soaked_token
    return dataclasses.replace(d, retrials=retrials, reproduced=hits)


def _delayed(server: Server, prompt: Sequence[int], max_tokens: int, delay_s: float) -> list[int]:
    time.sleep(delay_s)
    return server.complete(prompt, max_tokens, timeout_s=300.0)
