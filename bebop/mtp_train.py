"""Stage `mtp`: train the MTP draft layer(s) once, before RL, on the policy's own samples.

Backbone, embedding and head are frozen: the train state holds only the MTP parameters, the policy
parameters ride in the batch (arguments, not compile-time constants) and every use of them is
under `stop_gradient`. Each step: one policy forward for the hiddens -> `mtp.train_hidden` for
`mtp.train_steps` recursive steps -> the loss named by `mtp.loss` (`mtp_losses.MTP_LOSSES`).
Every `mtp.eval_every` steps the real speculative sampler (γ = `mtp.eval_draft`, `rejection` and
`target_only`) runs on held-out prompts and logs per-position acceptance, accept length, mean
policy entropy and the analytic acceptance Σ min(p, q) of the drafted positions.

`mtp.draft_vocab = K`: the draft head keeps the K tokens most frequent in the distill responses
(`select_draft_vocab`), saved as `DIR/mtp/draft_vocab.npy` for the samplers (`load_draft_vocab`).
`mtp.cache_hidden`: the policy's hiddens over the distill set are computed once (`policy_hiddens`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop import distill, model, policies, prompts, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.config import RunConfig
from bebop.fit import fit, restore_params
from bebop.mtp_losses import draft_loss
from bebop.train import TrainState, make_optimizer, make_train_step, schedule


def mtp_loss(
    pol_gd, mtp_gd, loss_name: str, train_steps: int, chunk: int, temperature: float, vocab=None
):  # fmt: skip
    """`loss_fn(mtp_params, batch, rng)` for `make_train_step`; `vocab`: the draft vocabulary."""
    vocab = None if vocab is None else jnp.asarray(vocab, jnp.int32)

    def fn(mtp_params, batch, rng):
        del rng
        pol_params = jax.lax.stop_gradient(batch["policy"])
        policy = nnx.merge(pol_gd, pol_params)
        tokens_BxT = batch["tokens"]
        if "hidden" in batch:  # precomputed by `policy_hiddens`
            hidden_BxTxD = jax.lax.stop_gradient(batch["hidden"])
        else:
            positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
            hidden_BxTxD = jax.lax.stop_gradient(policy.hidden(tokens_BxT, positions)[0])
        draft_YxBxTxD = mtp_lib.train_hidden(
            mtp_gd, mtp_params, pol_gd, pol_params, tokens_BxT, hidden_BxTxD, train_steps
        )
        return draft_loss(
            loss_name, draft_YxBxTxD, policy.final_norm(hidden_BxTxD), policy.head_matrix(),
            tokens_BxT, batch["mask"], vocab=vocab, chunk=chunk,
            temperature=max(temperature, 1e-3), accept_len=batch.get("accept_len"),
        )  # fmt: skip

    return fn


def evaluate(pol, mtp, tok, cfg: RunConfig, prompt_ids, num_draft: int, vocab=None) -> dict:
    """Real speculative rollouts on held-out prompts, both verification rules."""
    scfg = distill.sampling_config(cfg, tok)
    toks, lens = sampling.pad_prompts(prompt_ids, tok.pad_id)
    res = {}
    for rule in ("rejection", "target_only"):
        out = speculative.sample_jit(
            *pol, *mtp, toks, lens, jax.random.key(cfg.seed + 7), scfg,
            speculative.SpecConfig(num_draft, rule), vocab,
        )  # fmt: skip
        res.update({f"{rule}/{k}": v for k, v in speculative.summarize(out).items()})
    return res


def policy_hiddens(pol_gd, pol_params, tokens_NxS, batch_size: int) -> np.ndarray:
    """The frozen policy's last hidden states `[N, S, D]` (host, float32) of every row."""

    @jax.jit
    def fn(params, tokens_BxS):
        positions = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
        return nnx.merge(pol_gd, params).hidden(tokens_BxS, positions)[0].astype(jnp.float32)

    n = tokens_NxS.shape[0]
    out = None
    for start in range(0, n, batch_size):
        rows = np.asarray(tokens_NxS[start : start + batch_size])
        pad = batch_size - rows.shape[0]  # keep one compiled shape
        h = np.asarray(fn(pol_params, np.pad(rows, ((0, pad), (0, 0)))))[: rows.shape[0]]
        if out is None:
            out = np.empty((n,) + h.shape[1:], np.float32)
        out[start : start + rows.shape[0]] = h
    return out


