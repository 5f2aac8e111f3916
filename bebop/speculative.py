"""Speculative sampler: the MTP drafts, one policy forward verifies, each row accepts by the
rule and rolls back (docs/method.md §2).

Shape letters (array-name suffixes): B rows, P prompt width, N max new tokens, Y drafts per cycle
(γ), W = Y + 1 verified positions, V vocabulary, Vd draft vocabulary (= V without one), D model
width, S cache slots.

One `lax.while_loop`; rows advance by different amounts, shapes stay static. A cycle is these
phases, in this order (the functions of the same names):
  `_catch_up`  the MTP consumes what the policy accepted last cycle (backbone features at t,
               fused, and token t+1); its output at the last of these positions gives q for
               draft 1;
  `_draft`     Y tokens from the MTP chain (draft k >= 2 feeds on draft k-1's hidden);
  `_verify`    one policy forward over [pending token, d_1 .. d_Y] gives p_0 .. p_Y (p_j: the
               target distribution of the token after position c + j) and the backbone features
               the MTP reads (`mtp.features`: the outputs of the layers it reads, from the same
               pass; `mtp_lib.fuse` turns them into its D-wide input once, here);
  `accept`     the rule's test per draft and the cycle's last token (residual or bonus);
  `_emit`      writes the accepted drafts and that token, cut at EOS and the token budget, with
               log-probs, entropies and acceptance statistics;
  `_roll_back` both caches keep what the row kept; the new token becomes the pending one.
`init_state` prefills both models; `finalise` masks what lies past each row's length.

Verification rules (docs/method.md §2), both lossless, chosen by name from `DRAFT_RULES`; they
differ only in how a draft token is taken from q and which q the acceptance test uses:
  - `rejection`:   d ~ q, accept iff u · q(d) < p(d); on the first rejection sample from
                   max(0, p - q) / Z (Z underflow -> p). Per-step acceptance Σ_v min(p, q).
  - `target_only`: d = argmax q, q treated as one-hot: accept iff u < p(d); on rejection sample
                   from p without d, renormalised. Per-step acceptance p(argmax q).
p and q are the processed distributions (temperature / top-k / top-p applied to both). q lives on
the draft vocabulary; it is placed into the full vocabulary only for the residual of the one
position that needs it.

Randomness: row r's draws come from its own key fold_in(rng, r) (folded with 0 for the first
token, with c + 1 in cycle c), so a row's sample does not depend on the other rows of its batch.
The key lives in the loop state with its row: `spec_compacted.sample_compacted` drops finished
rows as the batch thins out, optionally with another γ per batch size (γ = 0: no drafts); it
drives this module's `init_state`, `run_cycles` and `finalise` bucket by bucket.

Statistics per row, from what was emitted (drafts cut off by EOS or the token budget do not
count): attempts and acceptances per draft position, a histogram of tokens emitted per verify
(1 .. Y+1), verify calls; per emitted token its `status` (ACCEPTED draft, REJECTED =
the residual token that replaced a rejected draft, UNDRAFTED = bonus or first token) and, at
drafted positions, the analytic acceptance Σ_v min(p, q_rule) (`overlap`; with
`SpecConfig.other_rule` also the other rule's, `overlap_other`: the RS-vs-TO analysis).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from bebop import model
from bebop import mtp as mtp_lib
from bebop.sampling import (
    SampleOutput,
    SamplingConfig,
    argmax,
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
    # Also return backbone hiddens (and the MTP's backbone features, when it reads other layers
    # than the last) and per-cycle accept lengths (GrowMTP).
    record: bool = False
    # Also record, per drafted position, the analytic acceptance the *other* rule would have had
    # for the same p and MTP distribution (`SpecStats.overlap_other`; the RS-vs-TO analysis).
    # At draft k >= 2 that q is conditioned on this rule's own earlier drafts.
    other_rule: bool = False


def _draft_rejection(key, logq_BxVd, cfg: SamplingConfig):
    """d ~ q; the acceptance test uses q itself."""
    return draw(key, logq_BxVd, cfg), jnp.exp(logq_BxVd)


def _draft_target_only(key, logq_BxVd, cfg: SamplingConfig):
    """d = argmax q; the acceptance test uses a one-hot at d."""
    del key, cfg
    d_B = argmax(logq_BxVd)
    return d_B, jax.nn.one_hot(d_B, logq_BxVd.shape[-1], dtype=jnp.float32)


# A rule maps (per-row keys, processed draft log-probs [B, Vd], config) to (draft indices into the
# draft vocabulary [B], the q its acceptance test uses [B, Vd]).
DRAFT_RULES = {"rejection": _draft_rejection, "target_only": _draft_target_only}
OTHER_RULE = {"rejection": "target_only", "target_only": "rejection"}


@struct.dataclass
class SpecStats:
    attempts: jax.Array  # [B, Y] drafts evaluated at each position
    accepts: jax.Array  # [B, Y]
    accept_hist: jax.Array  # [B, Y+1] verifies that emitted 1 .. Y+1 tokens (after cuts)
    verify_calls: jax.Array  # [B]
    status: jax.Array  # [B, N] int32 per emitted token (ACCEPTED / REJECTED / UNDRAFTED)
    overlap: jax.Array  # [B, N] Σ min(p, q) at drafted positions, 0 elsewhere
    # With SpecConfig.other_rule: the same for the other rule's q (target_only's one-hot at
    # argmax q -> p(argmax q); rejection's q itself -> Σ min(p, q)), else None.
    overlap_other: jax.Array | None = None


@struct.dataclass
class SpecOutput:
    sample: SampleOutput
    stats: SpecStats
    # With SpecConfig.record, by absolute position (prompt + response): the backbone hidden
    # verification computed [B, P+N, D], and at each cycle's anchor (the position before its
    # pending token) the number of tokens that cycle's verify accepted + 1, else 0 [B, P+N].
    hidden: jax.Array | None = None
    cycle_len: jax.Array | None = None
    # With SpecConfig.record and an MTP reading other layers than the last (`mtp.features`):
    # the features verification computed [B, P+N, F*D] (the layers' outputs concatenated).
    features: jax.Array | None = None


@struct.dataclass
class State:
    cycle: jax.Array
    policy_cache: model.KVCache
    mtp_cache: model.KVCache
    pending_B: jax.Array  # last emitted token, not yet seen by the policy
    catch_hid_BxWxD: jax.Array  # fused backbone features of positions the MTP has not consumed
    catch_tok_BxW: jax.Array  # the token that followed each of them
    n_catch_B: jax.Array
    done_B: jax.Array
    keys_B: jax.Array  # row r's key fold_in(rng, r): it travels with its row under compaction
    out: SampleOutput  # width N + max W so per-row writes never clamp
    stats: SpecStats
    hid_buf: jax.Array | None  # [B, P+N+max W, D] when recording
    cyc_buf: jax.Array | None  # [B, P+N+W]
    feat_buf: jax.Array | None = None  # [B, P+N+max W, F*D] when recording a fused MTP's


@dataclasses.dataclass(frozen=True)
class Models:
    """What every phase reads (trace-time constants and the loop-invariant arrays)."""

    policy: nnx.Module
    layers: model.DecodeWeights
    mtp: mtp_lib.DecodeMTP
    head_DxVd: jax.Array  # the MTP's output projection (the draft vocabulary's columns)
    vocab_Vd: jax.Array | None
    scfg: SamplingConfig
    spec: SpecConfig  # this bucket's γ (0: no drafts, one policy step per cycle)
    max_len: int
    max_draft: int  # per-position statistics are this wide (the largest γ of a draft table)
    # With γ = 0: a later bucket drafts again, so the MTP must see every token. Its catch-up is
    # deferred: each cycle appends its position to the catch-up buffer (`catch_width` wide),
    # which `spec_compacted.regamma` consumes in chunks when a bucket drafts again.
    sync_mtp: bool = True
    mtp_slack: int = 0  # MTP cache slots past `max_len`, for those chunks' writes

    @property
    def collect(self) -> tuple[int, ...] | None:
        """The decoder layers whose outputs the policy's forwards return for the MTP (None: it
        reads the last hidden)."""
        return mtp_lib.collected(self.mtp)


def catch_width(num_draft: int, sync_mtp: bool, max_new: int, max_draft: int) -> int:
    """Width of the catch-up buffer: the γ+1 positions a cycle verifies; with γ = 0 and a
    deferred catch-up (`Models.sync_mtp`), every position a row can still verify (its first
    token comes from the prefill) after what an earlier bucket left (at most `max_draft` + 1)."""
    if num_draft or not sync_mtp:
        return num_draft + 1
    return max_new + max_draft + 1


def _write_rows(buf_BxM, new_BxW, offsets_B):
    """Per-row write of `new` at the row's offset along axis 1 (trailing axes whole)."""

    def one(b, n, o):
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (o,) + (0,) * (b.ndim - 1))

    return jax.vmap(one)(buf_BxM, new_BxW, offsets_B)


