"""Chat templates render exactly as transformers renders them: the public Llama-3.1/3.2 Instruct, Qwen2.5 Instruct
and Qwen3 templates (stored verbatim under tests/data/chat_templates/) give the same text and token ids as
``apply_chat_template`` on single-turn, multi-turn and system-prompt chats, with and without the generation
prompt, and with Qwen3's ``enable_thinking=False``; the Jinja environment matches transformers' (``tojson``,
``raise_exception``, ``strftime_now``, loop controls, the sandbox).

The ``hf_parity`` tests need transformers (Python 3.11 lane); without it they skip, unless
``NEREUS_REQUIRE_HF=1``, which turns the skip into a failure. The others run anywhere.
Run: ``NEREUS_REQUIRE_HF=1 .venv311/bin/python -m pytest tests/rl/test_chat_template.py -q -k hf_parity`` and
``.venv312/bin/python -m pytest tests/rl/test_chat_template.py -q``
"""

import hashlib
import json
import os
from datetime import datetime
from functools import cache
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nereus_jax.rl.chat import render_chat
from nereus_jax.rl.tasks import Problem
from nereus_jax.rl.tokenizer import HFTokenizer, TokenizerError

try:
    import transformers
except ImportError:
    if os.environ.get("NEREUS_REQUIRE_HF") == "1":
        raise
    transformers = None
needs_hf = pytest.mark.skipif(transformers is None, reason="Hugging Face parity needs transformers (pip install -e "
                                                           "'.[hf]' on Python 3.11)")

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# sha256 of the stored templates: they must stay byte-for-byte the published ones (see the README there).
SHA256 = {
    "llama-3.1-instruct.jinja": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "llama-3.2-instruct.jinja": "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
    "qwen2.5-instruct.jinja": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "qwen3.jinja": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
}
FAMILY = {"llama-3.1-instruct.jinja": "llama", "llama-3.2-instruct.jinja": "llama",
          "qwen2.5-instruct.jinja": "qwen", "qwen3.jinja": "qwen"}

# The special tokens of each family, added as special tokens so that the templates' control strings tokenize to
# single ids; Qwen3's <think> and </think> are ordinary added tokens, as in its tokenizer.
LLAMA = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>")
QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("the", "model", "answer", "question", "what", "is", "two", "plus", "four", "six", "sum", "brief", "be",
         "think", "step", "by", "final", "hello", "you", "are", "helpful", "assistant", "system", "user")
CORPUS = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 10)) + f" {i} + {i * 7 % 13} = {i + i * 7 % 13}."
          for i in range(400)]


@cache
def _tokenizer_json(family: str) -> str:
    specials = LLAMA if family == "llama" else QWEN
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if family == "llama":  # tokenizer(text) puts <|begin_of_text|> first; templates write it themselves
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])
    else:
        tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    return tok.to_str()


