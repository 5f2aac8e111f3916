"""grain pipelines.

The SFT stream is a random-access synthetic source (example `i` is a pure function of the seed and
`i`); the distill set is the `distill` stage's `DIR/distill/` arrays (`tokens.npy`, `mask.npy`
`[N, S]`), read memory-mapped, shuffled and repeated. Both are cut into global batches of B
consecutive elements, of which each process reads only the rows its devices hold
(`ProcessRows`, rows from `sharding.process_rows`; every row with one process). The iterator's
state (`{"next_index": ...}`, the global batch) goes into every checkpoint so a resumed run
continues with exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class ProcessRows:
    """Random-access source whose item i is global batch i of `ds` (its elements i·B .. i·B+B-1)
    restricted to `rows` (sorted indices into the batch), stacked per key: one process's share
    of every batch, the others' never read. With every row, item i is `ds.batch(B)[i]`."""

    def __init__(self, ds: grain.MapDataset, batch_size: int, rows: Sequence[int] | None = None):
        self.ds, self.batch_size = ds, batch_size
        self.rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
        r = self.rows
        if r.size == 0 or r.min() < 0 or r.max() >= batch_size or (np.diff(r) <= 0).any():
            raise ValueError(
                f"rows {r.tolist()} are not sorted distinct rows of a batch of {batch_size}"
            )

    def __len__(self) -> int:
        return len(self.ds) // self.batch_size

    def __getitem__(self, i: int) -> dict:
        items = [self.ds[int(i) * self.batch_size + int(r)] for r in self.rows]
        return {k: np.stack([x[k] for x in items]) for k in items[0]}


def sft_dataset(
    task: TaskConfig, tok: CharTokenizer, seq_len: int, batch: int, seed: int, rows=None
):
    """Global batches of `batch` examples; only `rows` of each are generated (default: all)."""
    source = grain.MapDataset.source(SFTSource(task, tok, seq_len, seed))
    return grain.MapDataset.source(ProcessRows(source, batch, rows))


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


def distill_dataset(directory: Path, batch_size: int, seed: int, rows=None):
    """The distill set shuffled and repeated, in global batches of `batch_size`; only `rows` of
    each are read (default: all)."""
    shuffled = grain.MapDataset.source(DistillSource(directory)).shuffle(seed=seed).repeat()
    return grain.MapDataset.source(ProcessRows(shuffled, batch_size, rows))