def select_draft_vocab(tokens, mask, size: int, eos_ids, vocab_size: int) -> np.ndarray:
    """The `size` token ids most frequent among the supervised (`mask` > 0) tokens, ties to the
    lower id, EOS ids always included; sorted int32."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"mtp.draft_vocab={size} must be in [1, {vocab_size}] (the vocabulary)")
    counts = np.bincount(np.asarray(tokens)[np.asarray(mask) > 0], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts[:vocab_size]))
    eos = [int(e) for e in eos_ids if 0 <= e < vocab_size][:size]
    rest = [int(i) for i in order if int(i) not in eos][: size - len(eos)]
    return np.sort(np.asarray(eos + rest, np.int32))


def load_draft_vocab(mtp_dir: Path, vocab_size: int | None = None) -> np.ndarray | None:
    """The draft vocabulary an `mtp` stage saved next to its checkpoints (None: full vocab),
    checked: distinct int token ids (below `vocab_size` when given)."""
    path = Path(mtp_dir) / "draft_vocab.npy"
    if not path.exists():
        return None
    ids = np.load(path, allow_pickle=False)
    ok = ids.ndim == 1 and ids.size > 0 and np.issubdtype(ids.dtype, np.integer)
    ok = ok and len(np.unique(ids)) == ids.size and int(ids.min()) >= 0
    if not ok or (vocab_size is not None and int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{path}: not a draft vocabulary (want distinct int token ids in [0, "
            f"{vocab_size or 'V'}), got {ids.dtype} shape {ids.shape})"
        )
    return ids.astype(np.int32)


def init_mtp(cfg: RunConfig, pol_cfg, mesh):
    """(graphdef, params) of a fresh MTP (or of `mtp.init_from`), on the mesh."""
    graphdef, params = mtp_lib.init(pol_cfg, cfg.mtp.num_layers, cfg.seed + 100)
    if cfg.mtp.init_from:
        optimizer = make_optimizer(cfg.mtp.optim, cfg.mtp.steps)
        params = restore_params(Path(cfg.mtp.init_from), params, optimizer, mesh)
    return graphdef, sharding.place_state(params, mesh)


def load_trained(cfg: RunConfig, workdir: Path, pol_cfg, mesh):
    """(graphdef, params) of the MTP trained by this run's `mtp` stage."""
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: mtp_lib.MTP(pol_cfg, cfg.mtp.num_layers, nnx.Rngs(params=0)))
    )
    optimizer = make_optimizer(cfg.mtp.optim, cfg.mtp.steps)
    params = restore_params(Path(workdir) / "mtp" / "ckpt", abstract, optimizer, mesh)
    return graphdef, params


def run(cfg: RunConfig, workdir: Path, mesh, stop_at_step: int | None = None) -> dict:
    sdir = Path(workdir) / "mtp"
    m = cfg.mtp
    pol_gd, pol_params, tok = policies.load(cfg, workdir, mesh)
    pol_cfg = model.graphdef_config(pol_gd, pol_params)
    mtp_gd, mtp_params = init_mtp(cfg, pol_cfg, mesh)
    optimizer = make_optimizer(m.optim, m.steps)
    state = sharding.replicate_unplaced(
        TrainState.create(mtp_params, optimizer, cfg.seed + 101), mesh
    )
    source = distill.DistillSource(Path(workdir) / "distill")
    vocab = None
    if m.draft_vocab:
        vocab = select_draft_vocab(
            source.tokens, source.mask, m.draft_vocab, tok.eos_ids, pol_cfg.vocab_size
        )
        sdir.mkdir(parents=True, exist_ok=True)
        np.save(sdir / "draft_vocab.tmp.npy", vocab, allow_pickle=False)
        (sdir / "draft_vocab.tmp.npy").rename(sdir / "draft_vocab.npy")
    temp = cfg.rollout.temperature
    steps = {
        name: make_train_step(
            mtp_loss(pol_gd, mtp_gd, name, m.train_steps, m.chunk, temp, vocab), optimizer
        )
        for name in {m.loss, m.warmup_loss}
    }

    def train_step(state, batch):  # the warm-up loss for the first warmup_loss_steps steps
        name = m.warmup_loss if int(state.step) < m.warmup_loss_steps else m.loss
        return steps[name](state, batch)

    it = iter(distill.dataset(Path(workdir) / "distill", m.batch_size, cfg.seed))
    hiddens = None
    if m.cache_hidden:
        hiddens = policy_hiddens(pol_gd, pol_params, source.tokens, m.batch_size)

    def make_batch(b):
        if hiddens is not None:
            b = {**b, "hidden": hiddens[b["index"]]}
        return {**sharding.shard_batch(b, mesh), "policy": pol_params}

    seq_len = source.tokens.shape[1]
    eval_ids = prompts.prompt_ids(cfg, tok, m.eval_prompts, "eval", cfg.distill.prompts)

    def eval_fn(state):
        return evaluate(
            (pol_gd, pol_params), (mtp_gd, state.params), tok, cfg, eval_ids, m.eval_draft, vocab
        )

    before = eval_fn(state)
    res = fit(
        "mtp", sdir, cfg, state, train_step, it, make_batch,
        total_steps=m.steps, log_every=m.log_every, tokens_per_step=m.batch_size * seq_len,
        lr_at=schedule(m.optim, m.steps), eval_fn=eval_fn, eval_every=m.eval_every,
        stop_at_step=stop_at_step,
    )  # fmt: skip
    after = res.last_eval or eval_fn(res.state)
    summary = {
        "stage": "mtp",
        "loss": m.loss,
        "warmup": f"{m.warmup_loss} x {m.warmup_loss_steps} steps" if m.warmup_loss_steps else None,
        "steps": m.steps,
        "draft_vocab": m.draft_vocab or None,
        "final_loss": res.last_metrics.get("loss"),
        "train_time_s": res.train_time_s,
        "before": before,
        "after": after,
    }
    (sdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
