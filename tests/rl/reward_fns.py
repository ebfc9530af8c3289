"""User reward functions for tests/rl/test_rewards.py (task.reward_fn="reward_fns:NAME"); the worker processes
import this module by name through the test process's sys.path, which has this folder on it."""

import contextlib
import os
import sys
import time

NOT_CALLABLE = 42


def exact(prompt, response, answer):
    return float(response.strip() == answer)


def prompt_is_messages(prompt, response, answer):
    """1.0 for chat messages (a list of dicts), 0.5 for a string prompt."""
    return 1.0 if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) else 0.5


def raises_on_boom(prompt, response, answer):
    if response == "boom":
        raise ValueError("bad row")
    return 1.0


def sleeps_on_sleep(prompt, response, answer):
    if response == "sleep":
        time.sleep(60)
    return 1.0


def ignores_the_timeout_on_sleep(prompt, response, answer):
    """Swallows every exception while it waits, so only stopping its process ends it."""
    end = time.monotonic() + 60
    while response == "sleep" and time.monotonic() < end:
        with contextlib.suppress(BaseException):
            time.sleep(0.02)
    return 1.0


def exits_on_exit(prompt, response, answer):
    if response == "exit":
        os._exit(3)
    return 1.0


def returns_response(prompt, response, answer):
    """NaN, a string, None or a bool as the user function's result."""
    return {"nan": float("nan"), "inf": float("inf"), "none": None, "true": True}.get(response, response)


def jax_imported(prompt, response, answer):
    return float("jax" in sys.modules)


def two_args(prompt, response):
    return 1.0
