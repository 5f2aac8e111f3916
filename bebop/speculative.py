"""Speculative sampler: MTP drafts, one policy forward verifies, per-row accept, rollback.

One `lax.while_loop`; each iteration, for every row (rows advance by different amounts, shapes
stay static):
  1. catch-up: the MTP layers consume the positions the policy accepted last iteration (backbone
     hiddens + the tokens that followed them); the output at the last one drafts step 1;
  2. draft Y tokens with the MTP chain (step k >= 2 feeds on step k-1's hidden);
  3. verify: one policy forward over [pending token, d_1 .. d_Y] at the row's cache offset gives
     p_0 .. p_Y (p_j is the target distribution of the token after position c + j);
  4. accept by the rule, emit n_acc accepted drafts + one token from the residual (or the bonus
     token from p_Y when all Y are accepted), cut at EOS / max_new_tokens;
  5. roll back both caches to what the row kept.

Verification rules (METHOD §2), both lossless, chosen by name from `DRAFT_RULES`; they differ
only in how a draft token is taken from q and which q the acceptance test uses:
  - `rejection`:   d ~ q, accept iff u · q(d) < p(d); on the first rejection sample from
                   max(0, p - q) / Z (Z underflow -> p). Per-step acceptance Σ_v min(p, q).
  - `target_only`: d = argmax q, q treated as one-hot: accept iff u < p(d); on rejection sample
                   from p without d, renormalised. Per-step acceptance p(argmax q).
p and q are the processed distributions (temperature / top-k / top-p applied to both).

Statistics per row, from what was emitted (drafts cut off by EOS or the token budget do not
count): attempts and acceptances per draft position, a histogram of tokens emitted per verify
(1 .. Y+1), verify calls; per emitted token its `status` (ACCEPTED draft, REJECTED =
the residual token that replaced a rejected draft, UNDRAFTED = bonus or first token) and, at
drafted positions, the analytic acceptance Σ_v min(p, q_rule) (`overlap`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from bebop import model
from bebop import mtp as mtp_lib
from bebop.sampling import (
    SampleOutput,
    SamplingConfig,
    draw,
    entropy,
    is_eos,
    process_logits,
    stats_logprobs,
)

REJECTED, ACCEPTED, UNDRAFTED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    num_draft: int = 3  # Y (γ)
    rule: str = "rejection"  # a key of DRAFT_RULES
    record: bool = False  # also return backbone hiddens and per-cycle accept lengths (GrowMTP)


def _draft_rejection(key, logq_BxV, cfg: SamplingConfig):
    """d ~ q; the acceptance test uses q itself."""
    return draw(key, logq_BxV, cfg), jnp.exp(logq_BxV)


def _draft_target_only(key, logq_BxV, cfg: SamplingConfig):
    """d = argmax q; the acceptance test uses a one-hot at d."""
    del key, cfg
    d_B = jnp.argmax(logq_BxV, axis=-1).astype(jnp.int32)
    return d_B, jax.nn.one_hot(d_B, logq_BxV.shape[-1], dtype=jnp.float32)


DRAFT_RULES = {"rejection": _draft_rejection, "target_only": _draft_target_only}


@struct.dataclass
class SpecStats:
    attempts: jax.Array  # [B, Y] drafts evaluated at each position
    accepts: jax.Array  # [B, Y]
    accept_hist: jax.Array  # [B, Y+1] verifies that emitted 1 .. Y+1 tokens (after cuts)
    verify_calls: jax.Array  # [B]
    status: jax.Array  # [B, N] int32 per emitted token (ACCEPTED / REJECTED / UNDRAFTED)
    overlap: jax.Array  # [B, N] Σ min(p, q) at drafted positions, 0 elsewhere


@struct.dataclass
class SpecOutput:
    sample: SampleOutput
    stats: SpecStats
    # With SpecConfig.record, by absolute position (prompt + response): the backbone hidden
    # verification computed [B, P+N, D], and at each cycle's anchor (the position before its
    # pending token) the number of tokens that cycle's verify accepted + 1, else 0 [B, P+N].
    hidden: jax.Array | None = None
    cycle_len: jax.Array | None = None


@struct.dataclass
class _State:
    step: jax.Array
    tcache: model.KVCache
    mcache: model.KVCache
    pending_B: jax.Array  # last emitted token, not yet seen by the policy
    catch_hid_BxWxD: jax.Array  # backbone hiddens of positions the MTP has not consumed yet
    catch_tok_BxW: jax.Array  # the token that followed each of them
    n_catch_B: jax.Array
    done_B: jax.Array
    rng: jax.Array
    out: SampleOutput  # width N + W so per-row writes never clamp
    stats: SpecStats
    hid_buf: jax.Array | None  # [B, P+N+W, D] when recording
    cyc_buf: jax.Array | None  # [B, P+N+W]


def _write_rows(buf_BxM, new_BxW, offsets_B):
    """Per-row write of `new` at the row's offset along axis 1 (trailing axes whole)."""

    def one(b, n, o):
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (o,) + (0,) * (b.ndim - 1))

    return jax.vmap(one)(buf_BxM, new_BxW, offsets_B)


