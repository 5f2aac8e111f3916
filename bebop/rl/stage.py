"""Stage `rl`: async GRPO whose rollouts run through the speculative sampler.

Reads top to bottom: policy (SFT stage / GGUF / HF) + MTP (pre-RL stage, or random for growmtp)
-> greedy accuracy before RL -> resume from the newest checkpoint (policy + MTP train states, both
optimizers, RNG, versions, step) -> rollout worker thread + learner loop (each step: the next
batch, the strategy's update, the guards, publish the weights, log, checkpoint) -> greedy accuracy
after RL -> plain vs speculative rollout timed on the same prompts -> `summary.json`.

The MTP strategies (`rl.mtp_strategy`: frozen, online, joint, growmtp) are the step functions of
`learner.MTP_STRATEGIES`; the rollouts come from `rollout.Rollouts` (or the `make_rollouts`
argument, e.g. a test's recording source).

Several processes: rollouts and learner steps launch their device programs in one deterministic
order that every process follows (`loop.Turnstile`; why this and not disjoint rollout / learner
sub-meshes: `bebop/rl/loop.py`), each step checks that all processes agree on step and versions,
and process 0 alone writes metrics, draft records and the summary. Each process's rollouts
prompt, sample and score its own rows of the batch (`rollout.Rollouts`), and the learner's batch
is assembled from every process's rows (`loop.RolloutBatch.place`).

Per step, `metrics.jsonl` gets the learner's metrics, the batch's rollout statistics
(`records.rollout_stats`: reward mean / std, zero-std groups, per-position acceptance, accept-length
histogram), a wall-clock `time`, the step's time split (rollout_s and reward_s of its batch;
wait_s, train_s, mtp_train_s, sync_s, eval_s of the learner), `lr` / `mtp_lr`, policy and MTP
versions, and every `rl.eval_every` steps a greedy `eval_accuracy`. `rl/draft_tokens.bin` holds
per-token draft records (see `records`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np

from bebop import config as config_lib
from bebop import io, policies, rollout, sharding, tasks
from bebop.ckpt import Checkpointer, CheckpointRestoreError
from bebop.config import RunConfig
from bebop.fit import Interrupted, Preempted, preempted
from bebop.metrics import MetricsWriter, Progress, Timer
from bebop.rl import learner, loop, records
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
        return (*policies.init_mtp(cfg, policy, mesh), None)
    has_ckpt = lambda d: d.is_dir() and any(p.name.isdigit() for p in d.iterdir())  # noqa: E731
    if not has_ckpt(ckpt_dir) and cfg.mtp.init_from and "mtp" not in cfg.stages:
        other = Path(cfg.mtp.init_from)
        if not has_ckpt(other):
            raise FileNotFoundError(f"config key 'mtp.init_from': {other} holds no checkpoint")
        return policies.load_mtp(cfg, other, policy.cfg, mesh)
    if not has_ckpt(ckpt_dir):
        if cfg.mtp.init == "checkpoint" and not cfg.mtp.init_from:
            return (*policies.init_mtp(cfg, policy, mesh), None)
        raise FileNotFoundError(
            f"rl: rollout.mode={cfg.rollout.mode!r} with rl.mtp_strategy="
            f"{cfg.rl.mtp_strategy!r} drafts with the trained MTP, but {ckpt_dir} holds no "
            "checkpoint: run the 'mtp' stage first (add it to `stages`), or use "
            "mtp.init_from=<another run>/mtp/ckpt, rl.mtp_strategy='growmtp' or "
            "rollout.mode='plain' (or mtp.init='checkpoint' to draft with the MTP layers an HF "
            "policy checkpoint ships)"
        )
    return policies.load_mtp(cfg, ckpt_dir, policy.cfg, mesh)


def run(
    cfg: RunConfig,
    workdir: Path,
    mesh,
    stop_at_step: int | None = None,
    task: tasks.Task | None = None,
    make_rollouts=rollout.Rollouts,
) -> dict:
    """`task`: the RL task (default `tasks.make_task(cfg.task)`); `make_rollouts`: the rollout
    source's constructor, called like `rollout.Rollouts`."""
    rdir, rl = Path(workdir) / "rl", cfg.rl
    policy = policies.load(cfg, workdir, mesh)
    pol_gd, pol_params, tok = policy.graphdef, policy.params, policy.tok
    task = task or tasks.make_task(cfg.task)
    mtp_gd, mtp_params, vocab = load_draft_model(cfg, workdir, policy, mesh)
    # The KL reference: the policy at RL start (also on resume), a copy the learner never donates.
    ref_params = loop.snapshot(pol_params) if rl.kl_coef > 0 else None
    score = rollout.reward_scorer(rl)

    def greedy_accuracy(params) -> float:
        return rollout.greedy_accuracy(
            (pol_gd, params),
            tok,
            task,
            cfg.seed,
            rl.eval_samples,
            cfg.rollout.max_new_tokens,
            score,
        )

    acc_before = greedy_accuracy(pol_params)
    opt = make_optimizer(rl.optim, rl.steps)
    mtp_opt = make_optimizer(rl.mtp_optim, rl.steps)
    pol_state = sharding.replicate_unplaced(
        TrainState.create(pol_params, opt, cfg.seed + 200), mesh
    )
    mtp_state = sharding.replicate_unplaced(
        TrainState.create(mtp_params, mtp_opt, cfg.seed + 201), mesh
    )
    versions = {"policy": 0, "mtp": 0}

    ckpt = Checkpointer(rdir / "ckpt", cfg.ckpt.keep, cfg.ckpt.async_save)
    writer = MetricsWriter(
        rdir / "metrics.jsonl", rdir / "tb" if cfg.tensorboard else None, config_lib.to_dict(cfg)
    )
    saved = None  # the newest checkpointed step: skipped updates are never saved

    def last_good() -> str:
        where = f"step {saved}" if saved is not None else "none saved this launch"
        return f"The last good RL checkpoint ({where}) is in {ckpt.directory}; rerun to resume."

    drafts_path = rdir / "draft_tokens.bin"
    # Behaviour versions in the decode dtype (`loop.behaviour_copy`): one float32 master (the
    # train state's) plus bfloat16 copies on a bfloat16 run.
    store = loop.WeightStore(keep=rl.max_staleness + 2)
    keep_copy = lambda params: loop.behaviour_copy(params, policy.cfg.dtype)  # noqa: E731
    history, evals = [], [(0, acc_before)]  # (step, greedy accuracy); also on resume
    timer, wall_before = Timer(), 0.0  # time split and RL wall time of earlier launches
    first_version = 0  # batch i comes from version max(first_version, i - max_staleness)
    restored = restore(ckpt, pol_state, mtp_state, rl.max_staleness, policy.cfg.dtype)
    if restored is not None:
        step, st, meta = restored
        pol_state, mtp_state, versions = st["policy"], st["mtp"], meta["versions"]
        run_meta = meta.get("run", {})
        history, evals = (
            run_meta.get("history", []),
            [tuple(e) for e in run_meta.get("evals", evals)],
        )
        timer.totals.update(run_meta.get("timings", {}))
        wall_before = run_meta.get("rl_wall_s", 0.0)
        if "behaviour" in st:  # the versions the next batches come from, as uninterrupted
            for slot, (v, mv) in enumerate(meta["behaviour"]):
                w = st["behaviour"][f"v{slot}"]
                store.publish(v, keep_copy(w["policy"]), w["mtp"], mv)
        else:  # a checkpoint of an older bebop: the first batches after it are fresher
            first_version = step
            log.warning("rl: %s holds no behaviour weights; resuming on-policy", ckpt.directory)
        writer.truncate_after(step)
        if writer.enabled:
            records.truncate_draft_tokens(drafts_path, step)
    else:  # a fresh run (also after a launch killed before its first checkpoint)
        writer.truncate_after(0)
        if writer.enabled and drafts_path.exists():
            drafts_path.unlink()
    start = int(pol_state.step)

    store.publish(
        versions["policy"],
        keep_copy(pol_state.params),
        loop.snapshot(mtp_state.params),
        versions["mtp"],
    )
    scfg = rollout.sampling_config(cfg, tok)  # the learner's log-probs use the sampler's support
    learn = learner.build(
        cfg,
        pol_gd,
        mtp_gd,
        scfg,
        vocab,
        opt,
        mtp_opt,
        store,
        ref_params,
        model_cfg=policy.cfg,
        batch_shards=batch_shards(mesh),
    )
    strategy = learner.MTP_STRATEGIES[rl.mtp_strategy]
    lr_fn = schedule(rl.optim, rl.steps)
    record, keep_hidden = learner.rollout_records(cfg)
    rollouts = make_rollouts(
        cfg,
        pol_gd,
        mtp_gd,
        tok,
        task,
        record=record,
        vocab=vocab,
        keep_hidden=keep_hidden,
        mesh=mesh,
    )
    q: queue.Queue = queue.Queue(maxsize=max(1, rl.max_staleness))
    stop = threading.Event()
    # Several processes: rollouts and updates launch in one global order (`loop.Turnstile`).
    turns = loop.Turnstile(start, rl.max_staleness, rl.steps) if jax.process_count() > 1 else None
    worker = loop.RolloutWorker(
        rollouts, store, q, start, rl.max_staleness, stop, first_version, rl.steps, turns
    )
    worker.start()

    save_due = False
    bar = Progress(rl.steps, start, "rl")
    t_start = time.perf_counter()
    try:
        for step in range(start, rl.steps):
            split = Timer()  # this step's time split
            if turns is not None:
                turns.acquire(("L", step))
            with split("wait_s"):
                batch = loop.next_batch(q, step, versions["policy"], rl.max_staleness)
            loop.check_agreement(step, batch, versions["policy"])
            dev = batch.place(mesh)
            pol_state, mtp_state, m, mtp_updated = strategy(
                learn, split, pol_state, mtp_state, dev, batch.policy_version, step
            )
            m["lr"] = lr_fn(step)
            versions["mtp"] += int(mtp_updated)
            learner.check_updates(pol_state, mtp_state, cfg.max_nonfinite, last_good())
            versions["policy"] += 1
            with split("sync_s"):
                store.publish(
                    versions["policy"],
                    keep_copy(pol_state.params),
                    loop.snapshot(mtp_state.params),
                    versions["mtp"],
                )
            if rl.eval_every and (step + 1) % rl.eval_every == 0 and step + 1 < rl.steps:
                with split("eval_s"):
                    m["eval_accuracy"] = greedy_accuracy(pol_state.params)
                evals.append((step + 1, m["eval_accuracy"]))
            for k, v in split.totals.items():
                timer.totals[k] = timer.totals.get(k, 0.0) + v
            rec = {
                **m,
                **batch.stats,
                **batch.timings,
                **split.totals,
                "time": time.time(),
                "policy_version": versions["policy"],
                "batch_policy_version": batch.policy_version,
                "batch_mtp_version": batch.mtp_version,
                "mtp_version": versions["mtp"],
                "staleness": versions["policy"] - 1 - batch.policy_version,
            }
            rec_host = sharding.to_host(rec)
            history.append({k: float(rec_host[k]) for k in SUMMARY_KEYS if k in rec_host})
            reward = f"{batch.stats['reward_mean']:.3f}"
            bar.update(1, batch.stats["response_tokens"], reward=reward)
            if (step + 1) % rl.log_every == 0 or step + 1 == rl.steps:
                writer.write(step + 1, rec)
            if writer.enabled and batch.draft_tokens is not None:
                records.append_draft_tokens(drafts_path, batch.draft_tokens)
            save_due = save_due or (step + 1) % cfg.ckpt.every == 0 or step + 1 == rl.steps
            skipped = bool(m.get("skipped", False)) or bool(m.get("mtp_skipped", False))
            if (save_due or preempted(step + 1)) and not skipped:
                state, meta = checkpoint_state(pol_state, mtp_state, store, step + 1, rl)
                meta["versions"] = versions
                meta["run"] = {  # copies: an async save may serialise after the next step
                    "history": list(history),
                    "evals": list(evals),
                    "timings": dict(timer.totals),
                    "rl_wall_s": wall_before + time.perf_counter() - t_start,
                }
                ckpt.save(step + 1, state, meta, force=preempted(step + 1))
                saved, save_due = step + 1, False
            if preempted(step + 1):
                raise Preempted(f"rl: SIGTERM at step {step + 1}; {last_good()}")
            if stop_at_step is not None and step + 1 >= stop_at_step:
                raise Interrupted(f"stopped at step {step + 1}")
            if turns is not None:
                turns.release(("L", step))
    finally:
        stop.set()
        if turns is not None:
            turns.close()
        worker.join(timeout=60)
        bar.close()
        ckpt.close()
        writer.close()
    rl_wall = wall_before + time.perf_counter() - t_start

    acc_after = greedy_accuracy(pol_state.params)
    speed = None
    if cfg.rl.speedup_repeats:
        speed = rollout.rollout_speedup(rollouts, pol_state.params, mtp_state.params, cfg)
    summary = summarize(history, rl, acc_before, acc_after, rl_wall, timer.totals, speed)
    summary["eval_curve"] = [*evals, (rl.steps, acc_after)]  # (step, greedy accuracy)
    if sharding.is_primary():
        io.write_json_atomic(rdir / "summary.json", summary)
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
