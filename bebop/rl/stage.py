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
           already computed: the recorded backbone hiddens seed the MTP (no extra backbone pass)
           and each draft cycle's accept length gates its chain.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bebop import distill, model, mtp_train, policies, prompts, sampling, sharding, speculative
from bebop import mtp as mtp_lib
from bebop.ckpt import Checkpointer
from bebop.config import RunConfig
from bebop.fit import Interrupted
from bebop.metrics import MetricsWriter, Progress, Timer
from bebop.mtp_losses import dca_loss
from bebop.rl import grpo, loop, rewards
from bebop.train import TrainState, check_nonfinite, make_optimizer, make_train_step


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
            batch["mask"], chunk=chunk, temperature=temperature, accept_len=batch["cycle_len"],
        )  # fmt: skip

    return fn


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
    r = rewards.score(task.reward, texts, probs, cfg.rl.reward_timeout_s, cfg.rl.reward_retries)
    return float(r.mean())


class Rollouts:
    """Prompts of batch i, the sampler (plain or speculative), rewards, learner arrays."""

    def __init__(self, cfg: RunConfig, pol_gd, mtp_gd, tok, task, record: bool, vocab=None):
        self.cfg, self.pol_gd, self.mtp_gd, self.tok, self.task = cfg, pol_gd, mtp_gd, tok, task
        self.vocab = vocab  # the MTP's draft vocabulary (None: full)
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
            r = rewards.score(
                self.task.reward, texts, problems, cfg.rl.reward_timeout_s, cfg.rl.reward_retries
            )
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
        stats = {
            "reward_mean": float(r.mean()),
            "response_len": float(sample.lengths.mean()),
            "rollout_entropy": float(sample.entropy.sum() / max(1, sample.lengths.sum())),
        }
        if spec_out is not None:
            summ = speculative.summarize(spec_out)
            stats.update({k: summ[k] for k in ("accept_rate", "accept_len", "analytic_alpha")})
            if spec_out.hidden is not None:
                data["hidden"] = np.asarray(spec_out.hidden)[:, :width]
                data["cycle_len"] = np.asarray(spec_out.cycle_len)[:, :width]
        return loop.RolloutBatch(i, version, mtp_version, data, stats, timer.totals)


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


def run(cfg: RunConfig, workdir: Path, mesh, stop_at_step: int | None = None) -> dict:
    rdir, rl = Path(workdir) / "rl", cfg.rl
    pol_gd, pol_params, tok = policies.load(cfg, workdir, mesh)
    pol_cfg = model.graphdef_config(pol_gd, pol_params)
    task = rewards.make_task(cfg.task)
    vocab = None
    if rl.mtp_strategy == "growmtp" or "mtp" not in cfg.stages:
        mtp_gd, mtp_params = mtp_train.init_mtp(cfg, pol_cfg, mesh)
    else:
        mtp_gd, mtp_params = mtp_train.load_trained(cfg, workdir, pol_cfg, mesh)
        vocab = mtp_train.load_draft_vocab(Path(workdir) / "mtp", pol_cfg.vocab_size)

    acc_before = greedy_accuracy((pol_gd, pol_params), tok, task, cfg)
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
    writer = MetricsWriter(rdir / "metrics.jsonl", rdir / "tb" if cfg.tensorboard else None)
    restored = ckpt.restore_latest({"policy": pol_state, "mtp": mtp_state})
    if restored is not None:
        step, st, meta = restored
        pol_state, mtp_state, versions = st["policy"], st["mtp"], meta["versions"]
        writer.truncate_after(step)
    start = int(pol_state.step)

    def grpo_loss(p, b, _):
        return grpo.policy_loss(
            pol_gd, p, b, rl.clip_low, rl.clip_high, rl.kl_coef, rl.loss_agg,
            max(cfg.rollout.temperature, 1e-6),
        )  # fmt: skip

    temp = max(cfg.rollout.temperature, 1e-3)
    if rl.mtp_strategy == "growmtp":
        mtp_fn = growmtp_loss(pol_gd, mtp_gd, cfg.mtp.train_steps, cfg.mtp.chunk, temp)
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

    rollouts = Rollouts(
        cfg, pol_gd, mtp_gd, tok, task, record=rl.mtp_strategy == "growmtp", vocab=vocab
    )
    store = loop.WeightStore(keep=rl.max_staleness + 2)
    store.publish(
        versions["policy"], loop.snapshot(pol_state.params), loop.snapshot(mtp_state.params),
        versions["mtp"],
    )  # fmt: skip
    q: queue.Queue = queue.Queue(maxsize=max(1, rl.max_staleness))
    stop = threading.Event()
    worker = loop.RolloutWorker(rollouts, store, q, start, rl.max_staleness, stop)
    worker.start()

    timer, history = Timer(), []
    bar = Progress(rl.steps, start, "rl")
    t_start = time.perf_counter()
    try:
        for step in range(start, rl.steps):
            with timer("wait_s"):
                batch = loop.next_batch(q, step, versions["policy"], rl.max_staleness)
            dev = sharding.shard_batch(batch.data, mesh)
            with timer("train_s"):
                if rl.mtp_strategy == "joint":
                    pol_state, mtp_state, m = joint_step(pol_state, mtp_state, dev)
                    versions["mtp"] += 1
                else:
                    pol_state, m = policy_step(pol_state, dev)
                jax.block_until_ready(pol_state.params)
            check_nonfinite(pol_state, cfg.max_nonfinite)
            if rl.mtp_strategy == "growmtp" or (
                rl.mtp_strategy == "online" and (step + 1) % rl.mtp_every == 0
            ):
                with timer("mtp_train_s"):
                    mtp_state, mm = mtp_step(mtp_state, {**dev, "policy": pol_state.params})
                    m = {**m, **{f"mtp_{k}": v for k, v in mm.items()}}
                versions["mtp"] += 1
            versions["policy"] += 1
            with timer("sync_s"):
                store.publish(
                    versions["policy"], loop.snapshot(pol_state.params),
                    loop.snapshot(mtp_state.params), versions["mtp"],
                )  # fmt: skip
            rec = {
                **m, **batch.stats, **batch.timings,
                "policy_version": versions["policy"], "batch_policy_version": batch.policy_version,
                "batch_mtp_version": batch.mtp_version, "mtp_version": versions["mtp"],
                "staleness": versions["policy"] - 1 - batch.policy_version,
            }  # fmt: skip
            history.append({k: float(v) for k, v in jax.device_get(rec).items()})
            bar.update(1, int(batch.data["mask"].sum()), reward=f"{batch.stats['reward_mean']:.3f}")
            if (step + 1) % rl.log_every == 0 or step + 1 == rl.steps:
                writer.write(step + 1, rec)
            if (step + 1) % cfg.ckpt.every == 0 or step + 1 == rl.steps:
                ckpt.save(step + 1, {"policy": pol_state, "mtp": mtp_state}, {"versions": versions})
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
    (rdir / "summary.json").write_text(json.dumps(summary, indent=2))
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
    ckpt = Checkpointer(Path(workdir) / "rl" / "ckpt", cfg.ckpt.keep, async_save=False)
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