def _take(x_BxT, idx_B):
    return jnp.take_along_axis(x_BxT, idx_B.reshape((-1,) + (1,) * (x_BxT.ndim - 1)), axis=1)[:, 0]


def _emit_limits(tokens_BxW, n_emit_B, out_len_B, done_B, scfg: SamplingConfig, max_new: int):
    """Cuts emission at the first EOS and at the token budget; returns (n_emit, row done)."""
    w = tokens_BxW.shape[1]
    in_run = jnp.arange(w)[None] < n_emit_B[:, None]
    eos_BxW = is_eos(tokens_BxW, scfg.eos_ids) & in_run
    first_eos_B = jnp.argmax(eos_BxW, axis=1)
    hit_eos_B = eos_BxW.any(axis=1)
    n_emit_B = jnp.where(hit_eos_B, first_eos_B + 1, n_emit_B)
    n_emit_B = jnp.minimum(n_emit_B, max_new - out_len_B)
    n_emit_B = jnp.where(done_B, 0, n_emit_B)
    finished_B = done_B | hit_eos_B | (out_len_B + n_emit_B >= max_new)
    return n_emit_B, finished_B


def _cycle_counts(st: SpecStats, n_acc_B, n_emit_B, live_B) -> dict:
    """One verify's contribution to the counters, from what it emitted: drafts cut off by EOS or
    the token budget are neither attempts nor acceptances (they are not part of the output), and
    the histogram counts emitted tokens, so Σ_k k·hist_k = tokens after the first."""
    y = st.attempts.shape[1]
    live_i = live_B.astype(jnp.int32)[:, None]
    pos_Y = jnp.arange(y)[None]
    emitted_BxY = pos_Y < n_emit_B[:, None]
    hist_BxW = jnp.arange(y + 1)[None] == n_emit_B[:, None] - 1
    return {
        "attempts": st.attempts + live_i * (emitted_BxY & (pos_Y <= n_acc_B[:, None])),
        "accepts": st.accepts + live_i * (emitted_BxY & (pos_Y < n_acc_B[:, None])),
        "accept_hist": st.accept_hist + live_i * hist_BxW,
        "verify_calls": st.verify_calls + live_i[:, 0],
    }


