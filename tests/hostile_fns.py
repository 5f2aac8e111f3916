"""Module-level functions for tests/test_hostile.py and tests/test_jsonl_task.py: rewards run in
worker processes, which import them by name."""

import sys


def nan_reward(text, problem):
    return float("nan")


def inf_reward(text, problem):
    return float("inf")


def string_reward(text, problem):
    return "1.0"


def none_reward(text, problem):
    return None


def chatty_reward(text, problem):
    """Prints a megabyte per call (to stdout and stderr), then scores 1."""
    print("x" * 500_000)
    print("y" * 500_000, file=sys.stderr)
    return 1.0


def record_reward(completion, record):
    """A `task.reward` function: 1 if the completion contains the record's `keyword`."""
    return 1.0 if record["keyword"] in completion else 0.0
