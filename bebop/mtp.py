"""MTP draft layer(s), DeepSeek-V3 / Qwen3.5 style, applied recursively (docs/method.md §1).

One MTP layer:
    e = RMSNorm_e(embed(token))          # embedding of the next token (shared, frozen embedding)
    h = RMSNorm_h(hidden)                # backbone input (step 1) or the MTP's previous output
    x = Blocks(W_fc [e ; h])             # 2D -> D, no bias; `depth` blocks of the policy's type
    logits = head(RMSNorm_out(x))        # shared, frozen head
`x` (before RMSNorm_out) is the hidden state passed to the next step. With `n` distinct layers,
step i (1-based) uses layer (i - 1) mod n. The MTP parameters are their own nnx state, separate
from the policy's: training "only the MTP" is a choice of which state to differentiate.

Backbone input (`mtp.features`): by default the policy's last hidden. With other or several
decoder layers (EAGLE-3 style), their hidden states, concatenated in layer order (`[B, T, F*D]`,
"the features", which the policy's forward returns from the same pass:
`model.Policy.hidden_features`), are fused by one linear projection `fc_features` `[F*D, D]`
(shared by the MTP layers) into the `hidden` above (`fuse`). Depth (`mtp.depth`): each layer runs
`depth` decoder blocks in turn (`block`, `block_1`, ...), each with its own KV cache. The default
(last layer, depth 1) has exactly the parameters of a plain MTP layer.

Train time (`train_hidden`), teacher forcing over whole sequences: step k at anchor position t
consumes the data token x[t+k] and the step-(k-1) hidden at t (k=1: the fused backbone features
at t) and predicts x[t+k+1]. Each step is one causal pass over the sequence.

Decode time (`extend`), chain style: each MTP layer keeps a KV cache (one per block) indexed by
position, whose entry p holds (fused backbone features at p, token p+1) for accepted positions.
Drafting from anchor a (the last position the backbone has processed): step 1 is the entry at a
itself, step k >= 2 sits at position a+k-1 with the previous step's output as its hidden. Drafted
entries are rolled back after verification and rewritten from the backbone's features by the
next catch-up, which needs the outputs of one position only (`extend(at_B=)`); where no output is
read (a prefill, layers past the first in a catch-up) `write_kv` writes the entries alone. The
features are fused once, when the verification returns them (`fuse`): the sampler's catch-up
buffer holds D-wide fused features whatever `mtp.features` is.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bebop import io, model, sharding
from bebop.config import ModelConfig, resolve_features
from bebop.kvcache import KVCache
from bebop.model import DTYPES, Block, RMSNorm, compute_weight


class MTPLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, depth: int = 1):
        dt = DTYPES[cfg.param_dtype]  # stored; the forward computes in cfg.dtype (bebop/model.py)
        self.cfg = cfg
        self.depth = depth
        self.emb_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.hid_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        w = cfg.init_std * jax.random.normal(rngs.params(), (2 * cfg.dim, cfg.dim))
        self.w_fc = nnx.Param(w.astype(dt), axes=("fc_in", "embed"))
        self.block = Block(cfg, rngs)
        self.out_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        for i in range(1, depth):  # after every other draw: depth 1 draws what it always did
            setattr(self, block_name(i), Block(cfg, rngs))

    def blocks(self) -> list[Block]:
        """The `depth` decoder blocks, in the order they run."""
        return [getattr(self, block_name(i)) for i in range(self.depth)]

    def __call__(
        self, emb_BxTxD, hid_BxTxD, positions_BxT, kv=None, offsets_B=None, valid=None, at_B=None
    ):
        """(out, normed out, new kv); `kv`: one `(k, v)` per block (or None: no cache). With
        `at_B` the outputs are those of position `at_B[b]` of each row only, `[B, 1, D]` (every
        position's key and value are written: the blocks before the last run every position)."""
        x_BxTxD = self._fc(emb_BxTxD, hid_BxTxD)
        new_kv = []
        for i, block in enumerate(self.blocks()):
            at = at_B if i == self.depth - 1 else None
            block_kv = None if kv is None else kv[i]
            x_BxTxD, out_kv = block(x_BxTxD, positions_BxT, block_kv, offsets_B, valid, at)
            new_kv.append(out_kv)
        return x_BxTxD, self.out_norm(x_BxTxD), None if kv is None else tuple(new_kv)

    def write_kv(self, emb_BxTxD, hid_BxTxD, positions_BxT, kv, offsets_B):
        """The layer's cache update alone (one `(k, v)` per block): the last block's entries
        depend only on its input, so positions whose outputs nobody reads skip its attention and
        MLP (the blocks before it run every position: the next block's keys need their outputs)."""
        x_BxTxD = self._fc(emb_BxTxD, hid_BxTxD)
        *first, last = self.blocks()
        new_kv = []
        for block, block_kv in zip(first, kv, strict=False):
            x_BxTxD, out_kv = block(x_BxTxD, positions_BxT, block_kv, offsets_B)
            new_kv.append(out_kv)
        new_kv.append(last.write_kv(x_BxTxD, positions_BxT, kv[-1], offsets_B))
        return tuple(new_kv)

    def _fc(self, emb_BxTxD, hid_BxTxD):
        cdt = DTYPES[self.cfg.dtype]
        x = jnp.concatenate([self.emb_norm(emb_BxTxD), self.hid_norm(hid_BxTxD)], axis=-1)
        return x.astype(cdt) @ compute_weight(self.w_fc, cdt)


def block_name(i: int) -> str:
    """The attribute (and parameter path) of an MTP layer's block `i`: `block`, `block_1`, ..."""
    return "block" if i == 0 else f"block_{i}"


class MTP(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        num_layers: int,
        rngs: nnx.Rngs,
        features: tuple[int, ...] = (-1,),
        depth: int = 1,
    ):
        self.cfg = cfg
        self.num_layers = num_layers
        self.depth = depth
        self.features = resolve_features(features, cfg.num_layers)
        self.layers = model.stacked_blocks(
            cfg, num_layers, rngs, block_cls=functools.partial(MTPLayer, depth=depth)
        )
        if fused(self):  # drawn after the layers: the layers' draws do not depend on features
            n_in = len(self.features) * cfg.dim
            w = cfg.init_std * jax.random.normal(rngs.params(), (n_in, cfg.dim))
            self.fc_features = nnx.Param(w.astype(DTYPES[cfg.param_dtype]), axes=("fc_in", "embed"))

    def layer(self, i: int) -> MTPLayer:
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i % self.num_layers], state))


