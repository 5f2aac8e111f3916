"""Runs the configured stages in order. A stage whose `DIR/<stage>/summary.json` exists is done and
is skipped on re-run; an unfinished stage resumes from its own checkpoints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from bebop import distill, mtp_train, sft
from bebop.config import RunConfig
from bebop.rl import stage as rl_stage

log = logging.getLogger(__name__)

STAGES = {"sft": sft.run, "distill": distill.run, "mtp": mtp_train.run, "rl": rl_stage.run}


def run(cfg: RunConfig, workdir: Path, mesh) -> dict:
    summaries = {}
    for name in cfg.stages:
        done = Path(workdir) / name / "summary.json"
        if done.exists():
            log.info("stage %s already done (%s); skipping", name, done)
            summaries[name] = json.loads(done.read_text())
            continue
        summaries[name] = STAGES[name](cfg, Path(workdir), mesh)
    return summaries
