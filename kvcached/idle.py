"""The idle grace: an idle engine's deferred give-back, run on the engine's own thread.

An engine whose last request ended gives back memory other engines may want (the
cached-block cap, `kvcached.integration.vllm.block_pool`). Served traffic runs out of
requests for milliseconds all the time (a wave of equal requests ending together, the
client's next ones still on their way), and giving the prefix cache back at each such gap
loses it for nothing. `IdleGrace` defers that give-back until the engine has stayed idle for
``seconds``.

An idle engine takes no step, so something must wake it: a `threading.Timer` that, when it
runs out, hands the give-back to ``post``, which runs callables *on the engine's thread*
while the engine is idle (vLLM: `EngineCoreProc`'s idle callbacks and a wake-up on its input
queue, `kvcached.integration.vllm.engine.idle_post`). The timer's thread only posts; the
give-back touches the pool (and vLLM's prefix-cache metadata) on the thread that steps it,
so it never races a step.

Invariants: at most one timer is armed. Every call but the timer's own runs on the engine's
thread. `cancel` (each busy step, `close`) makes both an armed timer and a give-back
already posted no-ops: the posted callable checks, on the engine's thread, that nothing
cancelled or re-armed the grace since its timer was armed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

#: Hands a callable to the engine's thread, to run there while the engine is idle.
Post = Callable[[Callable[[], None]], None]


class IdleGrace:
    """Run ``action`` once the engine has been idle for ``seconds`` (`arm`), unless a step
    comes first (`cancel`)."""

    __slots__ = ("_generation", "_post", "_timer", "seconds")

    def __init__(self, seconds: float, post: Post) -> None:
        if not seconds > 0:
            raise ValueError(f"an idle grace needs seconds > 0, got {seconds!r}")
        self.seconds = seconds
        self._post = post
        self._timer: threading.Timer | None = None
        #: Bumped by every `arm` and `cancel`: a posted give-back runs only if it is still current.
        self._generation = 0

    @property
    def armed(self) -> bool:
        """Whether a give-back is pending (its timer running, or posted and not yet run)."""
        return self._timer is not None

    def arm(self, action: Callable[[], None]) -> None:
        """The engine went idle: run ``action`` after ``seconds`` on the engine's thread,
        unless `cancel` (or another `arm`) comes first."""
        self.cancel()
        self._generation += 1
        timer = threading.Timer(self.seconds, self._expired, (self._generation, action))
        timer.daemon = True  # an engine that exits while idle does not wait for it
        self._timer = timer
        timer.start()

    def cancel(self) -> None:
        """A step came (or the pool closes): the pending give-back, if any, will not run."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._generation += 1

    close = cancel

    def _expired(self, generation: int, action: Callable[[], None]) -> None:
        """On the timer's thread: hand the give-back to the engine's thread."""
        if generation == self._generation:
            self._post(functools.partial(self._run, generation, action))

    def _run(self, generation: int, action: Callable[[], None]) -> None:
        """On the engine's thread, idle: the give-back, if nothing came since it was armed."""
        if generation != self._generation:
            return
        self._timer = None
        self._generation += 1  # once: a second call of the same give-back is a no-op
        action()
