"""`kvcached.idle.IdleGrace`: the give-back runs on the engine's thread, once, and only if no
step came since the engine went idle.

``post`` here is what an engine's idle loop is: a queue whose callables the engine's thread
(this test's) runs. Every wait is on that queue, with a deadline, never on speed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest

from kvcached.idle import IdleGrace

DEADLINE_S = 30.0


def _grace(seconds: float) -> tuple[IdleGrace, queue.Queue[Callable[[], None]], list[str]]:
    posted: queue.Queue[Callable[[], None]] = queue.Queue()
    return IdleGrace(seconds, posted.put), posted, []


def test_the_give_back_is_posted_then_runs_on_the_engines_thread_once() -> None:
    grace, posted, ran = _grace(0.01)
    grace.arm(lambda: ran.append(threading.current_thread().name))
    assert grace.armed
    give_back = posted.get(timeout=DEADLINE_S)
    assert ran == [], "the timer's thread only posts"
    give_back()
    assert ran == [threading.current_thread().name] and not grace.armed
    give_back()
    assert len(ran) == 1, "a give-back runs once"


def test_a_step_before_the_grace_runs_out_cancels_it() -> None:
    grace, posted, ran = _grace(3600.0)
    grace.arm(lambda: ran.append("give back"))
    timer = grace._timer
    assert timer is not None
    grace.cancel()
    timer.join(DEADLINE_S)
    assert not timer.is_alive() and not grace.armed and posted.empty() and ran == []


def test_a_step_after_the_give_back_was_posted_makes_it_a_no_op() -> None:
    grace, posted, ran = _grace(0.01)
    grace.arm(lambda: ran.append("give back"))
    give_back = posted.get(timeout=DEADLINE_S)
    grace.cancel()  # a request came while the give-back waited for the engine's thread
    give_back()
    assert ran == [] and not grace.armed


def test_arming_again_supersedes_the_earlier_timer() -> None:
    grace, posted, ran = _grace(0.01)
    grace.arm(lambda: ran.append("first"))
    first = posted.get(timeout=DEADLINE_S)
    grace.arm(lambda: ran.append("second"))
    first()
    posted.get(timeout=DEADLINE_S)()
    assert ran == ["second"]


def test_close_cancels_and_a_grace_needs_time() -> None:
    grace, posted, ran = _grace(3600.0)
    grace.arm(lambda: ran.append("give back"))
    grace.close()
    assert not grace.armed and posted.empty()
    with pytest.raises(ValueError, match="seconds > 0"):
        IdleGrace(0.0, posted.put)
