"""Rewards: exact uses the task's rule; math extracts the final answer and accepts what math-verify finds
equivalent; a user's Python function that raises, hangs, kills its process or returns a non-number scores 0,
is counted and logged, and never hangs or kills the scoring (the pool recovers for the next batch)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from nereus_jax.rl.rewards import (
    ExactRewarder,
    RewardBatch,
    RewardFunctionError,
    _plain_verdict,
    extract_answer,
    make_rewarder,
    reference_answer,
)
from nereus_jax.rl.tasks import CountdownTask, Problem

TIMEOUT = 1.0


def _cfg(reward: str, reward_fn: str | None = None, timeout: float = TIMEOUT):
    return SimpleNamespace(reward=reward, reward_fn=reward_fn, reward_timeout=timeout)


def _problems(answers, prompt="q"):
    return [Problem(prompt, a, f"data.jsonl:{i + 1}") for i, a in enumerate(answers)]


class Log(list):
    def __call__(self, line: str) -> None:
        self.append(line)


# ------------------------------------------------------------------------------------------------ exact
def test_exact_reward_uses_the_tasks_own_rule_inline():
    task = CountdownTask(seed=0)
    rewarder = make_rewarder(_cfg("exact"), task)
    assert isinstance(rewarder, ExactRewarder)
    p = Problem("3,5>8=", "3+5")
    out = rewarder.score([p, p, p], ["5+3", " 3+5\n", "4+4"])
    np.testing.assert_array_equal(out.rewards, np.array([1, 1, 0], np.float32))
    assert out.rewards.dtype == np.float32 and out.format_ok.all() and out.correct.tolist() == [True, True, False]


def test_metrics_are_fractions_and_counts():
    batch = RewardBatch(np.array([1.0, 0.0, 0.5, 0.5], np.float32), np.array([True, True, False, True]),
                        np.array([True, False, False, False]), errors=2, timeouts=1)
    assert batch.metrics() == {"reward_mean": 0.5, "format_ok_fraction": 0.75, "answer_correct_fraction": 0.25,
                               "reward_errors": 2.0, "reward_timeouts": 1.0}


# ------------------------------------------------------------------------------------------------ math extraction
@pytest.mark.parametrize(("text", "answer"), [
    ("so x = 1/2, i.e. \\boxed{\\frac{1}{2}}. Done: 7 steps", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),       # nested braces
    ("first \\boxed{1}, then \\boxed{ 2 }", "2"),                      # the last box, stripped
    ("\\boxed{1} and a cut-off \\boxed{\\frac{2}{", "1"),             # the last *closed* box
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),                               # escaped braces balance too
    ("\\boxed{} so 5", "5"),                                           # an empty box is no answer
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "7"),
    ("#### 1,234 (checked in 2 ways)", "1,234"),                      # #### before the last number
    ("3 apples, then 17.", "17"),
    ("x = -5", "-5"),
    ("5-3", "3"),                                                      # a minus between numbers is not a sign
    ("pi is about 3.14", "3.14"),
    ("1,000,000 grains", "1,000,000"),
])
def test_the_final_answer_is_the_last_box_else_gsm8k_marker_else_last_number(text, answer):
    assert extract_answer(text) == answer


def test_a_response_without_an_answer_extracts_nothing():
    assert extract_answer("I am not sure, it depends.") is None


def test_a_worked_reference_solution_reduces_to_its_final_answer():
    assert reference_answer("48/2 = 24 clips in May.\n#### 72") == "72"
    assert reference_answer("So the sum is $\\boxed{\\frac{5}{6}}$.") == "\\frac{5}{6}"
    assert reference_answer(" x^2+1 ") == "x^2+1"


# ------------------------------------------------------------------------------------------------ math rewards
@pytest.fixture(scope="module")
def math_rewarder():
    with make_rewarder(_cfg("math", timeout=10.0), None, workers=1) as rewarder:
        yield rewarder


def test_math_reward_accepts_equivalent_forms(math_rewarder):
    cases = [  # (reference, response): all correct
        ("0.5", "Thus \\boxed{\\frac{1}{2}}."),
        ("\\frac{1}{2}", "The answer is 0.5"),
        ("42", "#### 42"),
        ("1234", "#### 1,234"),
        ("\\frac{1}{2}", "\\boxed{\\dfrac{2}{4}}"),
        ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}"),
        ("x^2+2x+1", "\\boxed{(x+1)^2}"),
        ("\\frac{\\pi}{2}", "\\boxed{\\pi/2}"),
        ("\\{1,2\\}", "\\boxed{\\{2,1\\}}"),
        ("3", "so it is 3.0"),
        ("48/2 = 24.\n#### 72", "It is \\boxed{72}"),
    ]
    out = math_rewarder.score(_problems([r for r, _ in cases]), [t for _, t in cases])
    assert out.correct.tolist() == [True] * len(cases)
    assert out.rewards.tolist() == [1.0] * len(cases) and out.format_ok.all() and out.errors == out.timeouts == 0


def test_math_reward_rejects_a_wrong_answer_and_flags_a_missing_one(math_rewarder):
    out = math_rewarder.score(_problems(["\\frac{1}{2}", "42", "x+1", "7"]),
                              ["\\boxed{\\frac{1}{3}}", "#### 41", "\\boxed{x-1}", "no idea"])
    assert out.rewards.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out.format_ok.tolist() == [True, True, True, False] and not out.correct.any()
    assert out.metrics()["format_ok_fraction"] == 0.75


def test_math_reward_of_a_grpo_sized_batch_takes_well_under_a_second(math_rewarder):
    # 64 prompts x 4 samples: integer answers (boxed or '#### N', right or off by one) and, for every fourth
    # prompt, a thirds fraction answered as a rounded decimal (one math-verify call per prompt).
    refs = [f"\\frac{{{i + 1}}}{{3}}" if i % 4 == 0 else str(i) for i in range(64)]
    problems = [p for p in _problems(refs) for _ in range(4)]
    responses = [f"... \\boxed{{{(k // 4 + 1) / 3:.6f}}}" if (k // 4) % 4 == 0
                 else f"... so \\boxed{{{int(p.answer) + k % 2}}}" if k % 3 else f"#### {p.answer}"
                 for k, p in enumerate(problems)]
    math_rewarder.score(problems[:8], responses[:8])
    start = time.perf_counter()
    out = math_rewarder.score(problems, responses)
    assert time.perf_counter() - start < 1.0
    assert out.correct.tolist() == [(k // 4) % 4 == 0 or k % 3 == 0 or k % 2 == 0 for k in range(256)]


@pytest.mark.parametrize(("reference", "answer", "verdict"), [
    ("0.5", "\\frac{1}{2}", 1.0), ("-\\dfrac12", "-0.5", 1.0), ("3/4", "\\tfrac{6}{8}", 1.0),
    ("1234", "1,234", 1.0), ("42", "41", 0.0), ("x+1", "x+1", 1.0),
    ("0.5", "0.6", None), ("\\frac{1}{3}", "0.333333", None), ("x+1", "1+x", None), ("1", "\\frac{1}{0}", None),
])
def test_plain_numbers_and_fractions_are_judged_without_a_math_verify_call(reference, answer, verdict):
    outcome = _plain_verdict(reference, answer)
    assert (outcome.value if outcome is not None else None) == verdict


def test_an_answer_that_hangs_math_verify_times_out_and_the_batch_goes_on():
    log = Log()
    with make_rewarder(_cfg("math"), None, log=log, workers=1) as rewarder:
        rewarder.score(_problems(["1"]), ["\\boxed{\\frac{2}{2}}"])  # started
        start = time.perf_counter()
        out = rewarder.score(_problems(["1", "\\frac{1}{2}"]), ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{0.5}"])
        assert time.perf_counter() - start < TIMEOUT + 2.0
        assert out.rewards.tolist() == [0.0, 1.0] and out.timeouts == 1 and out.format_ok.all()
        assert "reward math-verify timed out after task.reward_timeout=1 s on data.jsonl:1" in log[0]


# ------------------------------------------------------------------------------------------------ python rewards
def _python(name: str, log=None, timeout: float = TIMEOUT):
    return make_rewarder(_cfg("python", f"reward_fns:{name}", timeout), None, log=log, workers=1)


def test_a_user_function_scores_each_row():
    with _python("exact") as rewarder:
        out = rewarder.score(_problems(["4", "5"]), ["4 ", "6"])
    assert out.rewards.tolist() == [1.0, 0.0] and out.format_ok.all() and out.correct.tolist() == [True, False]


def test_a_user_function_gets_chat_prompts_as_a_list_of_messages():
    messages = ({"role": "user", "content": "2+2?"},)
    with _python("prompt_is_messages") as rewarder:
        out = rewarder.score([Problem(messages, "4"), Problem("2+2?", "4")], ["4", "4"])
    assert out.rewards.tolist() == [1.0, 0.5]


def test_workers_do_not_import_jax():
    with _python("jax_imported") as rewarder:
        assert rewarder.score(_problems(["1"]), ["1"]).rewards.tolist() == [0.0]


def test_a_raising_function_scores_zero_and_is_counted_and_logged_with_name_and_row():
    log = Log()
    with _python("raises_on_boom", log) as rewarder:
        out = rewarder.score(_problems(["1", "1", "1"]), ["ok", "boom", "ok"])
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.errors == 1 and out.timeouts == 0
    assert out.format_ok.tolist() == [True, False, True]
    assert len(log) == 1 and "reward_fns:raises_on_boom" in log[0] and "data.jsonl:2" in log[0]
    assert "ValueError: bad row" in log[0]


def test_a_function_past_the_timeout_scores_zero_and_the_next_batch_still_works():
    log = Log()
    with _python("sleeps_on_sleep", log) as rewarder:
        rewarder.score(_problems(["1"]), ["ok"])  # started
        start = time.perf_counter()
        out = rewarder.score(_problems(["1", "1", "1"]), ["ok", "sleep", "ok"])
        assert time.perf_counter() - start < TIMEOUT + 1.0
        assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.timeouts == 1 and out.errors == 0
        assert "timed out after task.reward_timeout=1 s on data.jsonl:2" in log[0]
        assert rewarder.score(_problems(["1", "1"]), ["ok", "ok"]).rewards.tolist() == [1.0, 1.0]


def test_a_function_that_swallows_the_timeout_has_its_worker_stopped_and_replaced():
    with _python("ignores_the_timeout_on_sleep") as rewarder:
        rewarder.score(_problems(["1"]), ["ok"])
        start = time.perf_counter()
        out = rewarder.score(_problems(["1", "1"]), ["sleep", "ok"])
        assert time.perf_counter() - start < TIMEOUT + 3.0  # the grace second, then a fresh worker starts
        assert out.rewards.tolist() == [0.0, 1.0] and out.timeouts == 1
        assert rewarder.score(_problems(["1"]), ["ok"]).rewards.tolist() == [1.0]


def test_a_function_that_kills_its_process_is_counted_and_the_pool_recovers():
    log = Log()
    with _python("exits_on_exit", log) as rewarder:
        out = rewarder.score(_problems(["1", "1", "1"]), ["ok", "exit", "ok"])
        assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.errors == 1
        assert "killed its worker process (exit code 3)" in log[0] and "data.jsonl:2" in log[0]
        assert rewarder.score(_problems(["1", "1"]), ["exit", "ok"]).rewards.tolist() == [0.0, 1.0]


def test_a_result_that_is_not_a_finite_number_is_an_error():
    log = Log()
    with _python("returns_response", log) as rewarder:
        out = rewarder.score(_problems(["1"] * 5), ["nan", "inf", "0.5", "none", "true"])
    assert out.rewards.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0] and out.errors == 4
    assert "returned nan (float), not a finite number" in log[0] and "returned '0.5' (str)" in log[2]


def test_only_the_first_few_failures_are_logged():
    log = Log()
    with _python("raises_on_boom", log) as rewarder:
        out = rewarder.score(_problems(["1"] * 8), ["boom"] * 8)
    assert out.errors == 8 and len(log) == 5 and "not logged" in log[-1]


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module_xyz:fn", r"task.reward_fn='no_such_module_xyz:fn': module 'no_such_module_xyz' does not "
                              r"import \(ModuleNotFoundError.*\): install it or put its folder on PYTHONPATH"),
    ("reward_fns:missing", r"'reward_fns' has no attribute 'missing'"),
    ("reward_fns:NOT_CALLABLE", r"task.reward_fn='reward_fns:NOT_CALLABLE' is int, not callable"),
    ("reward_fns:two_args", r"takes \(prompt, response\), not \(prompt, response, answer\)"),
    ("reward_fns", r"expected 'package.module:function'"),
])
def test_a_reward_function_that_cannot_be_used_is_an_error_when_the_rewarder_is_built(spec, message):
    with pytest.raises(RewardFunctionError, match=message):
        make_rewarder(_cfg("python", spec), None)


def test_closing_the_rewarder_stops_its_workers():
    rewarder = _python("exact")
    procs = [w.proc for w in rewarder._pool._workers]
    rewarder.close()
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        rewarder.score(_problems(["1"]), ["1"])


def test_math_reward_without_math_verify_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(RewardFunctionError, match=r'pip install "math-verify>=0.8"'):
        make_rewarder(_cfg("math"), None)
