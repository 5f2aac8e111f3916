"""`task.name=jsonl`: problems from a JSONL file, scored by a user's `task.reward` function that
runs in the reward worker processes with the built-ins' value check (examples/jsonl_task)."""

import json

import numpy as np
import pytest

from bebop import config as config_lib
from bebop import rewards, tasks
from bebop.config import ConfigError, TaskConfig
from bebop.io import DamagedFileError
from bebop.tokenizer import CharTokenizer

from .conftest import REPO

EXAMPLE = REPO / "examples" / "jsonl_task"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_example_task_loads_holds_out_and_scores_with_its_reward_in_workers():
    cfg = TaskConfig(
        name="jsonl",
        path=str(EXAMPLE / "problems.jsonl"),
        eval_size=10,
        reward="examples.jsonl_task.reward:score",
    )
    task = tasks.make_task(cfg)
    held = {task.eval_problem(0, i).record for i in range(10)}
    train = {task.problem(0, i).record for i in range(50)}  # one epoch of the other 50
    assert len(held) == 10 and len(train) == 50 and not held & train
    probs = [task.problem(0, i) for i in range(6)]
    recs = [json.loads(p.record) for p in probs]
    right = [f"so\n#### {r['answer']} {r.get('unit', '')}" for r in recs]
    wrong = [f"#### {float(r['answer']) + 1}" for r in recs]
    got = rewards.score(task.reward, right + wrong, probs + probs, timeout_s=60, retries=0)
    assert got[:6].tolist() == [1.0] * 6 and got[6:].tolist() == [0.0] * 6


def test_a_user_reward_gets_the_record_and_its_value_is_checked(tmp_path):
    rows = [{"prompt": f"say {w}", "answer": w, "keyword": w.upper()} for w in ["ab", "cd"]]
    path = _write(tmp_path / "t.jsonl", rows * 3)
    task = tasks.make_task(
        TaskConfig(name="jsonl", path=path, eval_size=1, reward="tests.hostile_fns:record_reward")
    )
    probs = [task.problem(0, i) for i in range(2)]
    texts = [json.loads(p.record)["keyword"] + "!" for p in probs]
    assert rewards.score(task.reward, texts, probs, timeout_s=60, retries=0).tolist() == [1, 1]
    assert rewards.score(task.reward, ["ab", "cd"], probs, timeout_s=60, retries=0).sum() == 0
    bad = tasks.UserReward("tests.hostile_fns:string_reward")
    with pytest.raises(rewards.RewardError, match=r"hostile_fns:string_reward returned '1.0'"):
        rewards.score(bad, ["x"], probs[:1], timeout_s=60, retries=0)


def test_the_default_reward_matches_the_final_answer():
    p = tasks.JsonlProblem("q", "1,234", None, "{}")
    assert tasks.jsonl_exact_match("work...\n#### 1234", p) == 1.0
    assert tasks.jsonl_exact_match("work...\n1234.0", p) == 1.0
    assert tasks.jsonl_exact_match("1234\nno, 1235", p) == 0.0
    word = tasks.JsonlProblem("q", "Paris", None, "{}")
    assert tasks.jsonl_exact_match("The answer:\n#### Paris", word) == 1.0
    assert tasks.jsonl_exact_match("#### paris, France", word) == 0.0


def test_prompts_use_the_system_message_for_chat_models_and_raw_text_for_the_demo(tmp_path):
    class Chat:
        is_chat = True

        def chat(self, messages):
            return messages

    with_system = tasks.JsonlProblem("1+2=", "3", "be brief", "{}", "f:1")
    assert tasks.jsonl_prompt_ids(Chat(), with_system) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "1+2="},
    ]
    tok = CharTokenizer()
    assert tasks.jsonl_prompt_ids(tok, with_system) == tok.encode("1+2=", bos=True)
    with pytest.raises(DamagedFileError, match=r"f:1: .*'Q'.*character-level"):
        tasks.jsonl_prompt_ids(tok, tasks.JsonlProblem("Q?", "3", None, "{}", "f:1"))


@pytest.mark.parametrize(
    "row, complaint",
    [
        ({"answer": 1}, "'prompt' must be a non-empty string, got missing"),
        ({"prompt": "", "answer": 1}, "'prompt' must be a non-empty string"),
        ({"prompt": "q"}, "'answer' must be a string or a number, got missing"),
        ({"prompt": "q", "answer": {"a": 1}}, "'answer' must be a string or a number"),
        ({"prompt": "q", "answer": 1, "system": 5}, "'system' must be a non-empty string"),
    ],
)
def test_a_bad_record_is_named_by_file_and_line(tmp_path, row, complaint):
    path = _write(tmp_path / "t.jsonl", [{"prompt": "q", "answer": 1}, row])
    with pytest.raises(DamagedFileError, match=rf"t\.jsonl:2: {complaint}"):
        tasks.load_jsonl_task(path)


def test_config_names_a_missing_file_or_an_unusable_reward(tmp_path):
    demo = str(REPO / "configs" / "demo.py")
    with pytest.raises(ConfigError, match=r"'task\.path': no such file"):
        config_lib.load(demo, ["task.name='jsonl'", f"task.path='{tmp_path / 'none.jsonl'}'"])
    with pytest.raises(ConfigError, match=r"'task\.reward'"):
        config_lib.load(demo, ["task.reward='no_colon'"])
    path = _write(tmp_path / "t.jsonl", [{"prompt": "q", "answer": 1}] * 3)
    for spec, msg in [
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("tests.hostile_fns:nope", "has no function 'nope'"),
    ]:
        with pytest.raises(ConfigError, match=rf"'task\.reward': .*{msg}"):
            tasks.make_task(TaskConfig(name="jsonl", path=path, eval_size=1, reward=spec))


def test_the_example_file_is_a_valid_task_file():
    probs = tasks.load_jsonl_task(EXAMPLE / "problems.jsonl")
    assert len(probs) == 60 and any(p.system for p in probs)
    assert np.isfinite([float(json.loads(p.record)["answer"]) for p in probs]).all()
