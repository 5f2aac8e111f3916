"""Stage `rl`: async GRPO whose rollouts run through the speculative sampler.

Reads top to bottom: policy (SFT stage / GGUF / HF) + MTP (pre-RL stage, or random for growmtp)
-> greedy accuracy before RL -> resume from the newest checkpoint (policy + MTP train states, both
optimizers, RNG, versions, step) -> worker thread + learner loop -> greedy accuracy after RL ->
plain vs speculative rollout timed on the same prompts -> `summary.json`.

MTP strategies during RL (`rl.mtp_strategy`); in every one, no gradient of an MTP loss reaches the
policy (the policy parameters enter MTP losses only through `stop_gradient`):
  frozen   Bebop's recipe: the pre-RL MTP, never updated.
  online   every `rl.mtp_every` learner steps, an MTP update (`rl.mtp_loss`) on the newest rollout
           batch, with the updated policy's hiddens; own optimizer, LR and clipping.
  joint    the MTP update is fused into the learner's jitted step (same batch, the pre-update
           policy's hiddens), with its own optimizer, LR and grad-norm clipping.
  growmtp  GrowMTP: a randomly initialised MTP trained with the DCA loss on what verification
           already computed: the recorded backbone hiddens seed the MTP (no extra backbone pass),
           each draft cycle's accept length gates its chain, and the target p is the behaviour
           version's (the weights the verifier used, kept by the weight store), over
           min(mtp.train_steps, rollout.num_draft) chain steps (no cycle ever drafts more).
With `rl.mtp_loss = "dca"` under online / joint, rollouts record each cycle's accept length too.

Per step, `metrics.jsonl` gets the learner's metrics, the batch's rollout statistics
(`records.rollout_stats`: reward mean / std, zero-std groups, per-position acceptance, accept-length
histogram), a wall-clock `time`, the step's time split (rollout_s and reward_s of its batch;
wait_s, train_s, mtp_train_s, sync_s, eval_s of the learner), `lr` / `mtp_lr`, policy and MTP
versions, and every `rl.eval_every` steps a greedy `eval_accuracy`. `rl/draft_tokens.bin` holds
per-token draft records (see `records`).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bebop import config as config_lib
from bebop import distill, io, model, mtp_train, policies, prompts, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.ckpt import Checkpointer
from bebop.config import RunConfig
from bebop.fit import Interrupted, Preempted, preempted
from bebop.metrics import MetricsWriter, Progress, Timer
from bebop.mtp_losses import dca_loss
from bebop.rl import grpo, loop, records, rewards
from bebop.train import (
    NonFiniteError,
    TrainState,
    check_nonfinite,
    make_optimizer,
    make_train_step,
    schedule,
)


def growmtp_loss(pol_gd, mtp_gd, train_steps: int, chunk: int, temperature: float):
    def fn(mtp_params, batch, rng):
        del rng
        pol_params = jax.lax.stop_gradient(batch["policy"])
        policy = nnx.merge(pol_gd, pol_params)
        hidden = jax.lax.stop_gradient(batch["hidden"])
        draft = mtp_lib.train_hidden(
            mtp_gd, mtp_params, pol_gd, pol_params, batch["tokens"], hidden, train_steps
        )
        return dca_loss(
            draft, policy.final_norm(hidden), policy.head_matrix(), batch["tokens"],
            batch["mask"], chunk=chunk, temperature=temperature, accept_len=batch["accept_len"],
        )  # fmt: skip

    return fn


def mtp_update_batch(strategy: str, dev: dict, pol_params, store: loop.WeightStore, version: int):
    """What an MTP update sees besides the rollout arrays. growmtp: the behaviour version's
    weights (`version`, still in the store): the recorded hiddens are that version's, so the DCA
    target p is exactly the distribution the verifier used, not the updated head applied to old
    hiddens. online: the current policy, which recomputes the hiddens (recorded ones dropped)."""
    if strategy == "growmtp":
        return {**dev, "policy": store.peek(version)[0]}
    return {**{k: v for k, v in dev.items() if k != "hidden"}, "policy": pol_params}


def check_updates(pol_state, mtp_state, max_nonfinite: int, last_good: str = "") -> None:
    """Stops after `max_nonfinite` non-finite updates in a row, of the policy or of the MTP."""
    check_nonfinite(pol_state, max_nonfinite, last_good)
    try:
        check_nonfinite(mtp_state, max_nonfinite, last_good)
    except NonFiniteError as e:
        raise NonFiniteError(f"MTP updates: {e}") from None


def greedy_accuracy(pol, tok, task, cfg: RunConfig) -> float:
    probs = [
        task.problem(cfg.seed + prompts.STREAMS["eval"], i) for i in range(cfg.rl.eval_samples)
    ]
    ids = [task.prompt_ids(tok, p) for p in probs]
    scfg = sampling.SamplingConfig(
        temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, eos_ids=tuple(tok.eos_ids),
        pad_id=tok.pad_id,
    )  # fmt: skip
    outs = sampling.generate(*pol, ids, jax.random.key(0), scfg)
    texts = [tok.decode(o) for o in outs]
    return float(score(cfg, task.reward, texts, probs).mean())


def score(cfg: RunConfig, reward_fn, texts, problems) -> np.ndarray:
    rl = cfg.rl
    return rewards.score(
        reward_fn, texts, problems, rl.reward_timeout_s, rl.reward_retries,
        rl.reward_timeout_action,
    )  # fmt: skip


class Rollouts:
    """Prompts of batch i, the sampler (plain or speculative), rewards, learner arrays.
    `record`: also each cycle's accept length (`accept_len`, by anchor position) and, for
    growmtp, the backbone hiddens verification computed (`hidden`)."""

    def __init__(self, cfg: RunConfig, pol_gd, mtp_gd, tok, task, record: bool, vocab=None):
        self.cfg, self.pol_gd, self.mtp_gd, self.tok, self.task = cfg, pol_gd, mtp_gd, tok, task
        self.vocab = vocab  # the MTP's draft vocabulary (None: full)
        self.keep_hidden = record and cfg.rl.mtp_strategy == "growmtp"
        self.scfg = distill.sampling_config(cfg, tok)
        r = cfg.rollout
        self.spec = None
        if r.mode != "plain":
            self.spec = speculative.SpecConfig(r.num_draft, r.mode, record=record)

    def prompts(self, i: int):
        p, g = self.cfg.rl.prompts_per_step, self.cfg.rl.group_size
        problems = [
            self.task.problem(self.cfg.seed + prompts.STREAMS["rl"], i * p + j) for j in range(p)
        ]
        ids = [self.task.prompt_ids(self.tok, q) for q in problems for _ in range(g)]
        return [q for q in problems for _ in range(g)], ids

    def sample(self, pol_params, mtp_params, toks, lens, key, spec):
        """`spec=None`: the plain sampler. Returns (SampleOutput, SpecOutput or None)."""
        if spec is None:
            return sampling.sample_jit(self.pol_gd, pol_params, toks, lens, key, self.scfg), None
        out = speculative.sample_jit(
            self.pol_gd, pol_params, self.mtp_gd, mtp_params, toks, lens, key, self.scfg, spec,
            self.vocab,
        )  # fmt: skip
        return out.sample, out

    def __call__(self, i, version, pol_params, mtp_params, mtp_version) -> loop.RolloutBatch:
        cfg, timer = self.cfg, Timer()
        problems, ids = self.prompts(i)
        toks, lens = sampling.pad_prompts(ids, self.tok.pad_id)
        with timer("rollout_s"):
            key = jax.random.fold_in(jax.random.key(cfg.seed + 5), i)
            sample, spec_out = jax.device_get(
                self.sample(pol_params, mtp_params, toks, lens, key, self.spec)
            )
        with timer("reward_s"):
            texts = [
                self.tok.decode(row[:n])
                for row, n in zip(sample.tokens, sample.lengths, strict=True)
            ]  # noqa: E501
            r = score(cfg, self.task.reward, texts, problems)
        adv = grpo.advantages(r.reshape(-1, cfg.rl.group_size), cfg.rl.std_norm).reshape(-1)
        b, p = toks.shape
        width = p + self.scfg.max_new_tokens
        tokens = np.full((b, width), self.tok.pad_id, np.int32)
        mask = np.zeros((b, width), np.float32)
        behaviour = np.zeros((b, width), np.float32)
        tokens[:, :p] = toks
        for row in range(b):
            s, n = int(lens[row]), int(sample.lengths[row])
            tokens[row, s : s + n] = sample.tokens[row, :n]
            mask[row, s : s + n] = 1.0
            behaviour[row, s : s + n] = sample.logprobs[row, :n]
        data = {"tokens": tokens, "mask": mask, "behaviour_logp": behaviour, "adv": adv}
        stats = records.rollout_stats(r, cfg.rl.group_size, sample, spec_out)
        drafts = None
        if spec_out is not None:
            if cfg.rl.draft_log_rows:
                rows = records.sample_rows(cfg.seed, i, b, cfg.rl.draft_log_rows)
                drafts = records.draft_token_records(spec_out, rows, step=i + 1)
            if spec_out.cycle_len is not None:
                data["accept_len"] = np.asarray(spec_out.cycle_len)[:, :width]
            if self.keep_hidden:
                data["hidden"] = np.asarray(spec_out.hidden)[:, :width]
        return loop.RolloutBatch(i, version, mtp_version, data, stats, timer.totals, drafts)


def _timed_rollout(rollouts: Rollouts, pol, mtp, toks, lens, spec, repeats: int) -> tuple:
    best, tokens = float("inf"), 0
    for rep in range(repeats + 1):  # the first call compiles
        t0 = time.perf_counter()
        out, spec_out = rollouts.sample(pol, mtp, toks, lens, jax.random.key(100 + rep), spec)
        assert (spec_out is None) == (spec is None), "timed the wrong sampler"
        lengths = np.asarray(jax.device_get(out.lengths))
        if rep:
            best, tokens = min(best, time.perf_counter() - t0), int(lengths.sum())
    return tokens / best, best


def rollout_speedup(rollouts: Rollouts, pol, mtp, cfg: RunConfig) -> dict:
    """Plain vs speculative sampler on the same prompts (one RL batch), same run, timed after
    compilation; best of `rl.speedup_repeats`."""
    _, ids = rollouts.prompts(10_000)
    toks, lens = sampling.pad_prompts(ids, rollouts.tok.pad_id)
    plain_tps, plain_s = _timed_rollout(
        rollouts, pol, mtp, toks, lens, None, cfg.rl.speedup_repeats
    )
    res = {"plain_tok_s": plain_tps, "plain_s": plain_s, "batch": len(ids)}
    if rollouts.spec is not None:
        spec = speculative.SpecConfig(cfg.rollout.num_draft, cfg.rollout.mode)
        spec_tps, spec_s = _timed_rollout(
            rollouts, pol, mtp, toks, lens, spec, cfg.rl.speedup_repeats
        )  # noqa: E501
        res.update({"spec_tok_s": spec_tps, "spec_s": spec_s, "speedup": spec_tps / plain_tps})
    return res


def load_draft_model(cfg: RunConfig, workdir: Path, pol_cfg, pol_params, mesh):
    """(graphdef, params, draft vocabulary) of the MTP the rollouts draft with: a fresh one for
    GrowMTP (or plain rollouts, which never draft), else the `mtp` stage's trained MTP in
    `DIR/mtp/ckpt` -- whether or not this launch lists that stage -- or an error naming it."""
    ckpt_dir = Path(workdir) / "mtp" / "ckpt"
    if cfg.rl.mtp_strategy == "growmtp" or cfg.rollout.mode == "plain":
        return (*mtp_train.init_mtp(cfg, pol_cfg, mesh, pol_params), None)
    if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        raise FileNotFoundError(
            f"rl: rollout.mode={cfg.rollout.mode!r} with rl.mtp_strategy="
            f"{cfg.rl.mtp_strategy!r} drafts with the trained MTP, but {ckpt_dir} holds no "
            "checkpoint: run the 'mtp' stage first (add it to `stages`), or use "
            "rl.mtp_strategy='growmtp' or rollout.mode='plain'"
        )
    return policies.load_mtp(cfg, ckpt_dir, pol_cfg, mesh)


def run(cfg: RunConfig, workdir: Path, mesh, stop_at_step: int | None = None) -> dict:
    rdir, rl = Path(workdir) / "rl", cfg.rl
    pol_gd, pol_params, tok = policies.load(cfg, workdir, mesh)
    pol_cfg = model.graphdef_config(pol_gd, pol_params)
    task = rewards.make_task(cfg.task)
    mtp_gd, mtp_params, vocab = load_draft_model(cfg, workdir, pol_cfg, pol_params, mesh)
    # The KL reference: the policy at RL start (also on resume), a copy the learner never donates.
    ref_params = loop.snapshot(pol_params) if rl.kl_coef > 0 else None

    acc_before = greedy_accuracy((pol_gd, pol_params), tok, task, cfg)
    opt = make_optimizer(rl.optim, rl.steps)
    mtp_opt = make_optimizer(rl.mtp_optim, rl.steps)
    lr_fn, mtp_lr_fn = schedule(rl.optim, rl.steps), schedule(rl.mtp_optim, rl.steps)
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
    restored = ckpt.restore_latest({"policy": pol_state, "mtp": mtp_state})
    if restored is not None:
        step, st, meta = restored
        pol_state, mtp_state, versions = st["policy"], st["mtp"], meta["versions"]
        writer.truncate_after(step)
        if writer.enabled:
            records.truncate_draft_tokens(drafts_path, step)
    elif writer.enabled and drafts_path.exists():
        drafts_path.unlink()  # a fresh run
    start = int(pol_state.step)

    scfg = distill.sampling_config(cfg, tok)  # the learner's log-probs use the sampler's support

    def grpo_loss(p, b, _):
        return grpo.policy_loss(
            pol_gd, p, b, rl.clip_low, rl.clip_high, rl.kl_coef, rl.loss_agg, scfg
        )  # fmt: skip

    temp = max(cfg.rollout.temperature, 1e-3)
    if rl.mtp_strategy == "growmtp":
        steps = min(cfg.mtp.train_steps, cfg.rollout.num_draft)
        mtp_fn = growmtp_loss(pol_gd, mtp_gd, steps, cfg.mtp.chunk, temp)
    else:
        mtp_fn = mtp_train.mtp_loss(
            pol_gd, mtp_gd, rl.mtp_loss, cfg.mtp.train_steps, cfg.mtp.chunk, temp, vocab
        )
    policy_step = make_train_step(grpo_loss, opt)
    mtp_step = make_train_step(mtp_fn, mtp_opt)
    if rl.mtp_strategy == "joint":
        inner_pol = make_train_step(grpo_loss, opt, donate=False, jit=False)
        inner_mtp = make_train_step(mtp_fn, mtp_opt, donate=False, jit=False)

        def joint(ps, ms, batch):
            ms, mm = inner_mtp(ms, {**batch, "policy": ps.params})  # pre-update policy hiddens
            ps, pm = inner_pol(ps, batch)
            return ps, ms, {**pm, **{f"mtp_{k}": v for k, v in mm.items()}}

        joint_step = jax.jit(joint, donate_argnums=(0, 1))

    record = rl.mtp_strategy == "growmtp" or (
        rl.mtp_loss == "dca" and rl.mtp_strategy in ("online", "joint")
    )
    rollouts = Rollouts(cfg, pol_gd, mtp_gd, tok, task, record=record, vocab=vocab)
    store = loop.WeightStore(keep=rl.max_staleness + 2)
    store.publish(
        versions["policy"], loop.snapshot(pol_state.params), loop.snapshot(mtp_state.params),
        versions["mtp"],
    )  # fmt: skip
    q: queue.Queue = queue.Queue(maxsize=max(1, rl.max_staleness))
    stop = threading.Event()
    worker = loop.RolloutWorker(rollouts, store, q, start, rl.max_staleness, stop)
    worker.start()

    timer, history, save_due = Timer(), [], False
    evals = [(0, acc_before)]  # (step, greedy accuracy); the RL-start policy, also on resume
    bar = Progress(rl.steps, start, "rl")
    t_start = time.perf_counter()
    try:
        for step in range(start, rl.steps):
            split = Timer()  # this step's time split
            with split("wait_s"):
                batch = loop.next_batch(q, step, versions["policy"], rl.max_staleness)
            dev = sharding.shard_batch(batch.data, mesh)
            if ref_params is not None:
                dev["ref_policy"] = ref_params
            with split("train_s"):
                if rl.mtp_strategy == "joint":
                    pol_state, mtp_state, m = joint_step(pol_state, mtp_state, dev)
                    versions["mtp"] += 1
                else:
                    pol_state, m = policy_step(pol_state, dev)
                jax.block_until_ready(pol_state.params)
            m["lr"] = lr_fn(step)
            if rl.mtp_strategy == "growmtp" or (
                rl.mtp_strategy == "online" and (step + 1) % rl.mtp_every == 0
            ):
                with split("mtp_train_s"):
                    mb = mtp_update_batch(
                        rl.mtp_strategy, dev, pol_state.params, store, batch.policy_version
                    )
                    mtp_state, mm = mtp_step(mtp_state, mb)
                    m = {**m, **{f"mtp_{k}": v for k, v in mm.items()}}
                    jax.block_until_ready(mtp_state.params)
                versions["mtp"] += 1
            if rl.mtp_strategy != "frozen":
                m["mtp_lr"] = mtp_lr_fn(int(mtp_state.step) - 1)
            check_updates(pol_state, mtp_state, cfg.max_nonfinite, last_good())
            versions["policy"] += 1
            with split("sync_s"):
                store.publish(
                    versions["policy"], loop.snapshot(pol_state.params),
                    loop.snapshot(mtp_state.params), versions["mtp"],
                )  # fmt: skip
            if rl.eval_every and (step + 1) % rl.eval_every == 0 and step + 1 < rl.steps:
                with split("eval_s"):
                    m["eval_accuracy"] = greedy_accuracy((pol_gd, pol_state.params), tok, task, cfg)
                evals.append((step + 1, m["eval_accuracy"]))
            for k, v in split.totals.items():
                timer.totals[k] = timer.totals.get(k, 0.0) + v
            rec = {
                **m, **batch.stats, **batch.timings, **split.totals, "time": time.time(),
                "policy_version": versions["policy"], "batch_policy_version": batch.policy_version,
                "batch_mtp_version": batch.mtp_version, "mtp_version": versions["mtp"],
                "staleness": versions["policy"] - 1 - batch.policy_version,
            }  # fmt: skip
            history.append({k: float(v) for k, v in jax.device_get(rec).items()})
            bar.update(1, int(batch.data["mask"].sum()), reward=f"{batch.stats['reward_mean']:.3f}")
            if (step + 1) % rl.log_every == 0 or step + 1 == rl.steps:
                writer.write(step + 1, rec)
            if writer.enabled and batch.draft_tokens is not None:
                records.append_draft_tokens(drafts_path, batch.draft_tokens)
            save_due = save_due or (step + 1) % cfg.ckpt.every == 0 or step + 1 == rl.steps
            skipped = bool(m.get("skipped", False)) or bool(m.get("mtp_skipped", False))
            if (save_due or preempted(step + 1)) and not skipped:
                state = {"policy": pol_state, "mtp": mtp_state}
                ckpt.save(step + 1, state, {"versions": versions}, force=preempted(step + 1))
                saved, save_due = step + 1, False
            if preempted(step + 1):
                raise Preempted(f"rl: SIGTERM at step {step + 1}; {last_good()}")
            if stop_at_step is not None and step + 1 >= stop_at_step:
                raise Interrupted(f"stopped at step {step + 1}")
    finally:
        stop.set()
        worker.join(timeout=60)
        bar.close()
        ckpt.close()
        writer.close()
    rl_wall = time.perf_counter() - t_start

    final = (pol_gd, pol_state.params)
    acc_after = greedy_accuracy(final, tok, task, cfg)
    speed = rollout_speedup(rollouts, pol_state.params, mtp_state.params, cfg)
    summary = summarize(history, rl, acc_before, acc_after, rl_wall, timer.totals, speed)
    summary["eval_curve"] = [*evals, (rl.steps, acc_after)]  # (step, greedy accuracy)
    io.write_json_atomic(rdir / "summary.json", summary)
    return summary


def load_trained(cfg: RunConfig, workdir: Path, mesh):
    """(policy params, MTP params) from this run's `rl` checkpoints (for `policy.source=sft`,
    whose architecture is `cfg.model`)."""
    pol_gd, abstract = model.abstract(cfg.model)
    pol_params = sharding.abstract_on_mesh(abstract, mesh)
    mtp_gd, mtp_abstract = nnx.split(
        nnx.eval_shape(lambda: mtp_lib.MTP(cfg.model, cfg.mtp.num_layers, nnx.Rngs(params=0)))
    )
    mtp_params = sharding.abstract_on_mesh(mtp_abstract, mesh)
    opt, mtp_opt = make_optimizer(cfg.rl.optim, cfg.rl.steps), make_optimizer(cfg.rl.mtp_optim, 1)

    def states(p, m):
        return {"policy": TrainState.create(p, opt, 0), "mtp": TrainState.create(m, mtp_opt, 0)}

    target = jax.eval_shape(states, pol_params, mtp_params)
    target["policy"] = target["policy"].replace(params=pol_params)
    target["mtp"] = target["mtp"].replace(params=mtp_params)
    ckpt = Checkpointer(Path(workdir) / "rl" / "ckpt", async_save=False, read_only=True)
    restored = ckpt.restore_latest(target)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no RL checkpoint under {Path(workdir) / 'rl' / 'ckpt'}")
    state = restored[1]
    return state["policy"].params, state["mtp"].params


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
        },  # fmt: skip
        "rollout_speedup": speed,
    }
