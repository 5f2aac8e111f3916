"""MTP losses: chunked = naive, analytic TV gradient, e2e-TV surrogate vs simulation, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import mtp_losses as L

Y, B, T, D, V = 3, 2, 9, 8, 37


def _inputs(seed=0, v=V, scale=1.5):
    k = jax.random.split(jax.random.key(seed), 4)
    draft = jax.random.normal(k[0], (Y, B, T, D))
    target = jax.random.normal(k[1], (B, T, D))
    head = scale * jax.random.normal(k[2], (D, v))
    tokens = jax.random.randint(k[3], (B, T), 0, v)
    mask = jnp.ones((B, T)).at[1, 6:].set(0.0)  # row 1 ends early: its chains must be masked
    return draft, target, head, tokens, mask


def _naive_parts(draft, target, head, tokens, mask, temperature=1.0):
    """Full-softmax reference: per-step q, p [Y, B, T, V], labels, validity."""
    y = draft.shape[0]
    zq = jnp.einsum("ybtd,dv->ybtv", draft, head) / temperature
    zp_full = jnp.einsum("btd,dv->btv", target, head) / temperature
    zp = jnp.stack([jnp.pad(zp_full[:, k:], ((0, 0), (0, k), (0, 0))) for k in range(1, y + 1)])
    labels = jnp.stack([jnp.pad(tokens[:, k + 1 :], ((0, 0), (0, k + 1))) for k in range(1, y + 1)])
    valid = (
        jnp.stack([jnp.pad(mask[:, k + 1 :], ((0, 0), (0, k + 1))) for k in range(1, y + 1)]) > 0
    )
    return (
        jax.nn.log_softmax(zq, -1),
        jax.lax.stop_gradient(jax.nn.log_softmax(zp, -1)),
        labels,
        valid,
    )


def _mean(x, m):
    return (x * m).sum() / m.sum()


def naive(name, draft, target, head, tokens, mask, temperature=1.0):
    lq, lp, labels, valid = _naive_parts(draft, target, head, tokens, mask, temperature)
    q, p = jnp.exp(lq), jnp.exp(lp)
    alpha = jnp.minimum(p, q).sum(-1)
    prods, ok = jnp.cumprod(alpha, 0), valid.all(0)
    if name == "ce":
        return _mean(-jnp.take_along_axis(lq, labels[..., None], -1)[..., 0], valid)
    if name == "kl":
        return _mean((p * (lp - lq)).sum(-1), valid)
    if name == "reverse_kl":
        return _mean((q * (lq - lp)).sum(-1), valid)
    if name == "tv":
        return _mean(1 - alpha, valid)
    if name == "e2e_tv":
        return _mean(1 - prods.mean(0), ok)
    if name == "e2e_tv_partial":  # chains cut at the end: steps after the first unsupervised one
        return _mean(1 - (prods * jnp.cumprod(valid, 0)).mean(0), valid[0])
    if name == "dca":  # chains cut at the end, as e2e_tv_partial
        terms = (prods * jnp.cumprod(valid, 0)).sum(0)
        return _mean(-jnp.log(jnp.where(valid[0], terms, 1.0)), valid[0])
    raise KeyError(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(L.MTP_LOSSES))
@pytest.mark.parametrize("chunk", [5, 16, 37, 64])  # 37 % 5 != 0, 37 % 16 != 0, chunk > V
def test_chunked_equals_naive(name, chunk):
    args = _inputs()
    got, _ = L.MTP_LOSSES[name](*args, chunk=chunk, temperature=0.8)
    want = naive(name, *args, temperature=0.8)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert float(got) >= 0.0


def test_partial_chains_train_step_one_near_the_end_of_a_sequence():
    """Anchor t = T - 3: step 1 (token T-1) is supervised, step 2 would pass the end. `e2e_tv`
    drops the whole chain (zero gradient there); `e2e_tv_partial` trains its step 1."""
    draft, target, head, tokens, _ = _inputs(seed=6)
    mask = jnp.ones((B, T))

    def loss(d, name):
        return L.MTP_LOSSES[name](d, target, head, tokens, mask, chunk=8)[0]

    grads = {name: jax.grad(loss)(draft, name) for name in ("e2e_tv", "e2e_tv_partial")}
    assert float(jnp.abs(grads["e2e_tv"][0, :, T - 3]).max()) == 0.0
    assert float(jnp.abs(grads["e2e_tv_partial"][0, :, T - 3]).max()) > 1e-4
    assert float(jnp.abs(grads["e2e_tv_partial"][1:, :, T - 3]).max()) == 0.0  # past the end


def test_dca_trains_every_anchor_whose_gated_terms_are_inside_the_sequence():
    """A reported case: T = 12, 5 chain steps, verify cycles with accept length 1 at anchors
    0, 2, .., 8 and longer ones at 9 and 10. Every cycle anchor whose step 1 is supervised gets a
    gradient on exactly its gated, in-sequence steps (anchors 6, 8, 9 were dropped when all 5 steps
    had to fit); the loss equals a naive per-term reference."""
    y, t = 5, 12
    rng = np.random.default_rng(3)
    draft = jnp.asarray(rng.normal(size=(y, 1, t, D)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(1, t, D)), jnp.float32)
    head = jnp.asarray(1.5 * rng.normal(size=(D, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (1, t)), jnp.int32)
    mask = np.ones((1, t), np.float32)
    mask[:, :2] = 0.0  # a 2-token prompt
    cycle_len = np.zeros((1, t), np.int32)
    cycle_len[0, [0, 2, 4, 6, 8, 9, 10]] = [1, 1, 1, 1, 1, 3, 2]

    @jax.jit
    def loss(d):
        return L.dca_loss(d, target, head, tokens, mask, chunk=8, cycle_len=cycle_len)[0]

    @jax.jit
    def naive_gated(d):
        lq, lp, _, valid = _naive_parts(d, target, head, tokens, mask)
        alpha = jnp.minimum(jnp.exp(lp), jnp.exp(lq)).sum(-1)
        gate = jnp.arange(1, y + 1)[:, None, None] <= cycle_len[None]
        prods = jnp.cumprod(alpha, 0) * jnp.cumprod(valid, 0) * gate
        ok = valid[0] & (cycle_len > 0)
        return _mean(-jnp.log(jnp.where(ok, prods.sum(0), 1.0)), ok)

    g = np.abs(np.asarray(jax.jit(jax.grad(loss))(draft)))[:, 0]  # [Y, T]
    for a in range(t):
        m = int(cycle_len[0, a])
        inside = [s for s in range(y) if a + s + 2 < t and s < m]
        trained = [s for s in range(y) if g[s, a].max() > 0]
        assert trained == inside, (a, trained, inside)
    assert [a for a in range(t) if g[0, a].max() > 0] == [0, 2, 4, 6, 8, 9]  # 10: step 1 is past T
    np.testing.assert_allclose(loss(draft), naive_gated(draft), rtol=1e-5)


def test_tv_of_identical_distributions_is_zero():
    draft, _, head, tokens, mask = _inputs()
    target = draft[0]
    same = jnp.stack([jnp.pad(target[:, k:], ((0, 0), (0, k), (0, 0))) for k in range(1, Y + 1)])
    loss, metrics = L.tv_loss(same, target, head, tokens, mask, chunk=8)
    assert abs(float(loss)) < 1e-6
    np.testing.assert_allclose(metrics["alpha_1"], 1.0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [8, 64])  # 5 chunks; the whole vocabulary in one (no scan)
@pytest.mark.parametrize("name", list(L.MTP_LOSSES))
def test_gradients_equal_autodiff_of_naive_reference(name, chunk):
    draft, target, head, tokens, mask = _inputs(seed=1)
    loss = lambda d: L.MTP_LOSSES[name](d, target, head, tokens, mask, chunk=chunk)[0]  # noqa: E731
    got = jax.grad(loss)(draft)
    want = jax.grad(lambda d: naive(name, d, target, head, tokens, mask))(draft)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert float(jnp.abs(got).max()) > 1e-4  # not trivially zero


def test_tv_gradient_matches_closed_form_in_logit_space():
    """∂L_TV/∂z_j = −q_j (1[q_j ≤ p_j] − S), via the VJP of `overlap` w.r.t. hidden = z."""
    k = jax.random.split(jax.random.key(2), 2)
    n, v = 6, V
    zq, zp = 2 * jax.random.normal(k[0], (n, v)), 2 * jax.random.normal(k[1], (n, v))
    eye = jnp.eye(v)  # head = I: the hidden states are the logits
    lse_p = jax.nn.logsumexp(zp, -1)
    grad = jax.grad(lambda z: (1 - L.overlap(z, zp, eye, lse_p, 8, 1.0)).sum())(zq)
    q, p = jax.nn.softmax(zq), jax.nn.softmax(zp)
    s = jnp.where(q <= p, q, 0.0).sum(-1, keepdims=True)
    np.testing.assert_allclose(grad, -q * ((q <= p) - s), atol=1e-6)


SUB = jnp.array([0, 3, 4, 9, 10, 11, 20, 25, 31, 36])  # a draft vocabulary of 10 of the 37 ids


def naive_subset(name, draft, target, head, tokens, mask, temperature=1.0):
    """Reference for a draft vocabulary: q = softmax over SUB only, p the full softmax."""
    lq_sub, lp, labels, valid = _naive_parts(draft, target, head[:, SUB], tokens, mask, temperature)
    lp = _naive_parts(draft, target, head, tokens, mask, temperature)[1][..., SUB]  # full p on SUB
    q, p = jnp.exp(lq_sub), jnp.exp(lp)
    mass = p.sum(-1)
    alpha = jnp.minimum(p, q).sum(-1)
    prods, ok = jnp.cumprod(alpha, 0), valid.all(0)
    if name == "ce":  # labels outside SUB are not supervised
        pos = jnp.full((V,), -1).at[SUB].set(jnp.arange(len(SUB)))[labels]
        nll = -jnp.take_along_axis(lq_sub, jnp.maximum(pos, 0)[..., None], -1)[..., 0]
        return _mean(nll, valid & (pos >= 0))
    p_hat = p / mass[..., None]
    if name == "kl":  # P · KL(p/P ‖ q)
        return _mean(mass * (p_hat * (jnp.log(p_hat) - lq_sub)).sum(-1), valid)
    if name == "reverse_kl":  # KL(q ‖ p/P)
        return _mean((q * (lq_sub - jnp.log(p_hat))).sum(-1), valid)
    if name == "tv":
        return _mean(1 - alpha, valid)
    if name == "e2e_tv":
        return _mean(1 - prods.mean(0), ok)
    if name == "e2e_tv_partial":
        return _mean(1 - (prods * jnp.cumprod(valid, 0)).mean(0), valid[0])
    terms = (prods * jnp.cumprod(valid, 0)).sum(0)  # dca, chains cut at the end
    return _mean(-jnp.log(jnp.where(valid[0], terms, 1.0)), valid[0])


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [4, 16])  # the draft vocabulary in 3 chunks; in one
@pytest.mark.parametrize("name", list(L.MTP_LOSSES))
def test_draft_vocabulary_losses_and_gradients_equal_a_naive_reference(name, chunk):
    """q on 10 of 37 tokens, p the policy's full distribution: values and gradients (≤ 1e-5)."""
    draft, target, head, tokens, mask = _inputs(seed=4)

    def got(d):
        return L.draft_loss(name, d, target, head, tokens, mask, vocab=SUB, chunk=chunk)[0]

    np.testing.assert_allclose(
        got(draft), naive_subset(name, draft, target, head, tokens, mask), atol=1e-5, rtol=1e-5
    )
    want_g = jax.grad(lambda d: naive_subset(name, d, target, head, tokens, mask))(draft)
    np.testing.assert_allclose(jax.grad(got)(draft), want_g, atol=1e-5)
    assert float(got(draft)) >= 0.0