def _configs(family: str) -> tuple[dict, dict]:
    """tokenizer_config.json and generation_config.json as the public checkpoints of the family write them."""
    ids = Tokenizer.from_str(_tokenizer_json(family)).token_to_id
    if family == "llama":
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        gen = {"bos_token_id": ids("<|begin_of_text|>"),
               "eos_token_id": [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")]}
    else:
        config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        gen = {"bos_token_id": ids("<|endoftext|>"), "pad_token_id": ids("<|endoftext|>"),
               "eos_token_id": [ids("<|im_end|>"), ids("<|endoftext|>")]}
    return {**config, "tokenizer_class": "PreTrainedTokenizerFast"}, gen


def checkpoint(folder: Path, family: str, template: str | None, *, as_file: bool = False) -> Path:
    """A tokenizer-only checkpoint folder of ``family`` with ``template`` (in tokenizer_config.json, or in
    chat_template.jinja when ``as_file``)."""
    folder.mkdir(parents=True, exist_ok=True)
    config, gen = _configs(family)
    if template is not None and not as_file:
        config["chat_template"] = template
    if template is not None and as_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    (folder / "tokenizer.json").write_text(_tokenizer_json(family), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    return folder


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def ours(tmp_path: Path, name: str, **kw) -> HFTokenizer:
    return HFTokenizer(str(checkpoint(tmp_path, FAMILY[name], template(name), **kw)))


USER, SYSTEM = " What is two plus four? ", "Be brief."  # the spaces: Llama's templates trim, Qwen's don't
CHATS = {
    "single_turn": [{"role": "user", "content": USER}],
    "system": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
    "multi_turn": [{"role": "user", "content": USER}, {"role": "assistant", "content": "six"},
                   {"role": "user", "content": "and two plus two? café ✓"}],
    "multi_turn_system": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
                          {"role": "assistant", "content": "six"}, {"role": "user", "content": "why"}],
}
QWEN3_REASONING = [{"role": "user", "content": "what is two plus four"},
                   {"role": "assistant", "content": "<think>\nthe sum\n</think>\n\nsix"},
                   {"role": "user", "content": "and plus six"},
                   {"role": "assistant", "content": "twelve", "reasoning_content": "add six"},
                   {"role": "user", "content": "why"}]


def test_stored_templates_are_the_published_ones_byte_for_byte():
    assert sorted(p.name for p in TEMPLATES.glob("*.jinja")) == sorted(SHA256)
    for name, digest in SHA256.items():
        assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == digest, name


# --- parity with transformers ----------------------------------------------------------------------------------


def _hf(folder: Path):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


def _hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@needs_hf
@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("name", sorted(SHA256))
def test_templates_match_transformers_hf_parity(tmp_path, name, chat):
    tok, hf = ours(tmp_path, name), _hf(tmp_path)
    messages = CHATS[chat]
    for gen in (True, False):
        assert tok.render(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.encode_prompt(messages) == _hf_ids(hf, messages)
    if chat in ("single_turn", "system"):  # the job's shape: a string prompt and task.system_prompt
        system = SYSTEM if chat == "system" else None
        assert tok.encode_prompt(USER, system_prompt=system) == _hf_ids(hf, messages)


@needs_hf
@pytest.mark.parametrize("name", sorted(SHA256))
def test_special_tokens_match_transformers_hf_parity(tmp_path, name):
    tok, hf = ours(tmp_path, name), _hf(tmp_path)
    assert tok.special_tokens == hf.special_tokens_map
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.chat_template == hf.chat_template and tok.vocab_size == len(hf)


@needs_hf
@pytest.mark.parametrize("messages", [CHATS["single_turn"], CHATS["multi_turn"], QWEN3_REASONING])
def test_qwen3_thinking_switch_and_reasoning_history_match_transformers_hf_parity(tmp_path, messages):
    tok, hf = ours(tmp_path, "qwen3.jinja"), _hf(tmp_path)
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        assert tok.render(messages, **kw) == hf.apply_chat_template(messages, tokenize=False,
                                                                   add_generation_prompt=True, **kw)
        assert tok.encode_prompt(messages, **kw) == _hf_ids(hf, messages, **kw)


@needs_hf
def test_chat_template_jinja_file_matches_transformers_hf_parity(tmp_path):
    tok, hf = ours(tmp_path, "llama-3.2-instruct.jinja", as_file=True), _hf(tmp_path)
    assert tok.template_origin.endswith("chat_template.jinja")
    messages = CHATS["system"]
    assert tok.encode_prompt(messages, date_string="01 Jan 2025") == _hf_ids(hf, messages, date_string="01 Jan 2025")


@needs_hf
def test_plain_prompts_and_decode_match_transformers_without_a_template_hf_parity(tmp_path):
    folder = checkpoint(tmp_path, "llama", None)
    tok, hf = HFTokenizer(str(folder)), _hf(folder)
    text = "what is two plus four? café"
    assert tok.encode_prompt(text) == hf(text)["input_ids"]  # bos from the post-processor
    assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    ids = tok.encode_prompt(text)
    assert tok.decode([*ids, tok.eos_ids[1], *ids]) == hf.decode(ids, skip_special_tokens=True) == text


# --- the stored templates, rendered here (no transformers) -----------------------------------------------------


def test_qwen25_renders_its_default_system_message_or_the_given_one(tmp_path):
    tok = ours(tmp_path, "qwen2.5-instruct.jinja")
    default = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert tok.render([{"role": "user", "content": "hi"}]) == \
        default + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                      add_generation_prompt=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_qwen3_drops_past_reasoning_and_closes_thinking_when_disabled(tmp_path):
    tok = ours(tmp_path, "qwen3.jinja")
    assert tok.render([{"role": "user", "content": "hi"}], enable_thinking=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.render(QWEN3_REASONING[:3]) == (
        "<|im_start|>user\nwhat is two plus four<|im_end|>\n<|im_start|>assistant\nsix<|im_end|>\n"
        "<|im_start|>user\nand plus six<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_prompt("hi", system_prompt="Be brief.", enable_thinking=False)
    assert ids == tok.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama31_writes_bos_and_the_dated_system_header(tmp_path):
    tok = ours(tmp_path, "llama-3.1-instruct.jinja")
    header = "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    assert tok.render([{"role": "user", "content": " hi "}]) == (
        f"<|begin_of_text|>{header}Today Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode_prompt("hi")
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_llama32_dates_its_system_header_with_strftime_now_unless_given_a_date(tmp_path):
    tok = ours(tmp_path, "llama-3.2-instruct.jinja")
    before = datetime.now().strftime("%d %b %Y")
    text = tok.render([{"role": "user", "content": "hi"}])
    assert any(f"Today Date: {d}\n\n<|eot_id|>" in text for d in (before, datetime.now().strftime("%d %b %Y")))
    assert "Today Date: 01 Jan 2025\n" in tok.render([{"role": "user", "content": "hi"}], date_string="01 Jan 2025")


# --- the Jinja environment -------------------------------------------------------------------------------------


def _render(source: str, **kw) -> str:
    return render_chat(source, [{"role": "user", "content": "x"}], origin="test.jinja", special_tokens={}, **kw)


def test_tojson_is_plain_json_dumps_with_transformers_options():
    value = {"b": "<a>&é", "a": [1, 2]}
    assert _render("{{ v | tojson }}", v=value) == json.dumps(value, ensure_ascii=False)  # no HTML escaping
    assert _render("{{ v | tojson(indent=2, sort_keys=true) }}", v=value) == \
        json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)
    assert _render("{{ v | tojson(ensure_ascii=true, separators=(',', ':')) }}", v=value) == \
        json.dumps(value, separators=(",", ":"))


def test_templates_see_special_tokens_messages_and_tools_none():
    source = "{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}|{{ tools is none }}|{{ documents is none }}"
    out = render_chat(source, [{"role": "user", "content": "x", "name": None}], origin="t",
                      special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, eos_token="<over>")
    assert out == "<s>|<over>|x|True|True"  # extra variables win over the special tokens, as in transformers


def test_trim_blocks_lstrip_blocks_and_loop_controls_are_on():
    source = "{% for m in [1, 2, 3] %}\n    {% if m == 2 %}{% break %}{% endif %}\n{{ m }}\n{% endfor %}"
    assert _render(source) == "1\n"


def test_raise_exception_is_a_tokenizer_error_naming_the_template():
    with pytest.raises(TokenizerError, match=r"^the chat template in test\.jinja failed to render.*roles alternate"):
        _render("{{ raise_exception('roles alternate') }}")


def test_the_sandbox_refuses_python_internals():
    with pytest.raises(TokenizerError, match="failed to render"):
        _render("{{ ''.__class__.__mro__ }}")
    with pytest.raises(TokenizerError, match="failed to render.*_x"):
        _render("{% set ns = namespace(_x=1) %}")
    with pytest.raises(TokenizerError, match="failed to render"):
        _render("{% set m = messages.append(1) %}")  # immutable: no mutating the messages


# --- tools and multi-turn trajectories ---------------------------------------------------------------------------
CALC_CALL = {"qwen3.jinja": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+4"}}\n</tool_call>',
             "llama-3.1-instruct.jinja": '{"name": "calculator", "parameters": {"expression": "2+4"}}'}
TOOL_FORMAT = {"qwen3.jinja": "hermes", "llama-3.1-instruct.jinja": "llama3"}


def _tool_chat(name):
    from nereus_jax.rl.tools import CALCULATOR

    return [{"role": "user", "content": USER}, {"role": "assistant", "content": CALC_CALL[name]},
            {"role": "tool", "name": "calculator", "content": "6"}], [CALCULATOR.schema()]


@needs_hf
@pytest.mark.parametrize("name", sorted(CALC_CALL))
def test_prompts_with_tools_and_tool_messages_match_transformers_hf_parity(tmp_path, name):
    tok, hf = ours(tmp_path, name), _hf(tmp_path)
    messages, tools = _tool_chat(name)
    for chat in (messages[:1], messages):
        assert tok.render(chat, tools=tools) == hf.apply_chat_template(chat, tools=tools, tokenize=False,
                                                                      add_generation_prompt=True)
        assert tok.encode_prompt(chat, tools=tools) == _hf_ids(hf, chat, tools=tools)


@pytest.mark.parametrize("name", sorted(CALC_CALL))
def test_a_trajectory_of_turns_and_tool_answers_is_the_templates_rendering_of_the_conversation(tmp_path, name):
    """The agent loop keeps the model's tokens and appends only what follows them (the rest of the turn's
    markup, the tool message, the next generation prompt): the whole equals the template's rendering of the
    conversation, with the tools shown to the model."""
    from types import SimpleNamespace

    from nereus_jax.config import load_config
    from nereus_jax.rl.env import ToolEnv
    from nereus_jax.rl.tools import CALCULATOR
    from nereus_jax.runtime.step.agent import AgentRollouts, Trajectory

    tok = ours(tmp_path, name)
    env = ToolEnv([CALCULATOR], TOOL_FORMAT[name])
    agent = AgentRollouts(SimpleNamespace(tok=tok, cfg=load_config(None)), env, TOOL_FORMAT[name])
    messages, tools = _tool_chat(name)
    start = env.reset(Problem(USER, "6"))
    for stopped in (True, False):  # the model wrote its end-of-turn token, or its turn was cut at its budget
        ids = agent.prompt_ids(start)
        turn = tok.encode(CALC_CALL[name]) + ([tok.eos_id] if stopped else [])
        step = env.step(start, {"role": "assistant", "content": CALC_CALL[name]})
        assert [m["content"] for m in step.messages] == ["6"]
        ids += turn + agent.continuation(Trajectory(ids, list(start), tokens=list(turn)), step, stopped)
        want = tok.render(start + [{"role": "assistant", "content": CALC_CALL[name]}] + step.messages, tools=tools)
        assert want == tok.render(messages, tools=tools)
        assert tok._tok.decode(ids, skip_special_tokens=False) == want
    agent.close()
