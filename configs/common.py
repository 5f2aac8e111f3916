"""Shared pieces of the config files (not a config itself: it has no get_config)."""

import ml_collections


def optim(lr, warmup=0, schedule="cosine", clip=1.0, wd=0.0, min_ratio=0.1, b2=0.95):
    return dict(lr=lr, warmup_steps=warmup, schedule=schedule, min_lr_ratio=min_ratio,
                weight_decay=wd, b1=0.9, b2=b2, grad_clip=clip)  # fmt: skip


def base(model: dict, policy: dict, stages) -> ml_collections.ConfigDict:
    """Every key of `RunConfig`, with defaults for a checkpoint-backed (non-demo) policy."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.stages = tuple(stages)
    c.max_nonfinite = 5
    c.max_loss_spike = 0.0  # divergence guard (0 = off)
    c.max_param_growth = 100.0
    c.tensorboard = False
    c.profile_steps = 0
    c.compile_cache = True
    # Architecture fields are placeholders: a gguf/hf policy's come from its checkpoint; only
    # dtype and scan_layers apply.
    c.model = dict(vocab_size=1, dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                   ffw_dim=8, rope_theta=10000.0, norm_eps=1e-6, qkv_bias=False, qk_norm=False,
                   tie_embeddings=True, dtype="float32", scan_layers=True,
                   init_std=0.02)  # fmt: skip
    c.model.update(model)
    c.mesh = dict(data=-1, fsdp=1, tensor=1)
    c.task = dict(name="wordmath", digits=2, noise=0.0, path="")
    c.sft = dict(steps=1, batch_size=1, seq_len=8, log_every=1, eval_samples=1, optim=optim(1e-4))
    c.policy = dict(source="gguf", path="")
    c.policy.update(policy)
    c.rollout = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=128, mode="rejection",
                     num_draft=3)  # fmt: skip
    c.distill = dict(num_samples=512, batch_size=32, prompts="mixed", mixed_fraction=0.0,
                     draft_from="")  # fmt: skip
    c.mtp = dict(num_layers=1, train_steps=5, loss="e2e_tv", warmup_loss="kl",
                 warmup_loss_steps=150, steps=300, batch_size=8, chunk=8192, log_every=10,
                 eval_every=100, eval_prompts=16, eval_draft=3, init_from="", init="random",
                 patience=0, eval_mixed_prompts=0, draft_vocab=0, cache_hidden=False,
                 optim=optim(1e-3, warmup=20))  # fmt: skip
    c.rl = dict(steps=100, prompts_per_step=8, group_size=8, clip_low=0.2, clip_high=0.28,
                kl_coef=0.0, std_norm=True, loss_agg="token", max_staleness=1,
                mtp_strategy="frozen", mtp_loss="e2e_tv", mtp_every=1, reward_timeout_s=30.0,
                reward_retries=1, reward_timeout_action="error", log_every=1, eval_samples=64,
                eval_every=0, draft_log_rows=4, speedup_repeats=1,
                optim=optim(1e-6, schedule="constant", min_ratio=1.0, b2=0.99),
                mtp_optim=optim(3e-4, warmup=10))  # fmt: skip
    c.ckpt = dict(every=50, keep=2, async_save=True)
    c.distributed = dict(coordinator_address="", num_processes=1, process_id=0, auto=False)
    return c
