"""MTP draft layer(s), DeepSeek-V3 / Qwen3.5 style, applied recursively (docs/method.md §1).

One MTP layer:
    e = RMSNorm_e(embed(token))          # embedding of the next token (shared, frozen embedding)
    h = RMSNorm_h(hidden)                # backbone hidden (step 1) or the MTP's previous output
    x = DecoderBlock(W_fc [e ; h])       # 2D -> D, no bias; one block of the policy's type
    logits = head(RMSNorm_out(x))        # shared, frozen head
`x` (before RMSNorm_out) is the hidden state passed to the next step. With `n` distinct layers,
step i (1-based) uses layer (i - 1) mod n. The MTP parameters are their own nnx state, separate
from the policy's: training "only the MTP" is a choice of which state to differentiate.

Train time (`train_hidden`), teacher forcing over whole sequences: step k at anchor position t
consumes the data token x[t+k] and the step-(k-1) hidden at t (k=1: the backbone's hidden at t) and
predicts x[t+k+1]. Each step is one causal pass over the sequence.

Decode time (`extend`), chain style: each MTP layer keeps a KV cache indexed by position, whose
entry p holds (backbone hidden at p, token p+1) for accepted positions. Drafting from anchor a
(the last position the backbone has processed): step 1 is the entry at a itself, step k >= 2 sits
at position a+k-1 with the previous step's output as its hidden. Drafted entries are rolled back
after verification and rewritten from backbone hiddens by the next catch-up, which needs the
outputs of one position only (`extend(at_B=)`); where no output is read (a prefill, layers past
the first in a catch-up) `write_kv` writes the entries alone.
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
from bebop.config import ModelConfig
from bebop.kvcache import KVCache
from bebop.model import DTYPES, Block, RMSNorm, compute_weight


class MTPLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = DTYPES[cfg.param_dtype]  # stored; the forward computes in cfg.dtype (bebop/model.py)
        self.cfg = cfg
        self.emb_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        self.hid_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)
        w = cfg.init_std * jax.random.normal(rngs.params(), (2 * cfg.dim, cfg.dim))
        self.w_fc = nnx.Param(w.astype(dt), axes=("fc_in", "embed"))
        self.block = Block(cfg, rngs)
        self.out_norm = RMSNorm(cfg.dim, cfg.norm_eps, dt)

    def __call__(
        self, emb_BxTxD, hid_BxTxD, positions_BxT, kv=None, offsets_B=None, valid=None, at_B=None
    ):
        """(out, normed out, new kv); with `at_B` the outputs are those of position `at_B[b]` of
        each row only, `[B, 1, D]` (every position's key and value are written)."""
        x_BxTxD = self._fc(emb_BxTxD, hid_BxTxD)
        out_BxTxD, new_kv = self.block(x_BxTxD, positions_BxT, kv, offsets_B, valid, at_B)
        return out_BxTxD, self.out_norm(out_BxTxD), new_kv

    def write_kv(self, emb_BxTxD, hid_BxTxD, positions_BxT, kv, offsets_B):
        """The layer's cache update alone: an entry's key and value depend only on its own
        (token, hidden), so positions whose outputs nobody reads skip attention and the MLP."""
        return self.block.write_kv(self._fc(emb_BxTxD, hid_BxTxD), positions_BxT, kv, offsets_B)

    def _fc(self, emb_BxTxD, hid_BxTxD):
        cdt = DTYPES[self.cfg.dtype]
        x = jnp.concatenate([self.emb_norm(emb_BxTxD), self.hid_norm(hid_BxTxD)], axis=-1)
        return x.astype(cdt) @ compute_weight(self.w_fc, cdt)


class MTP(nnx.Module):
    def __init__(self, cfg: ModelConfig, num_layers: int, rngs: nnx.Rngs):
        self.cfg = cfg
        self.num_layers = num_layers
        self.layers = model.stacked_blocks(cfg, num_layers, rngs, block_cls=MTPLayer)

    def layer(self, i: int) -> MTPLayer:
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i % self.num_layers], state))


@dataclasses.dataclass(frozen=True)
class DecodeMTP:
    """An MTP's layers in the decode layout (`for_decode`): what a sampler reads, with the
    `num_layers` / `layer(i)` of `MTP`."""

    layers: tuple

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> MTPLayer:
        return self.layers[i % self.num_layers]


def for_decode(mtp: MTP) -> DecodeMTP:
    """Each MTP layer sliced out once, its block in the fused decode layout (`model.fuse_block`):
    made outside a sampler's loop, so the slices and concatenations are loop constants."""
    layers = []
    for i in range(mtp.num_layers):
        # a fresh module over sliced arrays in the compute dtype (as `model.decode_layers`):
        # fusing it leaves `mtp` alone
        graphdef, state = nnx.split(mtp.layer(i))
        layer = nnx.merge(graphdef, model.to_compute(state, mtp.cfg))
        model.fuse_block(layer.block)
        # replicated over the mesh, as the policy's decode copy (data-parallel drafting)
        layer_gd, layer_state = nnx.split(layer)
        layers.append(nnx.merge(layer_gd, sharding.decode_replicated(layer_state)))
    return DecodeMTP(tuple(layers))


