"""The same job on a multi-host TPU pod: every host runs this command; `distributed.auto`
lets `jax.distributed.initialize()` discover the pod. Data parallel across hosts, FSDP within.

    python launch.py --config configs/qwen3_tpu_pod.py --config.policy.path=gs-mounted/Qwen3-8B \\
        --workdir /mnt/runs/qwen3_pod
"""

from bebop.config import parse_arg
from configs.common import base


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False)
    c = base(
        model=dict(dtype="bfloat16"),
        policy=dict(source="hf", path="/models/Qwen3-8B"),
        stages=("distill", "mtp", "rl"),
    )
    c.mesh.fsdp = 8
    c.distributed.auto = True
    c.task.digits = 3
    c.rollout.update(max_new_tokens=2048, num_draft=3)
    c.distill.update(num_samples=32768, batch_size=1024)
    c.mtp.update(steps=4000, batch_size=256, chunk=16384)
    c.rl.update(steps=1000, prompts_per_step=256, group_size=16, max_staleness=2)
    if a.runlocal:
        c.rl.update(steps=2, prompts_per_step=2, group_size=2)
        c.distributed.auto = False
    return c