def sample(
    pol_gd, pol_params, mtp_gd, mtp_params, prompt_BxP, prompt_lens_B, rng, scfg, spec,
    draft_vocab=None, layers=None,
):  # fmt: skip
    """Speculative sampling; same outputs as `sampling.sample` plus `SpecStats`.
    Jit with `pol_gd`, `mtp_gd`, `scfg`, `spec` static.

    `draft_vocab` (int32 `[K]`, distinct token ids) restricts the MTP's head to K tokens: q is a
    distribution over them, placed into the full vocabulary (0 elsewhere) before the acceptance
    test and the residual, which stay exact -- the output distribution is unchanged.
    `layers`: the policy's `model.decode_layers`, made once per parameter version by a caller
    that samples repeatedly (made here otherwise: a copy of every weight per call)."""
    policy = nnx.merge(pol_gd, pol_params)
    if layers is None:
        layers = model.decode_layers(pol_gd, pol_params)
    mtp = nnx.merge(mtp_gd, mtp_params)
    rule = DRAFT_RULES[spec.rule]
    head_DxK = None if draft_vocab is None else mtp_lib.draft_head(policy, draft_vocab)

    def draft_rule(key, logq_BxK, cfg):
        d_B, q_BxK = rule(key, logq_BxK, cfg)
        if draft_vocab is None:
            return d_B, q_BxK
        q_BxV = jnp.zeros((q_BxK.shape[0], policy.cfg.vocab_size), q_BxK.dtype)
        return draft_vocab[d_B], q_BxV.at[:, draft_vocab].set(q_BxK)

    y, w = spec.num_draft, spec.num_draft + 1
    n_mtp = mtp.num_layers
    b, p = prompt_BxP.shape
    n = scfg.max_new_tokens
    max_len = p + n + w

    # Prefill the policy; the first token comes from the last prompt position.
    last_BxV, hid_BxPxD, tcache = model.prefill_last(
        pol_gd, pol_params, prompt_BxP, prompt_lens_B, max_len, layers
    )
    rng, key = jax.random.split(rng)
    first_B = draw(key, process_logits(last_BxV, scfg), scfg)
    first_logp_BxV = stats_logprobs(last_BxV, scfg)

    # Prefill the MTP on positions 0 .. P_b-2 (hidden at p, token p+1); P_b-1 waits in the
    # catch-up buffer together with the first sampled token.
    next_tok_BxP = jnp.concatenate([prompt_BxP[:, 1:], prompt_BxP[:, :1]], axis=1)
    next_tok_BxP = jnp.where(
        jnp.arange(p)[None] == (prompt_lens_B - 1)[:, None], first_B[:, None], next_tok_BxP
    )
    mcache = mtp_lib.new_cache(policy.cfg, n_mtp, b, max_len)
    for j in range(n_mtp):
        _, _, mcache = mtp_lib.extend(
            mtp, policy, j, mcache, hid_BxPxD, next_tok_BxP, head_DxK=head_DxK
        )
    mcache = mcache.advance(prompt_lens_B - 1)
    catch_hid = jnp.zeros((b, w, policy.cfg.dim), hid_BxPxD.dtype)
    catch_hid = catch_hid.at[:, 0].set(_take(hid_BxPxD, prompt_lens_B - 1))
    catch_tok = jnp.zeros((b, w), jnp.int32).at[:, 0].set(first_B)

    zeros_f, zeros_i = jnp.zeros((b, n + w), jnp.float32), jnp.zeros((b, n + w), jnp.int32)
    out = SampleOutput(
        tokens=zeros_i.at[:, 0].set(first_B),
        logprobs=zeros_f.at[:, 0].set(_take(first_logp_BxV, first_B)),
        entropy=zeros_f.at[:, 0].set(entropy(first_logp_BxV)),
        lengths=jnp.ones((b,), jnp.int32),
    )
    stats = SpecStats(
        attempts=jnp.zeros((b, y), jnp.int32),
        accepts=jnp.zeros((b, y), jnp.int32),
        accept_hist=jnp.zeros((b, w), jnp.int32),
        verify_calls=jnp.zeros((b,), jnp.int32),
        status=zeros_i.at[:, 0].set(UNDRAFTED),
        overlap=zeros_f,
    )
    done_B = is_eos(first_B, scfg.eos_ids) | (n <= 1)
    hid_buf = cyc_buf = None
    if spec.record:
        hid_buf = jnp.zeros((b, max_len, policy.cfg.dim), hid_BxPxD.dtype).at[:, :p].set(hid_BxPxD)
        cyc_buf = jnp.zeros((b, max_len), jnp.int32)
    state = _State(
        jnp.int32(0), tcache, mcache, first_B, catch_hid, catch_tok, jnp.ones((b,), jnp.int32),
        done_B, rng, out, stats, hid_buf, cyc_buf,
    )  # fmt: skip

    def body(s: _State) -> _State:
        rng, k_draft, k_acc, k_res = jax.random.split(s.rng, 4)
        c_B = s.tcache.lengths
        live_B = ~s.done_B

        # 1. catch-up (every MTP layer keeps its cache complete); layer 0 drafts step 1.
        mcache = s.mcache
        for j in range(n_mtp):
            out_j, logits_j, mcache = mtp_lib.extend(
                mtp, policy, j, mcache, s.catch_hid_BxWxD, s.catch_tok_BxW, head_DxK=head_DxK
            )
            if j == 0:
                last_B = jnp.maximum(s.n_catch_B - 1, 0)
                hid_Bx1xD, q_logits_BxV = _take(out_j, last_B)[:, None], _take(logits_j, last_B)
        mcache = mcache.advance(s.n_catch_B)

        # 2. draft Y tokens.
        drafts, q_rule = [], []
        for k in range(1, y + 1):
            if k > 1:
                layer = (k - 1) % n_mtp
                valid = None
                if n_mtp > 1:  # this layer's chain entries of this cycle, plus accepted slots
                    own = jnp.asarray([i - 2 for i in range(2, k + 1) if (i - 1) % n_mtp == layer])
                    rel_BxS = jnp.arange(max_len)[None] - c_B[:, None]
                    valid = (rel_BxS < 0) | jnp.isin(rel_BxS, own)
                out_k, logits_k, mcache = mtp_lib.extend(
                    mtp, policy, layer, mcache, hid_Bx1xD, drafts[-1][:, None], valid, head_DxK
                )
                mcache = mcache.advance(jnp.ones((b,), jnp.int32))
                hid_Bx1xD, q_logits_BxV = out_k, logits_k[:, 0]
            logq_BxV = process_logits(q_logits_BxV, scfg)
            d_B, q_BxV = draft_rule(jax.random.fold_in(k_draft, k), logq_BxV, scfg)
            drafts.append(d_B)
            q_rule.append(q_BxV)
        mcache = mcache.rollback(c_B)
        drafts_BxY = jnp.stack(drafts, axis=1)
        q_BxYxV = jnp.stack(q_rule, axis=1)

        # 3. verify all W positions with one policy forward.
        v_tok_BxW = jnp.concatenate([s.pending_B[:, None], drafts_BxY], axis=1)
        t_logits_BxWxV, t_hid_BxWxD, tcache = policy(
            v_tok_BxW, s.tcache.positions(w), s.tcache, layers
        )
        tcache = tcache.advance(jnp.full((b,), w, jnp.int32))
        logp_BxWxV = process_logits(t_logits_BxWxV, scfg)
        p_BxWxV = jnp.exp(logp_BxWxV)

        # 4. accept.
        p_at_d_BxY = jnp.take_along_axis(p_BxWxV[:, :y], drafts_BxY[..., None], -1)[..., 0]
        q_at_d_BxY = jnp.take_along_axis(q_BxYxV, drafts_BxY[..., None], -1)[..., 0]
        u_BxY = jax.random.uniform(k_acc, (b, y))
        ok_BxY = u_BxY * q_at_d_BxY < p_at_d_BxY
        n_acc_B = jnp.sum(jnp.cumprod(ok_BxY.astype(jnp.int32), axis=1), axis=1)
        p_sel_BxV = _take(p_BxWxV, n_acc_B)
        q_pad_BxWxV = jnp.concatenate([q_BxYxV, jnp.zeros_like(q_BxYxV[:, :1])], axis=1)
        resid_BxV = jnp.maximum(p_sel_BxV - _take(q_pad_BxWxV, n_acc_B), 0.0)
        z_ok_B = resid_BxV.sum(-1) > 1e-12
        resid_BxV = jnp.where(z_ok_B[:, None], resid_BxV, p_sel_BxV)
        log_resid = jnp.log(resid_BxV)
        z_B = draw(k_res, log_resid, scfg)

        idx_W = jnp.arange(w)[None]
        drafts_pad_BxW = jnp.concatenate([drafts_BxY, drafts_BxY[:, :1]], axis=1)
        emit_BxW = jnp.where(idx_W < n_acc_B[:, None], drafts_pad_BxW, z_B[:, None])
        n_emit_B, finished_B = _emit_limits(emit_BxW, n_acc_B + 1, s.out.lengths, s.done_B, scfg, n)

        # 5. outputs and statistics.
        slogp_BxWxV = logp_BxWxV if scfg.temperature > 0 else stats_logprobs(t_logits_BxWxV, scfg)
        lp_BxW = jnp.take_along_axis(slogp_BxWxV, emit_BxW[..., None], -1)[..., 0]
        status_BxW = jnp.where(
            idx_W < n_acc_B[:, None], ACCEPTED, jnp.where(n_acc_B[:, None] < y, REJECTED, UNDRAFTED)
        )
        overlap_BxY = jnp.sum(jnp.minimum(p_BxWxV[:, :y], q_BxYxV), axis=-1)
        overlap_BxW = jnp.concatenate([overlap_BxY, jnp.zeros((b, 1))], axis=1)
        overlap_BxW = jnp.where(status_BxW == UNDRAFTED, 0.0, overlap_BxW)
        o, st, off = s.out, s.stats, s.out.lengths
        o = o.replace(
            tokens=_write_rows(o.tokens, emit_BxW, off),
            logprobs=_write_rows(o.logprobs, lp_BxW, off),
            entropy=_write_rows(o.entropy, entropy(slogp_BxWxV), off),
            lengths=off + n_emit_B,
        )
        st = st.replace(
            **_cycle_counts(st, n_acc_B, n_emit_B, live_B),
            status=_write_rows(st.status, status_BxW, off),
            overlap=_write_rows(st.overlap, overlap_BxW, off),
        )

        # 6. roll back: the policy keeps pending + accepted drafts; z becomes the pending token.
        new_c_B = jnp.where(live_B, c_B + n_acc_B + 1, c_B)
        tcache = tcache.rollback(new_c_B)
        hid_buf, cyc_buf = s.hid_buf, s.cyc_buf
        if spec.record:  # done rows write into the spare last slot
            hid_buf = _write_rows(hid_buf, t_hid_BxWxD, jnp.where(live_B, c_B, max_len - w))
            anchor_B = jnp.where(live_B, c_B - 1, max_len - 1)
            cyc_buf = _write_rows(cyc_buf, (n_acc_B + 1)[:, None], anchor_B)
        return _State(
            s.step + 1, tcache, mcache, jnp.where(live_B, z_B, s.pending_B), t_hid_BxWxD,
            emit_BxW, jnp.where(live_B, n_acc_B + 1, 0), finished_B, rng, o, st, hid_buf, cyc_buf,
        )  # fmt: skip

    def cond(s: _State):
        return (s.step < n) & ~jnp.all(s.done_B)

    final = jax.lax.while_loop(cond, body, state)
    mask_BxN = jnp.arange(n)[None] < final.out.lengths[:, None]
    o, st = final.out, final.stats
    sample_out = SampleOutput(
        tokens=jnp.where(mask_BxN, o.tokens[:, :n], scfg.pad_id),
        logprobs=jnp.where(mask_BxN, o.logprobs[:, :n], 0.0),
        entropy=jnp.where(mask_BxN, o.entropy[:, :n], 0.0),
        lengths=o.lengths,
    )
    stats = st.replace(
        status=jnp.where(mask_BxN, st.status[:, :n], -1),
        overlap=jnp.where(mask_BxN, st.overlap[:, :n], 0.0),
    )
    if not spec.record:
        return SpecOutput(sample_out, stats)
    return SpecOutput(sample_out, stats, final.hid_buf[:, : p + n], final.cyc_buf[:, : p + n])


