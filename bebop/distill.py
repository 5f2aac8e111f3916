"""Stage `distill`: self-distillation data for MTP training.

Samples responses from the frozen policy with the plain sampler at the rollout temperature and
stores token ids only (nothing decoded) in `DIR/distill/`: `tokens.npy` `[N, S]` int32 (prompt,
then response, right-padded) and `mask.npy` `[N, S]` (1 on response tokens). `DistillSource` reads
them for grain with memory mapping.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grain
import jax
import numpy as np

from bebop import policies, prompts, sampling
from bebop.config import RunConfig


def sampling_config(cfg: RunConfig, tok, max_new_tokens: int | None = None):
    r = cfg.rollout
    return sampling.SamplingConfig(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        max_new_tokens=max_new_tokens or r.max_new_tokens, eos_ids=tuple(tok.eos_ids),
        pad_id=tok.pad_id,
    )  # fmt: skip


def run(cfg: RunConfig, workdir: Path, mesh) -> dict:
    ddir = Path(workdir) / "distill"
    ddir.mkdir(parents=True, exist_ok=True)
    graphdef, params, tok = policies.load(cfg, workdir, mesh)
    ids = prompts.prompt_ids(cfg, tok, cfg.distill.num_samples, "distill", cfg.distill.prompts)
    scfg = sampling_config(cfg, tok)
    width = sampling.next_pow2(max(len(p) for p in ids)) + scfg.max_new_tokens
    tokens = np.full((len(ids), width), tok.pad_id, np.int32)
    mask = np.zeros((len(ids), width), np.float32)
    t0, rng = time.perf_counter(), jax.random.key(cfg.seed + 1)
    bs = cfg.distill.batch_size
    for start in range(0, len(ids), bs):
        batch = ids[start : start + bs]
        toks, lens = sampling.pad_prompts(batch, tok.pad_id)
        out = jax.device_get(sampling.sample_jit(
            graphdef, params, toks, lens, jax.random.fold_in(rng, start), scfg
        ))  # fmt: skip
        for r, prompt in enumerate(batch):
            n = int(out.lengths[r])
            row = start + r
            tokens[row, : len(prompt)] = prompt
            tokens[row, len(prompt) : len(prompt) + n] = out.tokens[r, :n]
            mask[row, len(prompt) : len(prompt) + n] = 1.0
    for name, arr in (("tokens", tokens), ("mask", mask)):  # atomic: a crash leaves no partial file
        np.save(ddir / f"{name}.tmp.npy", arr, allow_pickle=False)
        (ddir / f"{name}.tmp.npy").rename(ddir / f"{name}.npy")
    summary = {
        "stage": "distill",
        "samples": len(ids),
        "seq_len": width,
        "response_tokens": int(mask.sum()),
        "sample_time_s": time.perf_counter() - t0,
    }
    (ddir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


class DistillSource:
    def __init__(self, directory: Path):
        directory = Path(directory)
        for name in ("tokens.npy", "mask.npy"):
            if not (directory / name).exists():
                raise FileNotFoundError(f"{directory / name}: run the distill stage first")
        self.tokens = np.load(directory / "tokens.npy", mmap_mode="r", allow_pickle=False)
        self.mask = np.load(directory / "mask.npy", mmap_mode="r", allow_pickle=False)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {
            "tokens": np.asarray(self.tokens[i]),
            "mask": np.asarray(self.mask[i]),
            "index": np.int32(i),
        }


def dataset(directory: Path, batch_size: int, seed: int):
    source = DistillSource(directory)
    return grain.MapDataset.source(source).shuffle(seed=seed).repeat().batch(batch_size)
