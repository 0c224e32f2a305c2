"""notebooks/verdict.py, the statistics every verdict of 04-08 calls: checked against printed tables' values."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import verdict  # noqa: E402


@pytest.mark.parametrize("t, dof, p", [(2.776445, 4, 0.05), (4.604095, 4, 0.01), (2.228139, 10, 0.05),
                                       (1.959964, 10**6, 0.05), (0.0, 3, 1.0), (12.7062, 1, 0.05)])
def test_t_two_sided_p_matches_the_t_table(t, dof, p):
    assert verdict.t_two_sided_p(t, dof) == pytest.approx(p, rel=1e-4)


def test_sign_test_is_the_exact_binomial():
    assert verdict.sign_test_p(5, 5) == 2 / 32  # 5 of 5 one way can never fall below 0.0625
    assert verdict.sign_test_p(0, 10) == pytest.approx(2 / 1024)
    assert verdict.sign_test_p(3, 6) == 1.0 and verdict.sign_test_p(0, 0) == 1.0


def test_paired_uses_the_differences_not_the_spread_of_each_side():
    a, b = [10.1, 20.2, 30.1, 40.3, 50.2], [10.0, 20.0, 30.0, 40.0, 50.0]  # each side spread wide, differences tight
    r = verdict.paired(a, b)
    assert (r["n"], r["above"], r["below"]) == (5, 5, 0)
    d = [0.1, 0.2, 0.1, 0.3, 0.2]
    mean, sd = sum(d) / 5, math.sqrt(sum((x - 0.18) ** 2 for x in d) / 4)
    assert r["mean_diff"] == pytest.approx(mean) and r["t"] == pytest.approx(mean / (sd / math.sqrt(5)))
    assert r["p_t"] < 0.01 and "a difference at this scale" in verdict.say(r, "a", "b")
    same = verdict.paired([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same["p_t"] == 1.0 and "no difference" in verdict.say(same, "a", "b")
    with pytest.raises(ValueError, match="same length"):
        verdict.paired([1.0, 2.0], [1.0])


def test_ratios_are_paired_and_summarised_by_median_and_range():
    assert verdict.ratios([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == {"n": 3, "median": 3.0, "min": 2.0, "max": 4.0}
