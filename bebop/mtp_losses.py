"""MTP draft losses (docs/method.md §4), vocabulary-chunked, float32, by name from `MTP_LOSSES`.

Every loss takes the draft's normed hiddens for Y steps, `draft_YxBxTxD` (from `mtp.train_hidden`;
step k at anchor t predicts token t+k+1), the frozen policy's normed final hiddens
`target_BxTxD` (the target distribution of token t+k+1 is the policy's at position t+k), the shared
head `head_DxV`, the data tokens and a mask of positions whose token is supervised. Logits are
never materialised for all positions and steps at once: a `lax.scan` over vocabulary chunks keeps
an online max / exp-sum (pass 1), then accumulates the overlap Σ min(p, q), S = Σ q·1[q ≤ p] and
the KL terms (pass 2). Autodiffed passes are rematerialised per chunk; TV has an analytic VJP.
A vocabulary that fits one chunk (a draft vocabulary, a small model's) is not rematerialised: CE
and the KL losses compute each side's logits once and keep them for the backward pass (the TV
losses' scan of one chunk already compiles to that). Draft vocabulary of 8,192 at SmolLM2's
pre-RL MTP shapes (3,840 positions), loss + gradient: KL 1.58 -> 0.95 s, CE 0.73 -> 0.53 s.

  ce          -log q_k(x_{t+k+1})                                        (hard labels)
  kl          KL(p‖q) = Σ p (log p − log q)                              gradient q − p
  reverse_kl  KL(q‖p) = Σ q (log q − log p)
  tv          1 − α,  α_k = Σ_v min(p_k, q_k)                            (per-step mean)
              ∂L/∂z_j = −q_j (1[q_j ≤ p_j] − S),  S = Σ_v 1[q_v ≤ p_v] q_v (ties accepted)
  e2e_tv      1 − (1/Y) Σ_{j=1..Y} Π_{i≤j} α_i    (Bebop Eq. 13: one minus normalised E[accept])
  e2e_tv_partial  the same, chains cut at the sequence end instead of masked (see its doc)
  dca         −log Σ_{l=1..m} Π_{i≤l} α_i          (GrowMTP; m = accepted + 1 when known, else Y)
`p` is detached (self-distillation); chains that cross a sequence end are masked for e2e_tv
and cut at the end for e2e_tv_partial / dca.

Draft vocabulary (`draft_loss(..., vocab=ids)`): q lives on K tokens, p stays the policy's full
distribution (its log-normaliser over all V tokens is computed once per position, `target_stats`)
and only its mass on those K tokens enters the losses -- so α = Σ_{v∈K} min(p, q) is still exactly
the acceptance rate; `ce` supervises only labels inside the draft vocabulary.

The sampler's truncation (`top_k`, `top_p`: `sampling.process_logits`, the rollout's): the
verifier compares p̃ and q̃, the tempered distributions after top-k then top-p, each over its own
vocabulary (q over the draft vocabulary, p over all V), and so does every α here -- the TV-type
losses and every loss's per-step α metric:
  α = Σ_v min(p̃, q̃),  p̃_v = exp(z_v − lse_S) for z_v ≥ floor (S: the support), 0 elsewhere,
with z the tempered logits. `support_floor` finds each row's support once over the whole
vocabulary (the sampler's own code on blocks of rows) as a floor on z, which the chunked scans
apply (NEG below it: probability exactly 0, no -inf arithmetic). The TV gradient is the formula
above with q̃ and S̃ = Σ_v 1[q̃_v ≤ p̃_v] q̃_v, 0 off q's support; the support itself is
piecewise constant (a one-token support, or one disjoint from p's, gives α but no gradient).
`ce`, `kl` and `reverse_kl` keep the untruncated tempered distributions: a KL to a truncated
distribution is infinite off its support, and (full vocabulary) their minimiser q = p truncates
to exactly p̃.

`mtp_loss(...)` is the loss over the MTP's parameters that the stages train (`mtp` before RL; the
RL learner's MTP strategies, GrowMTP's being `dca`), at the rollout's temperature and truncation:
it runs the frozen policy (its parameters an explicit argument, always under `stop_gradient`) and
`mtp.train_hidden` on an `MTPBatch`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from bebop import mtp as mtp_lib
from bebop import sampling, sharding

NEG = -1e30


def truncates(top_k: int, top_p: float) -> bool:
    """Whether the sampler's top-k / top-p (`sampling.process_logits`) can drop tokens."""
    return top_k > 0 or top_p < 1.0


