"""KV cache with one length per row.

Layout `[L, B, K, S, Dh]` (kv heads before sequence: measured ~8x faster attention on CPU than the
other order). Row `b` holds valid entries at cache slots `[0, lengths[b])`, and slot `s` holds the
token at absolute position `s`. A forward over T new tokens writes them at each row's own offset
`lengths[b]`; rows may then keep a different number of them (`rollback`). Rejected entries are
never deleted: they sit past the row's length and are overwritten by the next write, so shapes stay
static.
Callers must size `S` for the longest row plus the widest write (e.g. γ+1 for verification):
`lax.dynamic_update_slice` clamps out-of-range writes instead of failing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, Dh]
    v: jax.Array  # [L, B, K, S, Dh]
    lengths: jax.Array  # [B] int32

    @classmethod
    def init(cls, num_layers, batch, num_kv_heads, max_len, head_dim, dtype=jnp.float32):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        zeros = jnp.zeros(shape, dtype)
        return cls(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))

    def positions(self, num_new: int) -> jax.Array:
        """Absolute positions `[B, T]` of the next `num_new` tokens of each row."""
        return self.lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None, :]

    def advance(self, num_new_B: jax.Array) -> KVCache:
        return self.replace(lengths=self.lengths + num_new_B.astype(jnp.int32))

    def rollback(self, lengths_B: jax.Array) -> KVCache:
        """Shortens rows to `lengths_B` (never lengthens: entries past a length are stale)."""
        return self.replace(lengths=jnp.minimum(self.lengths, lengths_B.astype(jnp.int32)))


def write(cache_BxKxSxDh: jax.Array, new_BxKxTxDh: jax.Array, offsets_B: jax.Array) -> jax.Array:
    """Writes T new entries per row at the row's own offset."""

    def one(c, n, o):
        return lax.dynamic_update_slice(c, n.astype(c.dtype), (0, o, 0))

    return jax.vmap(one)(cache_BxKxSxDh, new_BxKxTxDh, offsets_B)
