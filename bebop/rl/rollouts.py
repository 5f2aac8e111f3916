"""The RL rollout source (`Rollouts`: prompts of batch i -> sampler -> rewards -> a
`LearnerBatch`), the reward scorer with the run's bounds, and the plain-vs-speculative speed
comparison at the end of RL.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from bebop import (
    compaction,
    model,
    prompts,
    rewards,
    sampling,
    sharding,
    spec_compacted,
    speculative,
)
from bebop.config import ConfigError, RLConfig, RunConfig
from bebop.metrics import Timer
from bebop.rl import grpo, loop, records
from bebop.rollout import sampling_config, spec_config

# Rollouts whose per-position acceptance the default draft table averages (`Rollouts`).
DRAFT_WINDOW = 4
# A bucket of the derived draft table changes its γ only for a modelled gain above this. Without
# it the demo's RL run with compaction (commit 8fdf17a) flipped its 64-row bucket between γ = 0
# and 1 16 times in 120 steps, a tie redrawn by the drifting acceptance (a new program per new
# table).
DRAFT_MARGIN = 0.05
# A derived table that drafts at no bucket gets no new acceptance counts, so it could never draft
# again, even as an MTP trained during RL (online, joint, growmtp) improves: after this many such
# rollouts, one rollout drafts `rollout.num_draft` at every bucket (a probe), and the table is
# derived again from what it measured.
DRAFT_PROBE_EVERY = 16


def reward_scorer(rl: RLConfig):
    """`score(reward_fn, texts, problems)`: rewards in worker processes, with the run's time
    bound, retries and timeout action (`bebop/rewards.py`)."""
    return functools.partial(
        rewards.score,
        timeout_s=rl.reward_timeout_s,
        retries=rl.reward_retries,
        on_timeout=rl.reward_timeout_action,
    )


class Rollouts:
    """The RL rollout source: batch i's prompts, the sampler (plain or speculative), rewards,
    advantages and the learner's arrays (`loop.LearnerBatch`). `record`: also each verify
    cycle's length (`cycle_len`, by anchor position); `keep_hidden`: and the backbone hiddens
    verification computed (`hidden`, for GrowMTP). Called by the rollout worker as
    `rollouts(i, policy_version, pol_params, mtp_params, mtp_version)`.

    The default draft table (speculative mode, `rollout.compact` on, `rollout.draft_table`
    empty; not for GrowMTP, which drafts `num_draft` at every bucket): the first rollout drafts
    `rollout.num_draft` at every bucket size; after each rollout, each bucket size b gets the γ
    in 0 .. `num_draft` with the most expected tokens per second (`compaction.draft_table`): E_γ
    = 1 + Σ_{j<=γ} Π_{i<=j} α_i tokens per cycle of t_verify(b, γ+1) + γ t_draft(b) seconds,
    against 1 token per t_verify(b, 1) for γ = 0; a bucket keeps its γ unless another is more
    than `DRAFT_MARGIN` faster, and a table drafting nowhere is probed at `num_draft` every
    `DRAFT_PROBE_EVERY` rollouts. α_i is the acceptance of draft position i over the last
    `DRAFT_WINDOW` rollouts (accepted / attempted, all rows pooled:
    `compaction.RunningAcceptance`); the costs are `draft_costs` (`spec_compacted.bucket_costs`'
    layout), or measured once, after the first rollout, at its prompt width plus half the token
    budget. The stats carry `draft_table` when it changes. Not part of a checkpoint: a resumed
    run starts again from `num_draft` and re-measures (its samples can differ from the
    uninterrupted run's; each is lossless).

    A batch's rows come in GRPO groups (`prompts`), so where the batch is host arrays (no mesh
    to spread over, or compaction on) the samplers prefill each group's prompt once
    (`SamplingConfig.prompt_group` = `rl.group_size`; checked in `sample`): the same samples for
    the same keys (to the float rounding of a B/G-row prefill) for 1/G of the prefill's work
    (demo, 128 rows in groups of 8: plain 1.11x and speculative 1.27x faster, `benchmarks/
    tail.py --group 8`).

    With a `mesh`, a batch is laid out over it by rows (`sharding.batch_sharding`): each
    process builds the prompts of its own rows only (`self.rows`, `sharding.process_rows`),
    places them as its share of the global batch, reads back its rows of the sampler's output,
    decodes and scores them; the rewards (one number a row: GRPO's groups need them all), the
    statistics' sums and the sampled rows' draft records (each row counted once, by the lowest
    process that holds it: `sharding.RowShare`) are what the processes exchange, and the
    `LearnerBatch` holds this process's rows (`RolloutBatch.rows`). With `rollout.compact`
    every process holds every row (the tail-aware drivers move rows between devices on the
    host), as without a mesh. On a one-device mesh the sampler takes host arrays."""

    def __init__(
        self,
        cfg: RunConfig,
        pol_gd,
        mtp_gd,
        tok,
        task,
        record=False,
        vocab=None,
        keep_hidden=False,
        draft_costs=None,
        mesh=None,
    ):
        self.cfg, self.pol_gd, self.mtp_gd, self.tok, self.task = cfg, pol_gd, mtp_gd, tok, task
        self.mesh, self.batch_size = mesh, cfg.rl.prompts_per_step * cfg.rl.group_size
        # this process's rows (every row without a mesh, or with compaction)
        self.share = (
            sharding.RowShare.whole(self.batch_size)
            if mesh is None or cfg.rollout.compact
            else sharding.row_share(mesh, self.batch_size)
        )
        self.rows, self.split = self.share.rows, self.share.split
        self.vocab = vocab  # the MTP's draft vocabulary (None: full)
        self.keep_hidden = record and keep_hidden
        self.scfg = sampling_config(cfg.rollout, tok)
        if not sharding.spreads(mesh) or cfg.rollout.compact:
            # host arrays whose rows come in GRPO groups (`prompts`): one prefill per group
            self.scfg = dataclasses.replace(self.scfg, prompt_group=cfg.rl.group_size)
        self.score = reward_scorer(cfg.rl)
        r = cfg.rollout
        self.spec = None
        if r.mode != "plain":
            self.spec = spec_config(r, record=record)
        # The draft table: `rollout.draft_table`, or derived (see the class docstring). GrowMTP
        # drafts `num_draft` at every bucket: its DCA trains the steps its cycles drafted (a
        # γ = 0 bucket records 1-token cycles), and a new head would be derived γ = 0 throughout.
        self.table, self.acceptance, self.draft_costs = r.draft_table, None, draft_costs
        grow = cfg.rl.mtp_strategy == "growmtp"
        if self.spec is not None and r.compact and not r.draft_table and not grow:
            if jax.process_count() > 1 and draft_costs is None:
                # each process would time its own costs and could pick another table (program)
                raise ConfigError(
                    "config key 'rollout.draft_table': with rollout.compact on several "
                    "processes, give the table explicitly (the derived one is timed per process)"
                )
            self.acceptance = compaction.RunningAcceptance(r.num_draft, DRAFT_WINDOW)
            self.rollouts_without_drafts = 0

    def prompts(self, i: int, rows=None):
        """(problems, prompt ids) of `rows` (default: all) of batch i: row r is a sample of
        problem i * prompts_per_step + r // group_size."""
        p, g = self.cfg.rl.prompts_per_step, self.cfg.rl.group_size
        rows = range(p * g) if rows is None else rows
        made = {}
        for j in sorted({int(r) // g for r in rows}):
            q = self.task.problem(self.cfg.seed + prompts.STREAMS["rl"], i * p + j)
            made[j] = (q, self.task.prompt_ids(self.tok, q))
        return [made[int(r) // g][0] for r in rows], [made[int(r) // g][1] for r in rows]

    def place(self, ids):
        """This process's prompt rows padded to the batch's common width (the widest over every
        process), as (tokens, lengths): host arrays without a mesh or with compaction, else
        global arrays laid out over the mesh by rows."""
        width = sampling.bucket_width(max(len(x) for x in ids))
        width = sharding.max_over_processes(width, self.split)
        toks, lens = sampling.pad_prompts(ids, self.tok.pad_id, min_width=width)
        if not sharding.spreads(self.mesh) or self.cfg.rollout.compact:
            return toks, lens
        return sharding.place_rows((toks, lens), self.mesh, self.rows, self.batch_size)

    def sample(self, pol_params, mtp_params, toks, lens, key, spec):
        """`spec=None`: the plain sampler. Returns (SampleOutput, SpecOutput or None). With
        `rollout.compact` the samplers' tail-aware drivers (`bebop/compaction.py`; the same
        samples), with the draft table (`self.table`) giving γ per live-batch size."""
        r = self.cfg.rollout
        pol = (self.pol_gd, pol_params)
        sampling.check_prompt_groups(toks, lens, self.scfg.prompt_group)
        if spec is None:
            if r.compact:
                out = sampling.sample_compacted(
                    *pol, toks, lens, key, self.scfg, min_bucket=r.min_bucket
                )
                return out, None
            return sampling.sample_jit(*pol, toks, lens, key, self.scfg), None
        args = (*pol, self.mtp_gd, mtp_params, toks, lens, key, self.scfg)
        if r.compact:
            out = spec_compacted.sample_compacted(
                *args, spec, self.vocab, min_bucket=r.min_bucket, draft_table=self.table
            )
        else:  # one batch: the table's γ for its size
            num_draft = compaction.draft_for_batch(self.table, len(toks), spec.num_draft)
            spec = dataclasses.replace(spec, num_draft=num_draft)
            out = speculative.sample_jit(*args, spec, self.vocab)
        return out.sample, out

    def measure_costs(self, pol_params, mtp_params, shape) -> dict:
        """Verify and draft costs at each bucket size of a `shape` = (rows, prompt width) batch."""
        r = self.cfg.rollout
        pol = (self.pol_gd, pol_params)
        sizes = compaction.bucket_sizes(shape[0], r.min_bucket)
        context = shape[1] + self.scfg.max_new_tokens // 2
        layers = model.decode_layers_jit(*pol)
        mtp = (self.mtp_gd, mtp_params)
        return spec_compacted.bucket_costs(
            pol, layers, mtp, self.vocab, sizes, context, r.num_draft
        )

    def update_draft_table(self, attempts_Y, accepts_Y) -> dict:
        """Adds one rollout's attempts and acceptances per draft position and derives the table
        from the costs (`draft_costs`); returns `{"draft_table": [[b, γ], ...]}` if it changed,
        else {}."""
        self.acceptance.add(attempts_Y, accepts_Y)
        rates = self.acceptance.rates()
        if rates is None:
            return {}
        num_draft = self.cfg.rollout.num_draft
        table = compaction.draft_table(rates, self.draft_costs, num_draft, self.table, DRAFT_MARGIN)
        self.rollouts_without_drafts = (
            0 if any(g for _, g in table) else (self.rollouts_without_drafts + 1)
        )
        if self.rollouts_without_drafts > DRAFT_PROBE_EVERY:
            table = tuple((b, num_draft) for b, _ in table)  # the probe
            self.rollouts_without_drafts = 0
        if table == self.table:
            return {}
        self.table = table
        return {"draft_table": [list(e) for e in table]}

    def __call__(self, i, version, pol_params, mtp_params, mtp_version) -> loop.RolloutBatch:
        cfg, timer, rows, split = self.cfg, Timer(), self.rows, self.split
        problems, ids = self.prompts(i, rows)
        toks, lens = self.place(ids)
        with timer("rollout_s"):
            key = jax.random.fold_in(jax.random.key(cfg.seed + 5), i)
            sample, spec_out = self.sample(pol_params, mtp_params, toks, lens, key, self.spec)
            # this process's rows only (every row without a mesh)
            if spec_out is not None:
                spec_out = sharding.local_rows(spec_out, rows)
                sample = spec_out.sample
            else:
                sample = sharding.local_rows(sample, rows)
        with timer("reward_s"):
            texts = [
                self.tok.decode(row[:n])
                for row, n in zip(sample.tokens, sample.lengths, strict=True)
            ]
            r = sharding.gather_rows(
                self.score(self.task.reward, texts, problems), rows, self.batch_size
            )
        adv = grpo.advantages(r.reshape(-1, cfg.rl.group_size), cfg.rl.std_norm).reshape(-1)
        p = int(toks.shape[1])
        b, width = len(rows), p + self.scfg.max_new_tokens
        tokens = np.full((b, width), self.tok.pad_id, np.int32)
        mask = np.zeros((b, width), np.float32)
        behaviour = np.zeros((b, width), np.float32)
        for row, prompt in enumerate(ids):
            s, n = len(prompt), int(sample.lengths[row])
            tokens[row, :s] = prompt
            tokens[row, s : s + n] = sample.tokens[row, :n]
            mask[row, s : s + n] = 1.0
            behaviour[row, s : s + n] = sample.logprobs[row, :n]
        data = loop.LearnerBatch(tokens, mask, behaviour, adv[rows])
        # sums over the rows this process owns (another may hold the same ones), then all
        owned = self.share.owned
        mine = (lambda t: t) if owned.all() else (lambda t: jax.tree.map(lambda x: x[owned], t))
        total = functools.partial(sharding.sum_over_processes, split=split)
        stats = records.rollout_stats(r, cfg.rl.group_size, mine(sample), mine(spec_out), total)
        if self.acceptance is not None and spec_out is not None:
            if self.draft_costs is None:
                with timer("draft_costs_s"):
                    self.draft_costs = self.measure_costs(pol_params, mtp_params, toks.shape)
            st = spec_out.stats
            stats.update(self.update_draft_table(st.attempts.sum(0), st.accepts.sum(0)))
        drafts = None
        if spec_out is not None:
            if cfg.rl.draft_log_rows:
                logged = records.sample_rows(cfg.seed, i, self.batch_size, cfg.rl.draft_log_rows)
                local = np.nonzero(np.isin(rows, logged) & owned)[0]
                drafts = records.draft_token_records(spec_out, local, i + 1)
                drafts["row"] = rows[drafts["row"]]  # the row in the whole batch
                drafts = sharding.concat_over_processes(drafts, split)
                drafts = drafts[np.argsort(drafts["row"], kind="stable")]
            if spec_out.cycle_len is not None:
                data = data.replace(cycle_len=np.asarray(spec_out.cycle_len)[:, :width])
            if self.keep_hidden:
                data = data.replace(hidden=np.asarray(spec_out.hidden)[:, :width])
                if spec_out.features is not None:  # an MTP reading other layers than the last
                    data = data.replace(features=np.asarray(spec_out.features)[:, :width])
        return loop.RolloutBatch(
            i, version, mtp_version, data, stats, timer.totals, drafts, rows, self.batch_size
        )


def _timed_rollout(rollouts: Rollouts, pol, mtp, toks, lens, spec, rep: int) -> tuple:
    """(seconds, tokens) of one call; `rep` picks the key."""
    t0 = time.perf_counter()
    out, spec_out = rollouts.sample(pol, mtp, toks, lens, jax.random.key(100 + rep), spec)
    assert (spec_out is None) == (spec is None), "timed the wrong sampler"
    lengths = np.asarray(sharding.to_host(out.lengths))
    return time.perf_counter() - t0, int(lengths.sum())


def speedup_inputs(rollouts: Rollouts, ids) -> tuple:
    """The speed comparison's prompts (every row, in every process), padded, and laid out over
    the mesh by rows as a rollout's are (`Rollouts.place`): host arrays would give the samplers
    a replicated KV cache. Host arrays without a mesh to spread over or with compaction (its
    drivers move rows on the host)."""
    toks, lens = sampling.pad_prompts(ids, rollouts.tok.pad_id)
    if not sharding.spreads(rollouts.mesh) or rollouts.cfg.rollout.compact:
        return toks, lens
    return sharding.shard_batch((toks, lens), rollouts.mesh)


def rollout_speedup(rollouts: Rollouts, pol, mtp, repeats: int) -> dict:
    """Plain vs speculative sampler on the same prompts (one RL batch), same run, timed after
    compilation, the two alternating (a drift of the machine's speed reaches both); each the
    best of `repeats` calls (`rl.speedup_repeats`), tokens per second of that call."""
    _, ids = rollouts.prompts(10_000)
    toks, lens = speedup_inputs(rollouts, ids)
    samplers = {"plain": None}
    if rollouts.spec is not None:
        samplers["spec"] = spec_config(rollouts.cfg.rollout)
    best = {name: (float("inf"), 0) for name in samplers}
    for rep in range(repeats + 1):  # the first call of each compiles
        for name, spec in samplers.items():
            timed = _timed_rollout(rollouts, pol, mtp, toks, lens, spec, rep)
            if rep and timed[0] < best[name][0]:
                best[name] = timed
    res = {"batch": len(ids)}
    for name, (secs, tokens) in best.items():
        res.update({f"{name}_tok_s": tokens / secs, f"{name}_s": secs})
    if "spec" in best:
        res["speedup"] = res["spec_tok_s"] / res["plain_tok_s"]
    return res
