"""Careless or hostile input: each case ends in a defined outcome or one clear error that names
the config key, file, record or tensor (never a silently wrong run, a crash dump or a hang)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bebop import config as config_lib
from bebop import model, policies, sharding, tasks
from bebop import mtp as mtp_lib
from bebop.checkpoints.tokenizer_files import write_tokenizer
from bebop.ckpt import Checkpointer
from bebop.config import ConfigError, MeshConfig, RunConfig, TaskConfig
from bebop.finite import NonFiniteWeightsError
from bebop.io import DamagedFileError
from bebop.rl import rewards
from bebop.tokenizer import CharTokenizer

from . import hostile_fns
from .conftest import REPO

DEMO = str(REPO / "configs/demo.py")


def _mesh():
    return sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1])


def _save_params(ckpt_dir, params):
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    ckpt.save(1, {"params": params, "step": 1}, {})
    ckpt.close()


# ---------------------------------------------------------------------- 1: exported demo policy


def test_an_exported_demo_tokenizer_reads_back_as_the_character_tokenizer(tmp_path):
    """The demo's tokenizer as `bebop.export` writes it, loaded as `policy.source=hf`: task
    prompts are the raw characters the demo policy was trained on, not a chat template."""
    tok = CharTokenizer()
    write_tokenizer(tmp_path, RunConfig(), tok)
    back = policies.hf_tokenizer(tmp_path)
    assert not back.is_chat
    for i in range(5):
        prob = tasks.problem_at(TaskConfig(), 0, i)
        want = tok.encode(prob.prompt, bos=True)
        assert tasks.arithmetic_prompt_ids(back, prob) == want
        assert back.decode(want) == prob.prompt
    assert back.eos_ids == tok.eos_ids and back.vocab_size == tok.vocab_size


# ---------------------------------------------------------------------- 2: NaN / inf weights


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_policy_with_non_finite_weights_is_refused_naming_the_tensor(tmp_path, tiny_cfg, bad):
    graphdef, params = model.init(tiny_cfg, 0)
    w_up = params["layers"]["mlp"]["w_up"]
    w_up[...] = w_up[...].at[0, 1, 2].set(bad)
    _save_params(tmp_path / "sft" / "ckpt", params)
    cfg = RunConfig(model=tiny_cfg)
    with pytest.raises(NonFiniteWeightsError, match=r"layers\.mlp\.w_up.*(NaN|inf)"):
        policies.load(cfg, tmp_path, _mesh())


def test_an_mtp_with_non_finite_weights_is_refused_naming_the_tensor(tmp_path, tiny_cfg):
    _, params = mtp_lib.init(tiny_cfg, 1, 3)
    leaf = params["layers"]["w_fc"]
    leaf[...] = leaf[...].at[0, 0, 0].set(jnp.nan)
    _save_params(tmp_path / "mtp" / "ckpt", params)
    cfg = RunConfig(model=tiny_cfg)
    with pytest.raises(NonFiniteWeightsError, match=r"w_fc.*1 NaN"):
        policies.load_mtp(cfg, tmp_path / "mtp" / "ckpt", tiny_cfg, _mesh())


# ---------------------------------------------------------------------- 3: reward values, records


@pytest.mark.parametrize(
    "fn, shown",
    [
        (hostile_fns.nan_reward, "nan"),
        (hostile_fns.inf_reward, "inf"),
        (hostile_fns.string_reward, "'1.0'"),
        (hostile_fns.none_reward, "None"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_fails_naming_the_function(fn, shown):
    with pytest.raises(rewards.RewardError, match=rf"{fn.__name__} returned {shown}.*finite"):
        rewards.score(fn, ["a", "b"], [None, None], timeout_s=60, retries=0)


@pytest.mark.parametrize(
    "record, complaint",
    [
        ({"question": None, "answer": "#### 4"}, "'question' must be a non-empty string"),
        ({"answer": "#### 4"}, "'question' must be a non-empty string, got missing"),
        ({"question": "2+2?", "answer": [1, 2]}, "'answer' must be a string or a number"),
        ({"question": "2+2?", "answer": None}, "'answer' must be a string or a number"),
        ({"question": "2+2?", "answer": True}, "'answer' must be a string or a number"),
    ],
)
def test_a_gsm8k_record_with_a_wrong_field_type_is_named(tmp_path, record, complaint):
    f = tmp_path / "g.jsonl"
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    f.write_text(good + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DamagedFileError, match=rf"g\.jsonl:2: {complaint}"):
        tasks.load_gsm8k_jsonl(f)


# ---------------------------------------------------------------------- 4: config values


@pytest.mark.parametrize(
    "override, key",
    [
        ("rl.clip_high=1e309", "rl.clip_high"),
        ("rollout.temperature=-1e309", "rollout.temperature"),
        ("rl.optim.b1=2.0", "rl.optim.b1"),
        ("sft.optim.b2=-1.0", "sft.optim.b2"),
        ("mtp.optim.b2=1.0", "mtp.optim.b2"),
        ("rl.clip_low=5.0", "rl.clip_low"),
        ("rollout.num_draft=100000", "rollout.num_draft"),
        ("rollout.draft_table=((8, 100000),)", "rollout.draft_table"),
        ("stages=('rl','sft')", "stages"),
        ("stages=('sft','sft')", "stages"),
    ],
)
def test_out_of_range_config_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        config_lib.load(DEMO, [override])
