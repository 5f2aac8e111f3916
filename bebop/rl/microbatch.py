"""The learner's microbatch from a memory budget (`rl.microbatch=-1`).

`learner_row_bytes` estimates the activation bytes one row (one rollout, `seq_len` tokens) costs
the GRPO step at its peak -- what the backward keeps per layer under `model.remat`, the one
block being recomputed and differentiated, the attention scores by `model.attention`, and the
log-prob / entropy / KL arrays by `rl.logit_chunk` --, and `auto_microbatch` picks the largest
number of rows per gradient-accumulation chunk whose rows per device fit `rl.memory_budget_gb`.
An estimate, not a measurement: `benchmarks.memory` compiles the step and reads XLA's figure.
Against `memory_analysis()` of the compiled gradient of `grpo.policy_loss` on XLA:CPU
(2026-12-04; D=256, 4 layers, H=4, K=2, Dh=64, F=768, V=4096, 4 rows x 257 tokens): within 10 %
with the accelerator configs' knobs (bfloat16, block remat, chunked attention and log-probs) and
without any knob in float32; up to 40 % over with float32 remat; 35-40 % under for bfloat16
without remat (XLA:CPU computes bfloat16 elementwise ops in float32).
"""

from __future__ import annotations

import math

from bebop.config import ConfigError, ModelConfig

F32 = 4


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def learner_row_bytes(
    cfg: ModelConfig,
    seq_len: int,
    logit_chunk: int = 0,
    kl: bool = False,
    truncated: bool = False,
) -> int:
    """Estimated peak activation bytes per row of the GRPO learner step (forward + backward) at
    `seq_len` tokens per row, for the model `cfg` (its `dtype`, `remat`, `attention`,
    `attention_chunk`), `logit_chunk` (`rl.logit_chunk`), a KL term (`kl`: a second, reference
    forward and its logits) and top-k / top-p truncation (`truncated`: sorted logits)."""
    t = max(seq_len - 1, 1)  # the learner's positions: tokens[:, :-1] predict tokens[:, 1:]
    c = _itemsize(cfg.dtype)
    d, h, k, dh, f = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffw_dim
    qkv = (h + 2 * k) * dh
    # One block's per-token activations kept for its backward: the residual and normed inputs,
    # q/k/v (projected, normed, rotated; RoPE works in float32), the attention output and its
    # projection, the MLP's normed input, gate, up and their product, and the block output.
    per_tok = c * (4 * d + 3 * qkv + h * dh + 3 * f + d) + F32 * (h + k) * dh
    # Scores per row: kept for the backward, and alive while one block is differentiated
    # (scores, probabilities and their cotangent, float32).
    if cfg.attention in ("xla", "dot_product"):
        kept_scores = t * t * h * (F32 + c)  # float32 probabilities and their compute-dtype copy
        live_scores = t * t * h * (2 * F32 + c)
    elif cfg.attention == "chunked":
        kept_scores = 0  # each chunk is recomputed in the backward
        live_scores = min(cfg.attention_chunk, t) * t * h * (2 * F32 + c)
    else:  # cudnn: the flash kernel keeps one float32 log-sum-exp per query and head
        kept_scores = live_scores = t * h * F32
    block = t * per_tok + kept_scores
    if cfg.remat in ("none", "everything_saveable"):
        saved = block
    elif cfg.remat in ("block", "nothing_saveable"):
        saved = t * c * d  # the block's input
    else:  # dots_saveable / dots_with_no_batch_dims_saveable: the matmul outputs
        saved = t * c * (qkv + 2 * d + 2 * f)
        if cfg.remat == "dots_saveable" and cfg.attention in ("xla", "dot_product"):
            saved += t * t * h * c  # the score and probability-times-value einsums have batch dims
    # The block being differentiated: its activations, the cotangents alive, its live scores.
    live = 3 * t * per_tok // 2 + live_scores
    # Log-probs: float32 logits, log-softmax and the logits' cotangent per position (the
    # entropy's exp fuses); a sort for top-k / top-p; the reference's logits and untruncated
    # log-softmax.
    per_pos = F32 * cfg.vocab_size * (3 + (2 if truncated else 0) + (3 if kl else 0))
    positions = min(logit_chunk, t) if logit_chunk else t
    logits = positions * per_pos
    # Embeddings, the final norm's output and their cotangents (float32 where the head starts).
    ends = t * d * (c + F32) * 2
    forwards = 2 if kl else 1  # the reference forward (no backward) holds its last hidden
    return int(cfg.num_layers * saved + live + logits + ends + (forwards - 1) * t * d * c)


def auto_microbatch(
    rows: int, row_bytes: int, budget_bytes: float, batch_shards: int = 1, fixed_bytes: int = 0
) -> int:
    """The largest microbatch (rows per gradient-accumulation chunk) dividing `rows` whose rows
    on one device (`ceil(m / batch_shards)`: the rows are split over `batch_shards` devices)
    times `row_bytes`, plus `fixed_bytes`, fit `budget_bytes`. Microbatches that split evenly
    over the devices come first. A `ConfigError` naming `rl.memory_budget_gb` when not even one
    row per device fits."""
    if rows < 1 or row_bytes < 1 or batch_shards < 1:
        raise ValueError(f"auto_microbatch: rows={rows}, row_bytes={row_bytes}, {batch_shards=}")
    divisors = [m for m in range(1, rows + 1) if rows % m == 0]
    even = [m for m in divisors if m % batch_shards == 0]
    need = lambda m: math.ceil(m / batch_shards) * row_bytes + fixed_bytes  # noqa: E731
    for group in (even, divisors):
        fits = [m for m in group if need(m) <= budget_bytes]
        if fits:
            return max(fits)
    smallest = min(even or divisors)
    raise ConfigError(
        f"config key 'rl.memory_budget_gb': {budget_bytes / 1e9:.3g} GB per device does not hold "
        f"the learner step's activations at the smallest microbatch ({smallest} row(s) over "
        f"{batch_shards} device(s): an estimated {need(smallest) / 1e9:.3g} GB); raise the "
        "budget, shorten the rows (rollout.max_new_tokens), or turn on model.remat / "
        "model.attention='chunked' / rl.logit_chunk"
    )