def _take(x_BxT, idx_B):
    return model.take_at(x_BxT, idx_B)[:, 0]


def _fold(keys_B, data: int):
    return jax.vmap(jax.random.fold_in, (0, None))(keys_B, data)


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


def _cycle_counts(st: SpecStats, n_acc_B, n_emit_B, live_B, y: int) -> dict:
    """One verify's contribution to the counters, from what it emitted: drafts cut off by EOS or
    the token budget are neither attempts nor acceptances (they are not part of the output), and
    the histogram counts emitted tokens, so Σ_k k·hist_k = tokens after the first. The counters
    may be wider than this cycle's `y` drafts (a draft table's largest γ)."""
    y_max = st.attempts.shape[1]
    live_i = live_B.astype(jnp.int32)[:, None]
    pos_Y = jnp.arange(y_max)[None]
    emitted_BxY = (pos_Y < n_emit_B[:, None]) & (pos_Y < y)
    hist_BxW = jnp.arange(y_max + 1)[None] == n_emit_B[:, None] - 1
    return {
        "attempts": st.attempts + live_i * (emitted_BxY & (pos_Y <= n_acc_B[:, None])),
        "accepts": st.accepts + live_i * (emitted_BxY & (pos_Y < n_acc_B[:, None])),
        "accept_hist": st.accept_hist + live_i * hist_BxW,
        "verify_calls": st.verify_calls + live_i[:, 0],
    }


