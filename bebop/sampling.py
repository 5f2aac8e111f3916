"""Plain batched sampler: prefill, then one `lax.while_loop` over decode steps.

Prompts are **right-padded** (`pad_prompts`): row b's prompt occupies slots `[0, prompt_lens[b])`,
so token positions equal cache slots and no row needs a position offset. Padded prompt widths are
rounded up to a bucket width (`bucket_width`: 2^k or 3·2^(k-1), two compiled widths per doubling)
to bound the number of compilations. The prefill pays for the padding: SmolLM2 with a 39-token
prompt and 64 new tokens at batch 1 ran ~10 % faster padded to 48 than to 64 (CPU).

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

from bebop import compaction, model


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    eos_ids: tuple[int, ...] = (2,)
    pad_id: int = 0
    # Rows come in runs of this many identical prompts (GRPO groups): the prefill runs once per
    # run (`model.prefill_last`) and its caches are copied to the run's rows, each keeping its
    # own key: the samples of a prefill per row, to the float rounding of a B/G-row prefill.
    # The caller guarantees the runs (`check_prompt_groups`; `rl.rollouts.Rollouts` checks).
    prompt_group: int = 1

    def __post_init__(self):
        if self.prompt_group < 1:
            raise ValueError(f"SamplingConfig.prompt_group={self.prompt_group} must be >= 1")


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B, N] int32
    logprobs: jax.Array  # [B, N] float32, behaviour log-prob of each emitted token
    entropy: jax.Array  # [B, N] float32, entropy of the sampling distribution at that step
    lengths: jax.Array  # [B] int32, generated tokens per row (EOS included)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_width(n: int, minimum: int = 16) -> int:
    """The smallest width >= max(n, minimum) of the form 2^k or 3·2^(k-1) (at most
    `next_pow2(n)`). Few widths, few compilations: every new prompt width compiles the sampler
    and, through the learner batch, the train step again (~10 s each on a CPU)."""
    n = max(n, minimum)
    p = next_pow2(n)
    return 3 * p // 4 if p >= 4 and n <= 3 * p // 4 else p


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, bucket: bool = True, min_width: int = 0
):
    """Right-pads token lists to a common (`bucket_width`) width, at least `min_width`:
    (tokens_BxP, lengths_B) as numpy."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("pad_prompts: every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    width = max(bucket_width(width) if bucket else width, min_width)
    out = np.full((len(prompts), width), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, np.asarray([len(p) for p in prompts], np.int32)


def check_prompt_groups(prompt_BxP, prompt_lens_B, group: int) -> None:
    """Raises ValueError unless the rows come in runs of `group` identical prompts, as
    `SamplingConfig.prompt_group` promises the prefill (host arrays)."""
    if group == 1:
        return
    toks, lens = np.asarray(prompt_BxP), np.asarray(prompt_lens_B)
    if group < 1 or len(toks) % group:
        raise ValueError(f"prompt_group={group}: {len(toks)} prompt rows are not runs of {group}")
    runs_GxRxP = toks.reshape(-1, group, toks.shape[1])
    lens_GxR = lens.reshape(-1, group)
    bad = (runs_GxRxP != runs_GxRxP[:, :1]).any(-1) | (lens_GxR != lens_GxR[:, :1])
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"prompt_group={group}: prompt row {row} differs from row {row - row % group}, "
            "the first of its run"
        )


