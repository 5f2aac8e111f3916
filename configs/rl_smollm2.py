"""Async GRPO on SmolLM2-135M-Instruct with speculative rollouts (hand-run on CPU: slow).

The task is one-step maths word problems with one-digit numbers (`wordmath`, digits=1; reward =
the final number) sampled at T = 0.7: SmolLM2-135M answers 2-digit word problems correctly in
about 1 % of T = 1 samples (1,152 distilled answers: 10 correct) -- a reward RL cannot learn
from at 32 rollouts a step --, and 1-digit ones in ~20 % at T = 0.7 (64 samples; greedy 22 %).
Stages: distill -> mtp (Bebop's pre-RL recipe, `configs/mtp_smollm2.py`, on this task, here at
the RL temperature 0.7) -> rl with the frozen MTP (rejection-sampling verification). The learner
accumulates gradients over 8-row chunks (`rl.microbatch`): the [rows, S, V] logits of one pass
over 32 rows took ~19 GB. The recipe's own run distils at T = 1, which scored higher at both
temperatures (experiments/mtp_recipe/README.md); to use its MTP (recommended):

    python launch.py --config configs/mtp_smollm2.py --workdir runs/mtp_smollm2
    python launch.py --config configs/rl_smollm2.py --workdir runs/rl_smollm2 \\
        --config.stages="('rl',)" --config.mtp.init_from=runs/mtp_smollm2/mtp/ckpt
"""

from bebop.config import parse_arg
from configs import mtp_smollm2


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False)
    c = mtp_smollm2.get_config("runlocal" if a.runlocal else None)
    c.stages = ("distill", "mtp", "rl")
    c.rollout.temperature = 0.7  # RL's (the recipe distils at 1.0)
    # Tail-aware rollouts with the draft table derived from measured costs: one RL batch (32
    # rows, T = 0.7, 128 tokens) ran 1.11x as fast as compacted plain decoding and 1.37x as fast
    # as the static plain loop, where the static speculative loop ran at 0.73x
    # (`python -m benchmarks.tail --model smollm2 --batches 32`, docs/performance.md). On several
    # processes give
    # `rollout.draft_table` explicitly (each process would time its own costs).
    c.rollout.compact = True
    c.rl.update(
        steps=40, prompts_per_step=4, group_size=8, eval_samples=64, eval_every=10, microbatch=8
    )
    c.rl.optim.lr = 1e-5
    if a.runlocal:
        c.rollout.max_new_tokens = 8
        c.rl.update(
            steps=2, prompts_per_step=2, group_size=2, eval_samples=2, eval_every=0, microbatch=2
        )
    return c
