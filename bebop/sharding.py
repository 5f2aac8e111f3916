"""Device mesh, logical-axis rules and placement helpers.

Every weight declares logical axes (`nnx.Param(..., axes=("embed", "mlp"))`); one table maps them to
the mesh axes `data`, `fsdp`, `tensor`. A dimension that the mapped mesh axes do not divide is
replicated instead (e.g. 3 kv heads on a tensor axis of 2): correctness never depends on the table.

Parallelism (data / FSDP / tensor). Weights are stored split over `fsdp` (their model width) and
`tensor` (heads, feed-forward, vocabulary), replicated over `data`. Activations are split over the
batch on (`data`, `fsdp`) and over heads / feed-forward / vocabulary on `tensor`; their model
width is never split. The model pins that layout with `constrain` at each block's input and output
and on q/k/v, the MLP's hidden, the logits and the KV cache (`ACTIVATION_RULES`): without the pins
GSPMD followed the weights' layout, split activations along the model width and all-reduced every
matmul output, with each device holding the whole batch. With them, each layer's weights are
all-gathered (per layer: the scanned training forward gathers inside its loop), the gradients are
reduce-scattered back to the weights' layout, and no activation-sized tensor is all-reduced
(`tests/test_fsdp.py` reads the compiled HLO). Decoding is data-parallel: the decode copy of the
weights (`model.decode_layers`) is replicated over `data` and `fsdp` (`decode_replicated`), each
device runs its rows of the rollout batch, and the KV cache is split over the batch.

The pins need the mesh at trace time: `activation_mesh(mesh)` makes it the mesh they use, for
every thread (the RL rollout worker traces its samplers in its own thread); the pipeline holds it
around the stages. Without one (or on one device) `constrain` is a no-op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bebop.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Activations use "batch"; weights the rest.
RULES: Mapping[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": None,
    "layers": None,
    "fc_in": None,
    "norm": None,
    "seq": None,
}


# Activations' logical axes -> mesh axes (`constrain`). The batch takes `data` and `fsdp`; the
# model width ("act_embed") and the sequence are never split; heads / kv heads / feed-forward /
# vocabulary go over `tensor` as their weights do.
ACTIVATION_RULES: Mapping[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "act_embed": None,
    "act_seq": None,
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "head_dim": None,
}

_ACTIVATION_MESH: list = [None]  # the mesh `constrain` pins activations on (process-wide)


@contextlib.contextmanager
def activation_mesh(mesh: Mesh | None):
    """Within this block (in every thread) `constrain` pins activations on `mesh`; None or one
    device: no pins. Programs traced inside keep the pins in their compiled form."""
    prev = _ACTIVATION_MESH[0]
    _ACTIVATION_MESH[0] = mesh if spreads(mesh) else None
    try:
        yield
    finally:
        _ACTIVATION_MESH[0] = prev


def current_activation_mesh() -> Mesh | None:
    return _ACTIVATION_MESH[0]


def constrain(x, axes: tuple[str | None, ...]):
    """`x` pinned to the layout of its logical activation `axes` (`ACTIVATION_RULES`) on the
    activation mesh (`activation_mesh`); unchanged without one. A dimension the mesh axes do not
    divide stays whole (`spec_for`)."""
    mesh = _ACTIVATION_MESH[0]
    if mesh is None or x is None:
        return x
    spec = spec_for(tuple(axes), tuple(x.shape), mesh, ACTIVATION_RULES)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def keep_stored_layout(state, rules=RULES):
    """An nnx.State's values pinned to their stored layout (their logical `axes`), e.g. right
    after a cast: a decode copy is cast where the weights lie, and only the compute-dtype
    copy is gathered (half the bytes of gathering float32 masters, and no float32 copy of every
    layer alive). Unchanged without an activation mesh."""
    mesh = _ACTIVATION_MESH[0]
    if mesh is None:
        return state

    def one(v):
        axes = getattr(v, "axes", None)
        if axes is None:
            return v
        x = v.get_value()
        spec = spec_for(tuple(axes), tuple(x.shape), mesh, rules)
        return v.replace(value=jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)))

    return jax.tree.map(one, state, is_leaf=is_var)


def batch_shards() -> int:
    """Devices a batch is split over on the activation mesh (1 without one)."""
    mesh = _ACTIVATION_MESH[0]
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in ACTIVATION_RULES["batch"])


def decode_replicated(tree):
    """A decode copy of the weights pinned replicated over the mesh (`activation_mesh`): every
    device decodes its own rows with whole weights, no per-step gather. Unchanged without one."""
    mesh = _ACTIVATION_MESH[0]
    if mesh is None:
        return tree
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, rep), tree)


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(
                f"config key 'mesh': fixed axes multiply to {known}, which does not divide the "
                f"{num_devices} devices"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"config key 'mesh': data*fsdp*tensor = {math.prod(sizes)} but there are "
            f"{num_devices} devices ({dict(zip(MESH_AXES, sizes, strict=True))})"
        )
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """`jax.make_mesh` orders the devices by the physical topology (TPU torus, GPU NVLink
    islands) so that the inner axes (`tensor`) talk over the fastest links; a plain reshape of
    `jax.devices()` does not. Auto axis types: classic GSPMD propagation (JAX 0.10's default for
    `make_mesh` is explicit sharding, which would demand annotations everywhere)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules=RULES):
    """PartitionSpec for an array of `shape` with logical `axes`; undivisible dims replicate."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape, strict=True):
        mesh_axes = rules.get(name) if name is not None else None
        if mesh_axes is None and name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule")
        mesh_axes = tuple(a for a in (mesh_axes or ()) if a not in used and mesh.shape[a] > 1)
        size = math.prod(mesh.shape[a] for a in mesh_axes)
        if not mesh_axes or dim % size:
            out.append(None)
            continue
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def is_var(x) -> bool:
    """`is_leaf` for trees of nnx Variables (an nnx.State): each Variable is one leaf."""
    return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules=RULES):
    """A tree like `state` (an nnx.State of Variables carrying `axes`) holding NamedShardings."""

    def one(v):
        axes = getattr(v, "axes", None)
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, spec_for(tuple(axes), np.shape(v.get_value()), mesh, rules))

    return jax.tree.map(one, state, is_leaf=is_var)


def place_state(state, mesh: Mesh, rules=RULES):
    """Puts every Variable's value of an nnx.State on the mesh according to its logical axes."""
    shardings = state_shardings(state, mesh, rules)
    return jax.tree.map(
        lambda v, s: v.replace(value=jax.device_put(v.get_value(), s)),
        state,
        shardings,
        is_leaf=is_var,
    )


