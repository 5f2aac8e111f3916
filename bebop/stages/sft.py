"""Stage `sft`: supervised training of the demo policy on the synthetic arithmetic task.

Reads top to bottom: build the policy and optimizer -> resume from the newest good checkpoint
(params, optimizer, step, RNG, data-iterator state) -> train with a progress bar, logging
`metrics.jsonl` and checkpointing every `ckpt.every` steps -> final checkpoint -> greedy task
accuracy on held-out prompts -> `summary.json` (whose presence makes a re-run skip the stage).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from bebop import data, io, model, prompts, rollout, sharding, tasks
from bebop.config import ConfigError, RunConfig
from bebop.fit import Interrupted, fit  # noqa: F401 - Interrupted: API
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
    """Greedy accuracy on held-out problems of the task SFT trains on (arithmetic)."""
    n = n or cfg.sft.eval_samples
    task = tasks.checked(tasks.arithmetic(cfg.task), prompts.PromptLimits.sft_eval(cfg, n))
    acc = rollout.greedy_accuracy((graphdef, params), tok, task, cfg.seed, n, cfg.sft.seq_len)
    return {"accuracy": acc, "eval_samples": n}


def run(cfg: RunConfig, workdir: Path, mesh, stop_at_step: int | None = None) -> dict:
    sdir = Path(workdir) / "sft"
    scfg = cfg.sft
    tok = CharTokenizer()
    check_model_matches_tokenizer(cfg, tok)

    graphdef, params = model.init(cfg.model, cfg.seed)
    params = sharding.place_state(params, mesh)
    optimizer = make_optimizer(scfg.optim, scfg.steps)
    state = sharding.replicate_unplaced(TrainState.create(params, optimizer, cfg.seed), mesh)
    rows = sharding.process_rows(mesh, scfg.batch_size)  # this process's share of each batch
    it = iter(data.sft_dataset(cfg.task, tok, scfg.seq_len, scfg.batch_size, cfg.seed, rows))

    res = fit(
        "sft",
        sdir,
        cfg,
        state,
        make_train_step(lambda p, b, _: sft_loss(graphdef, p, b), optimizer),
        it,
        lambda batch: sharding.batch_from_process_rows(batch, mesh, scfg.batch_size),
        total_steps=scfg.steps,
        log_every=scfg.log_every,
        tokens_per_step=scfg.batch_size * scfg.seq_len,
        lr_at=schedule(scfg.optim, scfg.steps),
        stop_at_step=stop_at_step,
    )
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
    if sharding.is_primary():
        io.write_json_atomic(sdir / "summary.json", summary)
    return summary
