"""Stage `rl`: async GRPO whose rollouts run through the speculative sampler.

Reads top to bottom: policy (SFT stage / GGUF / HF) + MTP (pre-RL stage, or random for growmtp)
-> greedy accuracy before RL -> resume from the newest checkpoint (policy + MTP train states, both
optimizers, RNG, versions, step) -> rollout worker thread + learner loop (each step: the next
batch, the strategy's update, the guards, publish the weights, log, checkpoint) -> greedy accuracy
after RL -> plain vs speculative rollout timed on the same prompts -> `summary.json`.

The MTP strategies (`rl.mtp_strategy`: frozen, online, joint, growmtp) are the step functions of
`learner.MTP_STRATEGIES`; the rollouts come from `rl_rollouts.Rollouts` (or the `make_rollouts`
argument, e.g. a test's recording source).

Several processes: rollouts and learner steps launch their device programs in one deterministic
order that every process follows (`loop.Turnstile`; why this and not disjoint rollout / learner
sub-meshes: `bebop/rl/loop.py`), each step checks that all processes agree on step and versions,
and process 0 alone writes metrics, draft records and the summary. Each process's rollouts
prompt, sample and score its own rows of the batch (`rl_rollouts.Rollouts`), and the learner's batch
is assembled from every process's rows (`loop.RolloutBatch.place`).

Per step, `metrics.jsonl` gets the learner's metrics, the batch's rollout statistics
(`records.rollout_stats`: reward mean / std, zero-std groups, per-position acceptance, accept-length
histogram), a wall-clock `time`, the step's time split (rollout_s and reward_s of its batch;
wait_s, train_s, mtp_train_s, sync_s, eval_s of the learner), `lr` / `mtp_lr`, policy and MTP
versions, and every `rl.eval_every` steps a greedy `eval_accuracy`. `rl/draft_tokens.bin` holds
per-token draft records (see `records`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np

from bebop import config as config_lib
from bebop import io, policies, prompts, rollout, sharding, tasks
from bebop.ckpt import Checkpointer, CheckpointRestoreError
from bebop.config import RunConfig
from bebop.fit import Interrupted, Preempted, preempted
from bebop.metrics import MetricsWriter, Progress, Timer
from bebop.rl import guards, learner, loop, records
from bebop.rl import rollouts as rl_rollouts
from bebop.train import TrainState, make_optimizer, schedule

log = logging.getLogger(__name__)


def load_draft_model(cfg: RunConfig, workdir: Path, policy, mesh):
    """(graphdef, params, draft vocabulary) of the MTP the rollouts draft with: a fresh one for
    plain rollouts (which never draft) and for GrowMTP without `mtp.init_from` (grown from
    random init; with it, GrowMTP's updates start from a pre-trained head found as below), else
    the `mtp` stage's trained MTP in
    `DIR/mtp/ckpt` -- whether or not this launch lists that stage --, else (no `mtp` stage in
    this workdir) another run's trained MTP named by `mtp.init_from` (e.g.
    `runs/mtp_smollm2/mtp/ckpt`: one pre-RL MTP for several RL runs; its draft vocabulary next
    to it), else the MTP layers the policy checkpoint ships if `mtp.init='checkpoint'`, or an
    error naming the missing one."""
    ckpt_dir = Path(workdir) / "mtp" / "ckpt"
    if cfg.rollout.mode == "plain" or (cfg.rl.mtp_strategy == "growmtp" and not cfg.mtp.init_from):
        return (*policies.init_mtp(cfg.mtp, cfg.policy, cfg.seed, policy, mesh), None)
    has_ckpt = lambda d: d.is_dir() and any(p.name.isdigit() for p in d.iterdir())  # noqa: E731
    if not has_ckpt(ckpt_dir) and cfg.mtp.init_from and "mtp" not in cfg.stages:
        other = Path(cfg.mtp.init_from)
        if not has_ckpt(other):
            raise FileNotFoundError(f"config key 'mtp.init_from': {other} holds no checkpoint")
        return policies.load_mtp(cfg.mtp, other, policy.cfg, mesh)
    if not has_ckpt(ckpt_dir):
        if cfg.mtp.init == "checkpoint" and not cfg.mtp.init_from:
            return (*policies.init_mtp(cfg.mtp, cfg.policy, cfg.seed, policy, mesh), None)
        raise FileNotFoundError(
            f"rl: rollout.mode={cfg.rollout.mode!r} with rl.mtp_strategy="
            f"{cfg.rl.mtp_strategy!r} drafts with the trained MTP, but {ckpt_dir} holds no "
            "checkpoint: run the 'mtp' stage first (add it to `stages`), or use "
            "mtp.init_from=<another run>/mtp/ckpt, rl.mtp_strategy='growmtp' or "
            "rollout.mode='plain' (or mtp.init='checkpoint' to draft with the MTP layers an HF "
            "policy checkpoint ships)"
        )
    return policies.load_mtp(cfg.mtp, ckpt_dir, policy.cfg, mesh)


def run(
    cfg: RunConfig,
    workdir: Path,
    mesh,
    stop_at_step: int | None = None,
    task: tasks.Task | None = None,
    make_rollouts=rl_rollouts.Rollouts,
) -> dict:
    """`task`: the RL task (default `tasks.make_task(cfg.task)`); `make_rollouts`: the rollout
    source's constructor, called like `rl_rollouts.Rollouts`."""
    r = set_up(cfg, workdir, mesh, task)
    resume(r)
    learn = build_learner(r)
    rollouts = make_rollouts(
        cfg,
        r.pol_gd,
        r.mtp_gd,
        r.tok,
        r.task,
        record=r.record,
        vocab=r.vocab,
        keep_hidden=r.keep_hidden,
        mesh=mesh,
    )
    worker = RolloutThread(r, rollouts)
    collapse = guards.DraftCollapseGuard(cfg.rl.draft_collapse_ratio, cfg.rl.draft_collapse_action)
    bar = Progress(cfg.rl.steps, r.start, "rl")
    t_start = time.perf_counter()
    try:
        for step in range(r.start, cfg.rl.steps):
            split = Timer()  # this step's time split
            batch = worker.next_batch(step, split)
            if cfg.rollout.mode != "plain":
                rate = batch.stats.get("accept_rate")
                collapse.update(step, rate, batch.policy_version, batch.mtp_version)
            m = learner_step(r, learn, batch, split, step)
            record_step(r, batch, m, split, step, bar)
            save(r, step, m, wall_s=r.wall_before + time.perf_counter() - t_start)
            if stop_at_step is not None and step + 1 >= stop_at_step:
                raise Interrupted(f"stopped at step {step + 1}")
            worker.release(step)
    finally:
        worker.close()
        bar.close()
        r.ckpt.close()
        r.writer.close()
    return finish(r, rollouts, rl_wall=r.wall_before + time.perf_counter() - t_start)


