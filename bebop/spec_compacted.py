"""Tail-aware driver of the speculative sampler: `sample_compacted` runs `speculative`'s loop
bucket by bucket (`compaction.run`: each time the live rows fall to half, the loop continues with
half the rows), with optionally another draft length γ per bucket size (`regamma` adapts the loop
state to it). One compilation per bucket size; outputs in the original row order. `loop_costs`
times the loop's verify and draft steps at one batch size: what `compaction.draft_table` chooses
the per-bucket γ from (and what `benchmarks.rollout`'s cost model counts).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bebop import compaction, model, sampling, speculative
from bebop import mtp as mtp_lib
from bebop.sampling import SamplingConfig
from bebop.speculative import SpecConfig, SpecOutput

# Positions the MTP consumes per pass when a bucket drafts again after a deferred catch-up: the
# MTP cache's slack past the policy's length (`Models.mtp_slack`).
CATCH_CHUNK = 16


def regamma(m: speculative.Models, s: speculative.State, width: int) -> speculative.State:
    """The state of a bucket whose catch-up buffer is `width` wide (`speculative.catch_width`:
    γ+1, or a deferred γ = 0 bucket's). A narrower buffer: each row's MTP layers first consume
    what does not fit (a γ = 0 bucket's deferred positions, or the excess of a long accepted
    run when γ went down), `CATCH_CHUNK` positions a pass, so that the row keeps the last
    `width` entries, which the next cycle's catch-up consumes (its output at the last one drafts).
    Acceptance after a change of γ can differ from the unchanged loop's; the output distribution
    cannot (any q gives a lossless test)."""
    w_old, w_new = s.catch_tok_BxW.shape[1], width
    if w_new >= w_old:
        pad = ((0, 0), (0, w_new - w_old))
        return s.replace(
            catch_hid_BxWxD=jnp.pad(s.catch_hid_BxWxD, pad + ((0, 0),)),
            catch_tok_BxW=jnp.pad(s.catch_tok_BxW, pad),
        )
    excess_B = jnp.maximum(s.n_catch_B - w_new, 0)
    todo_B = jnp.where(s.done_B, 0, excess_B)  # finished rows (padding) drop theirs unconsumed
    chunk = min(CATCH_CHUNK, w_old)

    def window(start_B, size):  # entries start .. start + size - 1 of every row's buffer
        idx_BxC = jnp.minimum(start_B[:, None] + jnp.arange(size)[None], w_old - 1)
        hid = jnp.take_along_axis(s.catch_hid_BxWxD, idx_BxC[..., None], axis=1)
        return hid, jnp.take_along_axis(s.catch_tok_BxW, idx_BxC, axis=1)

    def consume(carry):
        cache, done_B = carry
        hid_BxCxD, tok_BxC = window(done_B, chunk)
        for j in range(m.mtp.num_layers):
            cache = mtp_lib.write_kv(m.mtp, m.policy, j, cache, hid_BxCxD, tok_BxC)
        step_B = jnp.minimum(todo_B - done_B, chunk)
        return cache.advance(step_B), done_B + step_B

    mtp_cache, _ = jax.lax.while_loop(
        lambda c: jnp.any(c[1] < todo_B), consume, (s.mtp_cache, jnp.zeros_like(todo_B))
    )
    hid_BxWxD, tok_BxW = window(excess_B, w_new)
    return s.replace(
        mtp_cache=mtp_cache,
        catch_hid_BxWxD=hid_BxWxD,
        catch_tok_BxW=tok_BxW,
        n_catch_B=s.n_catch_B - excess_B,
    )


_STATIC = ("pol_gd", "mtp_gd", "scfg", "spec", "max_draft", "sync_mtp")


@functools.partial(jax.jit, static_argnames=(*_STATIC, "mtp_slack"))
def _init_jit(
    pol_gd,
    pol_params,
    mtp_gd,
    mtp_params,
    draft_vocab,
    layers,
    toks,
    lens,
    rng,
    scfg,
    spec,
    sync_mtp,
    max_draft,
    mtp_slack,
):
    rows, width = toks.shape
    max_len = width + scfg.max_new_tokens + max_draft + 1
    m = speculative.make_models(
        pol_gd,
        pol_params,
        mtp_gd,
        mtp_params,
        draft_vocab,
        layers,
        scfg,
        spec,
        max_len,
        max_draft=max_draft,
        sync_mtp=sync_mtp,
        mtp_slack=mtp_slack,
    )
    row_keys_B = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(rows))
    return speculative.init_state(m, pol_gd, pol_params, toks, lens, row_keys_B)


def _bucket_models(
    args, s: speculative.State, scfg, spec, max_draft, sync_mtp
) -> speculative.Models:
    max_len = s.policy_cache.k[0].shape[2]  # the caches' S, set by `_init_jit`
    return speculative.make_models(
        *args, scfg, spec, max_len, max_draft=max_draft, sync_mtp=sync_mtp
    )


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("s",))
def _run_jit(
    pol_gd,
    pol_params,
    mtp_gd,
    mtp_params,
    draft_vocab,
    layers,
    s,
    min_live,
    scfg,
    spec,
    max_draft,
    sync_mtp,
):
    args = (pol_gd, pol_params, mtp_gd, mtp_params, draft_vocab, layers)
    return speculative.run_cycles(
        _bucket_models(args, s, scfg, spec, max_draft, sync_mtp), s, min_live
    )


@functools.partial(jax.jit, static_argnames=(*_STATIC, "width"))
def _regamma_jit(
    pol_gd,
    pol_params,
    mtp_gd,
    mtp_params,
    draft_vocab,
    layers,
    s,
    scfg,
    spec,
    max_draft,
    sync_mtp,
    width,
):
    args = (pol_gd, pol_params, mtp_gd, mtp_params, draft_vocab, layers)
    return regamma(_bucket_models(args, s, scfg, spec, max_draft, sync_mtp), s, width)


_finalise_jit = jax.jit(speculative.finalise, static_argnums=(0, 1, 3))


def sample_compacted(
    pol_gd,
    pol_params,
    mtp_gd,
    mtp_params,
    prompt_BxP,
    prompt_lens_B,
    rng,
    scfg: SamplingConfig,
    spec: SpecConfig,
    draft_vocab=None,
    layers=None,
    min_bucket: int = 8,
    draft_table: tuple = (),
) -> SpecOutput:
    """`speculative.sample` with tail-aware compaction (`bebop/compaction.py`): each time the
    live rows fall to half, the loop continues with half the rows, down to `min_bucket`; outputs
    in the original row order. With an empty `draft_table` the same samples as
    `speculative.sample_jit` for the same keys (log-probs and entropies to float rounding across
    batch sizes: see `compaction`).

    `draft_table`: (batch size, γ) pairs; a bucket of b rows drafts the γ of the largest batch
    size <= b (`spec.num_draft` below them all; `compaction.draft_for_batch`). γ = 0 verifies
    the pending token alone: one policy step per token and no MTP work; when a later bucket
    drafts again, the rows it keeps have their positions consumed by the MTP then (`regamma`).
    Per-position statistics are as wide as the largest γ. Lossless at every γ; the samples
    differ from a fixed-γ loop's."""
    batch, width = prompt_BxP.shape
    sizes = compaction.bucket_sizes(batch, min_bucket)
    gammas = [compaction.draft_for_batch(draft_table, b, spec.num_draft) for b in sizes]
    plan = {  # bucket size -> (its SpecConfig, whether a later bucket drafts)
        b: (dataclasses.replace(spec, num_draft=g), any(gammas[i + 1 :]))
        for i, (b, g) in enumerate(zip(sizes, gammas, strict=True))
    }
    max_draft = max(gammas)
    widths = {
        b: speculative.catch_width(sp.num_draft, later, scfg.max_new_tokens, max_draft)
        for b, (sp, later) in plan.items()
    }
    slack = CATCH_CHUNK if max(widths.values()) > max_draft + 1 else 0  # a deferred catch-up
    layers = model.decode_layers_jit(pol_gd, pol_params) if layers is None else layers
    args = (pol_gd, pol_params, mtp_gd, mtp_params, draft_vocab, layers)
    s = _init_jit(*args, prompt_BxP, prompt_lens_B, rng, scfg, *plan[batch], max_draft, slack)

    def advance(s, min_live):
        spec_b, later = plan[s.done_B.shape[0]]
        return _run_jit(*args, s, jnp.int32(min_live), scfg, spec_b, max_draft, later)

    def regroup(s, size):
        if widths[size] == s.catch_tok_BxW.shape[1]:
            return s
        spec_b, later = plan[size]
        return _regamma_jit(*args, s, scfg, spec_b, max_draft, later, widths[size])

    rows = compaction.run(
        s,
        advance,
        lambda s: speculative.live(s, scfg),
        speculative.row_outputs,
        min_bucket=min_bucket,
        regroup=regroup,
    )
    return _finalise_jit(scfg, spec.record, rows, width)


# ----------------------------------------------------------------------------- loop costs


def best_time(fn, repeats: int, first: list | None = None) -> float:
    """Best seconds of `repeats` calls of `fn` after one that compiles or warms up (its
    seconds appended to `first`)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())  # compile, or warm up
    if first is not None:
        first.append(time.perf_counter() - t0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def loop_cost_timers(pol, layers, mtp, vocab, batch, context, gammas, iters=16) -> dict:
    """Compiled timers for `loop_costs`: name -> a function that runs `iters` iterations of that
    forward and returns their output (`verify_{W}`, W = 1 and γ+1 for each γ of `gammas`;
    `draft`). A caller that times them more than once (interleaved with other runs) compiles them
    once here."""
    cfg = model.graphdef_config(*pol)
    cache = model.new_cache(cfg, batch, context + iters + max(gammas, default=0) + 2)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))

    @functools.partial(jax.jit, static_argnums=3)
    def verify(params, layers, cache, width):
        def body(_, carry):
            c, tok_B = carry
            toks = jnp.broadcast_to(tok_B[:, None], (batch, width))
            logits, _, c2 = model.extend(pol[0], params, c, toks, None, layers)
            return c2.rollback(c.lengths + 1), sampling.argmax(logits[:, -1])

        return jax.lax.fori_loop(0, iters, body, (cache, jnp.ones((batch,), jnp.int32)))

    timers = {
        f"verify_{w}": functools.partial(verify, pol[1], layers, cache, w)
        for w in sorted({1, *[g + 1 for g in gammas]})
    }
    mtp_module = nnx.merge(*mtp)
    mcache = mtp_lib.new_cache(
        cfg, mtp_module.num_layers, batch, context + iters + 2, mtp_module.depth
    )
    mcache = mcache.replace(lengths=jnp.full((batch,), context, jnp.int32))

    @jax.jit
    def draft(pp, mp, c):
        policy, m = nnx.merge(pol[0], pp), mtp_lib.for_decode(nnx.merge(mtp[0], mp))
        head = layers.head_DxV if vocab is None else mtp_lib.draft_head(policy, vocab)

        def body(_, carry):
            c, hid, tok_B = carry
            out, normed, c = mtp_lib.extend(m, policy, 0, c, hid, tok_B[:, None])
            logits = mtp_lib.logits(policy, normed, head)[:, 0]
            return c.advance(jnp.ones((batch,), jnp.int32)), out, sampling.argmax(logits)

        hid_Bx1xD = jnp.zeros((batch, 1, cfg.dim), model.DTYPES[cfg.dtype])
        init = (c, hid_Bx1xD, jnp.ones((batch,), jnp.int32))
        return jax.lax.fori_loop(0, iters, body, init)

    timers["draft"] = functools.partial(draft, pol[1], mtp[1], mcache)
    for fn in timers.values():
        jax.block_until_ready(fn())  # compile
    return timers


def time_costs(timers: dict, iters: int, repeats=3) -> dict:
    """Seconds per iteration of each of `loop_cost_timers`' timers (built with the same `iters`),
    best of `repeats`."""
    return {name: best_time(fn, repeats) / iters for name, fn in timers.items()}


def loop_costs(pol, layers, mtp, vocab, batch, context, gammas, iters=16, repeats=3) -> dict:
    """Seconds per iteration of a W-token verify (`verify_{W}`, W = 1 and γ+1 for each γ of
    `gammas`) and of one MTP draft step (`draft`) at `batch` rows and `context` cached tokens,
    each timed as a jitted loop of `iters` iterations the way the samplers run them (weights
    prepared once, the cache carried through the loop, every output feeding the next iteration so
    that nothing is dead code); best of `repeats`. `pol`, `mtp`: (graphdef, params) pairs;
    `layers`: the policy's `model.decode_layers`; `vocab`: the draft vocabulary or None."""
    timers = loop_cost_timers(pol, layers, mtp, vocab, batch, context, gammas, iters)
    return time_costs(timers, iters, repeats)


def bucket_costs(pol, layers, mtp, vocab, sizes, context, max_draft, repeats=3) -> dict:
    """`loop_costs` at each batch size of `sizes` for γ = 1 .. `max_draft`, with `step` = the
    1-token verify: the `costs` argument of `compaction.draft_table`."""
    costs = {}
    for b in sizes:
        gammas = list(range(1, max_draft + 1))
        c = loop_costs(pol, layers, mtp, vocab, b, context, gammas, repeats=repeats)
        costs[b] = {**c, "step": c["verify_1"]}
    return costs
