"""Percentiles, medians and the number format of the scripts' tables."""

from __future__ import annotations

import statistics


def percentile(sorted_vals, q: float):
    if not sorted_vals:
        return None
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


def fmt(v, nd=1):
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)