def accept(keys_B, logp_BxWxV, q_BxYxVd, d_idx_BxY, drafts_BxY, scfg, vocab_Vd=None):
    """The verification of one cycle, for either rule (its q): returns (accepted drafts n_acc
    `[B]`, the cycle's last token `[B]`).

    Draft j (1-based) is accepted iff u_j · q_j(d_j) < p_{j-1}(d_j), u_j ~ U[0, 1), and every
    draft before it was: for d_j ~ q_j the acceptance probability is Σ_v min(p_{j-1}, q_j). The
    last token comes from the residual max(0, p_n - q_{n+1}) / Z at the first rejection n (p_n
    itself if Z underflows), or from p_Y (the bonus) when all Y drafts are accepted; either way the
    emitted token is distributed as p (docs/method.md §2).

    `logp_BxWxV`: processed policy log-probs p_0 .. p_Y; `q_BxYxVd`: the q of each draft's test
    on the draft vocabulary `vocab_Vd` (token ids; None: the full vocabulary), `d_idx_BxY` the
    drafts' indices into it and `drafts_BxY` their token ids; `keys_B`: one key per row."""
    y = drafts_BxY.shape[1]
    if y == 0:  # nothing drafted (a γ = 0 bucket): the token comes from p_0 itself
        return jnp.zeros(drafts_BxY.shape[:1], jnp.int32), draw(
            _fold(keys_B, 1), logp_BxWxV[:, 0], scfg
        )
    logp_at_d_BxY = jnp.take_along_axis(logp_BxWxV[:, :y], drafts_BxY[..., None], -1)[..., 0]
    q_at_d_BxY = jnp.take_along_axis(q_BxYxVd, d_idx_BxY[..., None], -1)[..., 0]
    u_BxY = jax.vmap(lambda k: jax.random.uniform(k, (y,)))(_fold(keys_B, 0))
    ok_BxY = u_BxY * q_at_d_BxY < jnp.exp(logp_at_d_BxY)
    n_acc_B = jnp.sum(jnp.cumprod(ok_BxY.astype(jnp.int32), axis=1), axis=1)
    # The residual of the first rejected position only (q = 0 past the drafts: the bonus).
    p_sel_BxV = jnp.exp(_take(logp_BxWxV, n_acc_B))
    q_sel = _take(jnp.concatenate([q_BxYxVd, jnp.zeros_like(q_BxYxVd[:, :1])], 1), n_acc_B)
    if vocab_Vd is not None:  # into the full vocabulary (0 off the draft vocabulary)
        q_sel = jnp.zeros_like(p_sel_BxV).at[:, vocab_Vd].set(q_sel)
    resid_BxV = jnp.maximum(p_sel_BxV - q_sel, 0.0)
    z_ok_B = resid_BxV.sum(-1) > 1e-12
    resid_BxV = jnp.where(z_ok_B[:, None], resid_BxV, p_sel_BxV)
    return n_acc_B, draw(_fold(keys_B, 1), jnp.log(resid_BxV), scfg)