def abstract_on_mesh(abstract_state, mesh: Mesh, rules=RULES):
    """ShapeDtypeStructs carrying the mesh shardings: a restore target that allocates nothing."""
    shardings = state_shardings(abstract_state, mesh, rules)

    def one(v, s):
        x = v.get_value()
        return v.replace(value=jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))

    return jax.tree.map(one, abstract_state, shardings, is_leaf=is_var)


def abstract_like_params(tree, params, mesh: Mesh):
    """ShapeDtypeStructs of `tree` (e.g. `jax.eval_shape` of a `TrainState` over `params`)
    laid out as eagerly built state is: a leaf whose path ends with a parameter's path and
    has its shape (the optimizer's moments) takes that parameter's sharding, every other leaf
    (step counters, keys) is replicated. `params`: ShapeDtypeStructs carrying shardings
    (`abstract_on_mesh`)."""
    by_path = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        by_path[_path_keys(path)] = leaf
    rep = replicated(mesh)

    def one(path, x):
        keys = _path_keys(path)
        for i in range(len(keys)):
            hit = by_path.get(keys[i:])
            if hit is not None and hit.shape == x.shape:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=hit.sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

    return jax.tree_util.tree_map_with_path(one, tree)


def _path_keys(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def batch_sharding(mesh: Mesh, ndim: int, batch_size: int) -> NamedSharding:
    """Leading axis over (data, fsdp) when it divides, rest replicated."""
    spec = spec_for(("batch",) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1), mesh)
    return NamedSharding(mesh, spec)


def shard_batch(batch, mesh: Mesh):
    """Places a pytree of host arrays whose leading axis is the batch onto the mesh, from the
    whole global batch held by every process (the RL learner's: rollouts gathered from every
    process); each copies only the rows of its own devices (`make_array_from_callback`). With
    one process a plain `device_put`. Data loaders read only their rows instead
    (`process_rows`, `batch_from_process_rows`)."""

    def one(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim, x.shape[0])
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(one, batch)