@dataclasses.dataclass
class RLRun:
    """What the RL stage's phases share: the run's fixed parts (config, policy, MTP graph, task,
    checkpointer, metrics writer, weight store) and its state (train states, versions, history,
    timings), which `resume` replaces from a checkpoint."""

    cfg: RunConfig
    rdir: Path
    mesh: object
    policy: object
    task: tasks.Task
    mtp_gd: object
    vocab: object
    score: object
    ref_params: object
    opt: object
    mtp_opt: object
    pol_state: TrainState
    mtp_state: TrainState
    ckpt: Checkpointer
    writer: MetricsWriter
    store: loop.WeightStore
    record: bool
    keep_hidden: bool
    acc_before: float
    versions: dict = dataclasses.field(default_factory=lambda: {"policy": 0, "mtp": 0})
    history: list = dataclasses.field(default_factory=list)
    evals: list = dataclasses.field(default_factory=list)  # (step, greedy accuracy)
    timer: Timer = dataclasses.field(default_factory=Timer)  # the run's time split
    wall_before: float = 0.0  # RL wall time of earlier launches
    first_version: int = 0  # batch i comes from version max(first_version, i - max_staleness)
    start: int = 0
    saved: int | None = None  # the newest checkpointed step: skipped updates are never saved
    save_due: bool = False

    @property
    def pol_gd(self):
        return self.policy.graphdef

    @property
    def tok(self):
        return self.policy.tok

    @property
    def drafts_path(self) -> Path:
        return self.rdir / "draft_tokens.bin"

    def greedy_accuracy(self, params) -> float:
        c = self.cfg
        return rollout.greedy_accuracy(
            (self.pol_gd, params),
            self.tok,
            self.task,
            c.seed,
            c.rl.eval_samples,
            c.rollout.max_new_tokens,
            self.score,
        )

    def keep_copy(self, params):
        """A behaviour version in the decode dtype (`loop.behaviour_copy`): one float32 master
        (the train state's) plus bfloat16 copies on a bfloat16 run."""
        return loop.behaviour_copy(params, self.policy.cfg.dtype)

    def publish(self) -> None:
        """The current weights as the next behaviour version (what the rollouts sample from)."""
        self.store.publish(
            self.versions["policy"],
            self.keep_copy(self.pol_state.params),
            loop.snapshot(self.mtp_state.params),
            self.versions["mtp"],
        )

    def last_good(self) -> str:
        where = f"step {self.saved}" if self.saved is not None else "none saved this launch"
        return (
            f"The last good RL checkpoint ({where}) is in {self.ckpt.directory}; rerun to resume."
        )


