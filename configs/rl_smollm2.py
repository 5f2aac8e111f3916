"""Async GRPO on SmolLM2-135M-Instruct with speculative rollouts (hand-run on CPU: slow).
Maths word problems generated in code (task `wordmath`, reward = the number after '####').
Stages: distill -> mtp (Bebop's pre-RL recipe, `configs/mtp_smollm2.py`) -> rl with the frozen MTP
(rejection-sampling verification). Pointing `--workdir` at a finished `mtp_smollm2` run reuses
its distill and mtp stages:

    python launch.py --config configs/rl_smollm2.py --workdir runs/mtp_smollm2
"""

from bebop.config import parse_arg
from configs import mtp_smollm2


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False)
    c = mtp_smollm2.get_config("runlocal" if a.runlocal else None)
    c.stages = ("distill", "mtp", "rl")
    c.rl.update(steps=40, prompts_per_step=4, group_size=8, eval_samples=64)
    if a.runlocal:
        c.rl.update(steps=2, prompts_per_step=2, group_size=2, eval_samples=2)
    return c
