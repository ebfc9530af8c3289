"""Tokenizers from local Hugging Face checkpoint folders: special tokens resolved the way transformers resolves
them (tokenizer_config.json strings or AddedToken dicts, special_tokens_map.json, generation_config.json's eos
list), overrides, decode stopping at any eos, prompt encoding with and without a chat template, the character
tokenizer's prompts, and one-line TokenizerErrors naming the file or key to fix.

Each test builds its checkpoint: a small byte-level BPE trained here with ``tokenizers``.
Run: ``.venv312/bin/python -m pytest tests/rl/test_tokenizer.py -q``
"""

import json
from functools import cache

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nereus_jax.rl.tokenizer import CharTokenizer, HFTokenizer, TokenizerError, load_tokenizer

WORDS = ("the", "a", "model", "answer", "question", "what", "is", "two", "plus", "four", "sum", "of", "numbers",
         "think", "step", "by", "final", "hello")
CORPUS = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 9)) + f" {i} + {i * 7 % 13} = {i + i * 7 % 13}."
          for i in range(300)]
SPECIALS = ("<s>", "</s>", "<pad>", "<eot>", "<eom>")
EXTRA = "<|extra|>"  # added after training, at the highest id


@cache
def _tokenizer_json(bos_post_processor: bool = False) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(EXTRA, special=True, normalized=False)])
    if bos_post_processor:  # Llama-style: tokenizer(text) puts bos first
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok.to_str()


def _id(token: str) -> int:
    return Tokenizer.from_str(_tokenizer_json()).token_to_id(token)


