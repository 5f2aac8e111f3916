"""Stage `sft`: supervised training of the demo policy on the synthetic arithmetic task.

Reads top to bottom: build the policy and optimizer -> resume from the newest good checkpoint
(params, optimizer, step, RNG, data-iterator state) -> train with a progress bar, logging
`metrics.jsonl` and checkpointing every `ckpt.every` steps -> final checkpoint -> greedy task
accuracy on held-out prompts -> `summary.json` (whose presence makes a re-run skip the stage).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bebop import data, io, model, sampling, sharding
from bebop.config import ConfigError, RunConfig
from bebop.fit import Interrupted, fit, restore_params  # noqa: F401 - Interrupted: API
from bebop.rl import tasks
from bebop.tokenizer import CharTokenizer
from bebop.train import TrainState, make_optimizer, make_train_step, schedule
from bebop.train import token_cross_entropy as xent


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
    state = sharding.replicate_unplaced(TrainState.create(params, optimizer, cfg.seed), mesh)
    it = iter(data.sft_dataset(cfg.task, tok, scfg.seq_len, scfg.batch_size, cfg.seed))

    res = fit(
        "sft", sdir, cfg, state,
        make_train_step(lambda p, b, _: sft_loss(graphdef, p, b), optimizer),
        it, lambda batch: sharding.shard_batch(batch, mesh),
        total_steps=scfg.steps, log_every=scfg.log_every,
        tokens_per_step=scfg.batch_size * scfg.seq_len,
        lr_at=schedule(scfg.optim, scfg.steps), stop_at_step=stop_at_step,
    )  # fmt: skip
    state = res.state
    summary = {
        "stage": "sft",
        "steps": scfg.steps,
        "params": model.num_params(state.params),
        "final_loss": res.last_metrics.get("loss"),
        "tokens_per_s": res.steps_run * scfg.batch_size * scfg.seq_len / res.train_time_s
        if res.steps_run
        else None,
        "train_time_s": res.train_time_s,
        **evaluate(graphdef, state.params, cfg, tok),
    }
    io.write_json_atomic(sdir / "summary.json", summary)
    return summary


def load_policy(cfg: RunConfig, workdir: Path, mesh):
    """(graphdef, params) of the trained SFT policy, for the stages after SFT."""
    graphdef, abstract_params = model.abstract(cfg.model)
    optimizer = make_optimizer(cfg.sft.optim, cfg.sft.steps)
    params = restore_params(Path(workdir) / "sft" / "ckpt", abstract_params, optimizer, mesh)
    return graphdef, params
