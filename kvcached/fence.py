"""StepFence: when may a page whose blocks are all free be unmapped?

The scheduler hands block ids to steps that run later (one step ahead under async
scheduling; copy-on-write retentions are released right after scheduling, before the
worker has run the copy). A page emptied now may still be read or written by any step
scheduled so far. So an emptied page gets a *ticket* = the number of steps scheduled so
far, and may be unmapped only once that many steps have executed.

Invariant: ``executed <= scheduled``; ``passed(t)`` is monotone in time for a fixed ``t``.
Every ``begin_step`` must eventually be matched by one ``end_step`` (vLLM's engine core
calls ``update_from_output`` once for every ``schedule`` in both its sync and batch-queue
loops). When nothing is in flight (``executed == scheduled``) every ticket has passed.
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
