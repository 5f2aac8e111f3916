"""Hugging Face checkpoints: import (Qwen3 / Qwen2 / Llama, single or sharded safetensors, optional
MTP tensors) straight onto mesh shardings, and export to a directory transformers loads.

Import never holds a full copy of the model on a host: every parameter is created with
`jax.make_array_from_callback`, and each device's block is read through safetensors' lazy slices
(`names.read_slice`). Every tensor is checked: missing, unexpected and wrongly shaped tensors are
errors naming the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from bebop import model, sharding
from bebop import mtp as mtp_lib
from bebop.checkpoints import LoadedPolicy, names
from bebop.config import ConfigError, ModelConfig, resolve_features
from bebop.io import DamagedFileError, read_json

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
}


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match the model; names the culprit."""


# ----------------------------------------------------------------------------- config


def config_from_hf(
    hf: dict, source: str = "config.json", dtype="float32", scan_layers=True, param_dtype="float32"
):
    """The architecture of an HF config.json; `dtype` (compute), `param_dtype` (stored weights)
    and `scan_layers` are bebop's own (`ModelConfig`)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unknown architecture model_type={model_type!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise CheckpointError(f"{source}: rope scaling {scaling} is not supported")
    theta = hf.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: neither rope_theta nor rope_parameters.rope_theta")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in (*required, "intermediate_size") if k not in hf]
    if missing:
        raise CheckpointError(f"{source}: missing required key(s) {missing}")
    for k in (*required, "intermediate_size"):
        if not isinstance(hf[k], int) or isinstance(hf[k], bool) or hf[k] <= 0:
            raise CheckpointError(f"{source}: {k} must be a positive integer, got {hf[k]!r}")
    heads = hf["num_attention_heads"]
    positions = hf.get("max_position_embeddings", ModelConfig.max_positions)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions <= 0:
        raise CheckpointError(
            f"{source}: max_position_embeddings must be a positive integer, got {positions!r}"
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffw_dim=hf["intermediate_size"],
        rope_theta=float(theta),
        max_positions=positions,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=param_dtype,
        scan_layers=scan_layers,
    )


# Architectures known without a checkpoint (`arch/NAME.json`: the fields of the model's published
# `config.json`), for memory plans and compile checks at real shapes (`benchmarks.memory`).
ARCH_DIR = Path(__file__).resolve().parent / "arch"


def known_architectures() -> list[str]:
    return sorted(p.stem for p in ARCH_DIR.glob("*.json"))


def known_architecture(name: str, **kw) -> ModelConfig:
    """The `ModelConfig` of a shipped architecture (`arch/NAME.json`, read as a checkpoint's
    config.json is: `config_from_hf`); `kw`: dtype, param_dtype, scan_layers."""
    path = ARCH_DIR / f"{name}.json"
    if not path.is_file():
        raise CheckpointError(f"unknown architecture {name!r}; known: {known_architectures()}")
    return config_from_hf(json.loads(path.read_text()), str(path), **kw)


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffw_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- tensor sources


class SafetensorsSource:
    """Tensors of a single `model.safetensors` or of shards listed in `*.index.json`."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        index = sorted(directory.glob("*.safetensors.index.json"))
        if index:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(directory.glob("*.safetensors"))]
            if not files:
                raise CheckpointError(f"{directory}: no *.safetensors weights found")
            weight_map = None
        self.handles, self.where = {}, {}
        for f in files:
            path = directory / f
            if not path.exists():
                raise CheckpointError(f"{path}: listed in the index but missing")
            try:
                h = safe_open(str(path), framework="numpy")
                keys = list(h.keys())
            except Exception as e:  # noqa: BLE001 - any parse failure names the file
                raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e
            self.handles[f] = h
            for k in keys:
                self.where[k] = f
        if weight_map is not None:
            for k, f in weight_map.items():
                if self.where.get(k) != f:
                    raise CheckpointError(f"index lists tensor {k} in {f}, which lacks it")
        self.label = str(directory)

    def names(self):
        return list(self.where)

    def has(self, name):
        return name in self.where

    def shape(self, name):
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def read(self, name, index):
        try:
            return np.asarray(self.handles[self.where[name]].get_slice(name)[index])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.label}: cannot read tensor {name} ({e})") from e