@dataclasses.dataclass(frozen=True)
class RowShare:
    """A process's share of a global batch laid out by `batch_sharding`."""

    rows: np.ndarray  # the rows its devices hold, sorted (`process_rows`)
    # per entry of `rows`: held by no lower-numbered process. A batch shard is replicated over
    # the non-batch mesh axes, so two processes can hold the same rows: sums and records count
    # each row once, from its owner.
    owned: np.ndarray
    split: bool  # some process holds fewer than all rows (the same answer in every process)

    @classmethod
    def whole(cls, batch_size: int) -> RowShare:
        """Every row, owned: no mesh, or one whose every process holds the whole batch."""
        return cls(np.arange(batch_size), np.ones(batch_size, bool), False)


def row_share(mesh: Mesh, batch_size: int, log: bool = True) -> RowShare:
    """This process's `RowShare` of a batch of `batch_size` (from the global device layout, so
    that every process agrees on `split`)."""
    held: dict[int, set] = {}
    for device, idx in (
        batch_sharding(mesh, 1, batch_size).devices_indices_map((batch_size,)).items()
    ):
        held.setdefault(device.process_index, set()).update(range(*idx[0].indices(batch_size)))
    me = jax.process_index()
    rows = process_rows(mesh, batch_size, log)
    lower = set().union(*(r for p, r in held.items() if p < me))
    owned = np.asarray([r not in lower for r in rows.tolist()], bool)
    return RowShare(rows, owned, any(len(r) < batch_size for r in held.values()))


def spreads(mesh: Mesh | None) -> bool:
    """Whether a batch placed on `mesh` is split over several devices (else samplers take host
    arrays, as the stages' other calls do, and share their compiled programs)."""
    return mesh is not None and mesh.devices.size > 1


def process_rows(mesh: Mesh, batch_size: int, log: bool = True) -> np.ndarray:
    """The rows of a global batch of `batch_size` that this process's devices hold under
    `batch_sharding` (sorted; every row with one process or a replicated batch): what a data
    loader of this process reads (`data.ProcessRows`), in the order
    `make_array_from_process_local_data` expects them (its shards by start row). With several
    processes, logged (`log`)."""
    index_map = batch_sharding(mesh, 1, batch_size).addressable_devices_indices_map((batch_size,))
    rows = rows_of(index_map.values(), batch_size)
    if jax.process_count() > 1 and log:
        logging.info(
            "process %d of %d reads rows %s of each global batch of %d",
            jax.process_index(),
            jax.process_count(),
            f"{rows[0]}..{rows[-1]}" if rows[-1] - rows[0] + 1 == len(rows) else rows.tolist(),
            batch_size,
        )
    return rows


def rows_of(indices, batch_size: int) -> np.ndarray:
    """Sorted distinct rows covered by device indices (tuples whose first entry is a slice of
    the batch axis)."""
    return np.asarray(sorted({r for idx in indices for r in range(*idx[0].indices(batch_size))}))


def batch_from_process_rows(local, mesh: Mesh, batch_size: int):
    """Global arrays of `batch_size` rows, batch-sharded over the mesh, from a pytree of host
    arrays holding this process's rows only (`process_rows`, in order): with several processes
    `make_array_from_process_local_data`, each process contributing its block; with one, a
    plain `device_put`."""

    def one(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim, batch_size)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, x, (batch_size, *x.shape[1:]))

    return jax.tree.map(one, local)


def place_rows(local, mesh: Mesh, rows: np.ndarray, batch_size: int):
    """Global batch-sharded arrays of a batch of `batch_size` from host arrays holding `rows`
    of it: this process's share (`process_rows`: `batch_from_process_rows`) or every row
    (`shard_batch`)."""
    if len(rows) == batch_size:
        return shard_batch(local, mesh)
    return batch_from_process_rows(local, mesh, batch_size)


