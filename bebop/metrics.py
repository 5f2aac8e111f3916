"""Run records: `metrics.jsonl` (one JSON object per logged step, process 0 only), optional
TensorBoard, a progress bar with steps/s, tokens/s and ETA (process 0 only), and a small
wall-clock timer. Every process calls `write` (it returns the record everywhere); only process
0 writes."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from bebop.io import DamagedFileError

log = logging.getLogger(__name__)


def _plain(v):
    from bebop.sharding import to_host  # a value sharded over other processes is gathered

    v = np.asarray(to_host(v))
    if v.ndim == 0:
        x = v.item()
        return x if not isinstance(x, float) or math.isfinite(x) else str(x)
    return v.tolist()


class MetricsWriter:
    def __init__(self, path: Path, tensorboard_dir: Path | None = None, config: dict | None = None):
        self.path = Path(path)
        self.enabled = jax.process_index() == 0
        self._tb = None
        if self.enabled and tensorboard_dir is not None:
            SummaryWriter = tensorboard_writer_class()
            self._tb = SummaryWriter(str(tensorboard_dir))
            if config is not None:
                self._write_config(config)

    def _write_config(self, config: dict) -> None:
        """The run's config as text (TensorBoard's TEXT tab) and its scalar leaves as hparams."""
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        self._tb.add_text("config", "```\n" + text + "\n```", 0)
        flat = {
            k: v if isinstance(v, (bool, int, float, str)) else str(v)
            for k, v in flatten(config).items()
            if not isinstance(v, float) or math.isfinite(v)
        }
        self._tb.add_hparams(flat, {}, name="hparams")

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after the restored checkpoint (they will be redone).
        A cut-off last line (a crash mid-write) is dropped with a warning; any other unreadable
        line is an error naming the file and line."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [r for r in _records(self.path, repair=True) if r[1]["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln, _ in keep))

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


def tensorboard_writer_class():
    """tensorboardX's SummaryWriter; a missing package is a clear error (checked at launch)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "config key 'tensorboard': True needs tensorboardX (pinned in requirements.txt): "
            "pip install -r requirements.txt"
        ) from e
    return SummaryWriter


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _records(path: Path, repair: bool = False) -> list[tuple[str, dict]]:
    """(line, record) pairs of a metrics file. A last line without its newline that does not
    parse is a torn write: dropped (with a warning when `repair`). Anything else unreadable is a
    `DamagedFileError` naming the file and line."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    torn_ok = not text.endswith("\n")
    out = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as e:
            if i == len(lines) - 1 and torn_ok:
                if repair:
                    log.warning("%s: dropping a cut-off last line (%r)", path, ln[:80])
                continue
            raise DamagedFileError(f"{path}: line {i + 1} is not a metrics record ({e})") from e
        out.append((ln, rec))
    return out


def read_jsonl(path: Path) -> list[dict]:
    """The records of a `metrics.jsonl` (a cut-off last line of a live run is ignored)."""
    return [rec for _, rec in _records(Path(path))]


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
