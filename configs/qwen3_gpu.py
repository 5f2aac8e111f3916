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
        # bf16 compute (matmuls, activations, KV cache), float32 master weights and AdamW state
        model=dict(dtype="bfloat16", param_dtype="float32"),
        policy=dict(source="hf", path="/models/Qwen3-4B"),
        stages=("distill", "mtp", "rl"),
    )
    c.mesh.update(data=1, fsdp=-1)
    c.task.digits = 3
    c.rollout.update(max_new_tokens=1024, num_draft=3)
    c.distill.update(num_samples=8192, batch_size=256)
    c.mtp.update(steps=2000, batch_size=64, chunk=16384)
    # Sized by `python -m benchmarks.memory --config configs/qwen3_gpu.py --arch qwen3-8b`
    # (docs/distributed.md has the table) for 8 x 80 GB, every program <= 72 GB per GPU:
    #  - 16 prompts x 16 = 256 rows per step (was 64 x 16): a sampler's KV cache of 1,152 slots
    #    costs ~0.5 GB per row per GPU at 8B (compiled), beside a 15 GB decode copy on each GPU;
    #    1,024 rows (128 a GPU) compiled to a 77 GB rollout before any resident state;
    #  - max_staleness 0 (was 1): one process drives the 8 GPUs, so with staleness the rollout
    #    worker's sampler (KV cache, decode copy) and the learner's step (activations) are
    #    alive at the same time (8B: ~94 GB); synchronous, they take turns;
    #  - the learner's microbatch from `memory_knobs`' budget (the whole batch in one step
    #    compiled to ~4 GB of activations per row per 2 layers at 8B without the knobs).
    c.rl.update(steps=500, prompts_per_step=16, group_size=16, max_staleness=0)
    memory_knobs(c, budget_gb=20.0)
    if a.runlocal:
        smoke(c)
    return c


def memory_knobs(c, budget_gb: float):
    """What lets the learner's step fit an accelerator at 1k-2k-token rows: each block
    recomputed in the backward, attention 512 queries at a time (never [B, H, S, S] float32
    scores), log-probs 256 positions at a time (never [B, S, V] float32 logits), and the rows per
    accumulation chunk chosen so the estimated activations fit `budget_gb` per device (what the
    device's memory leaves after params, AdamW state, weight store and KV caches)."""
    c.model.update(remat="block", attention="chunked", attention_chunk=512)
    c.rl.update(microbatch=-1, memory_budget_gb=budget_gb, logit_chunk=256)


def smoke(c):
    """`:runlocal`: a smoke run of every stage (<= 60 s on 2 CPU cores) on a tiny random Qwen3
    with SmolLM2's tokenizer, built in-process once in WORKDIR/tiny_hf/qwen3 and loaded through
    the HF loader (bebop/checkpoints/tiny.py); every size cut."""
    c.policy.path = "tiny:qwen3"
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
