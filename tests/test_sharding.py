"""The same forward and train step on 1 device and on a (2, 2, 2) mesh of fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import model, sharding
from bebop.config import ConfigError, MeshConfig, OptimConfig
from bebop.stages.sft import sft_loss
from bebop.train import TrainState, make_optimizer, make_train_step


def _run(cfg, mesh, batch):
    graphdef, params = model.init(cfg, seed=0)
    params = sharding.place_state(params, mesh)
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    state = TrainState.create(params, optimizer, seed=0)
    batch = sharding.shard_batch(batch, mesh)
    tokens = batch["tokens"][:, :-1]
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    logits = jax.jit(model.forward, static_argnums=0)(graphdef, params, tokens, pos)[0]
    step = make_train_step(lambda p, b, _: sft_loss(graphdef, p, b), optimizer)
    for _ in range(2):
        state, metrics = step(state, batch)
    return logits, state.params, metrics["loss"]


@pytest.mark.slow
def test_one_device_and_2x2x2_mesh_agree(tiny_cfg, devices):
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, tiny_cfg.vocab_size, (8, 13)).astype(np.int32),
        "mask": (rng.random((8, 12)) < 0.7).astype(np.float32),
    }
    one = sharding.make_mesh(MeshConfig(data=1), devices[:1])
    eight = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    l1, p1, loss1 = _run(tiny_cfg, one, batch)
    l8, p8, loss8 = _run(tiny_cfg, eight, batch)
    # weights really are distributed on the big mesh
    wq = p8["layers"]["attn"]["wq"][...]
    assert len(wq.sharding.device_set) == 8 and not wq.sharding.is_fully_replicated
    np.testing.assert_allclose(l1, l8, atol=1e-5)
    np.testing.assert_allclose(loss1, loss8, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_mesh_must_match_device_count(devices):
    with pytest.raises(ConfigError, match="mesh"):
        sharding.make_mesh(MeshConfig(data=3, fsdp=1, tensor=1), devices)
    with pytest.raises(ConfigError, match="mesh"):
        sharding.make_mesh(MeshConfig(data=-1, fsdp=3, tensor=1), devices)
    assert dict(sharding.make_mesh(MeshConfig(data=-1, tensor=2), devices).shape) == {
        "data": 4,
        "fsdp": 1,
        "tensor": 2,
    }


def test_undivisible_dims_are_replicated(devices):
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, tensor=4), devices)
    # 3 kv heads cannot split 4 ways: replicated; embed 64 splits over fsdp.
    spec = sharding.spec_for(("embed", "kv_heads", "head_dim"), (64, 3, 16), mesh)
    assert tuple(spec) == ("fsdp", None, None)
    with pytest.raises(KeyError, match="no sharding rule"):
        sharding.spec_for(("nonsense",), (4,), mesh)


def test_process_rows_split_global_batches_into_per_process_blocks(devices, tmp_path):
    """One process holds every row (so its loader reads the whole batch, as before the split);
    `ProcessRows` cut to any blocks of rows gives exactly those rows of the global batches that
    grain's own `.batch` makes, for the SFT stream and the shuffled, repeated distill set; and
    `batch_from_process_rows` lays the batch out like `shard_batch`."""
    import grain

    from bebop import data
    from bebop.config import TaskConfig
    from bebop.tokenizer import CharTokenizer

    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2), devices)
    np.testing.assert_array_equal(sharding.process_rows(mesh, 16), np.arange(16))
    np.testing.assert_array_equal(sharding.process_rows(mesh, 6), np.arange(6))  # replicated
    # a process's devices as a batch-sharded index map shows them: 2 devices of 4 rows each,
    # interleaved with another process's (rows 4..7), and a replicated batch (slice(None))
    shards = [(slice(0, 4), slice(None)), (slice(8, 12), slice(None))]
    np.testing.assert_array_equal(sharding.rows_of(shards, 16), [0, 1, 2, 3, 8, 9, 10, 11])
    np.testing.assert_array_equal(sharding.rows_of([(slice(None),)] * 2, 6), np.arange(6))
    rng = np.random.default_rng(0)
    np.save(tmp_path / "tokens.npy", rng.integers(0, 50, (13, 5)).astype(np.int32))
    np.save(tmp_path / "mask.npy", rng.random((13, 5)).astype(np.float32))
    task, tok = TaskConfig(), CharTokenizer()
    sources = {
        "distill": (
            grain.MapDataset.source(data.DistillSource(tmp_path)).shuffle(seed=3).repeat(),
            lambda rows: data.distill_dataset(tmp_path, 8, 3, rows),
        ),
        "sft": (
            grain.MapDataset.source(data.SFTSource(task, tok, 48, 3)),
            lambda rows: data.sft_dataset(task, tok, 48, 8, 3, rows),
        ),
    }
    for name, (elements, make) in sources.items():
        full = elements.batch(8)
        halves = make(range(0, 4)), make(range(4, 8))
        for i in (0, 1, 5):  # batch 1 of the distill set wraps around its 13 examples
            for key in full[i]:
                joined = np.concatenate([h[i][key] for h in halves])
                np.testing.assert_array_equal(joined, full[i][key], err_msg=f"{name} {key} {i}")
                np.testing.assert_array_equal(make(None)[i][key], full[i][key])
        assert halves[1][0]["tokens"].shape[0] == 4
    for bad in ([6, 8], [3, 2], [1, 1]):
        with pytest.raises(ValueError, match="not sorted distinct rows of a batch of 8"):
            data.ProcessRows(sources["sft"][0], 8, bad)
    batch = {"tokens": np.arange(16 * 3).reshape(16, 3)}
    placed = sharding.batch_from_process_rows(batch, mesh, 16)["tokens"]
    assert placed.sharding == sharding.shard_batch(batch, mesh)["tokens"].sharding
    np.testing.assert_array_equal(np.asarray(placed), batch["tokens"])