def init_state(m: Models, pol_gd, pol_params, prompt_BxP, prompt_lens_B, row_keys_B) -> State:
    """Prefills the policy (the first token comes from the last prompt position) and the MTP on
    positions 0 .. P_b-2 (hidden at t, token t+1); position P_b-1 waits in the catch-up buffer
    with the first sampled token. With `scfg.prompt_group` G, both once per run of G rows."""
    policy, scfg, spec = m.policy, m.scfg, m.spec
    rows, width = prompt_BxP.shape
    n, y = scfg.max_new_tokens, m.max_draft
    w = catch_width(spec.num_draft, m.sync_mtp, n, y)
    g = scfg.prompt_group
    last_BxV, hid_BxPxD, feat_BxPxF, policy_cache = model.prefill_last_features(
        pol_gd, pol_params, prompt_BxP, prompt_lens_B, m.max_len, m.collect, m.layers, g
    )
    feat_BxPxF = hid_BxPxD if feat_BxPxF is None else feat_BxPxF
    fused_BxPxD = mtp_lib.fuse(m.mtp, feat_BxPxF)
    first_B = draw(_fold(row_keys_B, 0), process_logits(last_BxV, scfg), scfg)
    first_logp_BxV = stats_logprobs(last_BxV, scfg)

    next_tok_BxP = jnp.concatenate([prompt_BxP[:, 1:], prompt_BxP[:, :1]], axis=1)
    next_tok_BxP = jnp.where(
        jnp.arange(width)[None] == (prompt_lens_B - 1)[:, None], first_B[:, None], next_tok_BxP
    )
    # With prompt groups, once per run: an MTP slot's K/V depend only on the (features, next
    # token) of the slots at or before it, so slot P_b-1 (the row's first sampled token) is the
    # only kept one that differs within a run; it lies past the kept length, and the first
    # catch-up (or `regamma`'s consume after a γ = 0 bucket) rewrites it before anything
    # attends to it.
    mtp_cache = mtp_lib.new_cache(
        policy.cfg, m.mtp.num_layers, rows // g, m.max_len + m.mtp_slack, m.mtp.depth
    )
    for j in range(m.mtp.num_layers):
        mtp_cache = mtp_lib.write_kv(
            m.mtp, policy, j, mtp_cache, fused_BxPxD[::g], next_tok_BxP[::g]
        )
    if g > 1:
        mtp_cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), mtp_cache)
    mtp_cache = mtp_cache.advance(prompt_lens_B - 1)
    catch_hid = jnp.zeros((rows, w, policy.cfg.dim), fused_BxPxD.dtype)
    catch_hid = catch_hid.at[:, 0].set(_take(fused_BxPxD, prompt_lens_B - 1))
    catch_tok = jnp.zeros((rows, w), jnp.int32).at[:, 0].set(first_B)

    zeros_f, zeros_i = jnp.zeros((rows, n + y + 1)), jnp.zeros((rows, n + y + 1), jnp.int32)
    out = SampleOutput(
        tokens=zeros_i.at[:, 0].set(first_B),
        logprobs=zeros_f.at[:, 0].set(_take(first_logp_BxV, first_B)),
        entropy=zeros_f.at[:, 0].set(entropy(first_logp_BxV)),
        lengths=jnp.ones((rows,), jnp.int32),
    )
    stats = SpecStats(
        attempts=jnp.zeros((rows, y), jnp.int32),
        accepts=jnp.zeros((rows, y), jnp.int32),
        accept_hist=jnp.zeros((rows, y + 1), jnp.int32),
        verify_calls=jnp.zeros((rows,), jnp.int32),
        status=zeros_i.at[:, 0].set(UNDRAFTED),
        overlap=zeros_f,
        overlap_other=zeros_f if spec.other_rule else None,
    )
    hid_buf = cyc_buf = feat_buf = None
    if spec.record:
        hid_buf = jnp.zeros((rows, m.max_len, policy.cfg.dim), hid_BxPxD.dtype)
        hid_buf = hid_buf.at[:, :width].set(hid_BxPxD)
        cyc_buf = jnp.zeros((rows, m.max_len), jnp.int32)
        if m.collect is not None:
            feat_buf = jnp.zeros((rows, m.max_len, feat_BxPxF.shape[-1]), feat_BxPxF.dtype)
            feat_buf = feat_buf.at[:, :width].set(feat_BxPxF)
    return State(
        cycle=jnp.int32(0),
        policy_cache=policy_cache,
        mtp_cache=mtp_cache,
        pending_B=first_B,
        catch_hid_BxWxD=catch_hid,
        catch_tok_BxW=catch_tok,
        n_catch_B=jnp.ones((rows,), jnp.int32),
        done_B=is_eos(first_B, scfg.eos_ids) | (n <= 1),
        keys_B=row_keys_B,
        out=out,
        stats=stats,
        hid_buf=hid_buf,
        cyc_buf=cyc_buf,
        feat_buf=feat_buf,
    )


