"""The embedded default pipeline: a small policy trained from scratch on synthetic arithmetic.

    python launch.py --config configs/demo.py            # full demo
    python launch.py --config configs/demo.py:runlocal   # CPU smoke run (well under 2 minutes)

Stages: sft (supervised training of the demo policy) -> distill (its own samples) -> mtp
(pre-RL MTP training with the end-to-end TV loss).
"""

import ml_collections

from bebop.config import parse_arg
from bebop.tokenizer import CharTokenizer
from configs.common import optim


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False, digits=3)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.stages = ("sft", "distill", "mtp", "rl")
    c.max_nonfinite = 5
    c.max_loss_spike = 0.0  # divergence guard (0 = off)
    c.max_param_growth = 100.0
    c.tensorboard = False
    c.profile_steps = 0
    c.compile_cache = True

    c.model = dict(
        vocab_size=CharTokenizer().vocab_size,
        dim=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        ffw_dim=640,
        rope_theta=10000.0,
        norm_eps=1e-6,
        qkv_bias=False,
        qk_norm=True,
        tie_embeddings=True,
        dtype="float32",
        scan_layers=True,
        init_std=0.02,
    )
    c.mesh = dict(data=-1, fsdp=1, tensor=1)
    c.task = dict(name="arithmetic", digits=a.digits, noise=0.05)
    c.sft = dict(
        steps=150,
        batch_size=32,
        seq_len=48,
        log_every=10,
        eval_samples=512,
        optim=optim(2e-3, warmup=30, min_ratio=0.05, wd=0.01),
    )
    c.policy = dict(source="sft", path="")
    c.rollout = dict(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=48, mode="rejection", num_draft=2
    )
    c.distill = dict(
        num_samples=1024, batch_size=256, prompts="task", mixed_fraction=0.0, draft_from=""
    )
    c.mtp = dict(
        num_layers=1,
        train_steps=5,
        loss="e2e_tv",
        warmup_loss="kl",
        warmup_loss_steps=100,
        steps=200,
        batch_size=32,
        chunk=8192,
        log_every=10,
        eval_every=100,
        eval_prompts=64,
        eval_draft=3,
        init_from="",
        init="random",
        patience=0,
        eval_mixed_prompts=0,
        draft_vocab=0,
        cache_hidden=False,
        optim=optim(2e-3, warmup=20),
    )
    c.rl = dict(
        steps=30,
        prompts_per_step=16,
        group_size=8,
        clip_low=0.2,
        clip_high=0.28,
        kl_coef=0.0,
        std_norm=True,
        loss_agg="token",
        max_staleness=1,
        mtp_strategy="frozen",
        mtp_loss="e2e_tv",
        mtp_every=1,
        reward_timeout_s=30.0,
        reward_retries=1,
        reward_timeout_action="error",
        log_every=1,
        eval_samples=512,
        eval_every=0,
        draft_log_rows=4,
        speedup_repeats=2,
        optim=optim(3e-5, schedule="constant", min_ratio=1.0, b2=0.99),
        mtp_optim=optim(3e-4, warmup=10),  # GrowMTP's recipe
    )
    c.ckpt = dict(every=100, keep=2, async_save=True)
    c.distributed = dict(coordinator_address="", num_processes=1, process_id=0, auto=False)

    if a.runlocal:
        c.model.update(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=192)
        c.task.digits = 2
        c.sft.update(steps=300, batch_size=32, eval_samples=128)
        c.distill.update(num_samples=256)
        c.mtp.update(steps=100, warmup_loss_steps=50, eval_every=50, eval_prompts=32)
        c.rl.update(steps=10, prompts_per_step=8, eval_samples=128)
        c.ckpt.every = 100
    return ml_collections.ConfigDict(c)


def sweep(arg=None):
    """Learning-rate sweep: `--sweep_index i` picks entry i."""
    del arg
    return [{"sft.optim.lr": lr} for lr in (1e-3, 2e-3, 4e-3)]
