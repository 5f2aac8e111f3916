"""Stage `mtp`: train the MTP draft layer(s) once, before RL, on the policy's own samples.

Backbone, embedding and head are frozen: the train state holds only the MTP parameters, the policy
parameters are the train step's explicit frozen argument (traced, not compile-time constants) and
every use of them is under `stop_gradient`. Each step (`mtp_losses.mtp_loss`): one policy forward
for the hiddens -> `mtp.train_hidden` for `mtp.train_steps` recursive steps -> the loss named by
`mtp.loss` (`mtp_losses.MTP_LOSSES`).
Every `mtp.eval_every` steps the real speculative sampler (γ = `mtp.eval_draft`, `rejection` and
`target_only`) runs on held-out prompts and logs per-position acceptance, accept length, mean
policy entropy and the analytic acceptance Σ min(p, q) of the drafted positions.

`mtp.draft_vocab = K`: the draft head keeps the K tokens most frequent in the distill responses
(`mtp.select_draft_vocab`), saved as `DIR/mtp/draft_vocab.npy` for the samplers.
`mtp.cache_hidden`: everything of the frozen target computed once over the distill set
(`policy_hiddens`: hiddens and the full-vocabulary normalisers, with `rollout.top_k` /
`rollout.top_p` also each position's support, kept on disk next to the distill data by
`cached_target`), so a step costs only the MTP's own work. The losses run at the rollout's
temperature and truncation: what they measure is the acceptance the rollouts' verifier has.
`mtp.init`: random or the backbone's last layer. `mtp.patience`: stop once the held-out RS accept
length stops improving. `mtp.eval_mixed_prompts`: also evaluate on mixed chat.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop import data, io, policies, prompts, rollout, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.config import RunConfig
from bebop.fit import fit
from bebop.metrics import Progress
from bebop.mtp import load_draft_vocab, select_draft_vocab  # noqa: F401 - re-exported
from bebop.mtp_losses import MTPBatch, mtp_loss, target_stats, truncates
from bebop.train import TrainState, make_optimizer, make_train_step, schedule


def evaluate(
    pol, mtp, tok, cfg: RunConfig, prompt_ids, num_draft: int, vocab=None, width: int = 0
) -> dict:
    """Real speculative rollouts on held-out prompts, both verification rules (prompts padded to
    at least `width`: sets of one size and width share the compiled samplers)."""
    scfg = rollout.sampling_config(cfg.rollout, tok)
    toks, lens = sampling.pad_prompts(prompt_ids, tok.pad_id, min_width=width)
    res = {}
    for rule in ("rejection", "target_only"):
        out = speculative.sample_jit(
            *pol,
            *mtp,
            toks,
            lens,
            jax.random.key(cfg.seed + 7),
            scfg,
            speculative.SpecConfig(num_draft, rule),
            vocab,
        )
        out = sharding.to_host(out)  # gathered: the output may span other processes
        res.update({f"{rule}/{k}": v for k, v in speculative.summarize(out).items()})
    return res


def policy_hiddens(
    pol_gd,
    pol_params,
    tokens_NxS,
    batch_size: int,
    temperature: float = 1.0,
    mesh=None,
    rows=None,
    top_k: int = 0,
    top_p: float = 1.0,
    features=None,
):
    """The frozen policy's last hidden states `[N, S, D]` and the normalisers of its distribution
    at `temperature` (and the sampler's `top_k` / `top_p`) over the full vocabulary
    (`mtp_losses.TargetStats` fields by `MTPBatch` name, each `[N, S]`; host, float32), per row:
    everything of the target that does not change while only the MTP trains. With `features`
    (an MTP's `mtp.collected` layers), a third: those layers' outputs `[N, S, F*D]`, from the
    same pass (else None). With `mesh` (and `rows`, this process's rows of a batch:
    `sharding.process_rows`), each batch is split over the mesh's batch axis, so every device
    computes only its share, and gathered."""

    @jax.jit
    def fn(params, tokens_BxS):
        policy = nnx.merge(pol_gd, params)
        positions = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
        hidden, feats, _ = policy.hidden_features(tokens_BxS, positions, features=features)
        stats = target_stats(
            policy.final_norm(hidden),
            policy.head_matrix(),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        fields = {"target_lse": stats.lse, "target_floor": stats.floor}
        fields["target_lse_kept"] = stats.lse_kept
        fields = {k: v for k, v in fields.items() if v is not None}
        if features is not None:
            fields["features"] = feats.astype(jnp.float32)
        return hidden.astype(jnp.float32), fields

    n = tokens_NxS.shape[0]
    if mesh is not None and rows is None:
        rows = sharding.process_rows(mesh, batch_size)
    mine = np.arange(batch_size) if rows is None else rows
    hiddens, stats = None, {}
    bar = Progress(n, 0, "mtp target cache")  # minutes on a CPU for a real policy
    try:
        for start in range(0, n, batch_size):
            chunk = np.asarray(tokens_NxS[start : start + batch_size])
            pad = batch_size - chunk.shape[0]  # keep one compiled shape
            batch = np.pad(chunk, ((0, pad), (0, 0)))
            if mesh is not None:
                batch = sharding.batch_from_process_rows(batch[mine], mesh, batch_size)
            h, st = sharding.to_host(fn(pol_params, batch))
            if hiddens is None:
                hiddens = np.empty((n,) + h.shape[1:], np.float32)
                stats = {k: np.empty((n,) + v.shape[1:], np.float32) for k, v in st.items()}
            hiddens[start : start + chunk.shape[0]] = h[: chunk.shape[0]]
            for k, v in st.items():
                stats[k][start : start + chunk.shape[0]] = v[: chunk.shape[0]]
            bar.update(chunk.shape[0], chunk.size)
    finally:
        bar.close()
    feats = stats.pop("features", None)
    return hiddens, stats, feats


def _fingerprint(tokens_NxS, pol_params, temperature: float, top_k=0, top_p=1.0, features=None):
    """What the cached target depends on: the distill tokens, the policy's weights, T, the
    sampler's truncation (and the feature layers, when cached)."""
    h = hashlib.sha256(np.ascontiguousarray(tokens_NxS).tobytes())
    for leaf in jax.tree.leaves(sharding.to_host(pol_params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    h.update(repr(float(temperature)).encode())
    if truncates(top_k, top_p):
        h.update(repr((int(top_k), float(top_p))).encode())
    if features is not None:
        h.update(repr(tuple(features)).encode())
    return h.hexdigest()


def cached_target(
    distill_dir: Path,
    pol_gd,
    pol_params,
    tokens_NxS,
    batch_size,
    temperature,
    mesh=None,
    rows=None,
    top_k: int = 0,
    top_p: float = 1.0,
    features=None,
):
    """`policy_hiddens` kept on disk next to the distill data (`target_T{T}/`, with a truncating
    sampler `target_T{T}_k{top_k}_p{top_p}/`), keyed by a hash of the tokens, the policy's
    weights, T and the truncation: every MTP run on the same data and policy (the init
    comparison, the loss ablation, a rerun) pays the backbone pass once. Read memory-mapped;
    a cache from other data or another policy is recomputed, never used. `mesh`, `rows`: the
    pass split over the mesh (`policy_hiddens`; its gathers are collectives, so every process
    must see the same `distill_dir`, as for checkpoints). `features` (an MTP's `mtp.collected`
    layers): their outputs are cached too (`features.npy`, in `target_T{T}_f{layers}/`)."""
    temperature = max(temperature, 1e-3)
    name = f"target_T{temperature:g}"
    if truncates(top_k, top_p):
        name += f"_k{top_k}_p{top_p:g}"
    if features is not None:
        name += "_f" + "-".join(map(str, features))
    cdir = Path(distill_dir) / name
    key = _fingerprint(tokens_NxS, pol_params, temperature, top_k, top_p, features)
    meta = cdir / "meta.json"
    fields = ["target_lse"] + (
        ["target_floor", "target_lse_kept"] if truncates(top_k, top_p) else []
    )
    if meta.exists() and io.read_json(meta).get("fingerprint") == key:
        hid = io.load_array(cdir / "hidden.npy", ndim=3, kind="f", mmap=True)
        stats = {k: io.load_array(cdir / f"{k}.npy", ndim=2, kind="f", mmap=True) for k in fields}
        if features is not None:
            stats["features"] = io.load_array(cdir / "features.npy", ndim=3, kind="f", mmap=True)
        want = tuple(tokens_NxS.shape)
        if hid.shape[:2] == want and all(v.shape[:2] == want for v in stats.values()):
            logging.info("mtp: target hiddens from %s", cdir)
            return {"hidden": hid, **stats}
        logging.warning(
            "mtp: %s has shapes %s/%s for tokens %s; recomputing",
            cdir,
            hid.shape,
            [v.shape for v in stats.values()],
            tokens_NxS.shape,
        )
    hid, stats, feats = policy_hiddens(
        pol_gd, pol_params, tokens_NxS, batch_size, temperature, mesh, rows, top_k, top_p, features
    )
    if feats is not None:
        stats["features"] = feats
    if sharding.is_primary():  # the others computed the same arrays
        cdir.mkdir(parents=True, exist_ok=True)
        io.save_array_atomic(cdir / "hidden.npy", hid)
        for k, v in stats.items():
            io.save_array_atomic(cdir / f"{k}.npy", v)
        meta_json = {"fingerprint": key, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        io.write_json_atomic(meta, meta_json)
    return {"hidden": hid, **stats}


def load_trained(cfg: RunConfig, workdir: Path, pol_cfg, mesh):
    """(graphdef, params) of the MTP trained by this run's `mtp` stage."""
    graphdef, params, _ = policies.load_mtp(cfg.mtp, Path(workdir) / "mtp" / "ckpt", pol_cfg, mesh)
    return graphdef, params


def patience_stop(patience: int, key: str = "rejection/accept_len"):
    """`stop_fn` for `fit`: True once `patience` evaluations in a row bring no new best `key`."""
    best, bad = -np.inf, 0

    def stop(results: dict) -> bool:
        nonlocal best, bad
        value = float(results[key])
        best, bad = (value, 0) if value > best else (best, bad + 1)
        return patience > 0 and bad >= patience

    return stop


def run(cfg: RunConfig, workdir: Path, mesh, stop_at_step: int | None = None) -> dict:
    """The stage: set up the frozen policy and the MTP, train it on the distilled samples with
    held-out evaluation, write `DIR/mtp/summary.json`."""
    sdir, m = Path(workdir) / "mtp", cfg.mtp
    policy = policies.load(cfg.policy, cfg.model, workdir, mesh)
    mtp_gd, mtp_params = policies.init_mtp(m, cfg.policy, cfg.seed, policy, mesh)
    optimizer = make_optimizer(m.optim, m.steps)
    state = sharding.replicate_unplaced(
        TrainState.create(mtp_params, optimizer, cfg.seed + 101), mesh
    )
    source = data.DistillSource(Path(workdir) / "distill")
    vocab = draft_vocab(m, source, policy, sdir)
    train_step = train_step_of(cfg, policy, mtp_gd, vocab, optimizer)
    it, make_batch = batches(cfg, workdir, mesh, source, policy, nnx.merge(mtp_gd, mtp_params))
    eval_fn = evaluator(cfg, policy, mtp_gd, vocab)
    before = eval_fn(state)
    res = fit(
        "mtp",
        sdir,
        cfg,
        state,
        train_step,
        it,
        make_batch,
        total_steps=m.steps,
        log_every=m.log_every,
        tokens_per_step=m.batch_size * source.tokens.shape[1],
        lr_at=schedule(m.optim, m.steps),
        eval_fn=eval_fn,
        eval_every=m.eval_every,
        stop_at_step=stop_at_step,
        stop_fn=patience_stop(m.patience, "rejection/accept_len") if m.patience else None,
    )
    summary = {
        "stage": "mtp",
        "loss": m.loss,
        "init": m.init,
        "warmup": f"{m.warmup_loss} x {m.warmup_loss_steps} steps" if m.warmup_loss_steps else None,
        "steps": m.steps,
        "steps_run": int(res.state.step),
        "draft_vocab": m.draft_vocab or None,
        "final_loss": res.last_metrics.get("loss"),
        "train_time_s": res.train_time_s,
        "before": before,
        "after": res.last_eval or eval_fn(res.state),
    }
    if sharding.is_primary():
        io.write_json_atomic(sdir / "summary.json", summary)
    return summary


def draft_vocab(m, source: data.DistillSource, policy, sdir: Path):
    """The draft head's vocabulary (`mtp.draft_vocab` most frequent response tokens, saved as
    `DIR/mtp/draft_vocab.npy` for the samplers), or None for the full vocabulary."""
    if not m.draft_vocab:
        return None
    tok = policy.tok
    vocab = select_draft_vocab(
        source.tokens, source.mask, m.draft_vocab, tok.eos_ids, policy.cfg.vocab_size
    )
    sdir.mkdir(parents=True, exist_ok=True)
    if sharding.is_primary():  # every process selected the same vocabulary
        io.save_array_atomic(sdir / "draft_vocab.npy", vocab)
    return vocab


def train_step_of(cfg: RunConfig, policy, mtp_gd, vocab, optimizer):
    """`train_step(state, batch)`: `mtp.loss`, after `mtp.warmup_loss` for the first
    `mtp.warmup_loss_steps` steps, at the rollouts' temperature and truncation (the verifier's p
    and q), the frozen policy an explicit argument."""
    m, r = cfg.mtp, cfg.rollout
    cut = dict(top_k=r.top_k, top_p=r.top_p)
    steps = {
        name: make_train_step(
            mtp_loss(
                policy.graphdef, mtp_gd, name, m.train_steps, m.chunk, r.temperature, vocab, **cut
            ),
            optimizer,
        )
        for name in {m.loss, m.warmup_loss}
    }

    def train_step(state, batch):
        name = m.warmup_loss if int(state.step) < m.warmup_loss_steps else m.loss
        return steps[name](state, batch, policy.params)

    return train_step


def batches(cfg: RunConfig, workdir: Path, mesh, source: data.DistillSource, policy, mtp_module):
    """(iterator over this process's rows of the distill batches, `make_batch` turning one into
    the global `MTPBatch`), with the frozen target's cached hiddens and normalisers
    (`mtp.cache_hidden`; the layers `mtp_module` reads) joined by row index."""
    m, r = cfg.mtp, cfg.rollout
    rows = sharding.process_rows(mesh, m.batch_size)  # this process's share of each batch
    it = iter(data.distill_dataset(Path(workdir) / "distill", m.batch_size, cfg.seed, rows))
    cached = {}
    if m.cache_hidden:  # the frozen target's hiddens and log-normalisers, computed once
        cached = cached_target(
            Path(workdir) / "distill",
            policy.graphdef,
            policy.params,
            source.tokens,
            m.batch_size,
            r.temperature,
            mesh,
            rows,
            top_k=r.top_k,
            top_p=r.top_p,
            features=mtp_lib.collected(mtp_module),
        )

    def make_batch(b):
        b = MTPBatch(b["tokens"], b["mask"], **{k: v[b["index"]] for k, v in cached.items()})
        return sharding.batch_from_process_rows(b, mesh, m.batch_size)

    return it, make_batch


def evaluator(cfg: RunConfig, policy, mtp_gd, vocab):
    """`eval_fn(state)`: real speculative rollouts of the MTP in `state` on held-out prompts of
    the distillation's own kind (the RL task) and, with `mtp.eval_mixed_prompts`, mixed chat."""
    m, tok = cfg.mtp, policy.tok
    limits = prompts.PromptLimits.of(cfg, policy.cfg)  # checked before a sampler allocates
    eval_sets = {
        "": prompts.prompt_ids(
            cfg.task, cfg.seed, tok, m.eval_prompts, "eval", cfg.distill.prompts, limits
        )
    }
    if m.eval_mixed_prompts:
        eval_sets["mixed/"] = prompts.prompt_ids(
            cfg.task, cfg.seed, tok, m.eval_mixed_prompts, "eval", "mixed", limits
        )
    # Sets of one size share the compiled samplers at one width; else each keeps its own.
    one_size = len({len(ids) for ids in eval_sets.values()}) == 1
    width = max(sampling.pad_prompts(ids, tok.pad_id)[0].shape[1] for ids in eval_sets.values())
    width = width if one_size else 0
    pol = (policy.graphdef, policy.params)

    def eval_fn(state):
        res = {}
        for prefix, ids in eval_sets.items():
            out = evaluate(pol, (mtp_gd, state.params), tok, cfg, ids, m.eval_draft, vocab, width)
            res.update({prefix + k: v for k, v in out.items()})
        return res

    return eval_fn
