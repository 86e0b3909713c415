"""``ckptlib.fits``: the power-law and log fits of peak memory against n (notebook 05, the
benchmark's scaling figure) recover what they were given and refuse what they cannot fit."""

from __future__ import annotations

import math
import random

import pytest

from ckptlib.fits import fit_log, fit_power_law


def test_power_law_fit_recovers_the_exponent_from_noisy_data():
    rng = random.Random(0)
    ns = [16, 32, 64, 128, 256]
    values = [3e5 * n**0.5 * (1 + rng.uniform(-0.02, 0.02)) for n in ns]
    fit = fit_power_law(ns, values)
    assert fit["exponent"] == pytest.approx(0.5, abs=0.02)
    assert fit["coefficient"] == pytest.approx(3e5, rel=0.1)
    assert fit["r2"] > 0.99
    linear = fit_power_law(ns, [7 * n for n in ns])
    assert linear["exponent"] == pytest.approx(1.0) and linear["r2"] == pytest.approx(1.0)


def test_log_fit_tells_log_growth_from_square_root_growth():
    ns = [16, 32, 64, 128, 256]
    logarithmic = [1000 + 50 * math.log2(n) for n in ns]
    assert fit_log(ns, logarithmic)["per_doubling"] == pytest.approx(50)
    assert fit_log(ns, logarithmic)["r2"] == pytest.approx(1.0)
    assert fit_log(ns, [100 * n**0.5 for n in ns])["r2"] < 0.97
    assert fit_power_law(ns, logarithmic)["exponent"] < 0.1


@pytest.mark.parametrize(
    "ns, values", [([16], [1.0]), ([16, 16], [1.0, 2.0]), ([0, 16], [1.0, 2.0]), ([16, 32], [1.0])]
)
def test_fits_reject_what_they_cannot_fit(ns, values):
    with pytest.raises(ValueError):
        fit_power_law(ns, values)
