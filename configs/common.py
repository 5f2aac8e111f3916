"""Shared pieces of the config files (not a config itself: it has no get_config)."""

import ml_collections

from bebop.config import defaults


def base(model: dict, policy: dict, stages) -> ml_collections.ConfigDict:
    """The typed defaults (`bebop.config.defaults()`) with what a checkpoint-backed (non-demo)
    policy changes."""
    c = defaults()
    c.stages = tuple(stages)
    # Architecture fields are placeholders: a gguf/hf policy's come from its checkpoint; only
    # dtype, param_dtype and scan_layers apply.
    c.model.update(
        vocab_size=1, dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, ffw_dim=8
    )
    c.model.update(model)
    c.task.update(name="wordmath", noise=0.0)
    c.sft.update(steps=1, batch_size=1, seq_len=8, log_every=1, eval_samples=1)  # no sft stage
    c.sft.optim.update(lr=1e-4, warmup_steps=0, weight_decay=0.0)
    c.policy.update(source="gguf")
    c.policy.update(policy)
    c.rollout.max_new_tokens = 128
    c.distill.update(num_samples=512, batch_size=32, prompts="mixed")
    c.mtp.update(warmup_loss_steps=150, batch_size=8, eval_prompts=16)
    c.mtp.optim.weight_decay = 0.0
    c.rl.update(steps=100, prompts_per_step=8, eval_samples=64, speedup_repeats=1)
    c.rl.optim.update(lr=1e-6, min_lr_ratio=1.0, weight_decay=0.0, b2=0.99)
    c.rl.mtp_optim.weight_decay = 0.0
    c.ckpt.every = 50
    return c
