"""StepFence and EngineStepFence: when may a page whose blocks are all free be unmapped?

The scheduler hands block ids to steps that run later (one step ahead under async
scheduling; copy-on-write retentions are released right after scheduling, before the
worker has run the copy). A page emptied now may still be read or written by any step
scheduled so far. So an emptied page gets a *ticket* = the number of steps scheduled so
far, and may be unmapped only once that many steps have executed.

Invariant: ``executed <= scheduled``; ``passed(t)`` is monotone in time for a fixed ``t``.
Every ``begin_step`` must eventually be matched by one ``end_step`` (vLLM's engine core
calls ``update_from_output`` once for every ``schedule`` in both its sync and batch-queue
loops). When nothing is in flight (``executed == scheduled``) every ticket has passed.

`EngineStepFence` adds what an engine knows about its steps: a step marked as touching no
KV memory holds no ticket. Engine-agnostic policy (no engine is imported here); the vLLM
adapter builds every elastic pool's fence from it and marks vLLM's empty steps.
"""

from __future__ import annotations

import threading

from kvcached.errors import InvariantError


class StepFence:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.scheduled = 0
        self.executed = 0

    def begin_step(self) -> int:
        """A step is being scheduled; returns its sequence number (1-based)."""
        with self._lock:
            self.scheduled += 1
            return self.scheduled

    def end_step(self) -> None:
        """The oldest in-flight step has executed and its output was processed."""
        with self._lock:
            if self.executed >= self.scheduled:
                raise InvariantError(
                    f"StepFence: end_step without a scheduled step "
                    f"(scheduled={self.scheduled}, executed={self.executed})"
                )
            self.executed += 1

    def ticket(self) -> int:
        """Ticket for something released now: the last step that may still use it."""
        with self._lock:
            return self.scheduled

    def passed(self, ticket: int) -> bool:
        with self._lock:
            return self.executed >= ticket

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self.scheduled - self.executed


class EngineStepFence(StepFence):
    """A `StepFence` that knows which in-flight steps cannot touch KV memory.

    An engine that schedules one step ahead (vLLM's batch-queue loop under async
    scheduling) may schedule a step with no work (every running request is already
    scheduled) and then stop stepping once no request is unfinished: that empty step stays
    queued, unexecuted, until the next request arrives. A page released meanwhile would be
    ticketed for it and stay mapped for as long as the engine idles. A step that schedules
    no tokens, no copies, no zeroing and no connector work reads and writes no block, so
    the engine's adapter marks it (`mark_kv_free`) and `ticket` skips such steps: it is the
    newest in-flight step that may touch KV, or the last executed one if none may.

    Invariant: every step in ``_kv_free`` is in flight (``executed < step <= scheduled``).
    A step is marked only after it was scheduled, so anything released while it was being
    scheduled already holds its ticket (conservative).
    """

    def __init__(self) -> None:
        super().__init__()
        self._kv_free: set[int] = set()

    def mark_kv_free(self, step: int) -> None:
        """Step ``step`` (scheduled, not yet executed) reads and writes no KV block."""
        with self._lock:
            if not self.executed < step <= self.scheduled:
                raise InvariantError(
                    f"step {step} is not in flight (scheduled={self.scheduled}, executed={self.executed})"
                )
            self._kv_free.add(step)

    def end_step(self) -> None:
        super().end_step()
        with self._lock:
            self._kv_free.discard(self.executed)

    def ticket(self) -> int:
        with self._lock:
            step = self.scheduled
            while step > self.executed and step in self._kv_free:
                step -= 1
            return step