def test_draft_vocabulary_overlap_is_below_the_target_mass_on_it():
    """With q on a subset, α = Σ_sub min(p, q) ≤ p(sub) < 1 (the full-vocab α can be larger)."""
    draft, target, head, tokens, mask = _inputs(seed=5)
    _, m_sub = L.draft_loss("tv", draft, target, head, tokens, mask, vocab=SUB, chunk=8)
    _, lp, _, valid = _naive_parts(draft, target, head, tokens, mask)
    p_mass = jnp.exp(lp)[..., SUB].sum(-1)
    assert float(m_sub["alpha_1"]) <= float(_mean(p_mass[0], valid[0])) + 1e-6
    assert float(m_sub["alpha_1"]) > 0.0


def test_e2e_tv_is_the_expected_accept_length_of_rejection_sampling():
    """1 − e2e_tv = (E[accept length] − 1) / Y. Monte Carlo of Y-step rejection sampling on random
    distributions, 200k trials per anchor; tolerance: 5 standard errors."""
    draft, target, head, tokens, mask = _inputs(seed=3, scale=0.7)
    mask = jnp.ones_like(mask)
    lq, lp, _, _ = _naive_parts(draft, target, head, tokens, mask)
    q, p = np.exp(np.asarray(lq, np.float64)), np.exp(np.asarray(lp, np.float64))
    rng = np.random.default_rng(0)
    trials, (b, t) = 200_000, (0, 2)
    accepted = np.ones(trials, bool)
    length = np.ones(trials)
    for k in range(Y):
        qk, pk = q[k, b, t] / q[k, b, t].sum(), p[k, b, t] / p[k, b, t].sum()
        d = rng.choice(V, size=trials, p=qk)
        ok = rng.random(trials) * qk[d] < pk[d]
        accepted &= ok
        length += accepted
    # a mask whose only complete chain is the one anchored at (b, t)
    only = jnp.zeros((B, T)).at[b, t + 2 : t + Y + 2].set(1.0)
    loss, _ = L.e2e_tv_loss(draft, target, head, tokens, only, chunk=8)
    surrogate = 1 + Y * (1 - float(loss))
    assert abs(length.mean() - surrogate) < 5 * length.std() / np.sqrt(trials)
    assert 1.3 < surrogate < Y + 0.7  # a non-trivial case


