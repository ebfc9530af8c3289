"""Tasks give deterministic, verifiable problems; held-out problems never appear in training;
prompt files fail with clear errors; the character tokenizer round-trips."""

import json

import numpy as np
import pytest

from nereus_jax.rl.tasks import (
    AdditionTask,
    CountdownTask,
    Problem,
    PromptDataError,
    PromptFileTask,
    SortingTask,
    load_prompt_file,
)
from nereus_jax.rl.tokenizer import CharTokenizer


def test_addition_problems_are_deterministic_by_index_and_rewarded_exactly():
    a, b = AdditionTask(seed=3), AdditionTask(seed=3)
    assert [a.problem(i) for i in range(20)] == [b.problem(i) for i in range(20)]
    p = a.problem(5)
    x, y = p.prompt.rstrip("=").split("+")
    assert p.answer == str(int(x) + int(y))
    assert a.reward(p, p.answer) == 1.0 and a.reward(p, p.answer + "1") == 0.0


def test_held_out_problems_never_appear_in_the_training_stream():
    task = AdditionTask(seed=0, eval_size=256, num_digits=1)  # 100 distinct problems: collisions certain
    held = {p.prompt for p in task.eval_problems()}
    assert all(task.problem(i).prompt not in held for i in range(500))


def test_sorting_answer_is_sorted_digits():
    p = SortingTask(seed=1).problem(0)
    assert p.answer == "".join(sorted(p.prompt[len("sort:"):-1]))


def test_countdown_reference_answer_scores_and_cheating_does_not():
    task = CountdownTask(seed=0, num_digits=3)
    for i in range(20):
        p = task.problem(i)
        assert task.reward(p, p.answer) == 1.0
    p = Problem("3,5>8=", "3+5")
    assert task.reward(p, "5+3") == 1.0
    assert task.reward(p, "4+4") == 0.0            # numbers not given
    assert task.reward(p, "3+5+0") == 0.0          # 0 not given
    assert task.reward(p, "__import__('os')") == 0.0


def test_char_tokenizer_round_trips_and_stops_at_eos():
    tok = CharTokenizer()
    ids = tok.encode("12+34=46")
    assert tok.decode(ids + [tok.eos_id] + tok.encode("99")) == "12+34=46"
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("é")


def _write(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_prompt_file_splits_train_and_held_out(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(10)]
    task = PromptFileTask(_write(tmp_path, rows), eval_size=3)
    assert len(task.eval_problems()) == 3
    assert task.problem(0) == Problem("0+1=", "1") and task.problem(7) == Problem("0+1=", "1")


def test_empty_prompt_file_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(PromptDataError, match="empty"):
        load_prompt_file(_write(tmp_path, [""]))


def test_malformed_prompt_line_is_an_error_naming_the_line(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "b"}), "{not json"])
    with pytest.raises(PromptDataError, match=r"prompts.jsonl:2: not valid JSON"):
        load_prompt_file(path)


def test_prompt_line_without_answer_is_an_error(tmp_path):
    with pytest.raises(PromptDataError, match=r':1: needs string fields "prompt" and "answer"'):
        load_prompt_file(_write(tmp_path, [json.dumps({"prompt": "a"})]))


def test_missing_prompt_file_says_how_to_fix(tmp_path):
    with pytest.raises(PromptDataError, match="task.prompt_file"):
        load_prompt_file(str(tmp_path / "nope.jsonl"))


def test_a_held_out_set_covering_the_problem_space_is_an_error_not_a_hang():
    task = AdditionTask(seed=0, eval_size=3000, num_digits=1)  # only 100 distinct problems exist
    with pytest.raises(ValueError, match="task.eval_size"):
        task.problem(0)


def test_copy_task_lengths_have_a_long_tail_and_the_reward_checks_the_copy():
    from nereus_jax.rl.tasks import CopyTask

    task = CopyTask(eval_size=16, num_digits=24)
    lengths = np.array([len(task.problem(i).answer) for i in range(2000)])
    assert np.median(lengths) <= 4 and (lengths == 24).mean() > 0.05  # mostly short, a heavy tail at the cap
    p = task.problem(5)
    assert p.prompt == f"copy:{p.answer}=" and task.reward(p, p.answer) == 1.0 and task.reward(p, p.answer + "1") == 0
