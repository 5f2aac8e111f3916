"""grain pipelines.

The SFT stream is a random-access synthetic source (example `i` is a pure function of the seed and
`i`), batched by grain; the iterator's state (`{"next_index": ...}`) goes into every checkpoint so a
resumed run continues with exactly the batches it would have seen. The distill set is the `distill`
stage's `DIR/distill/` arrays (`tokens.npy`, `mask.npy` `[N, S]`), read memory-mapped, shuffled
and repeated.
"""

from __future__ import annotations

from pathlib import Path

import grain
import numpy as np

from bebop import io, tasks
from bebop.config import TaskConfig
from bebop.tokenizer import CharTokenizer


class SFTSource:
    """Example i: `<bos> prompt response <eos>` right-padded to `seq_len + 1` tokens, with a mask
    over the targets that belong to the response (the loss ignores prompt and padding)."""

    def __init__(self, task: TaskConfig, tok: CharTokenizer, seq_len: int, seed: int):
        self.task, self.tok, self.seq_len, self.seed = task, tok, seq_len, seed

    def __len__(self) -> int:
        return 2**31 - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        prob = tasks.make_problem(rng, self.task.digits)
        solution = prob.solution
        if rng.random() < self.task.noise:
            solution = tasks.corrupt_answer(rng, solution)
        prompt = self.tok.encode(prob.prompt, bos=True)
        response = self.tok.encode(solution) + [self.tok.eos_id]
        ids = prompt + response
        if len(ids) > self.seq_len + 1:
            raise ValueError(
                f"sft.seq_len={self.seq_len} is too short for a {len(ids)}-token example "
                f"(task.digits={self.task.digits})"
            )
        tokens = np.full(self.seq_len + 1, self.tok.pad_id, np.int32)
        tokens[: len(ids)] = ids
        mask = np.zeros(self.seq_len, np.float32)  # mask[t] weighs the target tokens[t + 1]
        mask[len(prompt) - 1 : len(ids) - 1] = 1.0
        return {"tokens": tokens, "mask": mask}


def sft_dataset(task: TaskConfig, tok: CharTokenizer, seq_len: int, batch: int, seed: int):
    source = SFTSource(task, tok, seq_len, seed)
    return grain.MapDataset.source(source).batch(batch, drop_remainder=True)


class DistillSource:
    def __init__(self, directory: Path):
        directory = Path(directory)
        for name in ("tokens.npy", "mask.npy"):
            if not (directory / name).exists():
                raise FileNotFoundError(f"{directory / name}: run the distill stage first")
        self.tokens = io.load_array(directory / "tokens.npy", ndim=2, kind="i", mmap=True)
        self.mask = io.load_array(directory / "mask.npy", ndim=2, kind="f", mmap=True)
        if self.tokens.shape != self.mask.shape:
            raise io.DamagedFileError(
                f"{directory}: tokens.npy {self.tokens.shape} and mask.npy {self.mask.shape} "
                "differ in shape; re-run the distill stage"
            )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {
            "tokens": np.asarray(self.tokens[i]),
            "mask": np.asarray(self.mask[i]),
            "index": np.int32(i),
        }


def distill_dataset(directory: Path, batch_size: int, seed: int):
    source = DistillSource(directory)
    return grain.MapDataset.source(source).shuffle(seed=seed).repeat().batch(batch_size)