def local_rows(tree, rows: np.ndarray):
    """Host copies of `rows` of a pytree of arrays whose leading axis is the batch, read from
    this process's own shards (no collective): e.g. a sampler's output for the rows whose
    prompts this process placed (`process_rows`). An array split along another axis as well is
    gathered from every process instead (`to_host`; its layout is the same in every process, so
    they all take this branch). A row none of its shards holds is an error."""
    rows = np.asarray(rows)

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))[rows]
        if any(i != slice(None) for s in x.addressable_shards for i in s.index[1:]):
            return to_host(x)[rows]  # split along another axis too: gathered (a collective)
        out = np.empty((len(rows), *x.shape[1:]), x.dtype)
        filled = np.zeros(len(rows), bool)
        for shard in x.addressable_shards:
            start, stop, step = shard.index[0].indices(x.shape[0])
            assert step == 1, shard.index
            held = (rows >= start) & (rows < stop)
            out[held] = np.asarray(shard.data)[rows[held] - start]
            filled |= held
        if not filled.all():
            raise ValueError(
                f"local_rows: rows {rows[~filled].tolist()} of an array of shape {x.shape} "
                f"are not on process {jax.process_index()}'s devices"
            )
        return out

    return jax.tree.map(one, tree)


def gather_rows(local, rows: np.ndarray, batch_size: int):
    """Host arrays of the whole batch of `batch_size` from every process's `rows` of it (host
    arrays of this process's rows, in `rows` order; `process_allgather`, a collective: every
    process calls it in the same order, with as many rows). With one process, or when `rows` is
    every row, the arrays put in row order."""
    rows = np.asarray(rows)
    if len(rows) == batch_size or jax.process_count() == 1:
        every_rows, stack = rows[None], lambda x: np.asarray(x)[None]
    else:
        every_rows, stack = _allgather(rows), _allgather
    flat = every_rows.reshape(-1)
    if sorted(set(flat.tolist())) != list(range(batch_size)):
        raise ValueError(f"gather_rows: the processes' rows do not tile a batch of {batch_size}")

    def one(x):
        every = stack(x)
        out = np.empty((batch_size, *every.shape[2:]), every.dtype)
        out[flat] = every.reshape(-1, *every.shape[2:])
        return out

    return jax.tree.map(one, local)


def sum_over_processes(tree, split: bool = True):
    """Element-wise sums over processes of a pytree of host numbers (`process_allgather`, a
    collective) -- e.g. per-process partial sums of statistics over their own rows; `split`
    False (every process holds every row) or one process: the tree itself."""
    if not split or jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda x: _allgather(x).sum(0), tree)


def concat_over_processes(records: np.ndarray, split: bool = True) -> np.ndarray:
    """Every process's 1-d structured `records` (any lengths), concatenated in process order
    (`process_allgather` of their bytes, a collective); `split` False or one process: as
    given."""
    if not split or jax.process_count() == 1:
        return records
    raw = np.frombuffer(records.tobytes(), np.uint8)
    sizes = _allgather(raw.size)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: raw.size] = raw
    every = _allgather(padded)
    parts = [every[p, : int(n)].tobytes() for p, n in enumerate(sizes)]
    return np.frombuffer(b"".join(parts), records.dtype).copy()


def max_over_processes(n: int, split: bool = True) -> int:
    """The largest of every process's `n` (a collective); `split` False or one process: `n`."""
    if not split or jax.process_count() == 1:
        return int(n)
    return int(_allgather(n).max())


def _allgather(x) -> np.ndarray:
    """Every process's host value `x` (same shape everywhere), stacked on a new leading axis
    (`process_allgather`, a collective)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def to_host(tree):
    """Host numpy copies of a pytree's arrays. A `jax.Array` that spans other processes'
    devices and is not replicated (e.g. a sampler output whose batch is sharded over the
    mesh) is gathered from every process (`process_allgather`, a collective: every process
    must call this in the same order); anything else is a plain `device_get`."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)


def is_primary() -> bool:
    """Process 0: the one that writes summaries, metrics, config and locks."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Every process waits here until all arrive (no-op with one process): after process 0
    wrote files the others read next."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def replicate_unplaced(tree, mesh: Mesh):
    """Leaves not laid out over `mesh` (step counters, RNG keys, optimizer counts) are put on it
    replicated, so a train state and its restored copy live on one device set. On a one-device
    mesh a plain single-device array counts as unplaced too: the step function's outputs carry
    the mesh's sharding, and an input that does not would compile the step a second time."""
    rep = replicated(mesh)

    def one(x):
        if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == mesh:
            return x
        return jax.device_put(x, rep)

    return jax.tree.map(one, tree)
