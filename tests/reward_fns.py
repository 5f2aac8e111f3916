"""Reward functions for the tests, at module level: rewards run in worker processes, which
import them by name."""

import time


def broken(text, problem):
    raise KeyError("boom")


def backend_down(text, problem):
    raise ValueError("reward backend down")


def slow(text, problem):
    time.sleep(2)
    return 1.0


def hangs_on_b(text, problem):
    """1.0, except that the completion "b" never returns."""
    while text == "b":
        time.sleep(3600)
    return 1.0
