"""The small RL run the RL tests share: demo runlocal, 4 GRPO steps of 4 prompts x 4."""

from bebop import config as config_lib

from .conftest import REPO

# The `pretrained` fixture's stages (every RL launch on a copy of it repeats them: a finished
# stage refuses a changed config). Sized so that programs are shared: the SFT and RL greedy
# evaluations (16 rows), the MTP evaluation's rejection sampler and the RL rollouts (16 rows =
# 4 prompts x 4); one MTP loss (no warm-up loss: no RL test needs a good draft, only a trained one).
PRE = [
    "sft.steps=60",
    "sft.eval_samples=16",
    "distill.num_samples=64",
    "mtp.steps=20",
    "mtp.warmup_loss_steps=0",
    "mtp.eval_every=20",
    "mtp.eval_prompts=16",
]


def rl_cfg(*overrides):
    base = [
        "rl.steps=4",
        "rl.prompts_per_step=4",
        "rl.group_size=4",
        "rl.eval_samples=16",
        "ckpt.every=2",
        *PRE,
    ]
    return config_lib.load(str(REPO / "configs/demo.py:runlocal"), base + list(overrides))[0]
