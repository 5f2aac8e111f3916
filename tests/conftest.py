"""Test setup: 8 fake CPU devices (set before JAX is imported anywhere)."""

import os
import sys
import tempfile
from pathlib import Path

# The suite's programs are tiny and mostly compiled once: XLA's CPU backend without its expensive
# optimisation passes compiles them in about half the CPU time (compaction + speculative tests:
# 4 min 40 s of CPU instead of 8 min 2 s, same machine load), and every test passes the same.
# Subprocesses (`launch.py` runs) inherit the flags through the environment. (The flags of
# `config.fast_compile`; bebop.config does not start JAX.)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bebop.config import FAST_COMPILE_XLA_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    + list(FAST_COMPILE_XLA_FLAGS)
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from bebop.config import ModelConfig  # noqa: E402, I001
from tests.mappings import MAP_LIMIT, memory_mappings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# One persistent compilation cache for the test run: many tests build fresh closures over the same
# tiny models, which compile to identical programs; the cache turns the repeats into loads.
# Subprocesses (`launch.py` runs) inherit it through the environment; pytest-xdist workers share
# one per run (PYTEST_XDIST_TESTRUNUID is the same in every worker of a run).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN:
    _CACHE = Path(tempfile.gettempdir()) / f"bebop-tests-jax-cache-{_RUN}"
    _CACHE.mkdir(exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_CACHE)
else:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="bebop-tests-jax-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Every program, however quick to compile, and in subprocesses too (a killed-and-restarted
# `launch.py` run loads what its first launch compiled).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Seconds each heavy file took on 2 loaded cores (per-file sums of `--durations=0` of the full
# suite, 2026-12-08). With `--dist loadfile` pytest-xdist hands whole files to the 2 workers in
# collection order; its default reordering (by number of tests: `pyproject.toml` turns it off)
# started the two slowest files by wall time, test_sft and test_multiprocess, among the last, so
# one worker ran them alone at the end. Longest first is the classic schedule that keeps both
# workers busy. Only the order matters here, not the exact figures.
HEAVY_FILES_S = {
    "test_speculative.py": 415,
    "test_mtp_features.py": 358,
    "test_rl_stage.py": 284,
    "test_mtp_truncation.py": 234,
    "test_memory_knobs.py": 232,
    "test_multiprocess.py": 228,
    "test_compaction.py": 214,
    "test_sft.py": 174,
    "test_mtp_train.py": 132,
}


def pytest_collection_modifyitems(items):
    """The heavy files first, longest first; every other file after them in collection order
    (the sort is stable, so the tests of a file keep their order)."""
    items.sort(key=lambda item: -HEAVY_FILES_S.get(item.path.name, 0))


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=23, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=48
    )


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "conftest must set 8 fake CPU devices before importing jax"
    return jax.devices()


# Every compiled CPU executable holds ~18 memory mappings of its own (its JIT code and data) until
# JAX's caches drop it, and a pytest-xdist worker that runs a few hundred tests compiles tens of
# thousands of programs (eager `lax.map` / `scan` calls over fresh closures compile anew each
# call: `tests/test_mtp_truncation.py` alone adds ~140 mappings a second). At the kernel's
# `vm.max_map_count` (65,530 by default) the next mmap fails and XLA segfaults while compiling or
# loading a program, wherever the worker happens to be; pytest-xdist then waits forever for it.
# Past half the limit, the caches are cleared (the mappings go with them; a later test
# recompiles what it needs).
@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
    yield
    if MAP_LIMIT and memory_mappings() > MAP_LIMIT // 2:
        jax.clear_caches()