class ArraySource:
    """In-memory tensors in HF layout (e.g. dequantized from a GGUF file)."""

    def __init__(self, arrays: dict[str, np.ndarray], label: str):
        self.arrays, self.label = arrays, label

    def names(self):
        return list(self.arrays)

    def has(self, name):
        return name in self.arrays

    def shape(self, name):
        return tuple(self.arrays[name].shape)

    def read(self, name, index):
        return self.arrays[name][index]


class FirstLayers:
    """A tensor source restricted to its first `n` decoder layers (`policy.num_layers`), MTP
    tensors hidden (trained on the whole stack, they do not fit a cut one)."""

    def __init__(self, source, n: int):
        self.source, self.n, self.label = source, n, source.label

    def _keep(self, name: str) -> bool:
        if name.startswith(("mtp.", "model.mtp_layers.")):
            return False
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is None or int(m.group(1)) < self.n

    def names(self):
        return [n for n in self.source.names() if self._keep(n)]

    def has(self, name):
        return self._keep(name) and self.source.has(name)

    def shape(self, name):
        return self.source.shape(name)

    def read(self, name, index):
        return self.source.read(name, index)


def first_layers(source, cfg: ModelConfig, num_layers: int):
    """(source, cfg) cut to the checkpoint's first `num_layers` decoder layers (0: unchanged): a
    smoke run's policy, the real embeddings, tokenizer and loader with a fraction of the compile
    time; its outputs are not the model's."""
    if not num_layers or num_layers == cfg.num_layers:
        return source, cfg
    if num_layers > cfg.num_layers:
        raise CheckpointError(
            f"{source.label}: policy.num_layers={num_layers} but the checkpoint has "
            f"{cfg.num_layers} decoder layers"
        )
    return FirstLayers(source, num_layers), dataclasses.replace(cfg, num_layers=num_layers)


# ----------------------------------------------------------------------------- import


def _paths(state):
    leaves, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=sharding.is_var)
    for path, var in leaves:
        yield ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path), var


def _block_reader(source, name_of, path, shape, stacked, dtype):
    """Callback for `make_array_from_callback`: reads one device's block of parameter `path`."""
    inner = shape[1:] if stacked else shape

    def one(layer, index):
        name, kind = name_of(path, layer)
        return names.read_slice(kind, lambda ix: source.read(name, ix), inner, index)

    def cb(index):
        if not stacked:
            return one(None, index).astype(dtype)
        l0, l1, _ = index[0].indices(shape[0])
        return np.stack([one(i, index[1:]) for i in range(l0, l1)]).astype(dtype)

    return cb


def _fill(abstract_state, mesh, source, name_of, used: set, dtype):
    """Builds the sharded state; `name_of(path, layer)` -> (HF name, kind)."""
    shardings = sharding.state_shardings(abstract_state, mesh)
    flat_sh = dict(_paths(shardings))
    out = {}
    for path, var in _paths(abstract_state):
        shape = var.get_value().shape
        stacked = path.startswith("layers.")
        layers = range(shape[0]) if stacked else [None]
        inner = shape[1:] if stacked else shape
        for i in layers:
            hf_name, kind = name_of(path, i)
            if not source.has(hf_name):
                raise CheckpointError(f"{source.label}: missing tensor {hf_name}")
            want, got = names.hf_shape(kind, inner), source.shape(hf_name)
            if tuple(want) != tuple(got):
                raise CheckpointError(
                    f"{source.label}: tensor {hf_name} has shape {got}, expected {want}"
                )
            used.add(hf_name)

        out[path] = jax.make_array_from_callback(
            shape, flat_sh[path], _block_reader(source, name_of, path, shape, stacked, dtype)
        )
    return out


def _assign(abstract_state, arrays: dict):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=sharding.is_var)
    new = []
    for path, var in leaves:
        key = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        new.append(var.replace(value=arrays[key]))
    return jax.tree_util.tree_unflatten(treedef, new)


