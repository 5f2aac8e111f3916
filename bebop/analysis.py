"""Statistics shared by the studies: a linear fit with bootstrap intervals, Spearman's rank
correlation, binned means and the RS-vs-TO decision-rule check. numpy only; every function takes
plain 1-D arrays."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class LinearFit:
    slope: float
    intercept: float
    r: float  # Pearson correlation
    slope_ci: tuple[float, float]  # bootstrap percentile interval
    intercept_ci: tuple[float, float]
    n: int

    def label(self, unit: str = "") -> str:
        lo, hi = self.slope_ci
        return (
            f"slope {self.slope:+.3f} [{lo:+.3f}, {hi:+.3f}]{unit}, r = {self.r:+.2f}, n = {self.n}"
        )


def _ols(x, y):
    xm, ym = x.mean(), y.mean()
    sxx = ((x - xm) ** 2).sum()
    slope = ((x - xm) * (y - ym)).sum() / sxx if sxx > 0 else 0.0
    return slope, ym - slope * xm


def linear_fit(x, y, n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> LinearFit:
    """Least-squares line y = slope * x + intercept, with `level` bootstrap percentile
    intervals from `n_boot` resamples of the (x, y) pairs."""
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    if x.shape != y.shape or x.size < 3:
        raise ValueError(f"linear_fit needs >= 3 paired values, got x {x.shape}, y {y.shape}")
    slope, intercept = _ols(x, y)
    sx, sy = x.std(), y.std()
    r = float(((x - x.mean()) * (y - y.mean())).mean() / (sx * sy)) if sx > 0 and sy > 0 else 0.0
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, (n_boot, x.size))
    boots = np.array([_ols(x[i], y[i]) for i in idx])
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    s_lo, s_hi = np.percentile(boots[:, 0], q)
    i_lo, i_hi = np.percentile(boots[:, 1], q)
    return LinearFit(
        float(slope),
        float(intercept),
        r,
        (float(s_lo), float(s_hi)),
        (float(i_lo), float(i_hi)),
        int(x.size),
    )


def _ranks(a):
    """Average ranks (ties share the mean of their positions), 1-based."""
    order = np.argsort(a, kind="stable")
    ranks = np.empty(a.size, np.float64)
    ranks[order] = np.arange(1, a.size + 1)
    _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]


def spearman(x, y) -> float:
    """Spearman's ρ: the Pearson correlation of the (tie-averaged) ranks."""
    rx, ry = _ranks(np.asarray(x).ravel()), _ranks(np.asarray(y).ravel())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx**2).sum() * (ry**2).sum())
    return float((rx * ry).sum() / den) if den > 0 else 0.0


def binned(x, y, bins: int = 10, min_count: int = 1):
    """Means of y in `bins` equal-count bins of x: (x centres, y means, counts), bins with fewer
    than `min_count` values dropped."""
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    order = np.argsort(x, kind="stable")
    parts = np.array_split(order, min(bins, max(x.size, 1)))
    xs, ys, ns = [], [], []
    for p in parts:
        if p.size >= min_count and p.size:
            xs.append(x[p].mean())
            ys.append(y[p].mean())
            ns.append(p.size)
    return np.array(xs), np.array(ys), np.array(ns, np.int64)


@dataclasses.dataclass(frozen=True)
class RuleCheck:
    """Per margin bin (see `rule_check`): arrays over the bins that hold enough tokens."""

    margin: np.ndarray  # mean predicted margin Σ min(p, q) − p(argmax q) of the bin's tokens
    measured: np.ndarray  # RS run's accepted share − TO run's, in the bin
    se: np.ndarray  # standard error of `measured`
    tokens: np.ndarray  # drafted tokens of both runs in the bin
    resolved: np.ndarray  # |measured| > z · se: the bin has a measured winner
    correct: np.ndarray  # resolved and the predicted winner (sign of margin) is the measured one

    @property
    def accuracy(self) -> float:
        """Token-weighted share of resolved bins whose winner the rule predicted."""
        n = self.tokens[self.resolved].sum()
        return float(self.tokens[self.correct].sum() / n) if n else float("nan")

    @property
    def resolved_share(self) -> float:
        return float(self.tokens[self.resolved].sum() / max(self.tokens.sum(), 1))


def rule_check(margin_rs, accepted_rs, margin_to, accepted_to, bins=20, min_count=30, z=2.0):
    """Bebop's decision rule, RS beats TO where TV(p, q) < 1 − p(argmax q), i.e. where the
    margin Σ_v min(p, q) − p(argmax q) > 0, tested on measured outcomes: the drafted tokens of an
    RS run (their margins, accepted or not) and of a TO run at the same setting are binned by
    margin (equal-count bins of the pooled margins); in each bin the measured acceptance
    difference (RS − TO) is compared in sign with the bin's mean margin. A bin with fewer than
    `min_count` tokens of either run is dropped; one whose difference is within `z` standard
    errors of 0 is unresolved (a tie at this sample size) and does not count either way."""
    m_rs, a_rs = np.asarray(margin_rs, np.float64), np.asarray(accepted_rs, np.float64)
    m_to, a_to = np.asarray(margin_to, np.float64), np.asarray(accepted_to, np.float64)
    if m_rs.shape != a_rs.shape or m_to.shape != a_to.shape:
        raise ValueError(
            f"rule_check: margins and outcomes differ in shape: RS {m_rs.shape} vs "
            f"{a_rs.shape}, TO {m_to.shape} vs {a_to.shape}"
        )
    pooled = np.concatenate([m_rs, m_to])
    edges = np.unique(np.quantile(pooled, np.linspace(0, 1, bins + 1)))
    b_rs = np.clip(np.searchsorted(edges, m_rs, "right") - 1, 0, len(edges) - 2)
    b_to = np.clip(np.searchsorted(edges, m_to, "right") - 1, 0, len(edges) - 2)
    rows = []
    for b in range(len(edges) - 1):
        r, t = a_rs[b_rs == b], a_to[b_to == b]
        if r.size < min_count or t.size < min_count:
            continue
        diff = r.mean() - t.mean()
        se = np.sqrt(r.var() / r.size + t.var() / t.size)
        margin = np.concatenate([m_rs[b_rs == b], m_to[b_to == b]]).mean()
        rows.append((margin, diff, se, r.size + t.size))
    margin, measured, se, tokens = np.array(rows, np.float64).reshape(-1, 4).T
    resolved = np.abs(measured) > z * se
    correct = resolved & (np.sign(measured) == np.sign(margin))
    return RuleCheck(margin, measured, se, tokens.astype(np.int64), resolved, correct)
