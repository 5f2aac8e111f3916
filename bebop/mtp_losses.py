"""MTP draft losses (METHOD §4), vocabulary-chunked, float32. Picked by name from `MTP_LOSSES`.

Every loss takes the draft's normed hiddens for Y steps, `draft_YxBxTxD` (from `mtp.train_hidden`;
step k at anchor t predicts token t+k+1), the frozen policy's normed final hiddens
`target_BxTxD` (the target distribution of token t+k+1 is the policy's at position t+k), the shared
head `head_DxV`, the data tokens and a mask of positions whose token is supervised. Logits are
never materialised for all positions and steps at once: a `lax.scan` over vocabulary chunks keeps
an online max / exp-sum (pass 1), then accumulates the overlap Σ min(p, q), S = Σ q·1[q ≤ p] and
the KL terms (pass 2). Autodiffed passes are rematerialised per chunk; TV has an analytic VJP.

  ce          -log q_k(x_{t+k+1})                                        (hard labels)
  kl          KL(p‖q) = Σ p (log p − log q)                              gradient q − p
  reverse_kl  KL(q‖p) = Σ q (log q − log p)
  tv          1 − α,  α_k = Σ_v min(p_k, q_k)                            (per-step mean)
              ∂L/∂z_j = −q_j (1[q_j ≤ p_j] − S),  S = Σ_v 1[q_v ≤ p_v] q_v (ties accepted)
  e2e_tv      1 − (1/Y) Σ_{j=1..Y} Π_{i≤j} α_i    (Bebop Eq. 13: one minus normalised E[accept])
  dca         −log Σ_{l=1..m} Π_{i≤l} α_i          (GrowMTP; m = accepted + 1 when known, else Y)
`p` is detached (self-distillation); chains that cross a sequence end are masked for e2e_tv / dca.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG = -1e30


def _chunks(head_DxV, chunk: int):
    """Head columns as [n_chunks, D, C] (zero-padded) and a [n_chunks, C] validity mask."""
    d, v = head_DxV.shape
    chunk = min(chunk, v)
    n = -(-v // chunk)
    w = jnp.pad(head_DxV.astype(jnp.float32), ((0, 0), (0, n * chunk - v)))
    valid = (jnp.arange(n * chunk) < v).reshape(n, chunk)
    return w.reshape(d, n, chunk).transpose(1, 0, 2), valid


def _logits(h_NxD, w_DxC, valid_C, temperature):
    z = (h_NxD @ w_DxC) / temperature
    return jnp.where(valid_C, z, NEG)


def _lse(h_NxD, w_chunks, valid, temperature):
    """Pass 1: log-sum-exp over the vocabulary with an online max."""

    @jax.checkpoint
    def body(carry, xs):
        m, s = carry
        z = _logits(h_NxD, *xs, temperature)
        m_new = jnp.maximum(m, z.max(-1))
        return (m_new, s * jnp.exp(m - m_new) + jnp.exp(z - m_new[:, None]).sum(-1)), None

    n = h_NxD.shape[0]
    (m, s), _ = jax.lax.scan(body, (jnp.full((n,), NEG), jnp.zeros((n,))), (w_chunks, valid))
    return m + jnp.log(s)


def _pass2(hq, hp, w_chunks, valid, lse_q, lse_p, temperature):
    """Pass 2: overlap α, S, Σ p(zp − zq), Σ q(zq − zp)."""

    @jax.checkpoint
    def body(carry, xs):
        zq = _logits(hq, *xs, temperature)
        zp = _logits(hp, *xs, temperature)
        q, p = jnp.exp(zq - lse_q[:, None]), jnp.exp(zp - lse_p[:, None])
        a, s, kpq, kqp = carry
        return (
            a + jnp.minimum(p, q).sum(-1),
            s + jnp.where(q <= p, q, 0.0).sum(-1),
            kpq + (p * (zp - zq)).sum(-1),
            kqp + (q * (zq - zp)).sum(-1),
        ), None

    zero = jnp.zeros((hq.shape[0],))
    (a, s, kpq, kqp), _ = jax.lax.scan(body, (zero, zero, zero, zero), (w_chunks, valid))
    return a, s, kpq, kqp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def overlap(hq_NxD, hp_NxD, head_DxV, chunk: int, temperature: float):
    """α = Σ_v min(p, q) per position, with the analytic TV gradient. The target hiddens and the
    head are frozen: their cotangents are zero (callers pass them through stop_gradient)."""
    return _overlap_fwd(hq_NxD, hp_NxD, head_DxV, chunk, temperature)[0]


def _overlap_fwd(hq, hp, head, chunk, temperature):
    w_chunks, valid = _chunks(head, chunk)
    lse_q = _lse(hq, w_chunks, valid, temperature)
    lse_p = _lse(hp, w_chunks, valid, temperature)
    a, s, _, _ = _pass2(hq, hp, w_chunks, valid, lse_q, lse_p, temperature)
    return a, (hq, hp, head, lse_q, lse_p, s)


def _overlap_bwd(chunk, temperature, res, g_N):
    hq, hp, head, lse_q, lse_p, s = res
    w_chunks, valid = _chunks(head, chunk)

    def body(dh, xs):
        w, v = xs
        zq, zp = _logits(hq, w, v, temperature), _logits(hp, w, v, temperature)
        q, p = jnp.exp(zq - lse_q[:, None]), jnp.exp(zp - lse_p[:, None])
        gz = g_N[:, None] * q * ((q <= p).astype(jnp.float32) - s[:, None]) / temperature
        return dh + gz @ w.T, None

    dh, _ = jax.lax.scan(body, jnp.zeros_like(hq), (w_chunks, valid))
    return dh, jnp.zeros_like(hp), jnp.zeros_like(head)


overlap.defvjp(lambda hq, hp, head, chunk, t: _overlap_fwd(hq, hp, head, chunk, t), _overlap_bwd)


# ----------------------------------------------------------------------------- losses


def _prepare(draft_YxBxTxD, target_BxTxD, tokens_BxT, mask_BxT):
    """Flattened per-(step, anchor) inputs: draft hidden, target hidden at t+k, label, validity."""
    y, b, t, d = draft_YxBxTxD.shape
    target = jax.lax.stop_gradient(target_BxTxD.astype(jnp.float32))
    tgt, labels, valid = [], [], []
    for k in range(1, y + 1):
        tgt.append(jnp.pad(target[:, k:], ((0, 0), (0, k), (0, 0))))
        labels.append(jnp.pad(tokens_BxT[:, k + 1 :], ((0, 0), (0, k + 1))))
        valid.append(jnp.pad(mask_BxT[:, k + 1 :], ((0, 0), (0, k + 1))) > 0)
    return (
        draft_YxBxTxD.astype(jnp.float32).reshape(y * b * t, d),
        jnp.stack(tgt).reshape(y * b * t, d),
        jnp.stack(labels).reshape(y * b * t),
        jnp.stack(valid),  # [Y, B, T]
    )


def _masked_mean(x, m):
    m = m.astype(jnp.float32)
    return (x * m).sum() / jnp.maximum(m.sum(), 1.0)


def _alphas(inputs, head, chunk, temperature, shape):
    hq, hp, _, valid = inputs
    a = overlap(hq, hp, jax.lax.stop_gradient(head), chunk, temperature).reshape(shape)
    return a, valid


def _per_step_metrics(a_YxBxT, valid):
    return {f"alpha_{k + 1}": _masked_mean(a_YxBxT[k], valid[k]) for k in range(a_YxBxT.shape[0])}


def ce_loss(draft, target, head, tokens, mask, chunk=8192, temperature=1.0, accept_len=None):
    del target, accept_len
    hq, _, labels, valid = _prepare(draft, draft[0], tokens, mask)
    w_chunks, v = _chunks(jax.lax.stop_gradient(head), chunk)
    lse = _lse(hq, w_chunks, v, temperature)
    z_label = jnp.einsum("nd,dn->n", hq, jax.lax.stop_gradient(head)[:, labels]) / temperature
    nll = (lse - z_label).reshape(valid.shape)
    return _masked_mean(nll, valid), {}


def _kl_terms(draft, target, head, tokens, mask, chunk, temperature):
    hq, hp, _, valid = _prepare(draft, target, tokens, mask)
    w_chunks, v = _chunks(jax.lax.stop_gradient(head), chunk)
    lse_q = _lse(hq, w_chunks, v, temperature)
    lse_p = jax.lax.stop_gradient(_lse(hp, w_chunks, v, temperature))
    a, _, kpq, kqp = _pass2(hq, hp, w_chunks, v, lse_q, lse_p, temperature)
    kl_pq = kpq + lse_q - lse_p  # Σ p (zp − zq) + lse_q − lse_p
    kl_qp = kqp + lse_p - lse_q
    return kl_pq.reshape(valid.shape), kl_qp.reshape(valid.shape), a.reshape(valid.shape), valid


def kl_loss(draft, target, head, tokens, mask, chunk=8192, temperature=1.0, accept_len=None):
    del accept_len
    kl_pq, _, a, valid = _kl_terms(draft, target, head, tokens, mask, chunk, temperature)
    return _masked_mean(kl_pq, valid), _per_step_metrics(jax.lax.stop_gradient(a), valid)


def reverse_kl_loss(
    draft, target, head, tokens, mask, chunk=8192, temperature=1.0, accept_len=None
):
    del accept_len
    _, kl_qp, a, valid = _kl_terms(draft, target, head, tokens, mask, chunk, temperature)
    return _masked_mean(kl_qp, valid), _per_step_metrics(jax.lax.stop_gradient(a), valid)


def tv_loss(draft, target, head, tokens, mask, chunk=8192, temperature=1.0, accept_len=None):
    del accept_len
    inputs = _prepare(draft, target, tokens, mask)
    a, valid = _alphas(inputs, head, chunk, temperature, inputs[3].shape)
    return _masked_mean(1.0 - a, valid), _per_step_metrics(a, valid)


def _chains(a_YxBxT, valid_YxBxT):
    """Π_{i≤j} α_i for j = 1..Y, and the anchors whose whole chain is valid."""
    return jnp.cumprod(a_YxBxT, axis=0), jnp.all(valid_YxBxT, axis=0)


def e2e_tv_loss(draft, target, head, tokens, mask, chunk=8192, temperature=1.0, accept_len=None):
    del accept_len
    inputs = _prepare(draft, target, tokens, mask)
    a, valid = _alphas(inputs, head, chunk, temperature, inputs[3].shape)
    prods, anchor_ok = _chains(a, valid)
    expected_accept = prods.mean(axis=0)  # (1/Y) Σ_j Π_{i≤j} α_i
    metrics = {
        **_per_step_metrics(a, valid),
        "accept_len": _masked_mean(1 + prods.sum(0), anchor_ok),
    }
    return _masked_mean(1.0 - expected_accept, anchor_ok), metrics


def dca_loss(draft, target, head, tokens, mask, chunk=8192, temperature=1.0, accept_len=None):
    """`accept_len_BxT` (optional): drafts accepted + 1 in the cycle seeded at each anchor;
    terms l > m are masked (verify-gated). Without it, m = Y."""
    inputs = _prepare(draft, target, tokens, mask)
    a, valid = _alphas(inputs, head, chunk, temperature, inputs[3].shape)
    prods, anchor_ok = _chains(a, valid)
    y = a.shape[0]
    if accept_len is not None:  # only anchors that seeded a verify cycle, gated by its outcome
        gate = jnp.arange(1, y + 1)[:, None, None] <= accept_len[None]
        prods = jnp.where(gate, prods, 0.0)
        anchor_ok = anchor_ok & (accept_len > 0)
    loss = -jnp.log(jnp.maximum(prods.sum(0), 1e-9))
    return _masked_mean(loss, anchor_ok), _per_step_metrics(a, valid)


MTP_LOSSES = {
    "ce": ce_loss,
    "kl": kl_loss,
    "reverse_kl": reverse_kl_loss,
    "tv": tv_loss,
    "e2e_tv": e2e_tv_loss,
    "dca": dca_loss,
}