def _catch_up(m: Models, s: State):
    """Every MTP layer consumes the catch-up buffer (so each keeps its cache complete); layer 0's
    output at the row's last consumed position starts the chain. Only that position goes through
    attention, the MLP and the head; the others (and every position of later layers) only write
    their keys and values, which depend on nothing else. Returns (hidden `[B, 1, D]`, draft-1
    logits `[B, Vd]`, MTP cache)."""
    last_B = jnp.maximum(s.n_catch_B - 1, 0)
    hid_Bx1xD, normed_Bx1xD, mtp_cache = mtp_lib.extend(
        m.mtp, m.policy, 0, s.mtp_cache, s.catch_hid_BxWxD, s.catch_tok_BxW, at_B=last_B
    )
    logits_BxVd = mtp_lib.logits(m.policy, normed_Bx1xD, m.head_DxVd)[:, 0]
    for j in range(1, m.mtp.num_layers):
        mtp_cache = mtp_lib.write_kv(
            m.mtp, m.policy, j, mtp_cache, s.catch_hid_BxWxD, s.catch_tok_BxW
        )
    return hid_Bx1xD, logits_BxVd, mtp_cache.advance(s.n_catch_B)


def _draft(m: Models, hid_Bx1xD, logits_BxVd, mtp_cache, anchor_B, keys_B):
    """Y drafts from the chain. Returns (token ids `[B, Y]`, indices into the draft vocabulary
    `[B, Y]`, the rule's q `[B, Y, Vd]`, the other rule's q `[B, Y, Vd]` or None unless
    `SpecConfig.other_rule`); the MTP cache is rolled back to `anchor_B` after."""
    n_mtp, y, b = m.mtp.num_layers, m.spec.num_draft, anchor_B.shape[0]
    rule = DRAFT_RULES[m.spec.rule]
    other = DRAFT_RULES[OTHER_RULE[m.spec.rule]] if m.spec.other_rule else None
    if y == 0:
        none_Bx0 = jnp.zeros((b, 0), jnp.int32)
        q_Bx0xVd = jnp.zeros((b, 0, m.head_DxVd.shape[1]))
        return none_Bx0, none_Bx0, q_Bx0xVd, q_Bx0xVd if other else None, mtp_cache
    idx, toks, qs, qs_other = [], [], [], []
    for k in range(1, y + 1):
        if k > 1:
            layer = (k - 1) % n_mtp
            valid = None
            if n_mtp > 1:  # this layer's chain entries of this cycle, plus accepted slots
                own = jnp.asarray([i - 2 for i in range(2, k + 1) if (i - 1) % n_mtp == layer])
                rel_BxS = jnp.arange(mtp_cache.k[0].shape[2])[None] - anchor_B[:, None]
                valid = (rel_BxS < 0) | jnp.isin(rel_BxS, own)
            hid_Bx1xD, normed_Bx1xD, mtp_cache = mtp_lib.extend(
                m.mtp, m.policy, layer, mtp_cache, hid_Bx1xD, toks[-1][:, None], valid
            )
            mtp_cache = mtp_cache.advance(jnp.ones((b,), jnp.int32))
            logits_BxVd = mtp_lib.logits(m.policy, normed_Bx1xD, m.head_DxVd)[:, 0]
        logq_BxVd = process_logits(logits_BxVd, m.scfg)
        d_idx_B, q_BxVd = rule(_fold(keys_B, k), logq_BxVd, m.scfg)
        idx.append(d_idx_B)
        toks.append(d_idx_B if m.vocab_Vd is None else m.vocab_Vd[d_idx_B])
        qs.append(q_BxVd)
        if other:  # its draft is not used (the chain follows this rule's drafts)
            qs_other.append(other(_fold(keys_B, k), logq_BxVd, m.scfg)[1])
    return (
        jnp.stack(toks, axis=1),
        jnp.stack(idx, axis=1),
        jnp.stack(qs, axis=1),
        jnp.stack(qs_other, axis=1) if other else None,
        mtp_cache.rollback(anchor_B),
    )


def _verify(m: Models, s: State, drafts_BxY):
    """One policy forward over [pending, d_1 .. d_Y] at each row's offset. Returns (logits
    `[B, W, V]`, backbone hiddens `[B, W, D]`, the MTP's features `[B, W, F*D]` (the hiddens
    themselves unless it reads other layers: `Models.collect`), policy cache advanced by W)."""
    w = drafts_BxY.shape[1] + 1
    tok_BxW = jnp.concatenate([s.pending_B[:, None], drafts_BxY], axis=1)
    positions_BxW = s.policy_cache.positions(w)
    logits_BxWxV, hid_BxWxD, feat_BxWxF, cache = m.policy.forward_features(
        tok_BxW, positions_BxW, s.policy_cache, m.layers, m.collect
    )
    feat_BxWxF = hid_BxWxD if feat_BxWxF is None else feat_BxWxF
    cache = cache.advance(jnp.full((tok_BxW.shape[0],), w, jnp.int32))
    return logits_BxWxV, hid_BxWxD, feat_BxWxF, cache


