"""Tail-aware decoding: when the live rows of a batch fall to half, continue with half the rows.

A decode loop runs every row until the longest one ends; an RL batch whose median response is
half its longest wastes about half its compute on finished rows. `run` is the host-level driver
both samplers share (`sampling.sample_compacted`, `spec_compacted.sample_compacted`): it runs
the sampler's jitted while-loop at batch b until at most b/2 rows are live (the bound is a traced
argument: one compilation per bucket size b, b/2, b/4, ... down to `min_bucket`), gathers the
live rows, padded to exactly b/2 with distinct finished ones, out of every batch-leading leaf of
the loop state (the state's scalar counter is shared), and goes on. Below `min_bucket` the last
bucket runs to the end. Each row's results are scattered back to its original row at every
compaction and at the end (a padded finished row writes back what it already held).

Every row draws from its own key stream, carried in the state with its row, so compaction never
changes a sample. The arithmetic can differ: XLA's CPU matmuls are not bit-identical across batch
sizes (measured: a dim-128, vocab-512 policy's logits moved by up to 1.7e-5 between batch 16 and
batches 8 .. 1; the tests' smaller policies: at most 1e-6 in any output), so log-probs and
entropies agree to that order (the tests use 1e-5), and a token drawn within that distance of a
sampling boundary could in principle differ (never observed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np


def bucket_sizes(batch: int, min_bucket: int) -> list[int]:
    """The compiled batch sizes: `batch`, then halves while they are at least `min_bucket`."""
    sizes = [batch]
    while sizes[-1] // 2 >= max(min_bucket, 1):
        sizes.append(sizes[-1] // 2)
    return sizes


def live_first(live_B: np.ndarray, size: int) -> np.ndarray:
    """`size` distinct row indices, every live row first (stable: rows keep their order)."""
    if live_B.sum() > size:
        raise ValueError(f"{int(live_B.sum())} live rows do not fit a bucket of {size}")
    return np.argsort(~live_B, kind="stable")[:size].astype(np.int32)


@jax.jit
def gather_rows(state, idx_b):
    """Rows `idx_b` of every batch-leading leaf; scalar leaves (loop counters) are shared."""
    return jax.tree.map(lambda x: x if x.ndim == 0 else x[idx_b], state)


@jax.jit
def scatter_rows(full, part, orig_b):
    """Writes the per-row leaves of `part` back into `full` at original rows `orig_b`."""
    return jax.tree.map(lambda f, p: f.at[orig_b].set(p), full, part)


def run(
    state,
    advance: Callable,
    live: Callable,
    results: Callable,
    min_bucket: int,
    regroup: Callable | None = None,
):
    """Runs a decode loop with compaction; returns `results` of every row in the original order.

    `advance(state, min_live)` runs the jitted loop while more than `min_live` rows are live (0:
    to the end); `live(state)` -> bool `[b]`: rows that still decode; `results(state)` -> a
    pytree of per-row arrays (batch first); `regroup(state, size)`: optional, called after each
    compaction to adapt the state to the new bucket size (e.g. another draft length)."""
    sizes = bucket_sizes(live(state).shape[0], min_bucket)
    orig_b = np.arange(sizes[0], dtype=np.int32)
    full = None
    for next_size in sizes[1:] + [0]:  # 0: the last bucket runs to the end
        state = advance(state, next_size)
        part = results(state)
        full = part if full is None else scatter_rows(full, part, orig_b)
        live_B = np.asarray(live(state))
        if not next_size or not live_B.any():
            break
        idx_b = live_first(live_B, next_size)
        state, orig_b = gather_rows(state, idx_b), orig_b[idx_b]
        if regroup is not None:
            state = regroup(state, next_size)
    return full


# ----------------------------------------------------------------------------- draft length


def draft_for_batch(table: Sequence[tuple[int, int]], batch: int, default: int) -> int:
    """γ of a bucket of `batch` rows from (batch size, γ) pairs: that of the largest batch size
    <= `batch`; `default` when every batch size in the table is larger (or it is empty)."""
    fits = [(b, g) for b, g in table if b <= batch]
    return max(fits)[1] if fits else default


def _rates(alpha: float | Sequence[float], num_draft: int) -> list[float]:
    """Per-position acceptance α_1 .. α_γ: a float is the same at every position; a sequence
    shorter than γ is extended with its last entry."""
    if isinstance(alpha, (int, float)):
        return [float(alpha)] * num_draft
    alpha = [float(a) for a in alpha]
    if num_draft and not alpha:
        raise ValueError("per-position acceptance: an empty sequence")
    return (alpha + alpha[-1:] * num_draft)[:num_draft]


def expected_tokens(alpha: float | Sequence[float], num_draft: int) -> float:
    """Tokens per verify: 1 + Σ_{j<=γ} Π_{i<=j} α_i (docs/method.md §2), where α_i is the
    acceptance of draft i given that drafts 1 .. i-1 were accepted (`alpha`: per position, or
    one float for all: then (1 - α^(γ+1)) / (1 - α))."""
    total, run = 1.0, 1.0
    for a in _rates(alpha, num_draft):
        run *= a
        total += run
    return total


def choose_num_draft(
    alpha: float | Sequence[float],
    t_step: float,
    t_verify: Mapping[int, float],
    t_draft: float,
    max_draft: int,
    current: int | None = None,
    margin: float = 0.0,
) -> int:
    """The γ in 0..`max_draft` with the most expected tokens per second at one batch size: γ = 0
    is plain decoding, 1 token per `t_step`; γ >= 1 gives `expected_tokens(alpha, γ)` per cycle of
    `t_verify[γ + 1] + γ * t_draft` (one policy forward over γ+1 tokens, the MTP's catch-up and
    γ-1 chain steps). Ties go to the smaller γ. With `current` (the γ in use), that γ stays
    unless the best one is more than `margin` faster (a fraction): near a tie, a drifting
    acceptance would otherwise flip the choice back and forth.

    Costs: the seconds per iteration `spec_compacted.loop_costs` measures at that batch size
    (`verify_{W}`, `draft`; `t_step` may be `verify_1`); `alpha`: the running acceptance per
    draft position (`RunningAcceptance`), or one rate for all positions (the geometric model,
    which ignores that acceptance falls with the position and so errs towards larger γ)."""
    rates = [1.0 / t_step] + [
        expected_tokens(alpha, g) / (t_verify[g + 1] + g * t_draft) for g in range(1, max_draft + 1)
    ]
    best = 0
    for g in range(1, max_draft + 1):
        if rates[g] > rates[best] * (1 + 1e-9):
            best = g
    if current is not None and 0 <= current <= max_draft:
        if rates[best] <= rates[current] * (1 + margin):
            return current
    return best


def draft_table(
    alpha: float | Sequence[float],
    costs: Mapping[int, dict],
    max_draft: int,
    current: Sequence[tuple[int, int]] = (),
    margin: float = 0.0,
) -> tuple[tuple[int, int], ...]:
    """A `rollout.draft_table` from measured costs: `costs[b]` holds `step`, `draft` and
    `verify_{W}` seconds at batch size b (W = 2 .. max_draft + 1); each b gets
    `choose_num_draft`, keeping its γ in the `current` table unless another is more than
    `margin` faster."""
    now = dict(current)
    table = []
    for b, c in sorted(costs.items()):
        verify = {w: c[f"verify_{w}"] for w in range(2, max_draft + 2)}
        g = choose_num_draft(alpha, c["step"], verify, c["draft"], max_draft, now.get(b), margin)
        table.append((b, g))
    return tuple(table)


class RunningAcceptance:
    """Per-position acceptance over the last `window` rollouts, for the default draft table.

    `add(attempts_Y, accepts_Y)` takes one rollout's counts per draft position (all rows
    pooled: `SpecStats.attempts.sum(0)`, `.accepts.sum(0)`). `rates()`: α_k = Σ accepts_k /
    Σ attempts_k over the window, for k = 1 .. `max_draft`; a position with no attempts in the
    window (no bucket drafted that far lately) keeps its last estimate, or else takes position
    k-1's; None before any rollout drafted."""

    def __init__(self, max_draft: int, window: int = 4):
        if window < 1 or max_draft < 1:
            raise ValueError(f"RunningAcceptance: window={window}, max_draft={max_draft}: >= 1")
        self.max_draft, self.window = max_draft, window
        self.history: list[tuple[np.ndarray, np.ndarray]] = []
        self._last: list[float | None] = [None] * max_draft

    def add(self, attempts_Y, accepts_Y) -> None:
        def pad(x):
            x = np.asarray(x, np.int64)[: self.max_draft]
            return np.pad(x, (0, self.max_draft - len(x)))

        self.history = (self.history + [(pad(attempts_Y), pad(accepts_Y))])[-self.window :]

    def rates(self) -> list[float] | None:
        if not self.history:
            return None
        attempts = sum(h[0] for h in self.history)
        accepts = sum(h[1] for h in self.history)
        for k in range(self.max_draft):
            if attempts[k]:
                self._last[k] = float(accepts[k] / attempts[k])
            elif self._last[k] is None and k:
                self._last[k] = self._last[k - 1]
        return None if self._last[0] is None else [float(a) for a in self._last]