def checkpoint(folder, *, config=None, gen=None, special_map=None, template_file=None, bos_post_processor=False):
    """A checkpoint folder holding tokenizer.json and whichever config files are given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_tokenizer_json(bos_post_processor))
    for name, data in (("tokenizer_config.json", config), ("generation_config.json", gen),
                       ("special_tokens_map.json", special_map)):
        if data is not None:
            (folder / name).write_text(json.dumps(data))
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


STD = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
SIMPLE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
                   "{% if add_generation_prompt %}[assistant]{% endif %}")


# --- special tokens -------------------------------------------------------------------------------------------


def test_special_tokens_resolve_from_tokenizer_config_strings(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config=STD)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (_id("<s>"), _id("</s>"), _id("<pad>"))
    assert tok.eos_ids == (_id("</s>"),)
    assert tok.special_tokens == STD and tok.chat_template is None


def test_added_token_dicts_resolve_like_strings(tmp_path):
    added = lambda t: {"__type": "AddedToken", "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}
    tok = HFTokenizer(str(checkpoint(tmp_path, config={k: added(v) for k, v in STD.items()})))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (_id("<s>"), _id("</s>"), _id("<pad>"))
    assert tok.special_tokens == STD


def test_generation_config_eos_list_joins_the_tokenizers_eos(tmp_path):
    gen = {"bos_token_id": _id("<s>"), "eos_token_id": [_id("</s>"), _id("<eom>"), _id("<eot>")]}
    tok = HFTokenizer(str(checkpoint(tmp_path, config={"bos_token": "<s>", "eos_token": "<eot>"}, gen=gen)))
    assert tok.eos_id == _id("<eot>")  # the tokenizer's own eos stays the primary one
    assert tok.eos_ids == (_id("<eot>"), _id("</s>"), _id("<eom>"))


def test_eos_may_come_from_generation_config_alone(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, gen={"eos_token_id": _id("<eot>")})))
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (_id("<eot>"), (_id("<eot>"),), _id("<eot>"))


def test_bos_set_to_null_means_no_bos_even_if_generation_config_names_one(tmp_path):
    # Qwen: tokenizer_config.json "bos_token": null, generation_config.json bos_token_id = <|endoftext|>.
    config = {"bos_token": None, "eos_token": "<eot>", "pad_token": "</s>"}
    gen = {"bos_token_id": _id("</s>"), "eos_token_id": [_id("<eot>"), _id("</s>")], "pad_token_id": _id("</s>")}
    tok = HFTokenizer(str(checkpoint(tmp_path, config=config, gen=gen)))
    assert tok.bos_id is None and "bos_token" not in tok.special_tokens
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (_id("<eot>"), (_id("<eot>"), _id("</s>")), _id("</s>"))


def test_bos_comes_from_generation_config_when_the_tokenizer_files_never_mention_it(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config={"eos_token": "</s>"}, gen={"bos_token_id": _id("<s>")})))
    assert tok.bos_id == _id("<s>")
    assert "bos_token" not in tok.special_tokens  # transformers' template variables come from the tokenizer files


def test_pad_falls_back_to_generation_config_then_to_eos(tmp_path):
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    with_gen = HFTokenizer(str(checkpoint(tmp_path / "a", config=config, gen={"pad_token_id": _id("<pad>")})))
    without = HFTokenizer(str(checkpoint(tmp_path / "b", config=config)))
    assert with_gen.pad_id == _id("<pad>") and without.pad_id == without.eos_id == _id("</s>")
    assert "pad_token" not in without.special_tokens


def test_special_tokens_map_fills_what_tokenizer_config_lacks_and_loses_conflicts(tmp_path):
    special_map = {"bos_token": {"content": "<s>"}, "eos_token": "<eom>", "pad_token": "<pad>"}
    tok = HFTokenizer(str(checkpoint(tmp_path, config={"eos_token": "</s>"}, special_map=special_map)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (_id("<s>"), _id("</s>"), _id("<pad>"))


def test_overrides_replace_the_checkpoints_tokens(tmp_path):
    folder = str(checkpoint(tmp_path, config=STD, gen={"eos_token_id": [_id("</s>")]}))
    tok = HFTokenizer(folder, bos="<eom>", eos="<eot>", pad="</s>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (_id("<eom>"), _id("<eot>"), _id("</s>"))
    assert tok.eos_ids == (_id("<eot>"), _id("</s>"))
    assert tok.special_tokens["eos_token"] == "<eot>"  # a template sees the override, as in transformers


def test_vocab_size_counts_added_tokens(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config=STD)))
    assert tok.vocab_size == _id(EXTRA) + 1 == Tokenizer.from_str(_tokenizer_json()).get_vocab_size()


def test_a_tokenizer_json_path_reads_its_folders_configs(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config=STD) / "tokenizer.json"))
    assert tok.eos_id == _id("</s>")


# --- encode / decode -------------------------------------------------------------------------------------------


def test_decode_stops_at_any_eos_and_skips_special_tokens(tmp_path):
    gen = {"eos_token_id": [_id("<eot>"), _id("<eom>")]}
    tok = HFTokenizer(str(checkpoint(tmp_path, config={"eos_token": "</s>", "bos_token": "<s>"}, gen=gen)))
    body = tok.encode("the sum of two")
    for stop in ("</s>", "<eot>", "<eom>"):
        assert tok.decode([tok.bos_id, *body, _id(stop), *tok.encode(" four")]) == "the sum of two"
    assert tok.decode([tok.bos_id, *body, _id(EXTRA), *tok.encode(" four")]) == "the sum of two four"


def test_string_prompt_without_template_is_tokenized_with_the_post_processors_bos(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config=STD, bos_post_processor=True)))
    assert tok.encode("what is two") == Tokenizer.from_str(_tokenizer_json()).encode("what is two").ids
    assert tok.encode_prompt("what is two") == [_id("<s>"), *tok.encode("what is two")]
    assert tok.encode_prompt("two", system_prompt="what is ") == [_id("<s>"), *tok.encode("what is two")]


def test_messages_prompt_without_template_names_the_fix(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config=STD)))
    with pytest.raises(TokenizerError, match="has no chat template.*plain strings"):
        tok.encode_prompt([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="has no chat template"):
        tok.encode_prompt("hi", chat=True)


def test_prompt_with_template_is_rendered_then_tokenized_without_added_special_tokens(tmp_path):
    config = {**STD, "chat_template": SIMPLE_TEMPLATE}
    tok = HFTokenizer(str(checkpoint(tmp_path, config=config, bos_post_processor=True)))
    text = "<s>[system]be brief</s>[user]what is two</s>[assistant]"
    assert tok.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two"}]) == text
    ids = tok.encode_prompt("what is two", system_prompt="be brief")
    assert ids == tok.encode(text) and ids.count(_id("<s>")) == 1  # the template writes bos; nothing adds another
    messages = [{"role": "user", "content": "what is two"}]
    assert tok.encode_prompt(messages) == tok.encode_prompt("what is two")
    assert tok.encode_prompt("what is two", chat=False) == [_id("<s>"), *tok.encode("what is two")]
    with pytest.raises(TokenizerError, match="chat template is off"):
        tok.encode_prompt(messages, chat=False)


def test_render_without_generation_prompt_and_with_extra_variables(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}{{ x }}"
    tok = HFTokenizer(str(checkpoint(tmp_path, config={**STD, "chat_template": template})))
    msgs = [{"role": "user", "content": "a"}]
    assert tok.render(msgs) == "a>" and tok.render(msgs, add_generation_prompt=False, x="!") == "a!"


def test_chat_template_list_uses_default_and_the_jinja_file_wins(tmp_path):
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
    assert HFTokenizer(str(checkpoint(tmp_path / "a", config={**STD, "chat_template": listed}))).chat_template == \
        "default"
    both = HFTokenizer(str(checkpoint(tmp_path / "b", config={**STD, "chat_template": "cfg"}, template_file="file")))
    assert both.chat_template == "file" and both.template_origin.endswith("chat_template.jinja")


# --- the character tokenizer ----------------------------------------------------------------------------------


def test_char_tokenizer_prompts_are_bos_then_characters():
    tok = CharTokenizer()
    assert tok.encode_prompt("1+2=") == [tok.bos_id] + tok.encode("1+2=")
    assert tok.encode_prompt("1+2=", system_prompt="add: ") == [tok.bos_id] + tok.encode("add: 1+2=")
    assert tok.eos_ids == (tok.eos_id,) and tok.chat_template is None


def test_char_tokenizer_rejects_chat_and_unknown_characters_naming_the_fix():
    tok = CharTokenizer()
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.encode_prompt([{"role": "user", "content": "1+2="}])
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.encode_prompt("1+2=", chat=True)
    with pytest.raises(TokenizerError, match=r"'Q'.*task\.tokenizer_path.*model\.hf_path"):
        tok.encode_prompt("Q: 1+2=")


# --- errors ----------------------------------------------------------------------------------------------------


def test_a_folder_without_tokenizer_json_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json in"):
        HFTokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="does not exist"):
        HFTokenizer(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("junk", [b'{"hello": [1, 2, 3]}', bytes(range(256)) * 4, b""])
def test_a_tokenizer_json_that_is_not_a_tokenizer_is_an_error_naming_the_file(tmp_path, junk):
    (tmp_path / "tokenizer.json").write_bytes(junk)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a Hugging Face tokenizer\.json"):
        HFTokenizer(str(tmp_path))


def test_no_resolvable_eos_names_the_keys_to_set(tmp_path):
    with pytest.raises(TokenizerError, match=r"eos_token in tokenizer_config\.json.*eos override"):
        HFTokenizer(str(checkpoint(tmp_path, config={"bos_token": "<s>"})))


def test_a_special_token_the_vocabulary_lacks_names_its_key_and_file(tmp_path):
    folder = str(checkpoint(tmp_path, config={**STD, "eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match=r"eos_token in .*tokenizer_config\.json.*'<\|nope\|>'"):
        HFTokenizer(folder)
    with pytest.raises(TokenizerError, match=r"the pad override names '<x>'"):
        HFTokenizer(str(checkpoint(tmp_path / "b", config=STD)), pad="<x>")


def test_generation_config_ids_outside_the_vocabulary_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"eos_token_id \[99999\] in .*generation_config\.json"):
        HFTokenizer(str(checkpoint(tmp_path, config=STD, gen={"eos_token_id": [_id("</s>"), 99999]})))


def test_unreadable_config_json_names_the_file(tmp_path):
    folder = checkpoint(tmp_path, config=STD)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is not readable JSON"):
        HFTokenizer(str(folder))


def test_chat_template_list_without_default_names_the_file(tmp_path):
    config = {**STD, "chat_template": [{"name": "tool_use", "template": "x"}]}
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*'default'.*\['tool_use'\]"):
        HFTokenizer(str(checkpoint(tmp_path, config=config)))


def test_a_template_that_fails_to_compile_names_its_file(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config=STD, template_file="{% for m in messages %}{{ m }")))
    with pytest.raises(TokenizerError, match=r"chat template in .*chat_template\.jinja does not compile \(line 1"):
        tok.encode_prompt("hi")


def test_a_template_that_fails_to_render_names_its_file_and_jinjas_message(tmp_path):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message comes first') }}{% endif %}"
    tok = HFTokenizer(str(checkpoint(tmp_path, config={**STD, "chat_template": template})))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json failed to render.*a system message comes first"):
        tok.encode_prompt("hi")


@pytest.mark.parametrize("prompt, what", [
    ([{"content": "hi"}], "chat message 0"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "chat message 1"),
    ([{"role": 3, "content": "hi"}], "string 'role'"),
    (["hi"], "chat message 0"),
    ([], "non-empty list"),
    (42, "not int"),
])
def test_messages_of_unknown_shape_are_errors(tmp_path, prompt, what):
    tok = HFTokenizer(str(checkpoint(tmp_path, config={**STD, "chat_template": SIMPLE_TEMPLATE})))
    with pytest.raises(TokenizerError, match=what):
        tok.encode_prompt(prompt)


def test_system_prompt_and_a_system_message_together_are_an_error(tmp_path):
    tok = HFTokenizer(str(checkpoint(tmp_path, config={**STD, "chat_template": SIMPLE_TEMPLATE})))
    with pytest.raises(TokenizerError, match="task.system_prompt"):
        tok.encode_prompt([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}], system_prompt="c")


# --- load_tokenizer --------------------------------------------------------------------------------------------


def test_load_tokenizer_prefers_task_tokenizer_path_then_the_checkpoint_then_chars(tmp_path):
    mine = checkpoint(tmp_path / "mine", config={**STD, "eos_token": "<eot>"})
    model = checkpoint(tmp_path / "model", config=STD)
    assert load_tokenizer(str(mine), str(model)).eos_id == _id("<eot>")
    assert load_tokenizer(None, str(model)).eos_id == _id("</s>")
    assert isinstance(load_tokenizer(None, None), CharTokenizer)


def test_load_tokenizer_errors_name_the_config_key(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(TokenizerError, match=r"^model\.hf_path='.*model': no tokenizer\.json in"):
        load_tokenizer(None, str(tmp_path / "model"))
    with pytest.raises(TokenizerError, match=r"^task\.tokenizer_path="):
        load_tokenizer(str(tmp_path / "missing.json"), None)
