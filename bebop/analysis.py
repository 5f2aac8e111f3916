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
    measured: np.ndarray  # mean paired difference: measured RS − TO acceptance, same tokens
    se: np.ndarray  # its standard error (ddof 1)
    tokens: np.ndarray  # drafted tokens in the bin
    resolved: np.ndarray  # a measured winner: |measured| > z · se and ≥ min_effect
    decided: np.ndarray  # resolved and a predicted winner (|margin| ≥ min_effect)
    correct: np.ndarray  # decided, and the predicted winner is the measured one
    dropped: int  # tokens in bins with fewer than `min_count` tokens

    @property
    def accuracy(self) -> float:
        """Token-weighted share of the decided bins whose measured winner the rule predicted."""
        n = self.tokens[self.decided].sum()
        return float(self.tokens[self.correct].sum() / n) if n else float("nan")

    @property
    def resolved_share(self) -> float:
        """Share of all tokens (dropped bins included) in resolved bins."""
        return float(self.tokens[self.resolved].sum() / max(self.tokens.sum() + self.dropped, 1))


def rule_check(
    margin, diff, bins: int = 20, min_count: int = 30, z: float = 3.0, min_effect: float = 1e-3
) -> RuleCheck:
    """Bebop's decision rule, RS beats TO where TV(p, q) < 1 − p(argmax q), i.e. where the
    margin Σ_v min(p, q) − p(argmax q) > 0, against measured outcomes on the same tokens.

    Per drafted token of a speculative run: `margin` and `diff`, a measured RS − TO acceptance
    difference on that token: for a token of an RS run, accepted (0/1) − p(argmax q) (TO's
    analytic acceptance there); of a TO run, Σ min(p, q) − accepted. Tokens are binned by margin
    (equal-count bins); in each bin the mean `diff` is compared in sign with the mean margin
    (`judge_bins`). A bin with fewer than `min_count` tokens is dropped; one whose mean is within
    `z` standard errors of 0, or below `min_effect` in size, is unresolved (a tie at this sample
    size, or a difference of no practical size: near-certain drafts give float-level
    differences with tiny standard errors); a bin whose margin is below `min_effect` predicts no
    winner. Tokens of one sequence are not independent, so the standard error is optimistic;
    z = 3 leaves room for that and for the number of bins.

    What it tests: E[diff | token] equals the margin iff the sampler accepts each draft with its
    rule's analytic probability, so a resolved bin of the wrong sign means the measured
    acceptance departs from Σ min(p, q) / p(argmax q) (a sampler bug, or a q other than the one
    the rule used), not chance. The rule itself is the identity 1 − TV(p, q) = Σ min(p, q)."""
    margin, diff = np.asarray(margin, np.float64), np.asarray(diff, np.float64)
    if margin.shape != diff.shape or margin.ndim != 1:
        raise ValueError(f"rule_check: margin {margin.shape} and diff {diff.shape} differ")
    if margin.size < min_count:
        raise ValueError(f"rule_check: {margin.size} tokens, fewer than min_count={min_count}")
    edges = np.unique(np.quantile(margin, np.linspace(0, 1, bins + 1)))
    idx = np.clip(np.searchsorted(edges, margin, "right") - 1, 0, max(len(edges) - 2, 0))
    rows, dropped = [], 0
    for b in np.unique(idx):
        m, d = margin[idx == b], diff[idx == b]
        if d.size < min_count:
            dropped += d.size
            continue
        rows.append((m.mean(), d.mean(), d.std(ddof=1) / np.sqrt(d.size), d.size))
    m, measured, se, n = np.array(rows, np.float64).reshape(-1, 4).T
    return judge_bins(m, measured, se, n, dropped, z, min_effect)


def judge_bins(margin, measured, se, tokens, dropped=0, z=3.0, min_effect=1e-3) -> RuleCheck:
    """The verdicts of `rule_check` from its per-bin means (e.g. a saved result, re-judged)."""
    m, measured, se = (np.asarray(a, np.float64) for a in (margin, measured, se))
    resolved = (np.abs(measured) > z * se) & (np.abs(measured) >= min_effect)
    predicted = np.where(np.abs(m) >= min_effect, np.sign(m), 0.0)
    decided = resolved & (predicted != 0)
    correct = decided & (np.sign(measured) == predicted)
    tokens = np.asarray(tokens).astype(np.int64)
    return RuleCheck(m, measured, se, tokens, resolved, decided, correct, int(dropped))
