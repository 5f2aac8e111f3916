"""The same job on a multi-host TPU pod: every host runs this command; `distributed.auto`
lets `jax.distributed.initialize()` discover the pod. Data parallel across hosts, FSDP within.

    python launch.py --config configs/qwen3_tpu_pod.py --config.policy.path=gs-mounted/Qwen3-8B \\
        --workdir /mnt/runs/qwen3_pod
"""

from bebop.config import parse_arg
from configs import qwen3_gpu
from configs.common import base


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False)
    c = base(
        # bf16 compute (matmuls, activations, KV cache), float32 master weights and AdamW state
        model=dict(dtype="bfloat16", param_dtype="float32"),
        policy=dict(source="hf", path="/models/Qwen3-8B"),
        stages=("distill", "mtp", "rl"),
    )
    c.mesh.fsdp = 8
    c.distributed.auto = True
    c.task.digits = 3
    c.rollout.update(max_new_tokens=2048, num_draft=3)
    c.distill.update(num_samples=32768, batch_size=1024)
    c.mtp.update(steps=4000, batch_size=256, chunk=16384)
    # Sized by `python -m benchmarks.memory --config configs/qwen3_tpu_pod.py --arch qwen3-8b`
    # for a v5p-128 slice (64 chips of 95 GB), every program <= 85 GB per chip:
    #  - 128 prompts x 16 = 2,048 rows per step (was 256 x 16): 32 rows a chip of 2,176 cache
    #    slots (~1 GB a row compiled) beside the 15 GB decode copy; 64 rows a chip did not fit;
    #  - the learner's microbatch from `memory_knobs`' budget. Processes take turns
    #    (`rl.loop.Turnstile`): rollouts and updates never overlap, staleness stays 2.
    c.rl.update(steps=1000, prompts_per_step=128, group_size=16, max_staleness=2)
    qwen3_gpu.memory_knobs(c, budget_gb=24.0)  # a v5p chip: 95 GB
    if a.runlocal:  # the smoke run of configs/qwen3_gpu.py, on this host's devices
        qwen3_gpu.smoke(c)
        c.distributed.auto = False
        c.mesh.update(data=1, fsdp=-1)  # FSDP over however many local devices there are
    return c