def process_logits(logits_BxV: jax.Array, cfg: SamplingConfig, keep_B=None) -> jax.Array:
    """Log-probs of the distribution actually sampled from: temperature, then top-k, then top-p;
    -inf outside the support. Temperature 0 is greedy: a one-hot at the argmax. `keep_B`: token
    ids (one per row) known to be in the support -- the tokens the sampler drew, for a learner
    that recomputes the support from logits that differ from the sampler's by rounding (bf16):
    a drawn token on the support's edge stays in it instead of getting -inf (ratio 0)."""
    logits = logits_BxV.astype(jnp.float32)
    kept = False if keep_B is None else jnp.arange(logits.shape[-1]) == keep_B[..., None]
    if cfg.temperature == 0:
        top = argmax(logits)[..., None]
        return jnp.where(jnp.arange(logits.shape[-1]) == top, 0.0, -jnp.inf)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where((logits >= kth) | kept, logits, -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    if cfg.top_p < 1.0:
        sorted_logp = jnp.sort(logp, axis=-1)[..., ::-1]
        cum_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
        keep_sorted = cum_before < cfg.top_p  # always keeps the most likely token
        threshold = jnp.min(jnp.where(keep_sorted, sorted_logp, jnp.inf), axis=-1, keepdims=True)
        logp = jnp.where((logp >= threshold) | kept, logp, -jnp.inf)
        logp = jax.nn.log_softmax(logp, axis=-1)
    return logp


def stats_logprobs(logits_BxV: jax.Array, cfg: SamplingConfig, keep_B=None) -> jax.Array:
    """The distribution whose log-prob and entropy are recorded: the sampling one, except under
    greedy decoding, where the untempered softmax (with the same top-k/top-p) is more useful.
    `keep_B`: as `process_logits`."""
    if cfg.temperature == 0:
        cfg = dataclasses.replace(cfg, temperature=1.0)
    return process_logits(logits_BxV, cfg, keep_B)


def entropy(logp_BxV: jax.Array) -> jax.Array:
    p = jnp.exp(logp_BxV)
    return -jnp.sum(jnp.where(p > 0, p * logp_BxV, 0.0), axis=-1)


def argmax(x_BxV: jax.Array) -> jax.Array:
    """First index of the maximum along the last axis, as two plain reductions (XLA's CPU argmax,
    a reduction over (value, index) pairs, ran 7x slower over a 49152-token vocabulary)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x_BxV.shape, x_BxV.ndim - 1)
    hit = x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(hit, iota, x_BxV.shape[-1]), axis=-1)


def _last_positive(p_NxC: jax.Array) -> jax.Array:
    iota = jax.lax.broadcasted_iota(jnp.int32, p_NxC.shape, 1)
    return jnp.max(jnp.where(p_NxC > 0, iota, 0), axis=1)


def categorical(rng, logp_BxV: jax.Array) -> jax.Array:
    """One draw per row from `exp(logp)` (normalised here; -inf = excluded) by inverse CDF with
    one uniform per row (from `rng`, or from each row's own key when `rng` holds one per row).
    Two-level, so no cumulative sum runs over the whole vocabulary: pick the block of C ~ sqrt(V)
    tokens whose cumulative mass passes u, then the token inside it. Gumbel-max
    (`jax.random.categorical`) draws V uniforms per row: 9 ms of a ~70 ms SmolLM2 decode step at
    batch 8 on CPU, against 0.3 ms here. A zero-probability token is never returned (float
    rounding that would overshoot a block or a row stops at its last positive entry)."""
    lead, v = logp_BxV.shape[:-1], logp_BxV.shape[-1]
    logp_NxV = logp_BxV.reshape(-1, v)
    n = logp_NxV.shape[0]
    c = next_pow2(int(np.ceil(np.sqrt(v))))
    nb = -(-v // c)
    if nb * c != v:
        logp_NxV = jnp.pad(logp_NxV, ((0, 0), (0, nb * c - v)), constant_values=-jnp.inf)
    logp_NxV = logp_NxV.astype(jnp.float32)
    p_NxBxC = jnp.exp(logp_NxV - jnp.max(logp_NxV, axis=1, keepdims=True)).reshape(n, nb, c)
    mass_NxB = p_NxBxC.sum(-1)
    cum_NxB = jnp.cumsum(mass_NxB, axis=1)
    if rng.ndim:  # per-row keys
        u_N = jax.vmap(lambda k: jax.random.uniform(k))(rng.reshape(-1))
    else:
        u_N = jax.random.uniform(rng, (n,))
    u_N = u_N * cum_NxB[:, -1]
    blk_N = jnp.minimum(jnp.sum(cum_NxB <= u_N[:, None], axis=1), _last_positive(mass_NxB))
    p_NxC = jnp.take_along_axis(p_NxBxC, blk_N[:, None, None], axis=1)[:, 0]
    below_N = jnp.take_along_axis(cum_NxB, jnp.maximum(blk_N - 1, 0)[:, None], axis=1)[:, 0]
    u_N = u_N - jnp.where(blk_N > 0, below_N, 0.0)
    tok_N = jnp.sum(jnp.cumsum(p_NxC, axis=1) <= u_N[:, None], axis=1)
    tok_N = blk_N * c + jnp.minimum(tok_N, _last_positive(p_NxC))
    return tok_N.reshape(lead).astype(jnp.int32)


def draw(rng, logp_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token per row from processed log-probs (argmax when temperature is 0)."""
    if cfg.temperature == 0:
        return argmax(logp_BxV)
    return categorical(rng, logp_BxV)


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@struct.dataclass
class _LoopState:
    step: jax.Array
    cache: model.KVCache
    logits_BxV: jax.Array
    done_B: jax.Array
    keys_B: jax.Array  # row r's key fold_in(rng, r): it travels with its row under compaction
    out: SampleOutput


def _init(graphdef, params, prompt_BxP, prompt_lens_B, rng, cfg: SamplingConfig, layers):
    b, p = prompt_BxP.shape
    n = cfg.max_new_tokens
    last_BxV, _, cache = model.prefill_last(
        graphdef, params, prompt_BxP, prompt_lens_B, p + n, layers, cfg.prompt_group
    )
    zeros_f = jnp.zeros((b, n), jnp.float32)
    out = SampleOutput(
        tokens=jnp.full((b, n), cfg.pad_id, jnp.int32),
        logprobs=zeros_f,
        entropy=zeros_f,
        lengths=jnp.zeros((b,), jnp.int32),
    )
    # Row r's draw at step t uses its own key fold_in(fold_in(rng, r), t): a row's sample does
    # not depend on which other rows share its batch (so finished rows can be dropped).
    keys_B = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(b))
    return _LoopState(jnp.int32(0), cache, last_BxV, jnp.zeros((b,), bool), keys_B, out)


def _live(s: _LoopState, cfg: SamplingConfig) -> jax.Array:
    return ~s.done_B & (s.step < cfg.max_new_tokens)


def _run(graphdef, params, s: _LoopState, min_live, cfg: SamplingConfig, layers) -> _LoopState:
    """Decode steps while more than `min_live` rows are live (0: until every row ends)."""

    def body(s: _LoopState):
        if cfg.temperature > 0:
            stats_logp = process_logits(s.logits_BxV, cfg)
            keys_B = jax.vmap(jax.random.fold_in, (0, None))(s.keys_B, s.step)
            tok_B = categorical(keys_B, stats_logp)
        else:  # the one-hot of `process_logits` is not needed to take an argmax
            stats_logp = stats_logprobs(s.logits_BxV, cfg)
            tok_B = argmax(s.logits_BxV)
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
        return s.replace(
            step=s.step + 1, cache=cache, logits_BxV=logits_Bx1xV[:, 0], done_B=done_B, out=o
        )

    return jax.lax.while_loop(lambda s: jnp.sum(_live(s, cfg)) > min_live, body, s)


def sample(
    graphdef, params, prompt_BxP, prompt_lens_B, rng, cfg: SamplingConfig, layers=None
) -> SampleOutput:
    """Samples up to `cfg.max_new_tokens` per row. Jit with `graphdef` and `cfg` static.
    `layers`: `model.decode_layers(graphdef, params)`, made once per parameter version by a
    caller that samples repeatedly (made here otherwise: a copy of every weight per call)."""
    if layers is None:
        layers = model.decode_layers(graphdef, params)
    s = _init(graphdef, params, prompt_BxP, prompt_lens_B, rng, cfg, layers)
    return _run(graphdef, params, s, 0, cfg, layers).out


sample_jit = jax.jit(sample, static_argnames=("graphdef", "cfg"))
_init_jit = jax.jit(_init, static_argnames=("graphdef", "cfg"))
# The loop state is donated: its KV cache is updated in place across the buckets' loops.
_run_jit = jax.jit(_run, static_argnames=("graphdef", "cfg"), donate_argnames=("s",))


def sample_compacted(
    graphdef,
    params,
    prompt_BxP,
    prompt_lens_B,
    rng,
    cfg: SamplingConfig,
    layers=None,
    min_bucket: int = 8,
) -> SampleOutput:
    """`sample` with tail-aware compaction (`bebop/compaction.py`): a host-level driver that
    continues with half the rows each time the live rows fall to half, down to `min_bucket`.
    Same samples as `sample_jit` for the same keys (log-probs and entropies to float rounding
    across batch sizes, ~1e-5 on CPU: see `compaction`); outputs in the original row order."""
    if layers is None:
        layers = model.decode_layers_jit(graphdef, params)
    s = _init_jit(graphdef, params, prompt_BxP, prompt_lens_B, rng, cfg, layers)
    return compaction.run(
        s,
        advance=lambda s, k: _run_jit(graphdef, params, s, jnp.int32(k), cfg, layers),
        live=lambda s: _live(s, cfg),
        results=lambda s: s.out,
        min_bucket=min_bucket,
    )


def generate(graphdef, params, prompts, rng, cfg: SamplingConfig, layers=None) -> list[list[int]]:
    """Host convenience: token lists in, generated token lists out (EOS stripped)."""
    toks, lens = pad_prompts(prompts, cfg.pad_id)
    out = jax.device_get(sample_jit(graphdef, params, toks, lens, rng, cfg, layers))
    res = []
    for row, n in zip(out.tokens, out.lengths, strict=True):
        row = [int(t) for t in row[:n]]
        if row and row[-1] in cfg.eos_ids:
            row = row[:-1]
        res.append(row)
    return res
