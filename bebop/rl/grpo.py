"""GRPO learner: group-normalised advantages and a clipped importance-weighted policy loss.

How this differs from canonical GRPO (DeepSeekMath):
  - the importance ratio is π_θ / π_behaviour with the **behaviour log-probs recorded by the
    sampler** (not a recomputed "old policy"), so asynchronous, stale rollouts are corrected;
  - one gradient step per rollout batch (no inner PPO epochs);
  - token-level averaging over the whole batch by default (DAPO), sequence-level optional;
  - asymmetric clipping [1 − clip_low, 1 + clip_high] (DAPO's clip-higher);
  - the KL penalty to a reference policy is optional (k3 estimator) and off by default; the
    reference is the policy at RL start, and its log-probs are computed inside the learner's step
    (one extra forward, no backward, under stop_gradient) on the batch already on the device --
    cheaper than a pass in the rollout worker, which would compete with decoding and ship an
    extra [B, S] array;
  - advantages (r − mean_G) / (std_G + ε), or r − mean_G without the std (Dr. GRPO).
Log-probs are those of the distribution the sampler drew from (`sampling.stats_logprobs`:
temperature, then top-k, then top-p, renormalised over that support), so on-policy the ratio is
exactly 1 for any top-p / top-k. The KL term uses the temperature-scaled distributions without
the truncation (a truncated reference would put −∞ on tokens outside its support).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop import sampling
from bebop.sampling import SamplingConfig


def advantages(rewards_PxG: np.ndarray, std_norm: bool = True, eps: float = 1e-6) -> np.ndarray:
    centred = rewards_PxG - rewards_PxG.mean(axis=1, keepdims=True)
    if not std_norm:
        return centred
    return centred / (rewards_PxG.std(axis=1, keepdims=True) + eps)


def _logits(graphdef, params, tokens_BxS):
    """float32 logits `[B, S - 1, V]` of tokens[:, 1:]; the head in the compute dtype with float32
    accumulation (`Policy.head_compute`)."""
    policy, xn_BxTxD = _normed_hidden(graphdef, params, tokens_BxS)
    return policy.head_compute(xn_BxTxD)


def _at_tokens(logp_BxTxV, tokens_BxS):
    """log-prob of tokens[t] at every t >= 1, position 0 padded with 0: aligned with tokens."""
    logp = jnp.take_along_axis(logp_BxTxV, tokens_BxS[:, 1:, None], axis=-1)[..., 0]
    return jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], 1)


def untruncated(scfg: SamplingConfig) -> SamplingConfig:
    """The sampler's temperature without its top-k / top-p (what the KL term compares)."""
    return dataclasses.replace(scfg, top_k=0, top_p=1.0)


def token_logprobs(graphdef, params, tokens_BxS, scfg: SamplingConfig):
    """log π(tokens[t] | tokens[<t]) at every position t >= 1 (position 0 gets 0) under the
    distribution the sampler draws from (`scfg`: temperature, top-k, top-p), and its entropy at
    each position. Float32. A token outside the support gets −∞ (ratio 0: only off-policy)."""
    return _token_stats(_logits(graphdef, params, tokens_BxS), tokens_BxS, scfg)


def _token_stats(logits_BxTxV, tokens_BxS, scfg):
    logp_all = sampling.stats_logprobs(logits_BxTxV, scfg)
    ent = jax.lax.stop_gradient(sampling.entropy(logp_all))
    pad = jnp.zeros_like(tokens_BxS[:, :1], jnp.float32)
    return _at_tokens(logp_all, tokens_BxS), jnp.concatenate([pad, ent], 1)


def k3_kl(logits_BxTxV, ref_logits_BxTxV, tokens_BxS, scfg: SamplingConfig):
    """Per-token k3 estimate of KL(π‖π_ref) at the sampled tokens, r − log r − 1 with
    r = π_ref / π (≥ 0, exactly 0 where π = π_ref), on the untruncated distributions; the
    reference is under stop_gradient."""
    full = untruncated(scfg)
    logp = _at_tokens(sampling.stats_logprobs(logits_BxTxV, full), tokens_BxS)
    ref = jax.lax.stop_gradient(sampling.stats_logprobs(ref_logits_BxTxV, full))
    d = _at_tokens(ref, tokens_BxS) - logp
    return jnp.maximum(jnp.expm1(d) - d, 0.0)  # expm1 and the floor: no float32 round-off < 0


def _normed_hidden(graphdef, params, tokens_BxS):
    """(policy module, final-normed last-layer hiddens `[B, S - 1, D]` of the inputs
    tokens[:, :-1], in the compute dtype): what the head turns into the logits of tokens[:, 1:]."""
    policy = nnx.merge(graphdef, params)
    inputs = tokens_BxS[:, :-1]
    pos = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    hidden_BxTxD, _ = policy.hidden(inputs, pos)
    return policy, policy.final_norm(hidden_BxTxD)


