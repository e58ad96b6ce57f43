"""The retrial's rule for a served token difference: native chose it in a retrial, or it lies
within the noise native's own concurrent requests showed in the same run."""

from __future__ import annotations

from conformance.serving.retrial import Difference, NoiseFloor


def _d(margin: float, *, first: int = 5, reproduced: int = 0) -> Difference:
    return Difference(0, 0, first, 7, 8, margin, retrials=8, reproduced=reproduced)


def test_a_difference_within_natives_own_noise_is_explained_and_one_above_it_is_not() -> None:
    noise = NoiseFloor.of([_d(0.0), _d(0.03125), _d(-1.0, first=-1)])  # another length does not count
    assert noise.margin == 0.03125
    assert _d(0.03125).explained_by(noise) and _d(0.0).explained_by(noise)
    assert not _d(0.05).explained_by(noise)  # above it: only a retrial explains it
    assert _d(0.75, reproduced=1).explained_by(noise)
    assert not _d(-1.0, first=-1).explained_by(noise)  # a failed or shorter output never is
    none = NoiseFloor.of([])  # native never differed: nothing is within its noise
    assert none.margin is None and not _d(0.0).explained_by(none) and _d(0.0, reproduced=2).explained_by(none)
