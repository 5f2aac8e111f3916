"""Stage `distill`: self-distillation data for MTP training.

Samples responses from the frozen policy at the rollout temperature and stores token ids only
(nothing decoded) in `DIR/distill/`: `tokens.npy` `[N, S]` int32 (prompt, then response,
right-padded) and `mask.npy` `[N, S]` (1 on response tokens). `data.DistillSource` reads them for
grain with memory mapping.

Prompts (`distill.prompts`): the run's own task -- what RL will sample -- with a
`distill.mixed_fraction` share of mixed chat requests so that the MTP generalises beyond the
task's templates. Sampler: the plain one, or the speculative one with an existing MTP
(`distill.draft_from`): its output distribution is exactly the policy's, it just needs fewer
policy passes.

With a mesh, each batch of prompts is laid out over it by rows: each process places its own
rows (`sharding.process_rows`), the sampler runs data-parallel, and the rows come back to every
process (`sharding.gather_rows`); process 0 alone writes the arrays. The samples are the same as
on one device (the same global batch and keys).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from bebop import io, model, policies, prompts, rollout, sampling, sharding, speculative
from bebop.config import RunConfig
from bebop.fit import Preempted, preempted
from bebop.metrics import Progress


def sample_responses(pol, ids, scfg, rng, batch_size: int, draft=None, progress=None, mesh=None):
    """Samples one response per prompt; returns `(tokens [N, S], mask [N, S])` as in the module
    doc. `pol` = (graphdef, params); `draft` = (mtp graphdef, params, vocab, SpecConfig) to use
    the speculative sampler; `progress(rows_done, tokens)` is called after each batch; `mesh`:
    each process samples its rows of each batch (module doc)."""
    width = sampling.next_pow2(max(len(p) for p in ids)) + scfg.max_new_tokens
    tokens = np.full((len(ids), width), scfg.pad_id, np.int32)
    mask = np.zeros((len(ids), width), np.float32)
    layers = model.decode_layers_jit(*pol)  # once for all batches, not a weight copy per call
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        n = len(batch)
        rows = np.arange(n) if mesh is None else sharding.process_rows(mesh, n, log=not start)
        width = sampling.bucket_width(max(len(p) for p in batch))
        toks, lens = sampling.pad_prompts([batch[r] for r in rows], scfg.pad_id, min_width=width)
        if sharding.spreads(mesh):
            toks, lens = sharding.place_rows((toks, lens), mesh, rows, n)
        key = jax.random.fold_in(rng, start)
        if draft is None:
            out = sampling.sample_jit(*pol, toks, lens, key, scfg, layers)
        else:
            mtp_gd, mtp_params, vocab, spec = draft
            out = speculative.sample_jit(
                *pol, mtp_gd, mtp_params, toks, lens, key, scfg, spec, vocab, layers
            ).sample
        # this process's rows, then every process's
        out = sharding.gather_rows(sharding.local_rows((out.tokens, out.lengths), rows), rows, n)
        out_tokens, out_lengths = out
        for r, prompt in enumerate(batch):
            m, row = int(out_lengths[r]), start + r
            tokens[row, : len(prompt)] = prompt
            tokens[row, len(prompt) : len(prompt) + m] = out_tokens[r, :m]
            mask[row, len(prompt) : len(prompt) + m] = 1.0
        if progress is not None:
            progress(n, int(out_lengths.sum()))
        if preempted(start // batch_size + 1):  # SIGTERM: stop between batches (none written)
            raise Preempted(
                f"distill: SIGTERM after {start + n} of {len(ids)} samples; distillation writes "
                "its arrays only when it finishes: rerun the same command to redo the stage"
            )
    return tokens, mask


def run(cfg: RunConfig, workdir: Path, mesh) -> dict:
    ddir = Path(workdir) / "distill"
    ddir.mkdir(parents=True, exist_ok=True)
    d = cfg.distill
    policy = policies.load(cfg.policy, cfg.model, workdir, mesh)
    graphdef, params, tok = policy.graphdef, policy.params, policy.tok
    limits = prompts.PromptLimits.of(cfg, policy.cfg)  # checked before a sampler allocates
    ids = prompts.blend(
        cfg.task, cfg.seed, tok, d.num_samples, "distill", d.prompts, d.mixed_fraction, limits
    )
    draft = None
    if d.draft_from:
        mtp_gd, mtp_params, vocab = policies.load_mtp(cfg.mtp, Path(d.draft_from), policy.cfg, mesh)
        spec = rollout.spec_config(cfg.rollout, rule="rejection")
        draft = (mtp_gd, mtp_params, vocab, spec)
    bar = Progress(len(ids), 0, "distill")
    t0 = time.perf_counter()
    try:
        tokens, mask = sample_responses(
            (graphdef, params),
            ids,
            rollout.sampling_config(cfg.rollout, tok),
            jax.random.key(cfg.seed + 1),
            d.batch_size,
            draft,
            progress=lambda rows, n: bar.update(rows, n),
            mesh=mesh,
        )
    finally:
        bar.close()
    for name, arr in (("tokens", tokens), ("mask", mask)):  # atomic: a crash leaves no partial file
        if sharding.is_primary():  # every process holds every row
            io.save_array_atomic(ddir / f"{name}.npy", arr)
    summary = {
        "stage": "distill",
        "samples": len(ids),
        "prompts": d.prompts,
        "mixed_fraction": d.mixed_fraction,
        "sampler": "speculative" if draft else "plain",
        "seq_len": tokens.shape[1],
        "response_tokens": int(mask.sum()),
        "sample_time_s": time.perf_counter() - t0,
    }
    if sharding.is_primary():
        io.write_json_atomic(ddir / "summary.json", summary)
    return summary
