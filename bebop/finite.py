"""Finiteness of loaded weights: a NaN or inf in a checkpoint makes every sample degenerate
(the sampler's argmax / categorical over NaN logits returns token 0) without any error, so every
policy and MTP is checked where it is loaded, naming the first bad tensor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bebop.io import DamagedFileError


class NonFiniteWeightsError(DamagedFileError):
    """A loaded tensor holds NaN or inf; the message names the tensor and where it came from."""


@jax.jit
def _bad_counts(leaves):
    return [jnp.sum(jnp.isnan(x)) for x in leaves], [jnp.sum(jnp.isinf(x)) for x in leaves]


def check_finite(params, what: str) -> None:
    """Raises `NonFiniteWeightsError` naming `what` (e.g. the checkpoint) and the first tensor of
    `params` (a pytree, e.g. an nnx.State) that holds NaN or inf, with the counts."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    named = [(p, x) for p, x in flat if jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.inexact)]
    if not named:
        return
    nans, infs = jax.device_get(_bad_counts([x for _, x in named]))
    for (path, x), n_nan, n_inf in zip(named, nans, infs, strict=True):
        if n_nan or n_inf:
            name = ".".join(
                str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path
            )
            raise NonFiniteWeightsError(
                f"{what}: tensor {name!r} {tuple(np.shape(x))} holds {int(n_nan)} NaN and "
                f"{int(n_inf)} inf values; the weights are damaged"
            )
