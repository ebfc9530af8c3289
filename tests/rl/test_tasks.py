"""Tasks give deterministic, verifiable problems; held-out problems never appear in training; prompt files
(JSONL or Parquet, verl-style nested fields, chat messages) load the same problems and fail with one-line
errors naming the file, the row and the field; the character tokenizer round-trips."""

import json
import sys

import numpy as np
import pytest

from nereus_jax.config import TaskConfig
from nereus_jax.rl.tasks import (
    AdditionTask,
    CountdownTask,
    Problem,
    PromptDataError,
    PromptFileTask,
    SortingTask,
    load_prompt_file,
    make_task,
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
    assert task.problem(0).prompt == "0+1=" and task.problem(0).answer == "1"
    assert task.problem(7) == task.problem(0) and task.problem(0).source.endswith("prompts.jsonl:1")
    assert [p.prompt for p in task.eval_problems()] == ["7+1=", "8+1=", "9+1="]  # the tail


def test_empty_prompt_file_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(PromptDataError, match="empty"):
        load_prompt_file(_write(tmp_path, [""]))


def test_malformed_prompt_line_is_an_error_naming_the_line(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "b"}), "{not json"])
    with pytest.raises(PromptDataError, match=r"prompts.jsonl:2: not valid JSON"):
        load_prompt_file(path)


def test_prompt_line_without_answer_is_an_error_naming_the_field(tmp_path):
    with pytest.raises(PromptDataError, match=r"prompts.jsonl:1: no field 'answer'"):
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


VERL_ROWS = [
    {"prompt": [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "6*7?"}],
     "reward_model": {"ground_truth": 42, "style": "rule"}, "data_source": "toy"},
    {"prompt": [{"role": "user", "content": "1/2 + 1/2?"}], "reward_model": {"ground_truth": 1, "style": "rule"},
     "data_source": "toy"},
    {"prompt": [{"role": "user", "content": "2^10?"}], "reward_model": {"ground_truth": 1024, "style": "rule"},
     "data_source": "toy"},
]


def _write_parquet(tmp_path, rows, name="prompts.parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_verl_rows_load_with_dotted_keys_as_chat_messages_and_string_answers(tmp_path):
    path = _write(tmp_path, [json.dumps(r) for r in VERL_ROWS])
    problems = load_prompt_file(path, "prompt", "reward_model.ground_truth")
    assert [p.answer for p in problems] == ["42", "1", "1024"]
    assert problems[0].prompt == ({"role": "system", "content": "Think step by step."},
                                  {"role": "user", "content": "6*7?"})
    assert problems[2].source == f"{path}:3"


def test_jsonl_and_parquet_files_give_the_same_problems(tmp_path):
    keys = ("prompt", "reward_model.ground_truth")
    jsonl = load_prompt_file(_write(tmp_path, [json.dumps(r) for r in VERL_ROWS]), *keys)
    parquet = load_prompt_file(_write_parquet(tmp_path, VERL_ROWS), *keys)
    assert [(p.prompt, p.answer) for p in parquet] == [(p.prompt, p.answer) for p in jsonl]
    assert parquet[1].source.endswith("prompts.parquet:row 1")


def test_a_field_literally_named_with_a_dot_is_found_before_the_dotted_path(tmp_path):
    path = _write(tmp_path, [json.dumps({"q.text": "2+2=", "answer": "4"})])
    assert load_prompt_file(path, "q.text")[0].prompt == "2+2="


def test_number_answers_become_strings(tmp_path):
    rows = [json.dumps({"prompt": f"q{i}", "answer": a}) for i, a in enumerate([42, 0.5, 3.0, -7])]
    assert [p.answer for p in load_prompt_file(_write(tmp_path, rows))] == ["42", "0.5", "3", "-7"]


def test_held_out_problems_come_from_eval_file_when_given(tmp_path):
    train = _write(tmp_path, [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(4)])
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "9+9=", "answer": "18"}) + "\n")
    task = PromptFileTask(train, eval_size=256, eval_file=str(held))
    assert [p.prompt for p in task.eval_problems()] == ["9+9="]
    assert [task.problem(i).prompt for i in range(5)] == ["0+1=", "1+1=", "2+1=", "3+1=", "0+1="]  # all 4 train


def test_make_task_reads_a_verl_parquet_file_from_the_config(tmp_path):
    cfg = TaskConfig(name="file", prompt_file=_write_parquet(tmp_path, VERL_ROWS * 2),
                     answer_key="reward_model.ground_truth", eval_size=2)
    task = make_task(cfg)
    assert [p.answer for p in task.eval_problems()] == ["1", "1024"]
    assert task.problem(0).answer == "42" and task.reward(task.problem(0), " 42\n") == 1.0


def test_dropping_prompts_keeps_indexing_deterministic_over_the_kept_rows(tmp_path):
    rows = [json.dumps({"prompt": "x" * n, "answer": str(n)}) for n in (1, 9, 2, 8, 3, 7, 1, 9)]
    task = PromptFileTask(_write(tmp_path, rows), eval_size=2)  # held out: the last two (n=1, n=9)
    dropped = task.drop_prompts(lambda p: len(p.prompt) < 5)
    assert [p.answer for p in dropped] == ["9", "8", "7", "9"]  # training ones first, then held-out
    assert [task.problem(i).answer for i in range(7)] == ["1", "2", "3", "1", "2", "3", "1"]
    assert [p.answer for p in task.eval_problems()] == ["1"] and task.num_train == 3