def set_up(cfg: RunConfig, workdir: Path, mesh, task) -> RLRun:
    """Policy, MTP, task, the KL reference (the policy at RL start, also on resume: a copy the
    learner never donates), greedy accuracy before RL, fresh train states, the checkpointer, the
    metrics writer and the weight store."""
    rl, rdir = cfg.rl, Path(workdir) / "rl"
    policy = policies.load(cfg.policy, cfg.model, workdir, mesh)
    task = task or tasks.make_task(cfg.task, prompts.PromptLimits.of(cfg, policy.cfg))
    mtp_gd, mtp_params, vocab = load_draft_model(cfg, workdir, policy, mesh)
    opt = make_optimizer(rl.optim, rl.steps)
    mtp_opt = make_optimizer(rl.mtp_optim, rl.steps)
    record, keep_hidden = learner.rollout_records(cfg.rl)
    r = RLRun(
        cfg=cfg,
        rdir=rdir,
        mesh=mesh,
        policy=policy,
        task=task,
        mtp_gd=mtp_gd,
        vocab=vocab,
        score=rl_rollouts.reward_scorer(rl),
        ref_params=loop.snapshot(policy.params) if rl.kl_coef > 0 else None,
        opt=opt,
        mtp_opt=mtp_opt,
        pol_state=None,
        mtp_state=None,
        ckpt=Checkpointer(rdir / "ckpt", cfg.ckpt.keep, cfg.ckpt.async_save),
        writer=None,
        store=loop.WeightStore(keep=rl.max_staleness + 2),
        record=record,
        keep_hidden=keep_hidden,
        acc_before=0.0,
    )
    r.acc_before = r.greedy_accuracy(policy.params)
    r.evals = [(0, r.acc_before)]
    r.pol_state = sharding.replicate_unplaced(
        TrainState.create(policy.params, opt, cfg.seed + 200), mesh
    )
    r.mtp_state = sharding.replicate_unplaced(
        TrainState.create(mtp_params, mtp_opt, cfg.seed + 201), mesh
    )
    r.writer = MetricsWriter(
        rdir / "metrics.jsonl", rdir / "tb" if cfg.tensorboard else None, config_lib.to_dict(cfg)
    )
    return r


