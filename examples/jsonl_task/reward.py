"""An example `task.reward` for `task.name=jsonl`: `score(completion, record)`.

`record` is the problem's line of `problems.jsonl` as a dict (a fresh copy per call), so a reward
may read any field the file carries -- here the optional `unit`. Rewards run in worker processes
under `rl.reward_timeout_s`; they must return a finite number (a NaN, an inf or a string is an
error naming this function), and what they print is captured (a bounded excerpt reaches the log).
"""

from bebop.tasks import extract_number


def score(completion: str, record: dict) -> float:
    """1.0 for the right number after the last '####' (or the last number in the text), plus 0.0
    / -0.1 when the record names a unit that the answer line mentions / omits."""
    got = extract_number(completion)
    if got is None or abs(got - float(record["answer"])) > 1e-6:
        return 0.0
    unit = record.get("unit") or ""
    last_line = completion.strip().splitlines()[-1] if completion.strip() else ""
    return 1.0 if not unit or unit in last_line else 0.9