def test_dropping_every_training_prompt_is_an_error_saying_what_to_raise(tmp_path):
    task = PromptFileTask(_write(tmp_path, [json.dumps({"prompt": "long", "answer": "1"})] * 4), eval_size=1)
    with pytest.raises(PromptDataError, match=r"prompts.jsonl: all 3 training prompts were dropped.*"
                                              r"rollout.max_prompt_length"):
        task.drop_prompts(lambda p: False)


@pytest.mark.parametrize(("row", "keys", "message"), [
    ({"question": "a", "answer": "b"}, {}, r"prompts.jsonl:1: no field 'prompt' \(the row has fields "
                                           r"\['answer', 'question'\]\): set task.prompt_key"),
    ({"prompt": "a", "reward_model": {"style": "rule"}}, {"answer_key": "reward_model.ground_truth"},
     r"prompts.jsonl:1: no field 'reward_model.ground_truth' \(reward_model has fields \['style'\]\)"),
    ({"prompt": "a", "reward_model": "42"}, {"answer_key": "reward_model.ground_truth"},
     r"prompts.jsonl:1: no field 'reward_model.ground_truth' \(reward_model is a string\)"),
    ({"prompt": 5, "answer": "b"}, {}, r"prompts.jsonl:1: field 'prompt' is a number, expected a string or a list "
                                       r"of chat messages"),
    ({"prompt": [{"content": "hi"}], "answer": "b"}, {},
     r"prompts.jsonl:1: field 'prompt' message 0 is \{\"content\": \"hi\"\}; each message needs string \"role\""),
    ({"prompt": ["hi"], "answer": "b"}, {}, r"prompts.jsonl:1: field 'prompt' message 0 is \"hi\""),
    ({"prompt": "  ", "answer": "b"}, {}, r"prompts.jsonl:1: field 'prompt' is an empty prompt"),
    ({"prompt": [], "answer": "b"}, {}, r"prompts.jsonl:1: field 'prompt' is an empty prompt"),
    ({"prompt": "a", "answer": None}, {}, r"prompts.jsonl:1: field 'answer' is null"),
    ({"prompt": "a", "answer": ["4"]}, {}, r"prompts.jsonl:1: field 'answer' is a list \[\"4\"\], expected a string "
                                           r"or a number"),
    ({"prompt": "a", "answer": True}, {}, r"prompts.jsonl:1: field 'answer' is a boolean"),
    (["a", "b"], {}, r"prompts.jsonl:1: expected a JSON object"),
])
def test_a_bad_row_is_an_error_naming_file_row_and_field(tmp_path, row, keys, message):
    with pytest.raises(PromptDataError, match=message):
        load_prompt_file(_write(tmp_path, [json.dumps(row)]), keys.get("prompt_key", "prompt"),
                         keys.get("answer_key", "answer"))


@pytest.mark.parametrize(("data", "message"), [
    (b'{"prompt": "a", "answer": "1"}\n\x00\x01\x02PK', r"prompts.jsonl:2: binary data, not JSONL text"),
    (b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n', r"prompts.jsonl:2: not UTF-8 text"),
    (b"", r"prompt file '.*prompts.jsonl' is empty"),
    (b"\n  \n", r"prompt file '.*prompts.jsonl' is empty"),
])
def test_a_file_that_is_not_jsonl_text_is_an_error_naming_the_line(tmp_path, data, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    with pytest.raises(PromptDataError, match=message):
        load_prompt_file(str(path))


def test_a_utf8_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes('{"prompt": "é?", "answer": "1"}\n'.encode("utf-8-sig"))
    assert load_prompt_file(str(path))[0].prompt == "é?"


def test_a_directory_as_prompt_file_is_an_error_saying_to_name_a_file(tmp_path):
    with pytest.raises(PromptDataError, match=r"is a directory: set task.eval_file to a JSONL or Parquet file"):
        load_prompt_file(str(tmp_path), setting="task.eval_file")


def test_a_parquet_file_without_the_prompt_column_is_an_error_listing_the_columns(tmp_path):
    path = _write_parquet(tmp_path, [{"question": "a", "answer": "1"}])
    with pytest.raises(PromptDataError, match=r"prompts.parquet: no column 'prompt' for the prompt \(task.prompt_key="
                                              r"'prompt'\); the columns are \['question', 'answer'\]"):
        load_prompt_file(path)


def test_a_bad_parquet_row_is_an_error_naming_the_row_and_field(tmp_path):
    path = _write_parquet(tmp_path, [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}])
    with pytest.raises(PromptDataError, match=r"prompts.parquet:row 1: field 'prompt' is null"):
        load_prompt_file(path)


def test_a_corrupt_parquet_file_is_an_error(tmp_path):
    path = tmp_path / "prompts.parquet"
    path.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(PromptDataError, match=r"prompts.parquet: not a readable Parquet file"):
        load_prompt_file(str(path))


def test_parquet_without_pyarrow_says_which_extra_to_install(tmp_path, monkeypatch):
    path = _write_parquet(tmp_path, VERL_ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PromptDataError, match=r'pip install "nereus-jax\[parquet\]"'):
        load_prompt_file(path)
