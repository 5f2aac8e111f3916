"""Every config file loads and validates; bad values and keys fail naming the key."""

import copy
import dataclasses
import functools
import json
import subprocess
import sys
import typing

import pytest

from bebop import config as config_lib
from bebop.config import ConfigError

from .conftest import REPO

CONFIGS = sorted(p for p in (REPO / "configs").glob("*.py") if "def get_config" in p.read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("arg", ["", ":runlocal"])
def test_every_config_loads_and_validates(path, arg):
    cfg, raw = config_lib.load(f"{path}{arg}")
    assert isinstance(cfg, config_lib.RunConfig)
    # round trip: the typed config re-serialises to the same keys as the ConfigDict
    assert set(config_lib.to_dict(cfg)) == set(raw.to_dict())


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


LEAVES = list(_leaves(config_lib.RunConfig))


def _get(cfg, key):
    return functools.reduce(getattr, key.split("."), cfg)


# Empty sequence leaves whose elements are not strings: a value of the element type.
NONEMPTY = {"rollout.draft_table": ((8, 2),)}


def _other(value, key=""):
    """A different value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + (1 if isinstance(value, int) else 0.5)
    if isinstance(value, str):
        return value + "x"
    return (*value, *value[:1]) if value else NONEMPTY.get(key, ("sft",))


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_leaf_key_can_be_overridden_on_every_config(path):
    """Config files start from the typed defaults: every leaf of the schema is a key of every
    config file (an override to its own value loads and validates; another value lands in the
    typed config), and an unknown key still fails naming it."""
    cfg, raw = config_lib.load(str(path))
    assert len(LEAVES) > 100
    for key in LEAVES:
        value = _get(cfg, key)
        assert config_lib.load(str(path), [f"{key}={value!r}"])[0] == cfg, key
        cd = copy.deepcopy(raw)
        config_lib.set_by_path(cd, key, _other(value, key))
        assert _get(config_lib.from_dict(config_lib.RunConfig, cd), key) == _other(value, key), key
    for bad in ("mtp.optim.nope", "rl.nope", "nope"):
        with pytest.raises(ConfigError, match=bad.replace(".", r"\.")):
            config_lib.load(str(path), [f"{bad}=1"])


def test_draft_vocab_can_be_set_on_the_demo():
    cfg, _ = config_lib.load(str(REPO / "configs/demo.py"), ["mtp.draft_vocab=16"])
    assert cfg.mtp.draft_vocab == 16


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.num_kv_heads=3", "model.num_kv_heads"),  # 8 heads not divisible by 3
        ("model.dim=-4", "model.dim"),
        ("sft.optim.lr=0", "sft.optim.lr"),
        ("model.not_a_key=1", "model.not_a_key"),
        ("nonsense=1", "nonsense"),
        ("task.digits=9", "task.digits"),
        ("model.dtype=float8", "model.dtype"),
        ("stages=('sft','fly')", "stages"),
        ("mesh.data=0", "mesh.data"),
        # values that used to pass validation and then failed or silently misbehaved
        ("seed=-1", "seed"),  # crashed in the data loader
        ("rollout.temperature=0", "rollout.temperature"),  # RL: every GRPO gradient 0
        ("rollout.max_new_tokens=1000000", "rollout.max_new_tokens"),  # a 332 GB allocation
        ("distributed.num_processes=2", "distributed.coordinator_address"),
        ("max_param_growth=0.5", "max_param_growth"),
        ("profile_steps=-1", "profile_steps"),
        ("policy.num_layers=2", "policy.num_layers"),  # the demo's policy is its own sft stage
        ("policy.num_layers=-1", "policy.num_layers"),
    ],
)
def test_bad_overrides_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_lib.load(str(REPO / "configs/demo.py"), [override])


def test_kv_cache_estimate_bounds_long_rollouts():
    """Within the length bound, but 1024 rows x 32768 tokens of KV cache (~256 GiB)."""
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens.*GiB"):
        config_lib.load(
            str(REPO / "configs/demo.py"), ["rollout.max_new_tokens=32768", "rl.group_size=64"]
        )


def test_temperature_zero_is_fine_without_rl():
    cfg, _ = config_lib.load(
        str(REPO / "configs/demo.py"), ["rollout.temperature=0", "stages=('sft','distill')"]
    )
    assert cfg.rollout.temperature == 0.0


def test_config_arg_booleans_parse_as_booleans():
    demo = str(REPO / "configs/demo.py")
    full = config_lib.load(demo)[0]
    assert config_lib.load(demo + ":runlocal=false")[0] == full  # was the truthy string 'false'
    assert config_lib.load(demo + ":runlocal=False")[0] == full
    assert config_lib.load(demo + ":runlocal=true")[0] == config_lib.load(demo + ":runlocal")[0]
    with pytest.raises(ConfigError, match="'runlocal': expected a bool"):
        config_lib.load(demo + ":runlocal=maybe")
    with pytest.raises(ConfigError, match="'digits': expected a int"):
        config_lib.load(demo + ":digits=2.5")


def test_tokenizer_larger_than_the_model_vocabulary_names_both():
    with pytest.raises(ConfigError, match=r"tok\.json has 151669 tokens.*m/config\.json.*151643"):
        config_lib.check_vocab(151669, 151643, "tok.json", "m/config.json")
    config_lib.check_vocab(151643, 151936, "tok.json", "m/config.json")  # padded rows are fine


def test_bad_config_arg_is_an_error():
    with pytest.raises(ConfigError, match="runloca"):
        config_lib.load(str(REPO / "configs/demo.py:runloca"))


def test_override_types_and_sweeps():
    cfg, _ = config_lib.load(str(REPO / "configs/demo.py:runlocal"), ["sft.optim.lr=1"])
    assert cfg.sft.optim.lr == 1.0 and isinstance(cfg.sft.optim.lr, float)
    swept = [
        config_lib.load(str(REPO / "configs/demo.py"), [], i)[0].sft.optim.lr for i in range(3)
    ]
    assert len(set(swept)) == 3
    with pytest.raises(ConfigError, match="sweep_index"):
        config_lib.load(str(REPO / "configs/demo.py"), [], 99)


def test_launch_rejects_bad_override_before_compute(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--config",
            "configs/demo.py:runlocal",
            "--config.model.num_heads=5",
            "--workdir",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "model.num_kv_heads" in proc.stderr or "model.num_heads" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_resolved_config_is_json(tmp_path):
    cfg, _ = config_lib.load(str(REPO / "configs/demo.py:runlocal"))
    config_lib.dump(cfg, tmp_path / "config.json")
    again = config_lib.from_dict(
        config_lib.RunConfig, json.loads((tmp_path / "config.json").read_text())
    )
    assert again == cfg