def resume(r: RLRun) -> None:
    """From the newest checkpoint: both train states, versions, history, timings and the
    behaviour weights the next batches come from (as the uninterrupted run would); the records
    cut back to its step. A fresh run (also after a launch killed before its first checkpoint)
    clears them. Then the current weights are published."""
    rl = r.cfg.rl
    restored = restore(r.ckpt, r.pol_state, r.mtp_state, rl.max_staleness, r.policy.cfg.dtype)
    if restored is not None:
        step, st, meta = restored
        r.pol_state, r.mtp_state, r.versions = st["policy"], st["mtp"], meta["versions"]
        run_meta = meta.get("run", {})
        r.history = run_meta.get("history", [])
        r.evals = [tuple(e) for e in run_meta.get("evals", r.evals)]
        r.timer.totals.update(run_meta.get("timings", {}))
        r.wall_before = run_meta.get("rl_wall_s", 0.0)
        if "behaviour" in st:  # the versions the next batches come from, as uninterrupted
            for slot, (v, mv) in enumerate(meta["behaviour"]):
                w = st["behaviour"][f"v{slot}"]
                r.store.publish(v, r.keep_copy(w["policy"]), w["mtp"], mv)
        else:  # a checkpoint of an older bebop: the first batches after it are fresher
            r.first_version = step
            log.warning("rl: %s holds no behaviour weights; resuming on-policy", r.ckpt.directory)
        r.writer.truncate_after(step)
        if r.writer.enabled:
            records.truncate_draft_tokens(r.drafts_path, step)
    else:
        r.writer.truncate_after(0)
        if r.writer.enabled and r.drafts_path.exists():
            r.drafts_path.unlink()
    r.start = int(r.pol_state.step)
    r.publish()


def build_learner(r: RLRun) -> learner.Learner:
    """The learner's jitted steps; its log-probs use the sampler's support (`sampling_config`)."""
    return learner.build(
        r.cfg,
        r.pol_gd,
        r.mtp_gd,
        rollout.sampling_config(r.cfg.rollout, r.tok),
        r.vocab,
        r.opt,
        r.mtp_opt,
        r.store,
        r.ref_params,
        model_cfg=r.policy.cfg,
        batch_shards=batch_shards(r.mesh),
    )


class RolloutThread:
    """The rollout worker thread (`loop.RolloutWorker`) and its queue: batch i from behaviour
    version max(first_version, i - max_staleness). Several processes: rollouts and updates launch
    in one global order (`loop.Turnstile`)."""

    def __init__(self, r: RLRun, rollouts):
        rl = r.cfg.rl
        self.q: queue.Queue = queue.Queue(maxsize=max(1, rl.max_staleness))
        self.stop = threading.Event()
        self.turns = (
            loop.Turnstile(r.start, rl.max_staleness, rl.steps) if jax.process_count() > 1 else None
        )
        self.r = r
        self.worker = loop.RolloutWorker(
            rollouts,
            r.store,
            self.q,
            r.start,
            rl.max_staleness,
            self.stop,
            r.first_version,
            rl.steps,
            self.turns,
        )
        self.worker.start()

    def next_batch(self, step: int, split: Timer) -> loop.RolloutBatch:
        """The batch of `step` (its wait timed), checked to agree with every process."""
        if self.turns is not None:
            self.turns.acquire(("L", step))
        version = self.r.versions["policy"]
        with split("wait_s"):
            batch = loop.next_batch(self.q, step, version, self.r.cfg.rl.max_staleness)
        loop.check_agreement(step, batch, version)
        return batch

    def release(self, step: int) -> None:
        if self.turns is not None:
            self.turns.release(("L", step))

    def close(self) -> None:
        self.stop.set()
        if self.turns is not None:
            self.turns.close()
        self.worker.join(timeout=60)


