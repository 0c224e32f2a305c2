"""The statistics of a verdict, written once (notebook 04, section 8 teaches them; 05-08 call them).

A verdict compares two things measured under the same conditions: two settings run with the same seeds, or two
timings taken back to back in one repeat. Pairing removes what the pairs share (the seed's data order, the machine's
load at that moment), so the question is asked of the differences (or ratios) within pairs:

- `paired(a, b)`: the differences a_i - b_i, their mean and standard deviation, Student's paired t and its two-sided
  p-value (are the differences centred away from 0?), and the sign test (in how many pairs is a above b, and how
  likely that count is if the order were a coin toss);
- `ratios(a, b)`: timings, as the median and range of the paired ratios a_i / b_i (never an absolute time);
- `say(result, a_name, b_name, unit)`: one sentence that claims no more than the numbers.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Numerical Recipes, 6.4)."""
    if x <= 0.0 or x >= 1.0:
        return min(max(x, 0.0), 1.0)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only: use the symmetry
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    c, d, f = 1.0, 1.0 - (a + b) * x / (a + 1), 0.0
    d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
    f = d
    for m in range(1, 200):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
            c = 1.0 + numerator / c
            c = c if abs(c) > 1e-300 else 1e-300
            f *= c * d
        if abs(c * d - 1.0) < 1e-12:
            break
    return front * f


def t_two_sided_p(t: float, dof: int) -> float:
    """P(|T| >= |t|) for Student's t with `dof` degrees of freedom."""
    return _incomplete_beta(dof / (dof + t * t), dof / 2, 0.5)


def sign_test_p(k: int, n: int) -> float:
    """Two-sided exact p of k of n pairs falling one way when each way has probability 1/2."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
    """The paired comparison of a and b (same length, pair i measured under the same conditions)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired() needs two sequences of the same length >= 2, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    n, mean, sd = len(diffs), statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0:  # every pair differs by the same amount: nothing to weigh it against
        t, p_t = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        t = mean / (sd / math.sqrt(n))
        p_t = t_two_sided_p(t, n - 1)
    above, below = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return {"n": n, "mean_diff": mean, "sd_diff": sd, "t": t, "p_t": p_t, "above": above, "below": below,
            "p_sign": sign_test_p(above, above + below)}


def ratios(a: Sequence[float], b: Sequence[float]) -> dict:
    """Median, min and max of the paired ratios a_i / b_i (timings of one repeat, taken back to back)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"ratios() needs two sequences of the same, non-zero length, got {len(a)} and {len(b)}")
    values = [x / y for x, y in zip(a, b)]
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def say(result: dict, a_name: str, b_name: str, unit: str = "", alpha: float = 0.05) -> str:
    """One sentence for a `paired` result: direction, consistency, size, and what n pairs can and cannot say.

    The verdict is the paired t-test's; the sign test is reported beside it (with 5 pairs it can never fall below
    0.0625, so it alone could not decide)."""
    n, mean = result["n"], result["mean_diff"]
    side = "higher" if mean > 0 else "lower"
    count = result["above"] if mean > 0 else result["below"]
    numbers = (f"{a_name} {side} than {b_name} in {count} of {n} pairs, mean difference {mean:+.3g}{unit} "
               f"(sd {result['sd_diff']:.2g}), paired t = {result['t']:.2f}, p = {result['p_t']:.2g} "
               f"(sign test p = {result['p_sign']:.2g})")
    if result["p_t"] < alpha:
        return numbers + f": a difference at this scale ({n} pairs, p < {alpha})."
    return numbers + f": no difference these {n} pairs can show (p >= {alpha})."