def init(cfg: ModelConfig, num_layers: int, seed: int):
    """(graphdef, params) of a randomly initialised MTP: the same draws as building `MTP` eagerly,
    in one compiled program (eagerly, each parameter shape compiles its own RNG programs)."""
    graphdef, _ = abstract(cfg, num_layers)
    return graphdef, _init_params(cfg, num_layers, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params(cfg: ModelConfig, num_layers: int, key):
    return nnx.split(MTP(cfg, num_layers, nnx.Rngs(params=key)))[1]


def abstract(cfg: ModelConfig, num_layers: int):
    """(graphdef, params as ShapeDtypeStructs) of an MTP, without allocating weights."""
    return nnx.split(nnx.eval_shape(lambda: MTP(cfg, num_layers, nnx.Rngs(params=0))))


def init_from_last_layer(mtp_params, pol_params):
    """MTP parameters started from the backbone (`mtp.init = "last_layer"`): every MTP layer's
    decoder block is a copy of the policy's last block, `W_fc`'s hidden half is the identity (the
    normed backbone hidden passes through; the embedding half keeps its random init), and the
    output norm is the policy's final norm. At step 0 a draft step is then the policy's last
    block applied once more to its own normed output."""
    pol = nnx.to_pure_dict(pol_params)
    out = nnx.to_pure_dict(mtp_params)
    layers = out["layers"]
    n = jax.tree.leaves(layers)[0].shape[0]
    tile = lambda a: jnp.broadcast_to(a, (n,) + a.shape)  # noqa: E731
    layers["block"] = jax.tree.map(lambda a: tile(a[-1]), pol["layers"])
    layers["out_norm"] = jax.tree.map(tile, pol["final_norm"])
    w = layers["w_fc"]
    d = w.shape[-1]
    layers["w_fc"] = w.at[:, d:, :].set(jnp.broadcast_to(jnp.eye(d, dtype=w.dtype), (n, d, d)))
    new = jax.tree.map(lambda a: a, mtp_params)
    nnx.replace_by_pure_dict(new, out)
    return new


def new_cache(cfg: ModelConfig, num_layers: int, batch: int, max_len: int) -> KVCache:
    """A per-layer cache (a tuple of `[B, Kv, S, Dh]` arrays per side, one per MTP layer),
    split over the batch (`sharding.constrain`)."""
    cache = KVCache.init_per_layer(
        num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, DTYPES[cfg.dtype]
    )
    pin = lambda a: sharding.constrain(a, model.KV_AXES)  # noqa: E731
    return cache.replace(k=tuple(map(pin, cache.k)), v=tuple(map(pin, cache.v)))


def train_hidden(mtp_gd, mtp_params, pol_gd, pol_params, tokens_BxT, hidden_BxTxD, num_steps):
    """Teacher-forced multi-step forward. Returns normed hiddens `[Y, B, T, D]`; step k's row t
    predicts `tokens[t + k + 1]` (positions with t + k + 1 >= T are padding-fed and must be masked).
    Logits are `policy.head(out)`, left to the caller so the loss can chunk the vocabulary."""
    mtp = nnx.merge(mtp_gd, mtp_params)
    policy = nnx.merge(pol_gd, pol_params)
    b, t = tokens_BxT.shape
    feats = jax.lax.stop_gradient(hidden_BxTxD)
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

    Returns (hidden out `[B, T, D]` for the next chain step, the normed output `[B, T, D]` for
    `logits`, cache with that layer written). `valid_BxS` optionally masks cache slots (needed
    when n > 1 layers leave gaps in a chain). With `at_B`, the outputs are only those of index
    `at_B[b]` of each row (`[B, 1, D]`): the other positions only write their keys and values
    (a catch-up drafts from its last position alone)."""
    i, emb, positions, kv = _layer_inputs(mtp, policy, layer, cache, tokens_BxT)
    mtp_layer = mtp.layer(i)
    out, normed, (k, v) = mtp_layer(emb, hid_BxTxD, positions, kv, cache.lengths, valid_BxS, at_B)
    return out, normed, _swap_layer(cache, i, k, v)


def write_kv(mtp: MTP, policy, layer: int, cache: KVCache, hid_BxTxD, tokens_BxT) -> KVCache:
    """`extend`'s cache update alone (no outputs): what a prefill, or a catch-up's layers past
    the first, need (an entry's key and value depend only on its own token and hidden)."""
    i, emb, positions, kv = _layer_inputs(mtp, policy, layer, cache, tokens_BxT)
    k, v = mtp.layer(i).write_kv(emb, hid_BxTxD, positions, kv, cache.lengths)
    return _swap_layer(cache, i, k, v)


def _layer_inputs(mtp: MTP, policy, layer: int, cache: KVCache, tokens_BxT):
    """(layer index, token embeddings, positions at the cache's lengths, that layer's kv)."""
    i = layer % mtp.num_layers
    positions = cache.positions(tokens_BxT.shape[1])
    return i, policy.embed_tokens(tokens_BxT), positions, (cache.k[i], cache.v[i])


def _swap_layer(cache: KVCache, i: int, k, v) -> KVCache:
    swap = lambda layers, new: layers[:i] + (new,) + layers[i + 1 :]  # noqa: E731
    return cache.replace(k=swap(cache.k, k), v=swap(cache.v, v))


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