def learner_step(r: RLRun, learn: learner.Learner, batch, split: Timer, step: int) -> dict:
    """The strategy's update on the batch, the non-finite guard, the new weights published, and
    every `rl.eval_every` steps a greedy accuracy. Returns the step's metrics."""
    rl = r.cfg.rl
    strategy = learner.MTP_STRATEGIES[rl.mtp_strategy]
    r.pol_state, r.mtp_state, m, mtp_updated = strategy(
        learn, split, r.pol_state, r.mtp_state, batch.place(r.mesh), batch.policy_version, step
    )
    m["lr"] = schedule(rl.optim, rl.steps)(step)
    r.versions["mtp"] += int(mtp_updated)
    learner.check_updates(r.pol_state, r.mtp_state, r.cfg.max_nonfinite, r.last_good())
    r.versions["policy"] += 1
    with split("sync_s"):
        r.publish()
    if rl.eval_every and (step + 1) % rl.eval_every == 0 and step + 1 < rl.steps:
        with split("eval_s"):
            m["eval_accuracy"] = r.greedy_accuracy(r.pol_state.params)
        r.evals.append((step + 1, m["eval_accuracy"]))
    return m


def record_step(r: RLRun, batch, m: dict, split: Timer, step: int, bar: Progress) -> None:
    """The step's record (metrics, rollout statistics, time split, versions) to metrics.jsonl
    every `rl.log_every` steps, its summary keys to the history, drafted tokens to
    draft_tokens.bin, and the progress bar."""
    for k, v in split.totals.items():
        r.timer.totals[k] = r.timer.totals.get(k, 0.0) + v
    rec = {
        **m,
        **batch.stats,
        **batch.timings,
        **split.totals,
        "time": time.time(),
        "policy_version": r.versions["policy"],
        "batch_policy_version": batch.policy_version,
        "batch_mtp_version": batch.mtp_version,
        "mtp_version": r.versions["mtp"],
        "staleness": r.versions["policy"] - 1 - batch.policy_version,
    }
    rec_host = sharding.to_host(rec)
    r.history.append({k: float(rec_host[k]) for k in SUMMARY_KEYS if k in rec_host})
    bar.update(1, batch.stats["response_tokens"], reward=f"{batch.stats['reward_mean']:.3f}")
    if (step + 1) % r.cfg.rl.log_every == 0 or step + 1 == r.cfg.rl.steps:
        r.writer.write(step + 1, rec)
    if r.writer.enabled and batch.draft_tokens is not None:
        records.append_draft_tokens(r.drafts_path, batch.draft_tokens)


def save(r: RLRun, step: int, m: dict, wall_s: float) -> None:
    """A checkpoint every `ckpt.every` steps, at the last step and on SIGTERM (never of a
    skipped update: it waits for the next good one); on SIGTERM then `Preempted`."""
    c = r.cfg
    r.save_due = r.save_due or (step + 1) % c.ckpt.every == 0 or step + 1 == c.rl.steps
    skipped = bool(m.get("skipped", False)) or bool(m.get("mtp_skipped", False))
    if (r.save_due or preempted(step + 1)) and not skipped:
        state, meta = checkpoint_state(r.pol_state, r.mtp_state, r.store, step + 1, c.rl)
        meta["versions"] = r.versions
        meta["run"] = {  # copies: an async save may serialise after the next step
            "history": list(r.history),
            "evals": list(r.evals),
            "timings": dict(r.timer.totals),
            "rl_wall_s": wall_s,
        }
        r.ckpt.save(step + 1, state, meta, force=preempted(step + 1))
        r.saved, r.save_due = step + 1, False
    if preempted(step + 1):
        raise Preempted(f"rl: SIGTERM at step {step + 1}; {r.last_good()}")


def finish(r: RLRun, rollouts, rl_wall: float) -> dict:
    """Greedy accuracy after RL, the plain-vs-speculative speed comparison and `summary.json`."""
    rl = r.cfg.rl
    acc_after = r.greedy_accuracy(r.pol_state.params)
    speed = None
    if rl.speedup_repeats:
        speed = rl_rollouts.rollout_speedup(
            rollouts, r.pol_state.params, r.mtp_state.params, rl.speedup_repeats
        )
    summary = summarize(r.history, rl, r.acc_before, acc_after, rl_wall, r.timer.totals, speed)
    summary["eval_curve"] = [*r.evals, (rl.steps, acc_after)]  # (step, greedy accuracy)
    if sharding.is_primary():
        io.write_json_atomic(r.rdir / "summary.json", summary)
    return summary


