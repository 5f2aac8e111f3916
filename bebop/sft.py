"""Stage `sft`: supervised training of the demo policy on the synthetic arithmetic task.

Reads top to bottom: build the policy and optimizer -> resume from the newest good checkpoint
(params, optimizer, step, RNG, data-iterator state) -> train with a progress bar, logging
`metrics.jsonl` and checkpointing every `ckpt.every` steps -> final checkpoint -> greedy task
accuracy on held-out prompts -> `summary.json` (whose presence makes a re-run skip the stage).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bebop import data, model, sampling, sharding
from bebop.ckpt import Checkpointer
from bebop.config import ConfigError, RunConfig
from bebop.metrics import MetricsWriter, Progress
from bebop.rl import tasks
from bebop.tokenizer import CharTokenizer
from bebop.train import TrainState, check_nonfinite, make_optimizer, make_train_step, schedule
from bebop.train import token_cross_entropy as xent


class Interrupted(RuntimeError):
    """Raised by `stop_at_step` (tests of kill-and-resume)."""


def sft_loss(graphdef, params, batch):
    tokens_BxT1 = batch["tokens"]
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    positions_BxT = jnp.broadcast_to(jnp.arange(inputs_BxT.shape[1]), inputs_BxT.shape)
    logits_BxTxV, _ = model.forward(graphdef, params, inputs_BxT, positions_BxT)
    loss = xent(logits_BxTxV, targets_BxT, batch["mask"])
    return loss, {"supervised_tokens": batch["mask"].sum()}


def check_model_matches_tokenizer(cfg: RunConfig, tok: CharTokenizer) -> None:
    if cfg.model.vocab_size != tok.vocab_size:
        raise ConfigError(
            f"config key 'model.vocab_size': {cfg.model.vocab_size} but the demo tokenizer has "
            f"{tok.vocab_size} tokens"
        )


def evaluate(graphdef, params, cfg: RunConfig, tok: CharTokenizer, n: int | None = None) -> dict:
    """Greedy task accuracy on held-out problems."""
    probs = data.eval_problems(cfg.task, cfg.seed, n or cfg.sft.eval_samples)
    scfg = sampling.SamplingConfig(
        temperature=0.0, max_new_tokens=cfg.sft.seq_len, eos_ids=tok.eos_ids, pad_id=tok.pad_id
    )
    prompts = [tok.encode(p.prompt, bos=True) for p in probs]
    outs = sampling.generate(graphdef, params, prompts, jax.random.key(0), scfg)
    rewards = [tasks.reward(tok.decode(o), p.answer) for o, p in zip(outs, probs, strict=True)]
    return {"accuracy": float(np.mean(rewards)), "eval_samples": len(probs)}


def run(cfg: RunConfig, workdir: Path, mesh, stop_at_step: int | None = None) -> dict:
    sdir = Path(workdir) / "sft"
    scfg = cfg.sft
    tok = CharTokenizer()
    check_model_matches_tokenizer(cfg, tok)

    graphdef, params = model.init(cfg.model, cfg.seed)
    params = sharding.place_state(params, mesh)
    optimizer = make_optimizer(scfg.optim, scfg.steps)
    state = TrainState.create(params, optimizer, cfg.seed)
    it = iter(data.sft_dataset(cfg.task, tok, scfg.seq_len, scfg.batch_size, cfg.seed))

    ckpt = Checkpointer(sdir / "ckpt", cfg.ckpt.keep, cfg.ckpt.async_save)
    writer = MetricsWriter(sdir / "metrics.jsonl", sdir / "tb" if cfg.tensorboard else None)
    restored = ckpt.restore_latest(state)
    if restored is not None:
        step, state, meta = restored
        it.set_state(meta["data"])
        writer.truncate_after(step)

    lr_at = schedule(scfg.optim, scfg.steps)
    train_step = make_train_step(lambda p, b, _: sft_loss(graphdef, p, b), optimizer)
    start = int(state.step)
    bar = Progress(scfg.steps, start, "sft")
    t0 = time.perf_counter()
    try:
        while (step := int(state.step)) < scfg.steps:
            batch = sharding.shard_batch(next(it), mesh)
            state, m = train_step(state, batch)
            step += 1
            check_nonfinite(state, cfg.max_nonfinite)
            bar.update(1, scfg.batch_size * scfg.seq_len)
            if step % scfg.log_every == 0 or step == scfg.steps:
                rec = writer.write(step, {**m, "lr": lr_at(step - 1)})
                bar.bar.set_postfix(loss=f"{rec['loss']:.4f}", refresh=False)
            if step % cfg.ckpt.every == 0 or step == scfg.steps:
                ckpt.save(step, state, {"data": it.get_state()})
            if stop_at_step is not None and step >= stop_at_step:
                raise Interrupted(f"stopped at step {step}")
    finally:
        bar.close()
        ckpt.close()
        writer.close()
    train_time = time.perf_counter() - t0
    steps_run = scfg.steps - start
    summary = {
        "stage": "sft",
        "steps": scfg.steps,
        "params": model.num_params(state.params),
        "final_loss": float(m["loss"]) if steps_run else None,
        "tokens_per_s": steps_run * scfg.batch_size * scfg.seq_len / train_time
        if steps_run
        else None,
        "train_time_s": train_time,
        **evaluate(graphdef, state.params, cfg, tok),
    }
    (sdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def load_policy(cfg: RunConfig, workdir: Path, mesh):
    """(graphdef, params) of the trained SFT policy, for the stages after SFT."""
    graphdef, abstract_params = model.abstract(cfg.model)
    target = sharding.abstract_on_mesh(abstract_params, mesh)
    ckpt = Checkpointer(Path(workdir) / "sft" / "ckpt", cfg.ckpt.keep, async_save=False)
    optimizer = make_optimizer(cfg.sft.optim, cfg.sft.steps)
    abstract_state = jax.eval_shape(lambda p: TrainState.create(p, optimizer, cfg.seed), target)
    abstract_state = abstract_state.replace(params=target)
    restored = ckpt.restore_latest(abstract_state)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no SFT checkpoint under {Path(workdir) / 'sft' / 'ckpt'}")
    return graphdef, restored[1].params
