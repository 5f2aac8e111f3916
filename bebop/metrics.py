"""Run records: `metrics.jsonl` (one JSON object per logged step, process 0 only), optional
TensorBoard, a progress bar with steps/s, tokens/s and ETA, and a small wall-clock timer."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm


def _plain(v):
    v = np.asarray(jax.device_get(v))
    if v.ndim == 0:
        x = v.item()
        return x if not isinstance(x, float) or math.isfinite(x) else str(x)
    return v.tolist()


class MetricsWriter:
    def __init__(self, path: Path, tensorboard_dir: Path | None = None):
        self.path = Path(path)
        self.enabled = jax.process_index() == 0
        self._tb = None
        if self.enabled and tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "tensorboard=True needs tensorboardX: pip install tensorboardX"
                ) from e
            self._tb = SummaryWriter(str(tensorboard_dir))

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after the restored checkpoint (they will be redone)."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [ln for ln in self.path.read_text().splitlines() if json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, step: int, metrics: dict) -> dict:
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if self._tb is not None:
                for k, v in record.items():
                    if isinstance(v, (int, float)) and k != "step":
                        self._tb.add_scalar(k, v, step)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


class Progress:
    """tqdm bar over steps; shows steps/s (tqdm's rate), tokens/s and ETA."""

    def __init__(self, total: int, initial: int, desc: str):
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            mininterval=2.0,
            disable=jax.process_index() != 0,
        )
        self._t0, self._tokens = time.perf_counter(), 0

    def update(self, n_steps: int, n_tokens: int, **postfix) -> None:
        self._tokens += n_tokens
        rate = self._tokens / max(time.perf_counter() - self._t0, 1e-9)
        self.bar.set_postfix({"tok/s": f"{rate:,.0f}", **postfix}, refresh=False)
        self.bar.update(n_steps)

    def close(self) -> None:
        self.bar.close()


class Timer:
    """Accumulates wall time per named section: `with timer("rollout"): ...`."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
