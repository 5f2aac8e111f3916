"""What the RL stage records per step besides its training metrics: rollout statistics for
`metrics.jsonl`, and per-token draft records for acceptance-vs-entropy studies.

`rl/draft_tokens.bin` is a flat array of `DRAFT_TOKEN_DTYPE` records (little-endian, no header;
read it with `load_draft_tokens` or `np.fromfile(path, DRAFT_TOKEN_DTYPE)`), one per drafted
token that was emitted (accepted, or the rejected one that the residual replaced), for
`rl.draft_log_rows` rows drawn at random from each step's rollout batch:
  step      the learner step whose batch it is (1-based, as `metrics.jsonl`'s `step`)
  row       the row in that batch (rows come in groups of `rl.group_size` per prompt)
  pos       the token's index in the response
  k         its draft position in the verify cycle, 0-based (0: drafted from the backbone hidden)
  accepted  1 if the draft was accepted, 0 if rejected
  entropy   entropy of the policy's sampling distribution p at that position (nats)
  alpha     Σ_v min(p, q), the analytic acceptance probability of that draft
On resume the records of steps after the restored checkpoint are dropped (they are redone).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bebop import speculative

DRAFT_TOKEN_DTYPE = np.dtype([
    ("step", "<i4"), ("row", "<i4"), ("pos", "<i4"), ("k", "u1"), ("accepted", "u1"),
    ("entropy", "<f4"), ("alpha", "<f4"),
])  # fmt: skip


def rollout_stats(rewards_N: np.ndarray, group_size: int, sample, spec_out, total=None) -> dict:
    """Per-step figures of one rollout batch: rewards (mean, std, share of groups whose rewards
    are all equal: zero advantage, no gradient), lengths (mean, and rows per length:
    `response_len_hist`), entropy, and with a speculative sampler
    what `speculative.summarize` reports (per-position acceptance, accept-length histogram).
    `rewards_N`: the whole batch's; `sample` / `spec_out`: host arrays of some of its rows,
    whose sums `total` adds up over the processes that hold the others
    (`sharding.sum_over_processes`; default: these are all the rows)."""
    total = total or (lambda sums: sums)
    groups = rewards_N.reshape(-1, group_size)
    lengths = np.asarray(sample.lengths)
    sums = {
        "tokens": np.int64(lengths.sum()),
        # rows per response length 0 .. budget: what the cost model's rollout time reads
        "len_hist": np.bincount(lengths, minlength=np.asarray(sample.tokens).shape[1] + 1),
        "entropy": np.float64(np.asarray(sample.entropy).sum()),
    }
    if spec_out is not None:
        sums["spec"] = speculative.summary_sums(spec_out)
    sums = total(sums)
    stats = {
        "reward_mean": float(rewards_N.mean()),
        "reward_std": float(rewards_N.std()),
        "zero_std_frac": float((groups.std(axis=1) == 0).mean()),
        "response_tokens": int(sums["tokens"]),
        "response_len": float(sums["tokens"] / len(rewards_N)),
        "response_len_hist": [int(n) for n in sums["len_hist"]],
        "rollout_entropy": float(sums["entropy"] / max(1, sums["tokens"])),
    }
    if spec_out is not None:
        summ = speculative.summary_from_sums(sums["spec"])
        stats.update({k: v for k, v in summ.items() if k not in ("mean_entropy", "tokens")})
    return stats


def draft_token_records(spec_out, rows, step: int) -> np.ndarray:
    """`DRAFT_TOKEN_DTYPE` records of the emitted drafted tokens of `rows` of one rollout."""
    rows = np.asarray(rows, np.int64)
    status = np.asarray(spec_out.stats.status)[rows]
    kpos = speculative.draft_positions(status)
    r_i, p_i = np.nonzero(kpos >= 0)
    rec = np.zeros(len(r_i), DRAFT_TOKEN_DTYPE)
    rec["step"], rec["row"], rec["pos"] = step, rows[r_i], p_i
    rec["k"] = kpos[r_i, p_i]
    rec["accepted"] = status[r_i, p_i] == speculative.ACCEPTED
    rec["entropy"] = np.asarray(spec_out.sample.entropy)[rows][r_i, p_i]
    rec["alpha"] = np.asarray(spec_out.stats.overlap)[rows][r_i, p_i]
    return rec


def sample_rows(seed: int, index: int, batch: int, n: int) -> np.ndarray:
    """`n` distinct rows of batch `index`, the same on a rerun."""
    rng = np.random.default_rng([seed, index])
    return np.sort(rng.choice(batch, size=min(n, batch), replace=False))


def append_draft_tokens(path: Path, records: np.ndarray) -> None:
    with Path(path).open("ab") as f:
        records.astype(DRAFT_TOKEN_DTYPE).tofile(f)


def load_draft_tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, DRAFT_TOKEN_DTYPE)


def truncate_draft_tokens(path: Path, step: int) -> None:
    """On resume: drop the records of steps after `step` (as `MetricsWriter.truncate_after`)."""
    path = Path(path)
    if path.exists():
        rec = load_draft_tokens(path)
        rec[rec["step"] <= step].tofile(path)