def chunked_token_stats(
    graphdef, params, tokens_BxS, scfg: SamplingConfig, chunk: int, ref_params=None
):
    """`token_logprobs` (log-prob and entropy at every position) and, with `ref_params`, the
    `k3_kl` term, from `chunk` positions at a time: per chunk the head (compute-dtype operands,
    float32 accumulation: `Policy.head_compute`), the log-softmax with temperature / top-k / top-p
    (`sampling.stats_logprobs`) and the token's log-prob, in a `lax.map` whose body is under
    `jax.checkpoint`, so neither the forward nor the backward holds more than one chunk's
    `[B, chunk, V]` float32 logits. The same per-position arithmetic as the unchunked functions.
    Returns (logp_BxS, entropy_BxS, kl_BxS or None), aligned with tokens (position 0: 0)."""
    policy, xn_BxTxD = _normed_hidden(graphdef, params, tokens_BxS)
    ref = None
    if ref_params is not None:
        ref_policy, ref_xn = _normed_hidden(graphdef, ref_params, tokens_BxS)
        ref = (ref_policy, jax.lax.stop_gradient(ref_xn))
    targets_BxT = tokens_BxS[:, 1:]
    b, t = targets_BxT.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def chunks(x):  # [B, T, ...] -> [N, B, chunk, ...] (padded positions: zeros, dropped below)
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

    full = untruncated(scfg)

    @jax.checkpoint
    def one(args):
        xn, tgt = args[0], args[1]
        logits = policy.head_compute(xn)
        logp_all = sampling.stats_logprobs(logits, scfg)
        logp = jnp.take_along_axis(logp_all, tgt[..., None], axis=-1)[..., 0]
        ent = jax.lax.stop_gradient(sampling.entropy(logp_all))
        if ref is None:
            return logp, ent, jnp.zeros_like(logp)
        pick = lambda lp: jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]  # noqa: E731
        logp_full = pick(sampling.stats_logprobs(logits, full))
        ref_logits = jax.lax.stop_gradient(ref[0].head_compute(args[2]))
        d = jax.lax.stop_gradient(pick(sampling.stats_logprobs(ref_logits, full))) - logp_full
        return logp, ent, jnp.maximum(jnp.expm1(d) - d, 0.0)

    xs = (chunks(xn_BxTxD), chunks(targets_BxT)) + (() if ref is None else (chunks(ref[1]),))
    outs = jax.lax.map(one, xs)
    zero = jnp.zeros((b, 1), jnp.float32)
    logp, ent, kl = (
        jnp.concatenate([zero, o.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]], 1) for o in outs
    )
    return logp, ent, (None if ref is None else kl)


def chunk_weight(agg: str):
    """The denominator of `policy_loss`'s mean over a batch (chunk): its response tokens under
    token aggregation, its rows under sequence aggregation -- the weights that make gradient
    accumulation over row chunks (`rl.microbatch`) equal to one pass over the whole batch (its
    token-mean metrics are then row-weighted across chunks under sequence aggregation)."""
    if agg == "token":
        return lambda b: b.mask.sum()
    return lambda b: b.mask.shape[0]


def policy_loss(
    graphdef,
    params,
    batch,
    clip_low,
    clip_high,
    kl_coef,
    agg,
    scfg: SamplingConfig,
    ref_params=None,
    logit_chunk: int = 0,
):
    """`batch`: a `loop.LearnerBatch` (tokens [B, S], mask [B, S] 1 on response tokens,
    behaviour_logp [B, S] aligned with tokens, adv [B]). `scfg`: the rollout sampler's config (its
    support defines the log-probs). With kl_coef > 0, `ref_params`: the reference policy.
    `logit_chunk` > 0 (`rl.logit_chunk`): the log-probs, entropy and KL from that many positions
    at a time (`chunked_token_stats`), never a `[B, S, V]` float32 array."""
    tokens = batch.tokens
    if kl_coef > 0 and ref_params is None:
        raise ValueError("rl.kl_coef > 0: the GRPO loss needs the reference policy's params")
    if logit_chunk:
        logp, ent, kl = chunked_token_stats(
            graphdef, params, tokens, scfg, logit_chunk, ref_params if kl_coef > 0 else None
        )
    else:
        logits = _logits(graphdef, params, tokens)
        logp, ent = _token_stats(logits, tokens, scfg)
        if kl_coef > 0:
            ref_logits = jax.lax.stop_gradient(_logits(graphdef, ref_params, tokens))
            kl = k3_kl(logits, ref_logits, tokens, scfg)
    mask = batch.mask
    ratio = jnp.exp(logp - batch.behaviour_logp)
    adv = batch.adv[:, None]
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    obj = jnp.minimum(ratio * adv, clipped * adv)
    per_tok = -obj
    n = jnp.maximum(mask.sum(), 1.0)
    metrics = {}
    if kl_coef > 0:
        per_tok = per_tok + kl_coef * kl
        metrics["kl"] = (kl * mask).sum() / n
    if agg == "token":
        loss = (per_tok * mask).sum() / n
    else:  # sequence: mean over each sequence's tokens, then over sequences
        per_seq = (per_tok * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
        loss = per_seq.mean()
    was_clipped = (jnp.abs(ratio - clipped) > 0) & (ratio * adv > clipped * adv)
    metrics.update(
        {
            "entropy": (ent * mask).sum() / n,
            "clip_frac": (was_clipped * mask).sum() / n,
            "ratio_mean": (ratio * mask).sum() / n,
            "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
            "ratio_min": jnp.min(jnp.where(mask > 0, ratio, jnp.inf)),
        }
    )
    return loss, metrics