def _emit(m: Models, s: State, drafts_BxY, n_acc_B, next_B, logits_BxWxV, logp_BxWxV, qs_BxYxVd):
    """Writes each row's emitted tokens (accepted drafts, then `next_B`; cut at EOS and the
    budget) with their log-probs, entropies, status and overlap. `qs_BxYxVd`: (the rule's q, the
    other rule's q or None). Returns (out, stats, tokens `[B, W]` as emitted, n_emit `[B]`,
    finished `[B]`)."""
    scfg, y = m.scfg, drafts_BxY.shape[1]
    b = drafts_BxY.shape[0]
    live_B = ~s.done_B
    idx_W = jnp.arange(y + 1)[None]
    drafts_pad_BxW = jnp.pad(drafts_BxY, ((0, 0), (0, 1)))  # column Y is never an accepted draft
    emit_BxW = jnp.where(idx_W < n_acc_B[:, None], drafts_pad_BxW, next_B[:, None])
    n_emit_B, finished_B = _emit_limits(
        emit_BxW, n_acc_B + 1, s.out.lengths, s.done_B, scfg, scfg.max_new_tokens
    )
    slogp_BxWxV = logp_BxWxV if scfg.temperature > 0 else stats_logprobs(logits_BxWxV, scfg)
    lp_BxW = jnp.take_along_axis(slogp_BxWxV, emit_BxW[..., None], -1)[..., 0]
    status_BxW = jnp.where(
        idx_W < n_acc_B[:, None], ACCEPTED, jnp.where(n_acc_B[:, None] < y, REJECTED, UNDRAFTED)
    )
    # Σ_v min(p, q) over the draft vocabulary (q is 0 outside it).
    logp_d_BxYxVd = logp_BxWxV[:, :y] if m.vocab_Vd is None else logp_BxWxV[:, :y, m.vocab_Vd]

    def overlap_BxW(q_BxYxVd):
        overlap_BxY = jnp.sum(jnp.minimum(jnp.exp(logp_d_BxYxVd), q_BxYxVd), axis=-1)
        overlap_BxW = jnp.concatenate([overlap_BxY, jnp.zeros((b, 1))], axis=1)
        return jnp.where(status_BxW == UNDRAFTED, 0.0, overlap_BxW)

    o, st, off = s.out, s.stats, s.out.lengths
    q_BxYxVd, q_other_BxYxVd = qs_BxYxVd
    if q_other_BxYxVd is not None:
        st = st.replace(
            overlap_other=_write_rows(st.overlap_other, overlap_BxW(q_other_BxYxVd), off)
        )
    o = o.replace(
        tokens=_write_rows(o.tokens, emit_BxW, off),
        logprobs=_write_rows(o.logprobs, lp_BxW, off),
        entropy=_write_rows(o.entropy, entropy(slogp_BxWxV), off),
        lengths=off + n_emit_B,
    )
    st = st.replace(
        **_cycle_counts(st, n_acc_B, n_emit_B, live_B, y),
        status=_write_rows(st.status, status_BxW, off),
        overlap=_write_rows(st.overlap, overlap_BxW(q_BxYxVd), off),
    )
    return o, st, emit_BxW, finished_B


def _roll_back(
    m: Models, s: State, caches, n_acc_B, next_B, hiddens, emit_BxW, finished_B, outputs
) -> State:
    """The policy keeps the pending token and the accepted drafts; the cycle's last token becomes
    pending; the positions the policy kept wait for the MTP's next catch-up (their features,
    fused once here). `hiddens`: the verify's (hiddens `[B, W, D]`, features `[B, W, F*D]`)."""
    policy_cache, mtp_cache = caches
    out, stats = outputs
    hid_BxWxD, feat_BxWxF = hiddens
    live_B = ~s.done_B
    anchor_B = s.policy_cache.lengths
    w = emit_BxW.shape[1]
    policy_cache = policy_cache.rollback(jnp.where(live_B, anchor_B + n_acc_B + 1, anchor_B))
    hid_buf, cyc_buf, feat_buf = s.hid_buf, s.cyc_buf, s.feat_buf
    if m.spec.record:  # done rows write into the spare last slot
        at_B = jnp.where(live_B, anchor_B, m.max_len - w)
        hid_buf = _write_rows(hid_buf, hid_BxWxD, at_B)
        if feat_buf is not None:
            feat_buf = _write_rows(feat_buf, feat_BxWxF, at_B)
        cycle_anchor_B = jnp.where(live_B, anchor_B - 1, m.max_len - 1)
        cyc_buf = _write_rows(cyc_buf, (n_acc_B + 1)[:, None], cycle_anchor_B)
    fused_BxWxD = mtp_lib.fuse(m.mtp, feat_BxWxF)
    catch_hid, catch_tok, n_catch = fused_BxWxD, emit_BxW, jnp.where(live_B, n_acc_B + 1, 0)
    if not m.spec.num_draft and m.sync_mtp:  # deferred catch-up: append this position
        catch_hid = _write_rows(s.catch_hid_BxWxD, fused_BxWxD, s.n_catch_B)
        catch_tok = _write_rows(s.catch_tok_BxW, emit_BxW, s.n_catch_B)
        n_catch = s.n_catch_B + live_B.astype(jnp.int32)
    return State(
        cycle=s.cycle + 1,
        policy_cache=policy_cache,
        mtp_cache=mtp_cache,
        pending_B=jnp.where(live_B, next_B, s.pending_B),
        catch_hid_BxWxD=catch_hid,
        catch_tok_BxW=catch_tok,
        n_catch_B=n_catch,
        done_B=finished_B,
        keys_B=s.keys_B,
        out=out,
        stats=stats,
        hid_buf=hid_buf,
        cyc_buf=cyc_buf,
        feat_buf=feat_buf,
    )