def _policy_name(path, layer):
    if path.startswith("layers."):
        name, kind = names.DECODER_LAYER[path[len("layers.") :]]
        return names.POLICY_LAYER_PREFIX.format(i=layer) + name, kind
    return names.POLICY[path]


def load_source(
    source, cfg: ModelConfig, mesh, mtp_layers: int | None = None, mtp_arch: dict | None = None
) -> LoadedPolicy:
    """Loads policy (and MTP layers, when present) from a tensor source onto `mesh`, stored in
    `cfg.param_dtype`. `mtp_arch`: the MTP's `features` and `depth` (config.json's `bebop_mtp`,
    `names.MTP_EXTENSIONS`; absent: the last layer, depth 1)."""
    dtype = model.DTYPES[cfg.param_dtype]
    used: set[str] = set()
    graphdef, abstract = model.abstract(cfg)
    arrays = _fill(abstract, mesh, source, _policy_name, used, dtype)
    params = _assign(abstract, arrays)
    mtp = None
    fmt = names.detect_mtp_format(source.names(), cfg.num_layers)
    if fmt is not None:
        n = mtp_layers or _count_mtp_layers(source.names(), fmt, cfg.num_layers)
        limit = names.MTP_FORMATS[fmt]["max_layers"]
        if limit is not None and n > limit:
            raise CheckpointError(f"{source.label}: format {fmt} holds at most {limit} MTP layer")
        features, depth = _mtp_arch(mtp_arch or {}, cfg, source.label)
        mgd, mabs = mtp_lib.abstract(cfg, n, features, depth)

        def mtp_name(path, j):
            return names.mtp_name(fmt, _mtp_path(path), j, cfg.num_layers)

        marrays = _fill(mabs, mesh, source, mtp_name, used, dtype)
        mtp = (mgd, _assign(mabs, marrays))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints still store it
    extra = [n for n in source.names() if n not in used and not n.endswith(names.IGNORED_SUFFIXES)]
    if extra:
        raise CheckpointError(f"{source.label}: unexpected tensor(s) {sorted(extra)[:5]}")
    return LoadedPolicy(cfg, graphdef, params, None, mtp, fmt if mtp is not None else None)


def _mtp_path(path: str) -> str:
    """An MTP parameter path as `names.mtp_name` reads it (the stacked layers' prefix off)."""
    return path[len("layers.") :] if path.startswith("layers.") else path


