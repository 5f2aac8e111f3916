"""GRPO learner: group-normalised advantages and a clipped importance-weighted policy loss.

How this differs from canonical GRPO (DeepSeekMath):
  - the importance ratio is π_θ / π_behaviour with the **behaviour log-probs recorded by the
    sampler** (not a recomputed "old policy"), so asynchronous, stale rollouts are corrected;
  - one gradient step per rollout batch (no inner PPO epochs);
  - token-level averaging over the whole batch by default (DAPO), sequence-level optional;
  - asymmetric clipping [1 − clip_low, 1 + clip_high] (DAPO's clip-higher);
  - the KL penalty to a reference policy is optional (k3 estimator) and off by default;
  - advantages (r − mean_G) / (std_G + ε), or r − mean_G without the std (Dr. GRPO).
Log-probs are of the temperature-scaled policy (the sampler's top-k / top-p truncation is not
reapplied here; keep top_p = 1 and top_k = 0 for exact ratios).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bebop import model


def advantages(rewards_PxG: np.ndarray, std_norm: bool = True, eps: float = 1e-6) -> np.ndarray:
    centred = rewards_PxG - rewards_PxG.mean(axis=1, keepdims=True)
    if not std_norm:
        return centred
    return centred / (rewards_PxG.std(axis=1, keepdims=True) + eps)


def token_logprobs(graphdef, params, tokens_BxS, temperature: float):
    """log π(tokens[t] | tokens[<t]) at every position t >= 1 (position 0 gets 0), and the
    entropy of π at each position. Float32."""
    inputs = tokens_BxS[:, :-1]
    pos = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    logits, _ = model.forward(graphdef, params, inputs, pos)
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / max(temperature, 1e-6), axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens_BxS[:, 1:, None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros_like(tokens_BxS[:, :1], jnp.float32)
    return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, ent], 1)


def policy_loss(graphdef, params, batch, clip_low, clip_high, kl_coef, agg, temperature):
    """batch: tokens [B, S], mask [B, S] (1 on response tokens), behaviour_logp [B, S] (aligned
    with tokens), adv [B], optionally ref_logp [B, S]."""
    logp, ent = token_logprobs(graphdef, params, batch["tokens"], temperature)
    mask = batch["mask"]
    ratio = jnp.exp(logp - batch["behaviour_logp"])
    adv = batch["adv"][:, None]
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    obj = jnp.minimum(ratio * adv, clipped * adv)
    per_tok = -obj
    if kl_coef > 0:
        d = batch["ref_logp"] - logp
        per_tok = per_tok + kl_coef * (jnp.exp(d) - d - 1.0)  # k3 estimator of KL(π‖π_ref)
    if agg == "token":
        loss = (per_tok * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    else:  # sequence: mean over each sequence's tokens, then over sequences
        per_seq = (per_tok * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
        loss = per_seq.mean()
    n = jnp.maximum(mask.sum(), 1.0)
    was_clipped = (jnp.abs(ratio - clipped) > 0) & (ratio * adv > clipped * adv)
    metrics = {
        "entropy": (ent * mask).sum() / n,
        "clip_frac": (was_clipped * mask).sum() / n,
        "ratio_mean": (ratio * mask).sum() / n,
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
        "ratio_min": jnp.min(jnp.where(mask > 0, ratio, jnp.inf)),
    }
    return loss, metrics