sample_jit = jax.jit(sample, static_argnames=("pol_gd", "mtp_gd", "scfg", "spec"))


def draft_positions(status_BxN) -> np.ndarray:
    """Host-side: the draft position (0-based, within its verify cycle) of each emitted drafted
    token, -1 elsewhere. A cycle's tokens are its accepted drafts, then one that is not."""
    status_BxN = np.asarray(status_BxN)
    n = status_BxN.shape[1]
    idx_N = np.arange(n)
    last = np.maximum.accumulate(np.where(status_BxN != ACCEPTED, idx_N, -1), axis=1)
    prev = np.concatenate([np.full_like(last[:, :1], -1), last[:, :-1]], axis=1)
    drafted = (status_BxN == ACCEPTED) | (status_BxN == REJECTED)
    return np.where(drafted, idx_N - 1 - prev, -1)


def summarize(out: SpecOutput) -> dict:
    """Host-side acceptance figures of one speculative rollout (all rows pooled): per draft
    position k the empirical acceptance rate `accept_rate_k` and the mean analytic acceptance
    Σ min(p, q) `analytic_alpha_k`; tokens per verify, `accept_len`, and their histogram
    `accept_hist_m` (share of verifies that emitted m tokens)."""
    st = jax.device_get(out.stats)
    lengths = np.asarray(jax.device_get(out.sample.lengths))
    ent = np.asarray(jax.device_get(out.sample.entropy))
    emitted = np.arange(ent.shape[1])[None] < lengths[:, None]
    kpos = draft_positions(st.status)
    drafted = kpos >= 0
    overlap = np.asarray(st.overlap)
    hist = np.asarray(st.accept_hist).sum(0)
    attempts, accepts = np.asarray(st.attempts).sum(0), np.asarray(st.accepts).sum(0)
    res = {}
    for k in range(len(attempts)):
        res[f"accept_rate_{k + 1}"] = float(accepts[k] / max(attempts[k], 1))
        res[f"analytic_alpha_{k + 1}"] = float(overlap[kpos == k].sum() / max((kpos == k).sum(), 1))
    res["accept_rate"] = float(accepts.sum() / max(attempts.sum(), 1))
    res["accept_len"] = float((hist * np.arange(1, len(hist) + 1)).sum() / max(hist.sum(), 1))
    for m in range(len(hist)):
        res[f"accept_hist_{m + 1}"] = float(hist[m] / max(hist.sum(), 1))
    res["analytic_alpha"] = float((overlap * drafted).sum() / max(drafted.sum(), 1))
    res["mean_entropy"] = float((ent * emitted).sum() / max(emitted.sum(), 1))
    res["tokens"] = int(lengths.sum())
    return res