def fused(mtp) -> bool:
    """Whether `mtp` (an `MTP` or `DecodeMTP`) reads other backbone layers than the last alone,
    through `fc_features`."""
    return tuple(mtp.features) != (mtp.cfg.num_layers - 1,)


def collected(mtp) -> tuple[int, ...] | None:
    """The decoder layers whose outputs the policy's forward must return for `mtp`
    (`model.Policy.hidden_features`), or None when the last hidden is its input."""
    return tuple(mtp.features) if fused(mtp) else None


def fuse(mtp, feats_BxTxF):
    """The backbone input of `mtp` from the features `[B, T, F*D]` (`collected`'s layers
    concatenated): `fc_features` applied, `[B, T, D]` in the compute dtype; the last hidden
    itself (unchanged) when the MTP reads the last layer alone."""
    if not fused(mtp):
        return feats_BxTxF
    cdt = DTYPES[mtp.cfg.dtype]
    return feats_BxTxF.astype(cdt) @ compute_weight(mtp.fc_features, cdt)


def backbone_inputs(mtp, policy, tokens_BxT, hidden_BxTxD=None, feats_BxTxF=None):
    """(last hidden, features) for training `mtp` on `tokens_BxT`, under `stop_gradient`: the
    precomputed arrays where given (a cache over the distill set, verification's records), else
    one policy forward (which collects the feature layers on the way). The features are the last
    hidden itself when `mtp` reads the last layer alone."""
    if hidden_BxTxD is not None and (feats_BxTxF is not None or not fused(mtp)):
        feats_BxTxF = hidden_BxTxD if feats_BxTxF is None else feats_BxTxF
    else:
        positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        hidden_BxTxD, feats_BxTxF, _ = policy.hidden_features(
            tokens_BxT, positions, features=mtp.features
        )
    return jax.lax.stop_gradient(hidden_BxTxD), jax.lax.stop_gradient(feats_BxTxF)


