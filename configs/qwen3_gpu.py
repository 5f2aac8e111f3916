"""Async GRPO with speculative rollouts on a real Qwen3 checkpoint on one GPU node (e.g. 8 GPUs):
FSDP over the node's devices, bf16, policy from a Hugging Face directory (with MTP tensors if it
ships them; else the mtp stage trains one).

    python launch.py --config configs/qwen3_gpu.py --config.policy.path=/models/Qwen3-4B \\
        --workdir runs/qwen3_gpu
"""

from bebop.config import parse_arg
from configs.common import base


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False)
    c = base(
        model=dict(dtype="bfloat16"),
        policy=dict(source="hf", path="/models/Qwen3-4B"),
        stages=("distill", "mtp", "rl"),
    )
    c.mesh.update(data=1, fsdp=-1)
    c.task.digits = 3
    c.rollout.update(max_new_tokens=1024, num_draft=3)
    c.distill.update(num_samples=8192, batch_size=256)
    c.mtp.update(steps=2000, batch_size=64, chunk=16384)
    c.rl.update(steps=500, prompts_per_step=64, group_size=16, max_staleness=1)
    if a.runlocal:
        c.rl.update(steps=2, prompts_per_step=2, group_size=2)
    return c
