"""Rollout settings as the stages use them: the sampler's config from `rollout.*`
(`sampling_config`), the speculative sampler's config from `rollout.*` (`spec_config`) and greedy
task accuracy. The RL rollout source and the plain-vs-speculative speed comparison are RL
machinery: `bebop/rl/rollouts.py`.

Problems come from one stream per use (`prompts.STREAMS`): `eval` for greedy accuracy (the same
problems before, during and after RL), `rl` for the RL batches.
"""

from __future__ import annotations

import jax
import numpy as np

from bebop import prompts, rewards, sampling, sharding, speculative, tasks
from bebop.config import RolloutConfig


def sampling_config(r: RolloutConfig, tok, max_new_tokens: int | None = None):
    """The rollout sampler's config (`rollout.*`): RL, distillation, MTP evaluation."""
    return sampling.SamplingConfig(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=max_new_tokens or r.max_new_tokens,
        eos_ids=tuple(tok.eos_ids),
        pad_id=tok.pad_id,
    )


def spec_config(r: RolloutConfig, rule: str | None = None, record: bool = False):
    """The speculative sampler's config from `rollout.*`: γ = `rollout.num_draft` drafts per
    verify under `rollout.mode`'s acceptance rule (`rule` overrides it, e.g. distillation's
    rejection sampling). The one place that turns `rollout.*` into a `speculative.SpecConfig`."""
    return speculative.SpecConfig(r.num_draft, rule or r.mode, record=record)


def in_process_score(reward_fn, texts, problems) -> list[float]:
    pairs = zip(texts, problems, strict=True)
    return [rewards.check_value(reward_fn(t, p), reward_fn) for t, p in pairs]


def greedy_accuracy(
    pol, tok, task: tasks.Task, seed: int, n: int, max_new_tokens: int, score=in_process_score
) -> float:
    """Mean reward of greedy completions of the first `n` held-out problems (`eval` stream).
    `pol` = (graphdef, params); `score(reward_fn, texts, problems)` computes the rewards."""
    probs = [task.eval_problem(seed + prompts.STREAMS["eval"], i) for i in range(n)]
    ids = [task.prompt_ids(tok, p) for p in probs]
    scfg = sampling.SamplingConfig(
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        eos_ids=tuple(tok.eos_ids),
        pad_id=tok.pad_id,
    )
    toks, lens = sampling.pad_prompts(ids, scfg.pad_id)
    # gathered from every process: the sampler's output may be sharded over the whole mesh
    out = sharding.to_host(sampling.sample_jit(*pol, toks, lens, jax.random.key(0), scfg))
    texts = []
    for row, n in zip(out.tokens, out.lengths, strict=True):
        row = [int(t) for t in row[:n]]
        texts.append(tok.decode(row[:-1] if row and row[-1] in scfg.eos_ids else row))
    return float(np.mean(score(task.reward, texts, probs)))