def _chunks(head_DxV, chunk: int):
    """Head columns as [n_chunks, D, C] (zero-padded) and a [n_chunks, C] validity mask."""
    d, v = head_DxV.shape
    chunk = min(chunk, v)
    n = -(-v // chunk)
    w = jnp.pad(head_DxV.astype(jnp.float32), ((0, 0), (0, n * chunk - v)))
    valid = (jnp.arange(n * chunk) < v).reshape(n, chunk)
    return w.reshape(d, n, chunk).transpose(1, 0, 2), valid


def _logits(h_NxD, w_DxC, valid_C, temperature, floor_N=None):
    """Tempered logits of one chunk: NEG off the vocabulary and, given the rows' support floors
    (`support_floor`), below them -- the tokens the sampler's truncation drops get probability
    exactly 0 (NEG, not -inf: no inf - inf or 0 · inf downstream)."""
    z = (h_NxD @ w_DxC) / temperature
    keep = valid_C if floor_N is None else valid_C & (z >= floor_N[:, None])
    return jnp.where(keep, z, NEG)


def support_floor(h_NxD, head_DxV, temperature: float, top_k=0, top_p=1.0, chunk=8192):
    """The sampler's support (`sampling.process_logits`: top-k, then top-p, of the logits / T)
    per row as a floor on the tempered logits z = h·W / T: token v is kept iff z_v >= floor.
    The floor lies halfway between the smallest kept z and the largest dropped one (-inf when
    nothing is dropped), so z recomputed chunk by chunk (other rounding) keeps the same tokens.
    Top-p needs a row's whole vocabulary at once (it sorts it): the rows go in blocks of
    ~N·C / V, a block holding as many logits as one chunk `C` of the losses' scans. No gradient
    (the support is piecewise constant in h)."""
    h = jax.lax.stop_gradient(h_NxD.astype(jnp.float32))
    w = jax.lax.stop_gradient(head_DxV.astype(jnp.float32))
    (n, d), v = h.shape, w.shape[1]
    if not truncates(top_k, top_p):
        return jnp.full((n,), -jnp.inf)
    rows = max(1, min(n, n * min(chunk, v) // v))
    blocks = -(-n // rows)
    h_BxRxD = jnp.pad(h, ((0, blocks * rows - n), (0, 0))).reshape(blocks, rows, d)
    cut = sampling.SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)  # z is tempered

    def block(h_RxD):
        z_RxV = (h_RxD @ w) / temperature
        kept_RxV = sampling.process_logits(z_RxV, cut) > -jnp.inf
        lo_R = jnp.min(jnp.where(kept_RxV, z_RxV, jnp.inf), axis=-1)
        hi_R = jnp.max(jnp.where(kept_RxV, -jnp.inf, z_RxV), axis=-1)
        return jnp.where(hi_R > -jnp.inf, hi_R + 0.5 * (lo_R - hi_R), -jnp.inf)

    return jax.lax.map(block, h_BxRxD).reshape(-1)[:n]


def _lse(h_NxD, w_chunks, valid, temperature, floor_N=None):
    """Pass 1: log-sum-exp over the vocabulary (over the support, given floors) with an online
    max."""
    if w_chunks.shape[0] == 1:  # one chunk: no scan, no rematerialisation
        z = _logits(h_NxD, w_chunks[0], valid[0], temperature, floor_N)
        return jax.nn.logsumexp(z, axis=-1)

    @jax.checkpoint
    def body(carry, xs):
        m, s = carry
        z = _logits(h_NxD, *xs, temperature, floor_N)
        m_new = jnp.maximum(m, z.max(-1))
        return (m_new, s * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None]).sum(-1)), None

    n = h_NxD.shape[0]
    (m, s), _ = jax.lax.scan(body, (jnp.full((n,), NEG), jnp.zeros((n,))), (w_chunks, valid))
    return m + jnp.log(s)


def _sums(zq, zp, lse_q, lse_p):
    """One chunk's α, S, Σ p(zp − zq), Σ q(zq − zp) and Σ p per position."""
    q, p = jnp.exp(zq - lse_q[:, None]), jnp.exp(zp - lse_p[:, None])
    return (
        jnp.minimum(p, q).sum(-1),
        jnp.where(q <= p, q, 0.0).sum(-1),
        (p * (zp - zq)).sum(-1),
        (q * (zq - zp)).sum(-1),
        p.sum(-1),
    )


def _pass2(hq, hp, w_chunks, valid, lse_q, lse_p, temperature, floors=None):
    """Pass 2: overlap α, S, Σ p(zp − zq), Σ q(zq − zp), Σ p (1 unless a draft vocabulary);
    `floors` = (q's, p's) support floors, or None: the untruncated distributions."""
    floor_q, floor_p = (None, None) if floors is None else floors

    def sums(xs):
        zq = _logits(hq, *xs, temperature, floor_q)
        return _sums(zq, _logits(hp, *xs, temperature, floor_p), lse_q, lse_p)

    @jax.checkpoint
    def body(carry, xs):
        return tuple(c + x for c, x in zip(carry, sums(xs), strict=True)), None

    zero = jnp.zeros((hq.shape[0],))
    return jax.lax.scan(body, (zero,) * 5, (w_chunks, valid))[0]


def overlap(hq_NxD, hp_NxD, head_DxV, lse_p_N, chunk: int, temperature: float, floors=None):
    """α = Σ_v min(p, q) per position, with the analytic TV gradient; `lse_p_N` is the target's
    log-normaliser (over its support, given floors). `floors` = (q's, p's) `support_floor`s:
    p and q are the sampler's truncated distributions, exactly 0 off their supports (None: the
    untruncated ones). The target, the head and the floors are frozen: their cotangents are
    zero (callers pass them through stop_gradient)."""
    return _overlap(hq_NxD, hp_NxD, head_DxV, lse_p_N, floors, chunk, temperature)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _overlap(hq_NxD, hp_NxD, head_DxV, lse_p_N, floors, chunk: int, temperature: float):
    return _overlap_fwd(hq_NxD, hp_NxD, head_DxV, lse_p_N, floors, chunk, temperature)[0]


def _overlap_fwd(hq, hp, head, lse_p, floors, chunk, temperature):
    w_chunks, valid = _chunks(head, chunk)
    lse_q = _lse(hq, w_chunks, valid, temperature, None if floors is None else floors[0])
    a, s, _, _, _ = _pass2(hq, hp, w_chunks, valid, lse_q, lse_p, temperature, floors)
    return a, (hq, hp, head, lse_q, lse_p, floors, s)


def _overlap_bwd(chunk, temperature, res, g_N):
    """∂α/∂z_j = q_j (1[q_j ≤ p_j] − S) / T on q's support; 0 off it (q_j = 0 there)."""
    hq, hp, head, lse_q, lse_p, floors, s = res
    floor_q, floor_p = (None, None) if floors is None else floors
    w_chunks, valid = _chunks(head, chunk)

    def body(dh, xs):
        w, v = xs
        zq, zp = _logits(hq, w, v, temperature, floor_q), _logits(hp, w, v, temperature, floor_p)
        q, p = jnp.exp(zq - lse_q[:, None]), jnp.exp(zp - lse_p[:, None])
        gz = g_N[:, None] * q * ((q <= p).astype(jnp.float32) - s[:, None]) / temperature
        return dh + gz @ w.T, None

    dh, _ = jax.lax.scan(body, jnp.zeros_like(hq), (w_chunks, valid))
    zeros = jax.tree.map(jnp.zeros_like, (hp, head, lse_p, floors))
    return (dh, *zeros)


_overlap.defvjp(_overlap_fwd, _overlap_bwd)


# ----------------------------------------------------------------------------- the target


@struct.dataclass
class TargetStats:
    """The frozen target's normalisers per position at the losses' temperature, over the full
    vocabulary (z = logits / T): `lse` = log Σ_v exp(z_v); with a truncating sampler also its
    `support_floor` `floor` and `lse_kept` = log Σ_{z_v ≥ floor} exp(z_v) (else None)."""

    lse: jax.Array
    floor: jax.Array | None = None
    lse_kept: jax.Array | None = None


def _full_stats(hp_NxD, head_DxV, chunk, temperature, top_k, top_p) -> TargetStats:
    w_chunks, valid = _chunks(head_DxV, chunk)
    lse = _lse(hp_NxD, w_chunks, valid, temperature)
    if not truncates(top_k, top_p):
        return TargetStats(lse)
    floor = support_floor(hp_NxD, head_DxV, temperature, top_k, top_p, chunk)
    return TargetStats(lse, floor, _lse(hp_NxD, w_chunks, valid, temperature, floor))


def target_stats(
    target_BxTxD, head_DxV, chunk: int = 8192, temperature: float = 1.0, top_k=0, top_p=1.0
) -> TargetStats:
    """The target's `TargetStats` `[B, T]` over the full vocabulary (what `draft_loss` needs when
    `vocab` is given), for caching next to a frozen policy's hiddens."""
    return _target_stats(target_BxTxD, head_DxV, chunk, temperature, top_k, top_p)


def _target_stats(target_BxTxD, head_DxV, chunk, temperature, top_k, top_p) -> TargetStats:
    b, t, d = target_BxTxD.shape
    hp_NxD = jax.lax.stop_gradient(target_BxTxD.astype(jnp.float32)).reshape(b * t, d)
    stats = _full_stats(hp_NxD, jax.lax.stop_gradient(head_DxV), chunk, temperature, top_k, top_p)
    return jax.tree.map(lambda x: x.reshape(b, t), stats)


def _target_lse(hp_NxD, stats, w_chunks, valid, temperature):
    """The target's untruncated log-normaliser (from `stats` when given), without gradient."""
    lse = stats.lse if stats is not None else _lse(hp_NxD, w_chunks, valid, temperature)
    return jax.lax.stop_gradient(lse)


def _target_kept(hp_NxD, stats, head_DxV, chunk, temperature, top_k, top_p):
    """(support floor or None, log-normaliser over the support) of the distribution the verifier
    uses for the target: the sampler's truncation of the tempered one (from `stats` when it
    holds them, else computed over `head_DxV`), without gradient."""
    if not truncates(top_k, top_p):
        return None, _target_lse(hp_NxD, stats, *_chunks(head_DxV, chunk), temperature)
    if stats is not None and stats.floor is not None:
        return jax.lax.stop_gradient(stats.floor), jax.lax.stop_gradient(stats.lse_kept)
    floor = support_floor(hp_NxD, head_DxV, temperature, top_k, top_p, chunk)
    lse = _lse(hp_NxD, *_chunks(head_DxV, chunk), temperature, floor)
    return floor, jax.lax.stop_gradient(lse)


# ----------------------------------------------------------------------------- losses


def _prepare(draft_YxBxTxD, target_BxTxD, tokens_BxT, mask_BxT, stats=None):
    """Flattened per-(step, anchor) inputs: draft hidden, target hidden at t+k, label, validity,
    and the target's `TargetStats` at t+k (None: computed over the head's vocabulary later)."""
    y, b, t, d = draft_YxBxTxD.shape
    target = jax.lax.stop_gradient(target_BxTxD.astype(jnp.float32))
    tgt, labels, valid = [], [], []
    for k in range(1, y + 1):
        tgt.append(jnp.pad(target[:, k:], ((0, 0), (0, k), (0, 0))))
        labels.append(jnp.pad(tokens_BxT[:, k + 1 :], ((0, 0), (0, k + 1))))
        valid.append(jnp.pad(mask_BxT[:, k + 1 :], ((0, 0), (0, k + 1))) > 0)

    def shifted(x_BxT):
        steps = [jnp.pad(x_BxT[:, k:], ((0, 0), (0, k))) for k in range(1, y + 1)]
        return jax.lax.stop_gradient(_flat(jnp.stack(steps)))

    return (
        _flat(draft_YxBxTxD.astype(jnp.float32)),
        _flat(jnp.stack(tgt)),
        _flat(jnp.stack(labels)),
        jnp.stack(valid),  # [Y, B, T]
        None if stats is None else jax.tree.map(shifted, stats),
    )


def _flat(x_YxBxT):
    """`[Y, B, T, ...]` flattened to `[B * Y * T, ...]` row-major in B: the rows of a batch split
    over devices stay split (a Y-major flattening interleaves every device's rows, and GSPMD
    gathered the whole batch on each device: the MTP step was not data-parallel)."""
    y, b, t = x_YxBxT.shape[:3]
    flat = x_YxBxT.swapaxes(0, 1).reshape(b * y * t, *x_YxBxT.shape[3:])
    return sharding.constrain(flat, ("batch",) + (None,) * (flat.ndim - 1))


def _unflat(x_N, valid_YxBxT):
    """Per-position values in `_flat`'s order back to `[Y, B, T]`."""
    y, b, t = valid_YxBxT.shape
    return x_N.reshape(b, y, t).swapaxes(0, 1)


def _masked_mean(x, m):
    m = m.astype(jnp.float32)
    return (x * m).sum() / jnp.maximum(m.sum(), 1.0)


def _alphas(inputs, head, chunk, temperature, top_k, top_p):
    """Per-step α `[Y, B, T]` between the distributions the verifier compares: the target's and
    the draft's, each tempered and truncated as the sampler does (its own support over its own
    head's vocabulary)."""
    hq, hp, _, valid, stats = inputs
    head = jax.lax.stop_gradient(head)
    floor_p, lse_p = _target_kept(hp, stats, head, chunk, temperature, top_k, top_p)
    floors = None
    if floor_p is not None:
        floors = (support_floor(hq, head, temperature, top_k, top_p, chunk), floor_p)
    return _unflat(overlap(hq, hp, head, lse_p, chunk, temperature, floors), valid), valid


def _per_step_metrics(a_YxBxT, valid):
    return {f"alpha_{k + 1}": _masked_mean(a_YxBxT[k], valid[k]) for k in range(a_YxBxT.shape[0])}


def ce_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    del target, cycle_len, target_stats, top_k, top_p
    hq, _, labels, valid, _ = _prepare(draft, draft[0], tokens, mask)
    w_chunks, v = _chunks(jax.lax.stop_gradient(head), chunk)
    lse = _lse(hq, w_chunks, v, temperature)
    z_label = jnp.einsum("nd,dn->n", hq, jax.lax.stop_gradient(head)[:, labels]) / temperature
    nll = _unflat(lse - z_label, valid)
    return _masked_mean(nll, valid), {}


def _kl_terms(draft, target, head, tokens, mask, chunk, temperature, stats, top_k, top_p):
    """KL(p‖q), KL(q‖p) of the tempered, untruncated distributions, and α of the truncated ones
    (without gradient)."""
    inputs = _prepare(draft, target, tokens, mask, stats)
    hq, hp, _, valid, stats = inputs
    w_chunks, v = _chunks(jax.lax.stop_gradient(head), chunk)
    if w_chunks.shape[0] == 1:  # one product per side, shared by the normaliser and the sums
        zq, zp = (_logits(h, w_chunks[0], v[0], temperature) for h in (hq, hp))
        lse_q = jax.nn.logsumexp(zq, axis=-1)
        lse_p = jax.lax.stop_gradient(jax.nn.logsumexp(zp, axis=-1) if stats is None else stats.lse)
        a, _, kpq, kqp, mass = _sums(zq, zp, lse_q, lse_p)
    else:
        lse_q = _lse(hq, w_chunks, v, temperature)
        lse_p = _target_lse(hp, stats, w_chunks, v, temperature)
        a, _, kpq, kqp, mass = _pass2(hq, hp, w_chunks, v, lse_q, lse_p, temperature)
    # p's mass on the head's vocabulary: 1, or P < 1 for a draft vocabulary, where these are
    # P·KL(p/P ‖ q) and KL(q ‖ p/P) (same minimiser q = p/P, still >= 0).
    log_mass = jnp.log(jnp.maximum(jax.lax.stop_gradient(mass), 1e-30))
    kl_pq = kpq + mass * (lse_q - lse_p - log_mass)  # Σ p (zp − zq) + P (lse_q − lse_p − log P)
    kl_qp = kqp + lse_p - lse_q + log_mass
    a = _unflat(a, valid)
    if truncates(top_k, top_p):  # the verifier's α: another overlap, of the truncated pair
        frozen = (jax.lax.stop_gradient(hq), *inputs[1:])
        a = _alphas(frozen, head, chunk, temperature, top_k, top_p)[0]
    return _unflat(kl_pq, valid), _unflat(kl_qp, valid), a, valid


def kl_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    del cycle_len
    kl_pq, _, a, valid = _kl_terms(
        draft, target, head, tokens, mask, chunk, temperature, target_stats, top_k, top_p
    )
    return _masked_mean(kl_pq, valid), _per_step_metrics(jax.lax.stop_gradient(a), valid)


def reverse_kl_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    del cycle_len
    _, kl_qp, a, valid = _kl_terms(
        draft, target, head, tokens, mask, chunk, temperature, target_stats, top_k, top_p
    )
    return _masked_mean(kl_qp, valid), _per_step_metrics(jax.lax.stop_gradient(a), valid)


def tv_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    del cycle_len
    inputs = _prepare(draft, target, tokens, mask, target_stats)
    a, valid = _alphas(inputs, head, chunk, temperature, top_k, top_p)
    return _masked_mean(1.0 - a, valid), _per_step_metrics(a, valid)


def _chains(a_YxBxT, valid_YxBxT):
    """Π_{i≤j} α_i for j = 1..Y, and the anchors whose whole chain is valid."""
    return jnp.cumprod(a_YxBxT, axis=0), jnp.all(valid_YxBxT, axis=0)


def _e2e_tv(draft, target, head, tokens, mask, partial: bool, chunk, temperature, stats, cut):
    inputs = _prepare(draft, target, tokens, mask, stats)
    a, valid = _alphas(inputs, head, chunk, temperature, *cut)
    if partial:  # the steps before the first unsupervised one count; step 1 must be supervised
        prods = jnp.cumprod(a, axis=0) * jnp.cumprod(valid.astype(jnp.float32), axis=0)
        anchor_ok = valid[0]
    else:
        prods, anchor_ok = _chains(a, valid)
    expected_accept = prods.mean(axis=0)  # (1/Y) Σ_j Π_{i≤j} α_i
    metrics = {
        **_per_step_metrics(a, valid),
        "accept_len": _masked_mean(1 + prods.sum(0), anchor_ok),
    }
    return _masked_mean(1.0 - expected_accept, anchor_ok), metrics


def e2e_tv_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    del cycle_len
    return _e2e_tv(
        draft, target, head, tokens, mask, False, chunk, temperature, target_stats, (top_k, top_p)
    )


def e2e_tv_partial_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    """`e2e_tv` with chains cut at the end of the response instead of dropped: an anchor whose
    step 1 is supervised counts Π_{i≤j} α_i for its supervised steps j only (what it can accept
    before the sequence ends). `e2e_tv` drops every anchor within Y + 1 tokens of the end, so on
    short responses the last tokens are never a step-1 target."""
    del cycle_len
    return _e2e_tv(
        draft, target, head, tokens, mask, True, chunk, temperature, target_stats, (top_k, top_p)
    )


def dca_loss(
    draft,
    target,
    head,
    tokens,
    mask,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    """Terms are masked one by one, as in `e2e_tv_partial`: a chain is cut at its first
    unsupervised step (the end of the response), so every anchor whose step 1 is supervised
    counts -- the answer tokens and EOS train the head too. `accept_len_BxT` (optional): drafts
    accepted + 1 in the verify cycle seeded at each anchor, 0 where none; then only those anchors
    count and terms l > m are masked (verify-gated). Without it, m = Y and every anchor counts.
    Metric `gated_alpha_1`: mean α_1 over the gated anchors (the verifier's step-1 acceptance,
    when the MTP and the target are the ones that drafted and verified)."""
    inputs = _prepare(draft, target, tokens, mask, target_stats)
    a, valid = _alphas(inputs, head, chunk, temperature, top_k, top_p)
    prods = jnp.cumprod(a, axis=0) * jnp.cumprod(valid.astype(jnp.float32), axis=0)
    anchor_ok = valid[0]
    metrics = _per_step_metrics(a, valid)
    if cycle_len is not None:  # only anchors that seeded a verify cycle, gated by its outcome
        gate = jnp.arange(1, a.shape[0] + 1)[:, None, None] <= cycle_len[None]
        prods = jnp.where(gate, prods, 0.0)
        anchor_ok = anchor_ok & (cycle_len > 0)
        metrics["gated_alpha_1"] = _masked_mean(a[0], anchor_ok)
    loss = -jnp.log(jnp.maximum(prods.sum(0), 1e-9))
    return _masked_mean(loss, anchor_ok), metrics


MTP_LOSSES = {
    "ce": ce_loss,
    "kl": kl_loss,
    "reverse_kl": reverse_kl_loss,
    "tv": tv_loss,
    "e2e_tv": e2e_tv_loss,
    "e2e_tv_partial": e2e_tv_partial_loss,
    "dca": dca_loss,
}


def draft_loss(
    name,
    draft,
    target,
    head_DxV,
    tokens,
    mask,
    *,
    vocab=None,
    chunk=8192,
    temperature=1.0,
    cycle_len=None,
    target_stats=None,
    top_k=0,
    top_p=1.0,
):
    """The loss `name` of `MTP_LOSSES`, optionally for a draft restricted to the token ids
    `vocab` `[K]`: q over those K tokens, p the full-vocabulary target (see the module doc).
    `target_stats` (`TargetStats` `[B, T]`): the target's normalisers over the full vocabulary at
    `temperature` (and `top_k` / `top_p`), when the caller has them cached (a frozen policy);
    else computed here. `top_k` / `top_p`: the sampler's truncation (`SamplingConfig`), applied
    to both distributions wherever a loss or metric measures acceptance. Returns (loss,
    metrics); every loss reports the per-step α of its drafts when a target is given (CE, which
    needs no target, measures it on the side without gradient, as the TV loss does)."""
    fn = MTP_LOSSES[name]
    kw = dict(
        vocab=vocab,
        chunk=chunk,
        temperature=temperature,
        cycle_len=cycle_len,
        target_stats=target_stats,
        top_k=top_k,
        top_p=top_p,
    )
    if fn is not ce_loss or target is None:
        return _draft_loss(fn, draft, target, head_DxV, tokens, mask, **kw)
    loss, _ = _draft_loss(ce_loss, draft, target, head_DxV, tokens, mask, **kw)
    draft = jax.lax.stop_gradient(draft)
    _, metrics = _draft_loss(tv_loss, draft, target, head_DxV, tokens, mask, **kw)
    return loss, metrics


def _draft_loss(fn, draft, target, head_DxV, tokens, mask, *, vocab, target_stats, **kw):
    if vocab is None:
        return fn(draft, target, head_DxV, tokens, mask, target_stats=target_stats, **kw)
    head_DxV = jax.lax.stop_gradient(head_DxV)
    head_DxK = jnp.take(head_DxV, vocab, axis=1)
    if fn is ce_loss:  # labels as positions in the draft vocabulary; others unsupervised
        pos_V = (
            jnp.full((head_DxV.shape[1],), -1, jnp.int32)
            .at[vocab]
            .set(jnp.arange(vocab.shape[0], dtype=jnp.int32))
        )
        sub_BxT = pos_V[tokens]
        return fn(draft, target, head_DxK, jnp.maximum(sub_BxT, 0), mask * (sub_BxT >= 0), **kw)
    cut = truncates(kw["top_k"], kw["top_p"])
    if target_stats is None or (cut and target_stats.floor is None):
        # p over the full vocabulary (the head's K columns cannot give its normaliser or support)
        target_stats = _target_stats(
            target, head_DxV, kw["chunk"], kw["temperature"], kw["top_k"], kw["top_p"]
        )
    return fn(draft, target, head_DxK, tokens, mask, target_stats=target_stats, **kw)


# ----------------------------------------------------------------------------- over parameters


@struct.dataclass
class MTPBatch:
    """What an MTP loss reads. Optional arrays: `hidden` and the `TargetStats` fields
    (`target_lse`, and with a truncating sampler `target_floor`, `target_lse_kept`), the frozen
    policy's hiddens and normalisers when already computed (cached over the distill set, or
    recorded by verification); `cycle_len`, the tokens emitted by the verify cycle anchored at
    each position (0: none), which gates `dca`."""

    tokens: jax.Array  # [B, T] int32
    mask: jax.Array  # [B, T] float32: 1 where the token is supervised
    hidden: jax.Array | None = None  # [B, T, D]
    target_lse: jax.Array | None = None  # [B, T]
    cycle_len: jax.Array | None = None  # [B, T] int32
    # [B, T, F*D] the layers an MTP with `mtp.features` reads (`mtp.backbone_inputs`)
    features: jax.Array | None = None
    target_floor: jax.Array | None = None  # [B, T]
    target_lse_kept: jax.Array | None = None  # [B, T]

    def target_stats(self) -> TargetStats | None:
        if self.target_lse is None:
            return None
        return TargetStats(self.target_lse, self.target_floor, self.target_lse_kept)


def mtp_loss(
    pol_gd,
    mtp_gd,
    loss_name: str,
    train_steps: int,
    chunk: int,
    temperature: float,
    vocab=None,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """`loss_fn(mtp_params, batch: MTPBatch, rng, pol_params)` for `make_train_step` (the frozen
    policy's parameters its extra argument); `vocab`: the draft vocabulary (None: full);
    `temperature`, `top_k`, `top_p`: the rollout sampler's (`rollout.*`), so the losses measure
    the acceptance its verifier has."""
    vocab = None if vocab is None else jnp.asarray(vocab, jnp.int32)

    def fn(mtp_params, batch: MTPBatch, rng, pol_params):
        del rng
        pol_params = jax.lax.stop_gradient(pol_params)
        policy = nnx.merge(pol_gd, pol_params)
        tokens_BxT = batch.tokens
        # precomputed (`stages.mtp.policy_hiddens`, verification) or one policy forward
        hidden_BxTxD, feats = mtp_lib.backbone_inputs(
            nnx.merge(mtp_gd, mtp_params), policy, tokens_BxT, batch.hidden, batch.features
        )
        draft_YxBxTxD = mtp_lib.train_hidden(
            mtp_gd, mtp_params, pol_gd, pol_params, tokens_BxT, feats, train_steps
        )
        stats = batch.target_stats()
        return draft_loss(
            loss_name,
            draft_YxBxTxD,
            policy.final_norm(hidden_BxTxD),
            policy.head_matrix(),
            tokens_BxT,
            batch.mask,
            vocab=vocab,
            chunk=chunk,
            temperature=max(temperature, 1e-3),
            cycle_len=batch.cycle_len,
            target_stats=None if stats is None else jax.lax.stop_gradient(stats),
            top_k=top_k,
            top_p=top_p,
        )

    return fn
