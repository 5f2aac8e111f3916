"""Orbax checkpoints: async save, keep N, restore newest -> older, auto-resume.

One checkpoint holds the train-state pytree (`state`) and a JSON side-car (`meta`: data-iterator
state, versions, anything small). `restore_latest` tries steps from newest to oldest: a step folder
that looks finalized but is partial or corrupt is renamed to `corrupt-<step>` (kept for inspection,
no longer counted by `max_to_keep`) and the next older one is tried.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: Path, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state, meta: dict, force: bool = False) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=force)

    def restore_latest(self, abstract_state):
        """Returns (step, state, meta) of the newest restorable step, or None if there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with shardings) or arrays.
        """
        self.manager.wait_until_finished()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                    ),
                )
                return step, restored["state"], restored["meta"]
            except Exception as e:  # noqa: BLE001 - any failure means: try an older step
                log.warning("checkpoint step %d is unreadable (%s); trying an older one", step, e)
                self._quarantine(step)
        return None

    def _quarantine(self, step: int) -> None:
        src = self.directory / str(step)
        if src.exists():
            src.rename(self.directory / f"corrupt-{step}")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