def batch_shards(mesh) -> int:
    """The devices a learner batch's rows are split over (the mesh axes of the "batch" rule)."""
    return int(np.prod([mesh.shape[a] for a in sharding.RULES["batch"] or () if a in mesh.shape]))


# What each step keeps for the summary (also checkpointed, so a resumed run's summary covers
# every step).
SUMMARY_KEYS = (
    "reward_mean",
    "accept_rate",
    "accept_len",
    "entropy",
    "staleness",
    "rollout_s",
    "reward_s",
)


def checkpoint_state(pol_state, mtp_state, store, next_step: int, rl) -> tuple[dict, dict]:
    """(state, meta) of a checkpoint after `next_step` updates: both train states, plus the
    published weights the next `max_staleness` batches are generated from (versions
    max(0, next_step - s) .. next_step - 1), so that a resumed run samples them from exactly the
    versions the uninterrupted run would (s extra copies of the policy and MTP parameters)."""
    state = {"policy": pol_state, "mtp": mtp_state}
    if not rl.max_staleness:
        return state, {}
    slots, behaviour = {}, []
    for j in range(rl.max_staleness):
        v = max(0, next_step - rl.max_staleness + j)
        policy, mtp, mtp_version = store.peek(v)
        slots[f"v{j}"] = {"policy": policy, "mtp": mtp}
        behaviour.append((v, mtp_version))
    state["behaviour"] = slots
    return state, {"behaviour": behaviour}


def restore(ckpt: Checkpointer, pol_state, mtp_state, max_staleness: int, dtype: str = "float32"):
    """The newest checkpoint with its behaviour weights (the policy's read in the decode dtype
    `dtype`, as the weight store keeps them); one without them (written before they were saved,
    or with max_staleness 0) restores the train states only."""
    target = {"policy": pol_state, "mtp": mtp_state}
    if max_staleness:
        slot = {"policy": _as_dtype(pol_state.params, dtype), "mtp": mtp_state.params}
        full = {**target, "behaviour": {f"v{j}": slot for j in range(max_staleness)}}
        try:
            return ckpt.restore_latest(full)
        except CheckpointRestoreError:
            pass
    return ckpt.restore_latest(target)


def _as_dtype(params, dtype: str):
    """ShapeDtypeStructs of `params` (same shardings), floating leaves in `dtype`."""
    dt = jax.numpy.dtype(dtype)

    def one(x):
        kind = dt if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape, kind, sharding=x.sharding)

    return jax.tree.map(one, params)


def summarize(history, rl, acc_before, acc_after, rl_wall, timings, speed) -> dict:
    def mean(key, rows=history):
        vals = [r[key] for r in rows if key in r]
        return float(np.mean(vals)) if vals else None

    k = max(1, min(5, len(history) // 4))
    return {
        "stage": "rl",
        "steps": rl.steps,
        "mtp_strategy": rl.mtp_strategy,
        "accuracy_before": acc_before,
        "accuracy_after": acc_after,
        "reward_first": mean("reward_mean", history[:k]),
        "reward_last": mean("reward_mean", history[-k:]),
        "accept_rate": mean("accept_rate"),
        "accept_len": mean("accept_len"),
        "accept_len_first": mean("accept_len", history[:k]),
        "accept_len_last": mean("accept_len", history[-k:]),
        "mean_entropy": mean("entropy"),
        "max_staleness_seen": max((r["staleness"] for r in history), default=0),
        "rl_wall_s": rl_wall,
        "time_s": {
            **timings,
            **{k2: float(sum(r.get(k2, 0.0) for r in history)) for k2 in ("rollout_s", "reward_s")},
        },
        "rollout_speedup": speed,
    }