def _mtp_arch(arch: dict, cfg: ModelConfig, label: str) -> tuple[tuple[int, ...], int]:
    """(features, depth) of a checkpoint's `bebop_mtp` entry, checked."""
    features, depth = arch.get("features", [-1]), arch.get("depth", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise CheckpointError(f"{label}: bebop_mtp.depth must be a positive integer: {depth!r}")
    try:
        return resolve_features(features, cfg.num_layers, "bebop_mtp.features"), depth
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{label}: {e}") from e


def _count_mtp_layers(all_names, fmt, num_policy_layers) -> int:
    if names.MTP_FORMATS[fmt]["max_layers"] == 1:  # its `mtp.layers.{i}` are a layer's blocks
        return 1
    present = set(all_names)
    n = 0
    while names.mtp_name(fmt, "block.attn_norm.scale", n, num_policy_layers)[0] in present:
        n += 1
    return max(n, 1)


def load(
    directory, mesh, dtype="float32", scan_layers=True, param_dtype="float32", num_layers=0
) -> LoadedPolicy:
    """The policy of a Hugging Face directory (`num_layers` > 0: only its first decoder layers,
    `first_layers`)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{directory}: missing config.json")
    try:
        hf_cfg = read_json(cfg_path)
    except DamagedFileError as e:
        raise CheckpointError(str(e)) from e
    if not isinstance(hf_cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(hf_cfg).__name__}")
    cfg = config_from_hf(hf_cfg, str(cfg_path), dtype, scan_layers, param_dtype)
    arch = hf_cfg.get("bebop_mtp") or {}
    if not isinstance(arch, dict):
        raise CheckpointError(f"{cfg_path}: bebop_mtp must be an object, got {arch!r}")
    source, cfg = first_layers(SafetensorsSource(directory), cfg, num_layers)
    return load_source(source, cfg, mesh, mtp_arch=arch)


# ----------------------------------------------------------------------------- export


def _mtp_export_arch(mtp_params, features, cfg: ModelConfig) -> dict | None:
    """config.json's `bebop_mtp` for an MTP's parameters (None: the last layer, depth 1)."""
    paths = [p for p, _ in _paths(mtp_params)]
    depth = 1 + len({p.split(".")[1] for p in paths if p.startswith("layers.block_")})
    last = (cfg.num_layers - 1,)
    features = last if features is None else resolve_features(features, cfg.num_layers)
    fc = [v for p, v in _paths(mtp_params) if p == "fc_features"]
    want = None if features == last else len(features) * cfg.dim
    got = fc[0].get_value().shape[0] if fc else None
    if want != got:
        raise ValueError(
            f"export: the MTP's fc_features has {got} input rows, but mtp_features={features} "
            f"needs {want}"
        )
    if features == last and depth == 1:
        return None
    return {"features": list(features), "depth": depth}


EXPORT_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def model_type_for(cfg: ModelConfig) -> str:
    """The transformers architecture that computes what bebop's model does for `cfg`: Qwen3 has
    q/k norms, Qwen2 biased q/k/v projections, Llama neither (its `attention_bias` also covers
    biases, but Qwen2 is what such checkpoints are published as)."""
    if cfg.qk_norm:
        return "qwen3"
    return "qwen2" if cfg.qkv_bias else "llama"


def export(
    directory,
    cfg: ModelConfig,
    params,
    model_type: str,
    mtp_params=None,
    mtp_format: str = "qwen3_5",
    max_shard_bytes: int | None = None,
    dtype: str = "float32",
    base_config: dict | None = None,
    mtp_features: tuple[int, ...] | None = None,
) -> None:
    """Writes config.json + safetensors (sharded with an index past `max_shard_bytes`), every
    tensor cast to `dtype`. `base_config`: a source checkpoint's config.json whose other keys
    (token ids, `max_position_embeddings`, ...) are kept; the architecture keys are bebop's.
    `mtp_features`: the backbone layers the MTP reads (`mtp.MTP.features`; None: the last), with
    its depth (counted from `mtp_params`) recorded as config.json's `bebop_mtp` when either
    differs from the default (`names.MTP_EXTENSIONS`)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r} unknown; choose one of {sorted(EXPORT_DTYPES)}")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"export model_type {model_type!r} unknown; supported {sorted(ARCHITECTURES)}"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    np_dtype = EXPORT_DTYPES[dtype]

    def put(state, name_of):
        for path, var in _paths(state):
            x = np.asarray(jax.device_get(var.get_value()), np.float32)
            for i in range(x.shape[0]) if path.startswith("layers.") else [None]:
                name, kind = name_of(path, i)
                y = names.to_hf(kind, x if i is None else x[i]).astype(np_dtype)
                tensors[name] = np.ascontiguousarray(y)

    put(params, _policy_name)
    mtp_arch = None
    if mtp_params is not None:
        mtp_arch = _mtp_export_arch(mtp_params, mtp_features, cfg)
        put(
            mtp_params,
            lambda p, j: names.mtp_name(mtp_format, _mtp_path(p), j, cfg.num_layers),
        )
    hf_cfg = dict(base_config or {})
    hf_cfg.pop("bebop_mtp", None)
    if mtp_arch is not None:
        hf_cfg["bebop_mtp"] = mtp_arch
    for k in ("rope_scaling", "rope_parameters", "torch_dtype", "dtype", "architectures"):
        hf_cfg.pop(k, None)  # bebop's RoPE is the default one; the rest is rewritten below
    hf_cfg.update(config_to_hf(cfg, model_type))
    if base_config and "max_position_embeddings" in base_config:
        hf_cfg["max_position_embeddings"] = base_config["max_position_embeddings"]
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = dtype  # transformers < 5 reads the first
    (directory / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    total = sum(v.nbytes for v in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        if cur and size + v.nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + v.nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