def row_outputs(s: State) -> tuple:
    """What `finalise` reads: the per-row outputs (the caches and buffers stay behind)."""
    return s.out, s.stats, s.hid_buf, s.cyc_buf, s.feat_buf


def finalise(scfg: SamplingConfig, record: bool, rows: tuple, prompt_width: int) -> SpecOutput:
    o, st, hid_buf, cyc_buf, feat_buf = rows
    n = scfg.max_new_tokens
    mask_BxN = jnp.arange(n)[None] < o.lengths[:, None]
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
    if st.overlap_other is not None:
        stats = stats.replace(overlap_other=jnp.where(mask_BxN, st.overlap_other[:, :n], 0.0))
    if not record:
        return SpecOutput(sample_out, stats)
    width = prompt_width + n
    feats = None if feat_buf is None else feat_buf[:, :width]
    return SpecOutput(sample_out, stats, hid_buf[:, :width], cyc_buf[:, :width], feats)


def make_models(
    pol_gd, pol_params, mtp_gd, mtp_params, draft_vocab, layers, scfg, spec, max_len, **kw
) -> Models:
    policy = nnx.merge(pol_gd, pol_params)
    vocab_Vd = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
    layers = model.decode_layers(pol_gd, pol_params) if layers is None else layers
    return Models(
        policy=policy,
        layers=layers,
        mtp=mtp_lib.for_decode(nnx.merge(mtp_gd, mtp_params)),
        head_DxVd=layers.head_DxV if vocab_Vd is None else mtp_lib.draft_head(policy, vocab_Vd),
        vocab_Vd=vocab_Vd,
        scfg=scfg,
        spec=spec,
        max_len=max_len,
        **{"max_draft": spec.num_draft, **kw},
    )


def _cycle(m: Models, s: State) -> State:
    scfg = m.scfg
    keys_B = _fold(s.keys_B, s.cycle + 1)  # 0: the first token
    hid_Bx1xD = logits_BxVd = None
    mtp_cache = s.mtp_cache
    if m.spec.num_draft:  # γ = 0: no MTP work (a deferred catch-up only appends: `_roll_back`)
        hid_Bx1xD, logits_BxVd, mtp_cache = _catch_up(m, s)
    anchor_B = s.policy_cache.lengths
    drafts_BxY, d_idx_BxY, q_BxYxVd, q_other_BxYxVd, mtp_cache = _draft(
        m, hid_Bx1xD, logits_BxVd, mtp_cache, anchor_B, keys_B
    )
    logits_BxWxV, hid_BxWxD, feat_BxWxF, policy_cache = _verify(m, s, drafts_BxY)
    logp_BxWxV = process_logits(logits_BxWxV, scfg)
    n_acc_B, next_B = accept(
        _fold(keys_B, 0), logp_BxWxV, q_BxYxVd, d_idx_BxY, drafts_BxY, scfg, m.vocab_Vd
    )
    out, stats, emit_BxW, finished_B = _emit(
        m, s, drafts_BxY, n_acc_B, next_B, logits_BxWxV, logp_BxWxV, (q_BxYxVd, q_other_BxYxVd)
    )
    return _roll_back(
        m,
        s,
        (policy_cache, mtp_cache),
        n_acc_B,
        next_B,
        (hid_BxWxD, feat_BxWxF),
        emit_BxW,
        finished_B,
        (out, stats),
    )


