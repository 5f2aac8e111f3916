"""Orbax checkpoints: async save, keep N, restore newest -> older, auto-resume, read-only readers.

One checkpoint holds the train-state pytree (`state`) and a JSON side-car (`meta`: data-iterator
state, versions, anything small). `restore_latest` tries steps from newest to oldest: a step folder
that looks finalized but is partial or corrupt is renamed to `corrupt-<step>` (kept for inspection,
no longer counted by `max_to_keep`) once an older one restores.

Only the run that owns a directory (it holds the workdir lock) opens it writable: that manager
removes leftover `*.orbax-checkpoint-tmp-*` folders of its own interrupted saves. Everyone else
(a later stage, `mtp.init_from`, `distill.draft_from`, a benchmark's `--mtp_ckpt`) opens it with
`read_only=True`: nothing is cleaned, renamed or deleted, so a live run's in-flight save survives.

Reading only some of a checkpoint (`restore_partial`, `restore_params`: the trained parameters
without the optimizer state) needs only the shapes of what is read: no optimizer is built.

Several processes: every process opens the same manager and calls `save` / `restore_latest`
with the same steps (orbax writes each process's shards; process 0 the metadata and renames).
Orbax's barriers then use the JAX distributed client's key-value store instead of a device
collective: an async save's background thread must not launch a program on the devices, whose
order against the RL loop's programs no process could agree on.

Every step saved holds a state the training guards trusted (`bebop/fit.py` never saves a skipped
or diverged step), so the newest step is always the last good one and `keep` only removes older
good ones.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from bebop import sharding

log = logging.getLogger(__name__)


class CheckpointRestoreError(RuntimeError):
    pass


class Checkpointer:
    def __init__(
        self, directory: Path, keep: int = 1, async_save: bool = True, read_only: bool = False
    ):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        if jax.process_count() > 1:
            _barriers_off_device()
        if read_only:
            if not self.directory.is_dir():
                raise FileNotFoundError(f"{self.directory}: no checkpoint directory")
            options = ocp.CheckpointManagerOptions(
                read_only=True, cleanup_tmp_directories=False, create=False
            )
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,  # our own interrupted saves (we hold the lock)
                create=True,
            )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state, meta: dict, force: bool = False) -> None:
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read-only")
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=force)

    def restore_latest(self, abstract_state, partial: bool = False):
        """Returns (step, state, meta) of the newest restorable step, or None if there is none.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with shardings) or arrays;
        `partial=True`: a subtree of what was saved (dicts holding some of the saved keys), and
        only that is read. Steps
        newer than the one restored are quarantined (not by a read-only reader, which only
        skips them). If no step restores, nothing is touched and
        `CheckpointRestoreError` is raised (most likely the config changed: starting afresh
        silently would hide it).
        """
        self.manager.wait_until_finished()
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        if partial:
            state_args = ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            )
        else:
            state_args = ocp.args.StandardRestore(target)
        failed = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            mismatch = _mismatch(self.directory / str(step) / "state", target, partial)
            if mismatch is not None:  # found from the metadata: no array read is started
                log.warning("checkpoint step %d does not fit: %s", step, mismatch)
                failed.append((step, ValueError(mismatch)))
                continue
            try:
                restored = self.manager.restore(
                    step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore())
                )
            except Exception as e:  # noqa: BLE001 - any failure means: try an older step
                log.warning(
                    "checkpoint step %d is unreadable (%s); trying an older one", step, _brief(e)
                )
                failed.append((step, e))
                continue
            for bad, _ in failed:
                self._quarantine(bad)
            return step, restored["state"], restored["meta"]
        if failed:
            step, e = failed[0]
            steps = ", ".join(str(s) for s, _ in failed)
            if not any(_is_mismatch(err) for _, err in failed):
                raise CheckpointRestoreError(
                    f"every checkpoint under {self.directory} is damaged (steps {steps} do not "
                    f"read; newest: {_brief(e)}); restore the files or start a new --workdir"
                ) from e
            raise CheckpointRestoreError(
                f"no checkpoint under {self.directory} restores into the current train state "
                f"(newest, step {step}: {_brief(e)}). If the config changed, use a new --workdir."
            ) from e
        return None

    def _quarantine(self, step: int) -> None:
        if self.read_only:
            return
        src = self.directory / str(step)
        if jax.process_index() == 0 and src.exists():
            src.rename(self.directory / f"corrupt-{step}")
        sharding.sync(f"bebop.ckpt: quarantined {self.directory}/{step}")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _path_name(path) -> str:
    keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
    return ".".join(str(k) for k in keys if k != "value")


def _mismatch(state_dir: Path, target, partial: bool) -> str | None:
    """How `target` (ShapeDtypeStructs) does not fit the arrays saved in `state_dir`, from its
    metadata alone: the first tensor missing or of another shape (None: it fits, or the metadata
    is unreadable and the restore itself decides). Restoring a mismatch starts array reads that
    orbax abandons, whose callbacks then print "Event loop is closed" tracebacks."""
    try:
        meta = ocp.StandardCheckpointHandler().metadata(state_dir)
    except Exception:  # noqa: BLE001 - damaged metadata: the restore reports it
        return None
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    if tree is None:
        return None
    saved = {
        _path_name(p): tuple(x.shape)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
        if getattr(x, "shape", None) is not None
    }
    wanted = {
        _path_name(p): tuple(x.shape)
        for p, x in jax.tree_util.tree_flatten_with_path(target)[0]
        if getattr(x, "shape", None) is not None
    }
    for name, shape in wanted.items():
        if name not in saved:
            return f"tensor {name!r} is not in the checkpoint (structure mismatch)"
        if saved[name] != shape:
            return f"tensor {name!r} has shape {saved[name]}, expected {shape} (shape mismatch)"
    extra = sorted(set(saved) - set(wanted))
    if extra and not partial:
        return (
            f"the checkpoint holds tensors the state lacks, e.g. {extra[0]!r} (structure mismatch)"
        )
    return None


def _brief(e: BaseException, limit: int = 240) -> str:
    """One line of an orbax / TensorStore error (their messages run over many lines)."""
    text = str(e).split("See full TensorStore details")[0]
    text = " ".join(text.split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}"


def _is_mismatch(e: BaseException) -> bool:
    """Whether a restore failed on the target's structure, shapes or dtypes (the config changed)
    rather than on reading the files (damage)."""
    words = ("shape", "structure", "dtype", "not compatible", "missing", "mismatch", "tree")
    return any(w in _brief(e, 10_000).lower() for w in words)  # not TensorStore's spec dump


def saved_keys(ckpt_dir: Path) -> list[str] | None:
    """The state keys ("params.embed", ...) of the newest step in `ckpt_dir` as its metadata
    lists them, or None when there is no readable metadata."""
    import json

    steps = [p for p in Path(ckpt_dir).glob("*") if p.name.isdigit()] if ckpt_dir else []
    for step in sorted(steps, key=lambda p: -int(p.name)):
        try:
            tree = json.loads((step / "state" / "_METADATA").read_text())["tree_metadata"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        keys = []
        for k in tree:
            parts = [x.strip(" '\"") for x in k.strip("()").split(",") if x.strip()]
            keys.append(".".join(x for x in parts if x != "value"))
        return keys
    return None


def describe(keys: list[str] | None) -> str:
    """What a checkpoint with state `keys` (`saved_keys`) holds, in words."""
    if keys is None:
        return "no readable checkpoint"
    top = sorted({k.split(".")[0] for k in keys})
    if "policy" in top and "mtp" in top:
        return "an rl stage checkpoint (policy and MTP train states)"
    if any(k.startswith("params.embed") for k in keys):
        return "a policy checkpoint (params.embed, params.layers: an sft stage's)"
    if any(".block." in k or k.startswith("params.layers.w_fc") for k in keys):
        return "an MTP checkpoint"
    return f"a checkpoint with keys {sorted(keys)[:6]}"


def _barriers_off_device() -> None:
    """Orbax's multi-process barriers through the distributed client (its absl flag; nothing
    else in bebop reads absl flags, so marking them parsed changes nothing else)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True


def restore_partial(ckpt_dir: Path, target):
    """The subtree `target` (ShapeDtypeStructs with shardings, dicts keyed like the saved state)
    of the newest readable checkpoint in `ckpt_dir`, opened read-only: a live run's in-flight
    save there is left alone."""
    ckpt = Checkpointer(ckpt_dir, read_only=True)
    try:
        restored = ckpt.restore_latest(target, partial=True)
    finally:
        ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"{ckpt_dir}: no checkpoint")
    return restored[1]


def restore_params(ckpt_dir: Path, abstract_params, mesh):
    """The trained params (`TrainState.params`) of a stage's newest readable checkpoint, placed
    on `mesh` by their logical axes; `abstract_params` gives their shapes (real arrays work too).
    Reads neither the optimizer state nor anything else."""
    target = sharding.abstract_on_mesh(abstract_params, mesh)
    return restore_partial(ckpt_dir, {"params": target})["params"]
