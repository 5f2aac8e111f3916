"""Prompt sets, generated in code (no downloads at run time).

`task`: the run's task's prompts (`bebop/tasks.py`: the demo's arithmetic, `wordmath`, ... or
a GSM8K-style file), one stream per use so that distillation, evaluation and RL never share
prompts. `mixed`: real-text requests for a chat model such as SmolLM2, a third each of
instructions, maths word problems and code requests, built from templates and word lists with a
seeded generator. `blend`: task prompts with a share of mixed ones.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from bebop import sampling, sharding, tasks
from bebop.config import KV_CACHE_LIMIT_BYTES, ConfigError, ModelConfig, RunConfig, TaskConfig

STREAMS = {"distill": 11, "eval": 1_000_003, "rl": 23, "bench": 37}

_TOPICS = [
    "the ocean",
    "autumn leaves",
    "a lighthouse",
    "friendship",
    "the night sky",
    "a busy city",
    "mountains",
    "a small robot",
    "rain",
    "the first day of school",
]
_CONCEPTS = [
    "photosynthesis",
    "gravity",
    "how vaccines work",
    "why the sky is blue",
    "compound interest",
    "the water cycle",
    "how a bicycle stays upright",
    "what a prime number is",
    "how computers store numbers",
    "the seasons",
]
_INSTRUCTIONS = [
    "Write a short poem about {t}.",
    "Explain {c} to a ten-year-old.",
    "Give three tips for learning about {c}.",
    "Write a two-sentence story about {t}.",
    "Summarize {c} in one paragraph.",
    "List five words that describe {t}.",
]
_MATHS = [
    "{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?",
    "{n} had {a} {i} and gave away {b}. How many {i} are left?",
    "A box holds {a} {i}. How many {i} are in {b} boxes?",
    "{n} shares {p} {i} equally among {b} friends. How many does each get?",
]
_CODE = [
    "Write a Python function that returns the {k} of a list of numbers.",
    "Write a Python function that checks whether a string is a {w}.",
    "Write a JavaScript function that {j}.",
    "Explain what this Python code does: `sum(x * x for x in range({a}))`",
]
_K = ["sum", "average", "largest element", "median", "product"]
_W = ["palindrome", "valid email address", "number", "title-cased sentence"]
_J = ["reverses a string", "counts the vowels in a word", "removes duplicates from an array"]


def mixed_prompt(rng: np.random.Generator) -> str:
    kind = rng.integers(3)
    pick = lambda xs: xs[rng.integers(len(xs))]  # noqa: E731
    if kind == 0:
        return pick(_INSTRUCTIONS).format(t=pick(_TOPICS), c=pick(_CONCEPTS))
    a, b = int(rng.integers(2, 50)), int(rng.integers(2, 12))
    if kind == 1:
        return pick(_MATHS).format(n=pick(tasks.NAMES), i=pick(tasks.ITEMS), a=a, b=b, p=a * b)
    return pick(_CODE).format(k=pick(_K), w=pick(_W), j=pick(_J), a=a)


def prompt_ids(
    task_cfg: TaskConfig,
    seed: int,
    tok,
    n: int,
    stream: str,
    kind: str = "task",
    limits: PromptLimits | None = None,
) -> list[list[int]]:
    """`n` tokenized prompts of the given kind from one stream of the run's `seed`: `task` (the
    `task` section's task, via `tasks.make_task`: arithmetic, wordmath, countdown, a GSM8K-style
    or jsonl file) or `mixed`. Each is checked as it is encoded (`tasks.checked`; with `limits`,
    against the policy's positions and the run's samplers' KV caches), before any sampler
    allocates a cache."""
    seed = seed + STREAMS[stream]
    if kind == "task":
        task = tasks.make_task(task_cfg, limits)
        problem = task.eval_problem if stream == "eval" else task.problem
        return [task.prompt_ids(tok, problem(seed, i)) for i in range(n)]
    if kind != "mixed":
        raise ValueError(f"unknown prompt kind {kind!r} (task | mixed)")
    rng = np.random.default_rng(seed)
    ids = [tok.chat([{"role": "user", "content": mixed_prompt(rng)}]) for _ in range(n)]
    for i, x in enumerate(ids if limits is not None else ()):
        limits.check(len(x), f"mixed prompt {i} of the {stream!r} stream")
    return ids


def blend(
    task_cfg: TaskConfig,
    seed: int,
    tok,
    n: int,
    stream: str,
    kind: str,
    mixed_fraction: float,
    limits: PromptLimits | None = None,
):
    """`n` prompts: `kind`'s, with a `mixed_fraction` share of mixed chat prompts interleaved at
    seeded positions (the two kinds draw from the same stream offsets; `mixed` never repeats).
    `limits`: as `prompt_ids`."""
    n_mixed = round(n * mixed_fraction) if kind == "task" else 0
    main = prompt_ids(task_cfg, seed, tok, n - n_mixed, stream, kind, limits)
    if not n_mixed:
        return main
    mixed = prompt_ids(task_cfg, seed, tok, n_mixed, stream, "mixed", limits)
    order = np.random.default_rng(seed + STREAMS[stream] + 1).permutation(n)
    is_mixed = np.zeros(n, bool)
    is_mixed[order[:n_mixed]] = True
    it_main, it_mixed = iter(main), iter(mixed)
    return [next(it_mixed) if m else next(it_main) for m in is_mixed]


# ----------------------------------------------------------------------------- prompt limits


class PromptDoesNotFitError(tasks.PromptTooLongError, ConfigError):
    """A prompt that, with the run's new tokens, does not fit the policy's positions or a
    sampler's KV cache bound; the message names the record, its length, the limit and the config
    keys to change."""


@dataclasses.dataclass(frozen=True)
class SamplerBatch:
    """One batch a run samples: its rows, the config key(s) that set them, and γ when it is
    speculative (0: plain)."""

    rows: int
    key: str
    drafts: int = 0


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """What each prompt of a run must fit, checked per record as it is encoded (`tasks.checked`),
    before any sampler allocates a cache for it:

    - positions: its tokens + the new tokens (+ the γ drafts speculative verification computes
      past the last one) <= the policy's `max_positions`;
    - KV caches: each of the run's sampler batches (`batches`) with this prompt as its longest
      allocates, per row, `sampling.pad_prompts`' bucketed prompt width + the new tokens (+ γ + 1
      verify slots) of cache, the policy's and (speculative) the MTP's; with the rows split over
      `shards` devices, that must fit `cache_limit` per device: the device's memory where JAX
      reports it (a GPU's, a TPU's), else `KV_CACHE_LIMIT_BYTES`.

    `PromptLimits.of(cfg, policy.cfg)` for the rollout samplers (distillation, MTP and RL
    evaluation, RL rollouts), `sft_eval` for the SFT stage's greedy evaluation."""

    max_positions: int
    positions_from: str  # where `max_positions` comes from (for the message)
    max_new_tokens: int
    new_tokens_key: str
    batches: tuple[SamplerBatch, ...]
    policy_slot_bytes: int  # one row's policy KV cache per slot
    mtp_slot_bytes: int = 0  # one row's MTP KV cache per slot (speculative batches)
    shards: int = 1  # devices a batch's rows are split over
    cache_limit: int = KV_CACHE_LIMIT_BYTES
    cache_limit_is: str = "the KV cache bound"  # what `cache_limit` is (for the message)

    @classmethod
    def of(cls, cfg: RunConfig, model_cfg: ModelConfig) -> PromptLimits:
        """The limits of `cfg`'s rollout samplers for the policy `model_cfg` (`LoadedPolicy.cfg`:
        a checkpoint's own positions), over the activation mesh's batch devices."""
        r, stages = cfg.rollout, cfg.stages
        batches = []
        if "distill" in stages:
            drafts = r.num_draft if cfg.distill.draft_from else 0
            batches.append(SamplerBatch(cfg.distill.batch_size, "distill.batch_size", drafts))
        if "mtp" in stages:
            m = cfg.mtp
            batches.append(SamplerBatch(m.eval_prompts, "mtp.eval_prompts", m.eval_draft))
            if m.eval_mixed_prompts:
                key = "mtp.eval_mixed_prompts"
                batches.append(SamplerBatch(m.eval_mixed_prompts, key, m.eval_draft))
        if "rl" in stages:
            rows = cfg.rl.prompts_per_step * cfg.rl.group_size
            drafts = r.num_draft if r.mode != "plain" else 0
            batches.append(SamplerBatch(rows, "rl.prompts_per_step x rl.group_size", drafts))
            batches.append(SamplerBatch(cfg.rl.eval_samples, "rl.eval_samples"))
        return cls(
            model_cfg.max_positions,
            _positions_from(cfg.policy.source),
            r.max_new_tokens,
            "rollout.max_new_tokens",
            tuple(batches),
            _slot_bytes(model_cfg, model_cfg.num_layers),
            _slot_bytes(model_cfg, cfg.mtp.num_layers),
            sharding.batch_shards(),
            *_cache_limit(),
        )

    @classmethod
    def sft_eval(cls, cfg: RunConfig, rows: int) -> PromptLimits:
        """The SFT stage's greedy evaluation: `rows` prompts of the demo policy `cfg.model`, up to
        `sft.seq_len` new tokens."""
        m = cfg.model
        batch = (SamplerBatch(rows, "sft.eval_samples"),)
        return cls(
            m.max_positions,
            _positions_from(cfg.policy.source),
            cfg.sft.seq_len,
            "sft.seq_len",
            batch,
            _slot_bytes(m, m.num_layers),
            0,
            sharding.batch_shards(),
            *_cache_limit(),
        )

    def check(self, n: int, where: str) -> None:
        """Raises `PromptDoesNotFitError` naming `where` (the record) unless a prompt of `n`
        tokens fits."""
        drafts = max((b.drafts for b in self.batches), default=0)
        need = n + self.max_new_tokens + drafts
        key = self.new_tokens_key
        if need > self.max_positions:
            past = f" + {drafts} drafted past them (speculative verification)" if drafts else ""
            raise PromptDoesNotFitError(
                f"{where}: the prompt is {n} tokens; with {self.max_new_tokens} new tokens (config "
                f"key '{key}'){past} it needs {need} positions, more than the "
                f"{self.max_positions} the policy supports ({self.positions_from}). Shorten or "
                f"drop the record, or lower config key '{key}'."
            )
        for b in self.batches:
            width = sampling.bucket_width(n)
            verify = b.drafts + 1 if b.drafts else 0
            slots = width + self.max_new_tokens + verify
            slot_bytes = self.policy_slot_bytes + (self.mtp_slot_bytes if b.drafts else 0)
            per_device = -(-b.rows // self.shards) * slots * slot_bytes
            if per_device <= self.cache_limit:
                continue
            extra = f" + {verify} verify" if verify else ""
            raise PromptDoesNotFitError(
                f"{where}: the prompt is {n} tokens; a batch of {b.rows} rows ({b.key}) with it "
                f"allocates KV caches of {slots} slots per row ({width} prompt + "
                f"{self.max_new_tokens} new{extra}), {per_device / 2**30:.1f} GiB per device "
                f"({self.shards} device(s) share the rows), more than the "
                f"{self.cache_limit / 2**30:.1f} GiB of {self.cache_limit_is}. Shorten or drop the "
                f"record, or lower config key '{key}' or '{b.key}'."
            )


def _positions_from(source: str) -> str:
    """Where a policy from `source` (`policy.source`) gets its maximum positions."""
    return {
        "sft": "config key 'model.max_positions'",
        "hf": "max_position_embeddings of the policy's config.json",
        "gguf": "context_length of the policy's GGUF file",
    }[source]


def _cache_limit() -> tuple[int, str]:
    """(bytes, what they are) a sampler's KV caches may take per device: the device's memory
    where JAX reports it (GPU, TPU; the caches cannot exceed it), else the generous
    `KV_CACHE_LIMIT_BYTES` (CPU)."""
    try:
        limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        limit = None
    if limit:
        return int(limit), "device memory"
    return KV_CACHE_LIMIT_BYTES, "the KV cache bound"


def _slot_bytes(m: ModelConfig, layers: int) -> int:
    """KV cache bytes of one slot of one row over `layers` layers of `m`'s attention."""
    itemsize = 2 if m.dtype == "bfloat16" else 4
    return 2 * layers * m.num_kv_heads * m.head_dim * itemsize
