"""The planner's load-matrix reductions: every width's way of summing the phases' maxima gives the same numbers,
so a few columns of a matrix get what the whole matrix gives (the search breaks ties on the tied ranks alone)."""

import numpy as np
import pytest

from embshard.planner import loads


@pytest.mark.parametrize("width", [2, 8, 33, 512, 1500])
def test_phase_max_sum_matches_phase_times_and_columns(width: int) -> None:
    rng = np.random.default_rng(width)
    m = rng.random((loads.NROWS, width)) * rng.random((loads.NROWS, 1)) * 1e-3
    per_phase = rng.random(len(loads.PHASES)) * (rng.random(len(loads.PHASES)) > 0.5) * 1e-4
    whole = loads.phase_max_sum(m, per_phase)
    phases = loads.phase_times(m) + per_phase[:, None]
    ref = phases[0].copy()
    for row in phases[1:]:
        ref += row  # the phases added in order
    assert np.array_equal(whole, ref)
    cols = np.sort(rng.choice(width, size=2, replace=False))
    assert np.array_equal(loads.phase_max_sum(m[:, cols], per_phase), whole[cols])
    assert np.array_equal(loads.phase_max_sum(m), loads.phase_max_sum(m, np.zeros(len(loads.PHASES))))