def live(s: State, scfg: SamplingConfig) -> jax.Array:
    return ~s.done_B & (s.cycle < scfg.max_new_tokens)


def run_cycles(m: Models, s: State, min_live) -> State:
    """Cycles while more than `min_live` rows are live (0: until every row ends)."""
    running = lambda s: jnp.sum(live(s, m.scfg)) > min_live  # noqa: E731
    return jax.lax.while_loop(running, functools.partial(_cycle, m), s)


def sample(
    pol_gd,
    pol_params,
    mtp_gd,
    mtp_params,
    prompt_BxP,
    prompt_lens_B,
    rng,
    scfg,
    spec,
    draft_vocab=None,
    layers=None,
):
    """Speculative sampling; same outputs as `sampling.sample` plus `SpecStats`.
    Jit with `pol_gd`, `mtp_gd`, `scfg`, `spec` static.

    `draft_vocab` (int32 `[Vd]`, distinct token ids) restricts the MTP's head to Vd tokens: q is
    a distribution over them, placed into the full vocabulary (0 elsewhere) for the residual, so
    the acceptance test and the residual stay exact -- the output distribution is unchanged.
    `layers`: the policy's `model.decode_layers`, made once per parameter version by a caller
    that samples repeatedly (made here otherwise: a copy of every weight per call)."""
    rows, width = prompt_BxP.shape
    max_len = width + scfg.max_new_tokens + spec.num_draft + 1
    m = make_models(
        *(pol_gd, pol_params, mtp_gd, mtp_params, draft_vocab, layers, scfg, spec, max_len),
        sync_mtp=spec.num_draft > 0,  # γ = 0 throughout: the MTP never drafts
    )
    row_keys_B = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(rows))
    state = init_state(m, pol_gd, pol_params, prompt_BxP, prompt_lens_B, row_keys_B)
    return finalise(scfg, spec.record, row_outputs(run_cycles(m, state, 0)), width)


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


def summary_sums(out: SpecOutput) -> dict:
    """The additive parts of `summarize` over the rows of `out` (host numbers): what several
    processes add up over their own rows before `summary_from_sums`."""
    st = jax.device_get(out.stats)
    lengths = np.asarray(jax.device_get(out.sample.lengths))
    ent = np.asarray(jax.device_get(out.sample.entropy))
    emitted = np.arange(ent.shape[1])[None] < lengths[:, None]
    attempts = np.asarray(st.attempts).sum(0)
    kpos = draft_positions(st.status)
    overlap = np.asarray(st.overlap)
    per_k = range(len(attempts))
    return {
        "attempts": attempts,
        "accepts": np.asarray(st.accepts).sum(0),
        "hist": np.asarray(st.accept_hist).sum(0),
        "overlap_k": np.asarray([overlap[kpos == k].sum() for k in per_k], np.float64),
        "drafted_k": np.asarray([(kpos == k).sum() for k in per_k], np.int64),
        "entropy": np.float64((ent * emitted).sum()),
        "emitted": np.int64(emitted.sum()),
        "tokens": np.int64(lengths.sum()),
    }


def summary_from_sums(sums: dict) -> dict:
    """Host-side acceptance figures of one speculative rollout (all rows pooled) from
    `summary_sums`: per draft position k the empirical acceptance rate `accept_rate_k` and the
    mean analytic acceptance Σ min(p, q) `analytic_alpha_k`; tokens per verify, `accept_len`,
    and their histogram `accept_hist_m` (share of verifies that emitted m tokens)."""
    attempts, accepts, hist = sums["attempts"], sums["accepts"], sums["hist"]
    overlap_k, drafted_k = sums["overlap_k"], sums["drafted_k"]
    res = {}
    for k in range(len(attempts)):
        res[f"accept_rate_{k + 1}"] = float(accepts[k] / max(attempts[k], 1))
        res[f"analytic_alpha_{k + 1}"] = float(overlap_k[k] / max(drafted_k[k], 1))
    res["accept_rate"] = float(accepts.sum() / max(attempts.sum(), 1))
    res["accept_len"] = float((hist * np.arange(1, len(hist) + 1)).sum() / max(hist.sum(), 1))
    for m in range(len(hist)):
        res[f"accept_hist_{m + 1}"] = float(hist[m] / max(hist.sum(), 1))
    res["analytic_alpha"] = float(overlap_k.sum() / max(drafted_k.sum(), 1))
    res["mean_entropy"] = float(sums["entropy"] / max(sums["emitted"], 1))
    res["tokens"] = int(sums["tokens"])
    return res


def summarize(out: SpecOutput) -> dict:
    """`summary_from_sums(summary_sums(out))`: the acceptance figures of one rollout's rows."""
    return summary_from_sums(summary_sums(out))
