"""The embedded default pipeline: a small policy trained from scratch on synthetic arithmetic.

    python launch.py --config configs/demo.py            # full demo
    python launch.py --config configs/demo.py:runlocal   # CPU smoke run

Stages: sft (supervised training of the demo policy) -> distill (its own samples at the rollout
temperature) -> mtp (pre-RL MTP training with the end-to-end TV loss) -> rl (async GRPO with
speculative rollouts drafted by the frozen MTP; greedy accuracy every 20 steps).
"""

from bebop.config import defaults, parse_arg
from bebop.tokenizer import CharTokenizer


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False, digits=3)
    c = defaults()
    c.stages = ("sft", "distill", "mtp", "rl")
    c.model.update(
        vocab_size=CharTokenizer().vocab_size,
        dim=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        ffw_dim=640,
        qk_norm=True,
        # Four layers: training forwards unroll them. The layer scan's per-layer residual buffers
        # cost the GRPO step (128 rows x 56 tokens) 2.55-2.59 s against 2.11-2.18 s unrolled
        # (commit 847a5a1, alternating processes, quiet); compiling 4 layers unrolled is cheap.
        scan_layers=False,
    )
    c.task.digits = a.digits
    # SFT stops half-way up its learning curve (greedy accuracy 44-46 % after 110 steps; 14 %
    # after 80, 80 % after 150), leaving RL room: GRPO at T = 0.7 then gains 11-16 points in 120
    # steps (lr 3e-5; trials: lr 1e-4 loses accuracy while the sampled reward rises, T = 1 gains
    # 7). The whole demo: 7 min 54 s to 9 min 46 s on 2 cores, by the machine's day
    # (docs/performance.md).
    c.sft.update(steps=110, batch_size=32, eval_samples=512)
    c.sft.optim.update(lr=2e-3, warmup_steps=30, min_lr_ratio=0.05)
    # A worked answer is at most 31 characters + EOS (999+999): 40 leaves room and
    # keeps the learner's rows 16 + 40 wide.
    c.rollout.update(num_draft=2, temperature=0.7, max_new_tokens=40)
    c.distill.num_samples = 1024
    # The frozen policy's hiddens are computed once. Held-out accept length at γ = 3: 3.27 after
    # these 120 steps (3.31 after 100 KL steps, 3.49 after 100 KL + 100 TV, 77 s more).
    c.mtp.update(steps=120, warmup_loss_steps=60, eval_every=60, cache_hidden=True)
    c.mtp.optim.update(lr=2e-3, weight_decay=0.0)
    # plain vs speculative rollout of one RL batch at the end, alternating, best of 5 each
    c.rl.update(steps=120, eval_samples=512, eval_every=20, speedup_repeats=5)
    c.rl.optim.update(lr=3e-5, min_lr_ratio=1.0, weight_decay=0.0, b2=0.99)
    c.rl.mtp_optim.weight_decay = 0.0  # GrowMTP's recipe (lr 3e-4, 10 warm-up steps: defaults)

    if a.runlocal:
        c.model.update(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffw_dim=192)
        c.task.digits = 2
        # Shapes chosen so that stages share compiled samplers: the SFT and RL greedy accuracy
        # (64 rows, 32 new tokens: the responses are at most ~26), the MTP evaluation's
        # rejection sampler and the RL rollouts (64 rows = 8 prompts x 8, γ = 2).
        c.sft.update(steps=300, batch_size=32, seq_len=32, eval_samples=64)
        c.rollout.max_new_tokens = 32
        c.distill.update(num_samples=128)
        c.mtp.update(steps=50, warmup_loss_steps=25, eval_every=50, eval_prompts=64)
        c.mtp.eval_draft = c.rollout.num_draft
        c.rl.update(
            steps=4,
            prompts_per_step=8,
            group_size=8,
            eval_samples=64,
            eval_every=0,
            speedup_repeats=0,
        )
    return c


def sweep(arg=None):
    """Learning-rate sweep: `--sweep_index i` picks entry i."""
    del arg
    return [{"sft.optim.lr": lr} for lr in (1e-3, 2e-3, 4e-3)]