@dataclasses.dataclass(frozen=True)
class DecodeMTP:
    """An MTP's layers in the decode layout (`for_decode`): what a sampler reads, with the
    `num_layers` / `layer(i)` / `depth` / `features` of `MTP` (and its `fc_features` in the
    compute dtype, None for the last layer alone)."""

    layers: tuple
    cfg: ModelConfig
    features: tuple[int, ...]
    depth: int = 1
    fc_features: jax.Array | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> MTPLayer:
        return self.layers[i % self.num_layers]


def for_decode(mtp: MTP) -> DecodeMTP:
    """Each MTP layer sliced out once, its blocks in the fused decode layout (`model.fuse_block`):
    made outside a sampler's loop, so the slices and concatenations are loop constants."""
    layers = []
    for i in range(mtp.num_layers):
        # a fresh module over sliced arrays in the compute dtype (as `model.decode_layers`):
        # fusing it leaves `mtp` alone
        graphdef, state = nnx.split(mtp.layer(i))
        layer = nnx.merge(graphdef, model.to_compute(state, mtp.cfg))
        for block in layer.blocks():
            model.fuse_block(block)
        # replicated over the mesh, as the policy's decode copy (data-parallel drafting)
        layer_gd, layer_state = nnx.split(layer)
        layers.append(nnx.merge(layer_gd, sharding.decode_replicated(layer_state)))
    fc = None
    if fused(mtp):
        fc = sharding.decode_replicated(compute_weight(mtp.fc_features, DTYPES[mtp.cfg.dtype]))
    return DecodeMTP(tuple(layers), mtp.cfg, mtp.features, mtp.depth, fc)


