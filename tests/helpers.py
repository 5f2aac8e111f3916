"""Test fixtures built from real components: a bigram policy and an MTP that copies it exactly."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from bebop import model
from bebop import mtp as mtp_lib
from bebop.config import ModelConfig


def random_policy(cfg: ModelConfig, seed: int, std: float = 0.3):
    """A random policy with peaky, varied next-token distributions (a larger init scale)."""
    return model.init(dataclasses.replace(cfg, init_std=std), seed)


def bigram_policy_and_copy_mtp(cfg: ModelConfig, seed: int, std: float = 0.5):
    """A one-layer policy whose attention output is zero (p(x_{t+1}) depends on x_t only), and
    an MTP layer that reproduces it: W_fc = [I; 0] passes the (unit-RMS) embedding through, the
    block is a copy of the policy's, RMSNorm_out = the final norm. Then q = p up to float error."""
    cfg = dataclasses.replace(cfg, num_layers=1, init_std=std, norm_eps=1e-12)
    pol = model.Policy(cfg, nnx.Rngs(params=seed))
    emb = pol.embed[...]
    pol.embed[...] = emb / jnp.sqrt(jnp.mean(emb * emb, axis=-1, keepdims=True))
    pol.layers.attn.wo[...] = jnp.zeros_like(pol.layers.attn.wo[...])
    mtp = mtp_lib.MTP(cfg, 1, nnx.Rngs(params=seed + 1))
    d = cfg.dim
    mtp.layers.w_fc[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))])[None]
    _, block_state = nnx.split(pol.layers)
    nnx.update(mtp.layers.block, block_state)
    mtp.layers.out_norm.scale[...] = pol.final_norm.scale[...][None]
    return nnx.split(pol), nnx.split(mtp)


def perturb(state, seed: int, scale: float):
    keys = iter(jax.random.split(jax.random.key(seed), 256))
    return jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape), state)
