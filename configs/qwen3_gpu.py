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
        # bf16 compute (matmuls, activations, KV cache), float32 master weights and AdamW state;
        # the learner recomputes each block in its backward and attends 512 queries at a time
        # (float32 scores [rows, H, 512, S] at most): without them one row of 1,152 tokens kept
        # ~4 GB of activations at Qwen3-8B width per 2 layers
        model=dict(dtype="bfloat16", param_dtype="float32", remat="block", attention="chunked"),
        policy=dict(source="hf", path="/models/Qwen3-4B"),
        stages=("distill", "mtp", "rl"),
    )
    c.mesh.update(data=1, fsdp=-1)
    c.task.digits = 3
    c.rollout.update(max_new_tokens=1024, num_draft=3)
    c.distill.update(num_samples=8192, batch_size=256)
    c.mtp.update(steps=2000, batch_size=64, chunk=16384)
    # Sized by `python benchmarks/memory.py --config configs/qwen3_gpu.py --arch qwen3-8b`
    # (docs/distributed.md has the table) for 8 x 80 GB, every program <= 72 GB per GPU:
    #  - 16 prompts x 16 = 256 rows per step (was 64 x 16): a sampler's KV cache of 1,152 slots
    #    costs ~0.5 GB per row per GPU at 8B (compiled), beside a 15 GB decode copy on each GPU;
    #    1,024 rows (128 a GPU) compiled to a 77 GB rollout before any resident state;
    #  - max_staleness 0 (was 1): one process drives the 8 GPUs, so with staleness the rollout
    #    worker's sampler (KV cache, decode copy) and the learner's step (activations) are
    #    alive at the same time (8B: ~94 GB); synchronous, they take turns;
    #  - learner microbatch 64 rows (8 a GPU) with `logit_chunk` 128 positions of log-probs at
    #    a time: the whole batch in one step kept [rows, S, V] float32 logits.
    c.rl.update(steps=500, prompts_per_step=16, group_size=16, max_staleness=0)
    c.rl.update(microbatch=64, logit_chunk=128)
    if a.runlocal:
        smoke(c)
    return c


def smoke(c):
    """`:runlocal`: a smoke run of every stage (<= 60 s on 2 CPU cores) on a tiny random Qwen3
    with SmolLM2's tokenizer, built in-process once in WORKDIR/tiny_hf/qwen3 and loaded through
    the HF loader (bebop/checkpoints/tiny.py); every size cut."""
    c.policy.path = "tiny:qwen3"
    # the memory knobs cost compile time and a tiny model needs none (the memory plan,
    # benchmarks/memory.py, compiles the full run's programs with them)
    c.model.update(remat="none", attention="xla")
    # bfloat16 compute kept, as in the full run: on 2 quiet CPU cores this run took 45 s of
    # wall time (65 s of CPU) vs 48 s (56 s of CPU) with model.dtype=float32
    # γ = 2 drafts, 2 trained MTP steps: the draft loops unroll, so compile time grows with γ
    c.rollout.update(max_new_tokens=8, num_draft=2)
    c.distill.update(num_samples=4, batch_size=4)
    c.mtp.update(
        steps=2,
        train_steps=2,
        eval_draft=2,
        warmup_loss_steps=0,  # a warm-up loss would compile a second train step
        batch_size=2,
        eval_every=2,
        eval_prompts=2,
        log_every=1,
    )
    c.rl.update(steps=2, prompts_per_step=2, group_size=2, eval_samples=2, speedup_repeats=0)
    c.rl.update(microbatch=0, logit_chunk=0)