def init(
    cfg: ModelConfig, num_layers: int, seed: int, features: tuple[int, ...] = (-1,), depth: int = 1
):
    """(graphdef, params) of a randomly initialised MTP: the same draws as building `MTP` eagerly,
    in one compiled program (eagerly, each parameter shape compiles its own RNG programs)."""
    features = resolve_features(features, cfg.num_layers)
    graphdef, _ = abstract(cfg, num_layers, features, depth)
    return graphdef, _init_params(cfg, num_layers, features, depth, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init_params(cfg: ModelConfig, num_layers: int, features, depth: int, key):
    return nnx.split(MTP(cfg, num_layers, nnx.Rngs(params=key), features, depth))[1]


def abstract(cfg: ModelConfig, num_layers: int, features: tuple[int, ...] = (-1,), depth: int = 1):
    """(graphdef, params as ShapeDtypeStructs) of an MTP, without allocating weights."""
    return nnx.split(
        nnx.eval_shape(lambda: MTP(cfg, num_layers, nnx.Rngs(params=0), features, depth))
    )


def init_from_last_layer(mtp_params, pol_params):
    """MTP parameters started from the backbone (`mtp.init = "last_layer"`): every MTP layer's
    decoder block is a copy of the policy's last block, `W_fc`'s hidden half is the identity (the
    normed backbone hidden passes through; the embedding half keeps its random init), and the
    output norm is the policy's final norm. At step 0 a draft step is then the policy's last
    block applied once more to its own normed output. With `mtp.depth` > 1 the blocks after the
    first are copies too, with their output projections (`attn.wo`, `mlp.w_down`) zero: each is
    the identity until trained. With `mtp.features`, `fc_features` passes the last feature layer
    through (identity on its slice, zero on the others)."""
    pol = nnx.to_pure_dict(pol_params)
    out = nnx.to_pure_dict(mtp_params)
    layers = out["layers"]
    n = jax.tree.leaves(layers)[0].shape[0]
    tile = lambda a: jnp.broadcast_to(a, (n,) + a.shape)  # noqa: E731
    layers["block"] = jax.tree.map(lambda a: tile(a[-1]), pol["layers"])
    for name in [k for k in layers if k.startswith("block_")]:
        block = jax.tree.map(lambda a: tile(a[-1]), pol["layers"])
        block["attn"]["wo"] = jnp.zeros_like(block["attn"]["wo"])
        block["mlp"]["w_down"] = jnp.zeros_like(block["mlp"]["w_down"])
        layers[name] = block
    layers["out_norm"] = jax.tree.map(tile, pol["final_norm"])
    w = layers["w_fc"]
    d = w.shape[-1]
    layers["w_fc"] = w.at[:, d:, :].set(jnp.broadcast_to(jnp.eye(d, dtype=w.dtype), (n, d, d)))
    if "fc_features" in out:
        fc = out["fc_features"]
        out["fc_features"] = jnp.zeros_like(fc).at[-d:].set(jnp.eye(d, dtype=fc.dtype))
    new = jax.tree.map(lambda a: a, mtp_params)
    nnx.replace_by_pure_dict(new, out)
    return new


def new_cache(cfg: ModelConfig, num_layers: int, batch: int, max_len: int, depth: int = 1):
    """A per-block cache (a tuple of `[B, Kv, S, Dh]` arrays per side: layer i's block b at
    `i * depth + b`), split over the batch (`sharding.constrain`)."""
    cache = KVCache.init_per_layer(
        num_layers * depth, batch, cfg.num_kv_heads, max_len, cfg.head_dim, DTYPES[cfg.dtype]
    )
    pin = lambda a: sharding.constrain(a, model.KV_AXES)  # noqa: E731
    return cache.replace(k=tuple(map(pin, cache.k)), v=tuple(map(pin, cache.v)))


def train_hidden(mtp_gd, mtp_params, pol_gd, pol_params, tokens_BxT, feats_BxTxF, num_steps):
    """Teacher-forced multi-step forward from the backbone features `feats_BxTxF` (the last hidden
    `[B, T, D]` by default; `collected`'s layers concatenated otherwise, fused here). Returns
    normed hiddens `[Y, B, T, D]`; step k's row t predicts `tokens[t + k + 1]` (positions with
    t + k + 1 >= T are padding-fed and must be masked). Logits are `policy.head(out)`, left to the
    caller so the loss can chunk the vocabulary."""
    mtp = nnx.merge(mtp_gd, mtp_params)
    policy = nnx.merge(pol_gd, pol_params)
    b, t = tokens_BxT.shape
    feats = fuse(mtp, jax.lax.stop_gradient(feats_BxTxF))
    outs = []
    for k in range(1, num_steps + 1):
        shifted_BxT = jnp.pad(tokens_BxT[:, k:], ((0, 0), (0, k)))
        emb = jax.lax.stop_gradient(policy.embed_tokens(shifted_BxT))
        positions = jnp.broadcast_to(jnp.arange(t) + k - 1, (b, t))
        feats, normed, _ = mtp.layer(k - 1)(emb, feats, positions)
        outs.append(normed)
    return jnp.stack(outs)


def draft_head(policy, vocab_K=None) -> jax.Array:
    """The draft's output projection `[D, K]` float32: the policy's head, restricted to the draft
    vocabulary `vocab_K` (token ids) when one is given."""
    head_DxV = policy.head_matrix()
    return head_DxV if vocab_K is None else jnp.take(head_DxV, vocab_K, axis=1)


def extend(
    mtp: MTP, policy, layer: int, cache: KVCache, hid_BxTxD, tokens_BxT, valid_BxS=None, at_B=None
):
    """Runs MTP layer `layer` over T positions per row at the cache's lengths (no advance).
    `hid_BxTxD`: the fused backbone features (`fuse`) or the previous chain step's output.

    Returns (hidden out `[B, T, D]` for the next chain step, the normed output `[B, T, D]` for
    `logits`, cache with that layer written). `valid_BxS` optionally masks cache slots (needed
    when n > 1 layers leave gaps in a chain). With `at_B`, the outputs are only those of index
    `at_B[b]` of each row (`[B, 1, D]`): the other positions only write their keys and values
    (a catch-up drafts from its last position alone)."""
    i, emb, positions, kv = _layer_inputs(mtp, policy, layer, cache, tokens_BxT)
    mtp_layer = mtp.layer(i)
    out, normed, new_kv = mtp_layer(emb, hid_BxTxD, positions, kv, cache.lengths, valid_BxS, at_B)
    return out, normed, _swap_layer(cache, mtp, i, new_kv)


def write_kv(mtp: MTP, policy, layer: int, cache: KVCache, hid_BxTxD, tokens_BxT) -> KVCache:
    """`extend`'s cache update alone (no outputs): what a prefill, or a catch-up's layers past
    the first, need (the last block's keys and values depend only on its input)."""
    i, emb, positions, kv = _layer_inputs(mtp, policy, layer, cache, tokens_BxT)
    new_kv = mtp.layer(i).write_kv(emb, hid_BxTxD, positions, kv, cache.lengths)
    return _swap_layer(cache, mtp, i, new_kv)


def _layer_inputs(mtp: MTP, policy, layer: int, cache: KVCache, tokens_BxT):
    """(layer index, token embeddings, positions at the cache's lengths, that layer's kv: one
    `(k, v)` per block)."""
    i = layer % mtp.num_layers
    positions = cache.positions(tokens_BxT.shape[1])
    first = i * mtp.depth
    kv = tuple((cache.k[first + b], cache.v[first + b]) for b in range(mtp.depth))
    return i, policy.embed_tokens(tokens_BxT), positions, kv


def _swap_layer(cache: KVCache, mtp: MTP, i: int, new_kv) -> KVCache:
    first, last = i * mtp.depth, (i + 1) * mtp.depth
    swap = lambda entries, new: entries[:first] + tuple(new) + entries[last:]  # noqa: E731
    return cache.replace(
        k=swap(cache.k, [k for k, _ in new_kv]), v=swap(cache.v, [v for _, v in new_kv])
    )


def logits(policy, normed_BxTxD, head_DxVd=None) -> jax.Array:
    """Draft logits `[B, T, Vd]` float32 of normed MTP outputs: through `head_DxVd` (from
    `draft_head`, a draft vocabulary) or the policy's own head."""
    if head_DxVd is None:
        return policy.head(normed_BxTxD)
    # A compute-dtype head (the policy's decode copy) multiplies the compute-dtype output with
    # float32 accumulation: the same products as a float32 head of the same values.
    x = normed_BxTxD.astype(head_DxVd.dtype)
    return jnp.matmul(x, head_DxVd, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- draft vocabulary


def select_draft_vocab(tokens, mask, size: int, eos_ids, vocab_size: int) -> np.ndarray:
    """The `size` token ids most frequent among the supervised (`mask` > 0) tokens, ties to the
    lower id, EOS ids always included; sorted int32."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"mtp.draft_vocab={size} must be in [1, {vocab_size}] (the vocabulary)")
    counts = np.bincount(np.asarray(tokens)[np.asarray(mask) > 0], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts[:vocab_size]))
    eos = [int(e) for e in eos_ids if 0 <= e < vocab_size][:size]
    rest = [int(i) for i in order if int(i) not in eos][: size - len(eos)]
    return np.sort(np.asarray(eos + rest, np.int32))


def load_draft_vocab(mtp_dir: Path, vocab_size: int | None = None) -> np.ndarray | None:
    """The draft vocabulary an `mtp` stage saved next to its checkpoints (None: full vocab),
    checked: distinct int token ids (below `vocab_size` when given)."""
    path = Path(mtp_dir) / "draft_vocab.npy"
    if not path.exists():
        return None
    ids = io.load_array(path)  # a damaged or pickled file is an error naming it
    ok = ids.ndim == 1 and ids.size > 0 and np.issubdtype(ids.dtype, np.integer)
    ok = ok and len(np.unique(ids)) == ids.size and int(ids.min()) >= 0
    if not ok or (vocab_size is not None and int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{path}: not a draft vocabulary (want distinct int token ids in [0, "
            f"{vocab_size or 'V'}), got {ids.dtype} shape {ids.shape})"
        )
    return ids.astype(np.int32)