def test_chunked_e2e_tv_uses_a_quarter_of_the_naive_memory():
    """Compiled peak (temp) memory of loss + gradient at V=49152, T=1024, Y=5 (D=64, B=1)."""
    y, t, d, v = 5, 1024, 64, 49152
    sds = jax.ShapeDtypeStruct
    args = (
        sds((y, 1, t, d), jnp.float32),
        sds((1, t, d), jnp.float32),
        sds((d, v), jnp.float32),
        sds((1, t), jnp.int32),
        sds((1, t), jnp.float32),
    )

    def temp_bytes(fn):
        g = jax.jit(jax.value_and_grad(fn))
        return g.lower(*args).compile().memory_analysis().temp_size_in_bytes

    chunked = temp_bytes(lambda dr, *a: L.e2e_tv_loss(dr, *a, chunk=4096)[0])
    full = temp_bytes(lambda dr, *a: naive("e2e_tv", dr, *a))
    assert chunked * 4 <= full, (chunked, full)


@pytest.mark.parametrize("vocab", [None, SUB])
@pytest.mark.parametrize("name", list(L.MTP_LOSSES))
def test_every_loss_reports_the_per_step_alpha_of_its_drafts(name, vocab):
    """The training curves' per-step α (`alpha_k`, k = 1..Y) from every loss -- CE included,
    which needs no target -- equal the naive Σ min(p, q) averaged over supervised positions,
    for the full vocabulary and a draft vocabulary."""
    draft, target, head, tokens, mask = _inputs(seed=6)
    _, metrics = L.draft_loss(name, draft, target, head, tokens, mask, vocab=vocab, chunk=8)
    if vocab is None:
        lq, lp, _, valid = _naive_parts(draft, target, head, tokens, mask)
    else:
        lq, _, _, valid = _naive_parts(draft, target, head[:, SUB], tokens, mask)
        lp = _naive_parts(draft, target, head, tokens, mask)[1][..., SUB]
    alpha = jnp.minimum(jnp.exp(lp), jnp.exp(lq)).sum(-1)
    for k in range(Y):
        np.testing.assert_allclose(metrics[f"alpha_{k + 1}"], _mean(alpha[k], valid[k]), atol=1e-5)
