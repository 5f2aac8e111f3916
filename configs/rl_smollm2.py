"""Async GRPO on SmolLM2-135M-Instruct with speculative rollouts (hand-run on CPU: slow).
Maths word problems generated in code (task `wordmath`, reward = the number after '####').
Stages: distill -> mtp (e2e TV) -> rl with the frozen MTP.

    python launch.py --config configs/rl_smollm2.py --workdir runs/rl_smollm2
"""

import ml_collections

from bebop.config import parse_arg
from configs.common import base


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False)
    c = base(model={}, policy=dict(source="gguf", path=""), stages=("distill", "mtp", "rl"))
    if a.runlocal:
        c.rollout.max_new_tokens = 8
        c.distill.update(num_samples=4, batch_size=4)
        c.mtp.update(steps=2, warmup_loss_steps=1, batch_size=2, eval_every=2, eval_prompts=2)
        c.rl.update(steps=2, prompts_per_step=2, group_size=2, eval_samples=2)
    return ml_collections.ConfigDict(c)
