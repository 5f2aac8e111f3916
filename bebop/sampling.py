"""Plain batched sampler: prefill, then one `lax.while_loop` over decode steps.

Prompts are **right-padded** (`pad_prompts`): row b's prompt occupies slots `[0, prompt_lens[b])`,
so token positions equal cache slots and no row needs a position offset. Padded prompt widths are
rounded up to a power of two to bound the number of compilations.

`process_logits` turns raw logits into the log-probabilities of the distribution actually sampled
from (temperature, then top-k, then top-p). With temperature 0 the sampler is greedy (a one-hot),
and the recorded log-probs and entropy are those of the untempered softmax (`stats_logprobs`).
Outputs per generated token: the token, its behaviour log-prob, the entropy of the policy's
(processed) distribution at that step; per row: the number of generated tokens (including the EOS
that ended it). Slots after a row's end hold `pad_id` and zeros.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from bebop import model


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    eos_ids: tuple[int, ...] = (2,)
    pad_id: int = 0


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B, N] int32
    logprobs: jax.Array  # [B, N] float32, behaviour log-prob of each emitted token
    entropy: jax.Array  # [B, N] float32, entropy of the sampling distribution at that step
    lengths: jax.Array  # [B] int32, generated tokens per row (EOS included)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0, bucket: bool = True):
    """Right-pads token lists to a common (power-of-two) width: (tokens_BxP, lengths_B) as numpy."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("pad_prompts: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    width = next_pow2(width) if bucket else width
    out = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)


def process_logits(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probs of the distribution actually sampled from: temperature, then top-k, then top-p;
    -inf outside the support. Temperature 0 is greedy: a one-hot at the argmax."""
    logits = logits_BxV.astype(jnp.float32)
    if cfg.temperature == 0:
        top = jnp.argmax(logits, axis=-1)[..., None]
        return jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, -jnp.inf)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    if cfg.top_p < 1.0:
        sorted_logp = jnp.sort(logp, axis=-1)[..., ::-1]
        cum_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
        keep_sorted = cum_before < cfg.top_p  # always keeps the most likely token
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logp, jnp.inf), axis=-1, keepdims=True)
        logp = jax.nn.log_softmax(jnp.where(logp >= threshold, logp, -jnp.inf), axis=-1)
    return logp


def stats_logprobs(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The distribution whose log-prob and entropy are recorded: the sampling one, except under
    greedy decoding, where the untempered softmax (with the same top-k/top-p) is more useful."""
    if cfg.temperature == 0:
        cfg = dataclasses.replace(cfg, temperature=1.0)
    return process_logits(logits_BxV, cfg)


def entropy(logp_BxV: jax.Array) -> jax.Array:
    p = jnp.exp(logp_BxV)
    return -jnp.sum(jnp.where(p > 0, p * logp_BxV, 0.0), axis=-1)


def draw(rng, logp_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token per row from processed log-probs (argmax when temperature is 0)."""
    if cfg.temperature == 0:
        return jnp.argmax(logp_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, logp_BxV, axis=-1).astype(jnp.int32)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@struct.dataclass
class _LoopState:
    step: jax.Array
    cache: model.KVCache
    logits_BxV: jax.Array
    done_B: jax.Array
    rng: jax.Array
    out: SampleOutput


def sample(graphdef, params, prompt_BxP, prompt_lens_B, rng, cfg: SamplingConfig) -> SampleOutput:
    """Samples up to `cfg.max_new_tokens` per row. Jit with `graphdef` and `cfg` static."""
    b, p = prompt_BxP.shape
    n = cfg.max_new_tokens
    last_BxV, _, cache = model.prefill_last(graphdef, params, prompt_BxP, prompt_lens_B, p + n)
    zeros_f = jnp.zeros((b, n), jnp.float32)
    out = SampleOutput(
        tokens=jnp.full((b, n), cfg.pad_id, jnp.int32),
        logprobs=zeros_f,
        entropy=zeros_f,
        lengths=jnp.zeros((b,), jnp.int32),
    )
    init = _LoopState(jnp.int32(0), cache, last_BxV, jnp.zeros((b,), bool), rng, out)
    layers = model.decode_layers(graphdef, params)

    def cond(s: _LoopState):
        return (s.step < n) & ~jnp.all(s.done_B)

    def body(s: _LoopState):
        rng, key = jax.random.split(s.rng)
        logp_BxV = process_logits(s.logits_BxV, cfg)
        tok_B = draw(key, logp_BxV, cfg)
        stats_logp = logp_BxV if cfg.temperature > 0 else stats_logprobs(s.logits_BxV, cfg)
        live_B = ~s.done_B
        tok_B = jnp.where(live_B, tok_B, cfg.pad_id)
        lp_B = jnp.take_along_axis(stats_logp, tok_B[:, None], axis=-1)[:, 0]
        o = s.out
        o = o.replace(
            tokens=o.tokens.at[:, s.step].set(tok_B),
            logprobs=o.logprobs.at[:, s.step].set(jnp.where(live_B, lp_B, 0.0)),
            entropy=o.entropy.at[:, s.step].set(jnp.where(live_B, entropy(stats_logp), 0.0)),
            lengths=o.lengths + live_B.astype(jnp.int32),
        )
        done_B = s.done_B | is_eos(tok_B, cfg.eos_ids)
        logits_Bx1xV, _, cache = model.extend(
            graphdef, params, s.cache, tok_B[:, None], None, layers
        )
        return _LoopState(s.step + 1, cache, logits_Bx1xV[:, 0], done_B, rng, o)

    return jax.lax.while_loop(cond, body, init).out


sample_jit = jax.jit(sample, static_argnames=("graphdef", "cfg"))


def generate(graphdef, params, prompts, rng, cfg: SamplingConfig) -> list[list[int]]:
    """Host convenience: token lists in, generated token lists out (EOS stripped)."""
    toks, lens = pad_prompts(prompts, cfg.pad_id)
    out = jax.device_get(sample_jit(graphdef, params, toks, lens, rng, cfg))
    res = []
    for row, n in zip(out.tokens, out.lengths, strict=True):
        row = [int(t) for t in row[:n]]
        if row and row[-1] in cfg.eos_ids:
            row = row[:-1]
        res.append(row)
    return res
