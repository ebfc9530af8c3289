"""The config tree: defaults, YAML files, model presets, overrides, round trips, and one test per kind of
mistake asserting the error names the dotted key.

    python -m pytest tests/test_config.py -q
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nereus_jax import config as cfgmod
from nereus_jax.config import (
    Config,
    ConfigError,
    ModelConfig,
    PoolChange,
    StageLayoutConfig,
    apply_overrides,
    available_models,
    config_dir,
    config_from_dict,
    describe,
    load_config,
    resolve_model,
)

REPO = Path(__file__).resolve().parents[1]
EXPECTED_PRESETS = {"tiny", "llama3.1-8b", "llama3.2-1b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ defaults and files
@pytest.mark.smoke
def test_defaults_construct_and_validate():
    config = Config()
    assert config.model.head_dim == config.model.hidden_size // config.model.num_heads == 16
    assert config.cluster.num_devices == 8 and config.cluster.platform == "cpu"
    assert load_config() == config


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().trainer.steps = 3  # type: ignore[misc]


def test_default_yaml_loads_and_equals_the_defaults():
    assert load_config("default") == Config()
    assert load_config(config_dir() / "default.yaml") == Config()


def test_default_yaml_lists_every_section_and_key_with_the_value_loaded():
    raw = yaml.safe_load((config_dir() / "default.yaml").read_text())
    loaded = load_config("default").to_dict()
    assert raw["model"] == "tiny"
    assert set(raw) == set(loaded)
    for section, values in raw.items():
        if section != "model":
            assert values == loaded[section], section


def test_config_dir_is_the_repository_configs_folder_in_a_checkout():
    assert config_dir() == REPO / "configs"


def test_every_model_preset_loads_and_is_named_after_its_file():
    assert set(available_models()) >= EXPECTED_PRESETS
    for name in available_models():
        model = resolve_model(name)
        assert model.name == name
        assert model.head_dim is not None and model.num_heads % model.num_kv_heads == 0


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS - {"tiny"}))
def test_real_presets_name_the_hugging_face_repo_they_mirror(name):
    first_line = (config_dir() / "models" / f"{name}.yaml").read_text().splitlines()[0]
    assert first_line.startswith("# Mirrors https://huggingface.co/")


def test_tiny_preset_equals_model_defaults():
    assert resolve_model("tiny") == ModelConfig()


def test_llama31_8b_preset_has_the_hugging_face_shape():
    model = resolve_model("llama3.1-8b")
    assert (model.vocab_size, model.hidden_size, model.num_layers) == (128256, 4096, 32)
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (32, 8, 128)
    assert model.rope_scaling is not None and model.rope_scaling.factor == 8.0
    assert model.rope_theta == 500000.0 and model.rms_norm_eps == 1e-5
    assert (model.param_dtype, model.compute_dtype) == ("float32", "bfloat16")


def test_qwen_presets_have_qkv_bias_and_small_eps():
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"):
        model = resolve_model(name)
        assert model.family == "qwen2" and model.qkv_bias and model.rms_norm_eps == 1e-6
        assert model.rope_scaling is None and model.num_heads * model.head_dim == model.hidden_size
    assert resolve_model("qwen2.5-0.5b").tie_embeddings and not resolve_model("qwen2.5-7b").tie_embeddings


def test_model_config_is_hashable_for_static_jit_arguments():
    assert hash(resolve_model("llama3.2-1b")) == hash(resolve_model("llama3.2-1b"))


def test_head_dim_is_derived_only_when_unset():
    assert ModelConfig(hidden_size=96, num_heads=4).head_dim == 24
    assert ModelConfig(hidden_size=100, num_heads=4, num_kv_heads=2, head_dim=32).head_dim == 32


def test_yaml_file_with_preset_mapping_changes_the_preset(tmp_path):
    path = _write(tmp_path, "model:\n  preset: llama3.2-1b\n  num_layers: 2\n  rope_scaling: {factor: 16}\n")
    model = load_config(path).model
    assert (model.name, model.num_layers, model.hidden_size) == ("llama3.2-1b", 2, 2048)
    assert model.rope_scaling.factor == 16.0 and model.rope_scaling.high_freq_factor == 4.0


def test_yaml_reads_exponent_floats_without_a_dot(tmp_path):
    config = load_config(_write(tmp_path, "trainer: {actor_lr: 3e-6}\nmodel: {rms_norm_eps: 1e-6}\n"))
    assert config.trainer.actor_lr == 3e-6 and config.model.rms_norm_eps == 1e-6


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(_write(tmp_path, "# nothing\n")) == Config()


# ------------------------------------------------------------------------------------------- overrides
def test_override_values_are_parsed_as_yaml_scalars():
    config = load_config(
        "default",
        [
            "trainer.steps=5",
            "trainer.actor_lr=2e-6",
            "logging.progress=false",
            "rollout.temperature=1",
            "checkpoint.dir=runs/x",
            "cluster.device_memory_bytes=null",
        ],
    )
    assert config.trainer.steps == 5 and type(config.trainer.steps) is int
    assert config.trainer.actor_lr == 2e-6
    assert config.logging.progress is False
    assert config.rollout.temperature == 1.0 and type(config.rollout.temperature) is float
    assert config.checkpoint.dir == "runs/x" and config.cluster.device_memory_bytes is None


def test_override_builds_nested_list_of_pool_changes():
    config = load_config(None, ["cluster.schedule=[{step: 3, leave: [7]}, {step: 5, join: [7]}]"])
    assert config.cluster.schedule == (PoolChange(step=3, leave=(7,)), PoolChange(step=5, join=(7,)))


def test_model_preset_override_applies_before_field_overrides_in_any_order():
    for overrides in (
        ["model=qwen2.5-0.5b", "model.num_layers=2"],
        ["model.num_layers=2", "model=qwen2.5-0.5b"],
    ):
        model = load_config("default", overrides).model
        assert (model.name, model.num_layers, model.vocab_size, model.qkv_bias) == (
            "qwen2.5-0.5b",
            2,
            151936,
            True,
        )


def test_model_preset_key_override_keeps_the_files_model_changes(tmp_path):
    path = _write(tmp_path, "model: {preset: tiny, remat: true}\n")
    model = load_config(path, ["model.preset=llama3.2-1b"]).model
    assert model.name == "llama3.2-1b" and model.remat and model.num_layers == 16


def test_override_adds_a_plan_stage_and_others_fall_back_to_default():
    config = load_config(None, ["plan.stages.actor-gen.tp=2", "plan.default.pp=2"])
    assert config.plan.layout_for("actor-gen") == StageLayoutConfig(tp=2)
    assert config.plan.layout_for("critic-train") == StageLayoutConfig(pp=2)


def test_apply_overrides_does_not_mutate_its_input():
    data = {"trainer": {"steps": 3}}
    assert apply_overrides(data, ["trainer.steps=4"]) == {"trainer": {"steps": 4}}
    assert data == {"trainer": {"steps": 3}}


# ------------------------------------------------------------------------------------------ round trip
def test_to_dict_round_trips_through_config_from_dict_and_yaml():
    config = load_config(
        None,
        [
            "model=llama3.2-1b",
            "cluster.schedule=[{step: 2, leave: [6, 7]}]",
            "plan.stages.actor-train.dp=4",
            "algorithm.name=grpo",
            "rollout.samples_per_prompt=4",
            "task.name=file",
            "task.prompt_file=p.jsonl",
        ],
    )
    plain = config.to_dict()
    assert plain["cluster"]["schedule"] == [{"step": 2, "leave": [6, 7], "join": [], "notice": 0, "fail": []}]
    assert config_from_dict(plain) == config
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(plain))) == config


# ----------------------------------------------------------------------------- one test per mistake kind
def test_unknown_top_level_section_is_rejected_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key 'trainr' — did you mean 'trainer'\?"):
        config_from_dict({"trainr": {"steps": 1}})


def test_unknown_nested_key_names_the_dotted_key_and_suggests_the_right_one():
    pattern = r"'model\.hiden_size' — did you mean 'model\.hidden_size'\?.*num_heads"
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["model.hiden_size=32"])


def test_unknown_key_inside_a_preset_mapping_is_named():
    pattern = r"unknown key 'model\.num_layer' — did you mean 'model\.num_layers'"
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict({"model": {"preset": "tiny", "num_layer": 3}})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.num_heads=four", r"model\.num_heads: expected int, got str 'four'"),
        ("trainer.steps=true", r"trainer\.steps: expected int, got bool True"),
        ("task.prompt_file=[a, b]", r"task\.prompt_file: expected str, got list \['a', 'b'\]"),
        ("trainer.actor_lr=fast", r"trainer\.actor_lr: expected float, got str 'fast'"),
        ("model.qkv_bias=1", r"model\.qkv_bias: expected bool, got int 1"),
        ("trainer.steps=null", r"trainer\.steps: expected int, got null"),
        ("trainer=5", r"trainer: expected a mapping of TrainerConfig keys, got int 5"),
        ("model=[1]", r"model: expected a preset name \(.*tiny\) or a mapping of ModelConfig keys, got list"),
        (
            "cluster.schedule=[{step: 1, leave: 7}]",
            r"cluster\.schedule\[0\]\.leave: expected a list, got int 7",
        ),
    ],
)
def test_wrong_type_names_the_key_expected_type_and_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_literal_value_out_of_set_lists_the_allowed_values():
    with pytest.raises(ConfigError, match=r"algorithm\.name: expected one of 'ppo', 'grpo', 'remax', 'rloo'"):
        load_config(None, ["algorithm.name=dpo"])


def test_missing_required_field_is_named():
    with pytest.raises(ConfigError, match=r"cluster\.schedule\[0\]\.step is required"):
        load_config(None, ["cluster.schedule=[{leave: [1]}]"])


def test_heads_not_divisible_by_kv_heads_explains_grouped_query_attention():
    pattern = r"model\.num_heads \(12\) must be divisible by model\.num_kv_heads \(5\)"
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["model.num_heads=12", "model.num_kv_heads=5", "model.hidden_size=96"])


def test_hidden_size_not_divisible_by_heads_without_head_dim_is_rejected():
    with pytest.raises(ConfigError, match=r"model\.hidden_size \(66\) must be divisible by model\.num_heads"):
        load_config(None, ["model.hidden_size=66"])


def test_non_positive_size_is_rejected():
    with pytest.raises(ConfigError, match=r"model\.num_layers must be > 0, got 0"):
        load_config(None, ["model.num_layers=0"])


def test_unknown_plan_stage_is_named_with_a_suggestion():
    pattern = r"'plan\.stages\.actor-generate' — did you mean 'plan\.stages\.actor-gen'"
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["plan.stages.actor-generate.tp=2"])


def test_plan_needing_more_devices_than_the_cluster_names_stage_and_num_devices():
    pattern = r"plan\.stages\.actor-train needs .* = 16 devices .*cluster\.num_devices is 8"
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["plan.stages.actor-train={tp: 2, pp: 2, dp: 4}"])


def test_expert_parallel_degree_is_checked_against_the_model():
    moe = ["model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=8", "model.num_experts_per_tok=2"]
    cfg = load_config(None, moe + ["plan.stages.actor-train.ep=4"])
    assert cfg.plan.layout_for("actor-train").ep == 4 and cfg.plan.layout_for("actor-gen").ep == 1
    with pytest.raises(ConfigError, match=r"plan\.default\.ep=2: expert parallelism needs a mixture-of-experts model.*"
                                          r"set plan\.default\.ep=1"):
        load_config(None, ["plan.default.ep=2"])
    with pytest.raises(ConfigError, match=r"plan\.stages\.actor-train\.ep=3 does not divide model\.num_experts=8"):
        load_config(None, moe + ["plan.stages.actor-train.ep=3"])
    with pytest.raises(ConfigError, match=r"plan\.stages\.actor-train\.ep=2 with plan\.stages\.actor-train\.pp=2"):
        load_config(None, moe + ["plan.stages.actor-train={pp: 2, ep: 2}"])
    with pytest.raises(ConfigError, match=r"tp\*pp\*ep\*dp = 1\*1\*8\*2 = 16 devices"):
        load_config(None, moe + ["plan.stages.actor-train={ep: 8, dp: 2}"])


def test_layout_degree_below_one_is_rejected():
    with pytest.raises(ConfigError, match=r"plan\.default\.tp must be >= 1, got 0"):
        load_config(None, ["plan.default.tp=0"])


def test_prompt_plus_response_longer_than_context_names_all_three_keys():
    with pytest.raises(
        ConfigError,
        match=r"rollout\.max_prompt_length .*rollout\.max_response_length .*"
        r"exceeds model\.max_position_embeddings \(2048\)",
    ):
        load_config(None, ["rollout.max_prompt_length=1024", "rollout.max_response_length=1025"])


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_group_algorithms_need_several_samples_per_prompt(algorithm):
    pattern = rf"algorithm\.name={algorithm} needs rollout\.samples_per_prompt >= 2"
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [f"algorithm.name={algorithm}"])
    assert load_config(None, [f"algorithm.name={algorithm}", "rollout.samples_per_prompt=2"])


def test_sampling_parameters_out_of_range_are_rejected():
    with pytest.raises(ConfigError, match=r"rollout\.top_p must be in \(0, 1\], got 0\.0"):
        load_config(None, ["rollout.top_p=0"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature must be >= 0"):
        load_config(None, ["rollout.temperature=-0.5"])


def test_wandb_logging_keys_load_and_bad_values_name_the_key():
    assert (Config().logging.wandb, Config().logging.wandb_project, Config().logging.wandb_mode) == (
        False, "nereus_jax", None)
    logging = load_config(None, ["logging.wandb=true", "logging.wandb_project=post-train_1",
                                 "logging.wandb_mode=offline"]).logging
    assert (logging.wandb, logging.wandb_project, logging.wandb_mode) == (True, "post-train_1", "offline")
    with pytest.raises(ConfigError, match=r"logging\.wandb_mode: expected one of 'online', 'offline', 'disabled'"):
        load_config(None, ["logging.wandb_mode=ofline"])
    with pytest.raises(ConfigError, match=r"logging\.wandb: expected bool, got int 1"):
        load_config(None, ["logging.wandb=1"])
    with pytest.raises(ConfigError, match=r"logging\.wandb_project='team/run' is not a W&B project name.*\(it has /\)"):
        load_config(None, ["logging.wandb_project=team/run"])
    for name in ("''", "x" * 129):
        with pytest.raises(ConfigError, match=r"logging\.wandb_project=.* is not a W&B project name: 1 to 128"):
            load_config(None, [f"logging.wandb_project={name}"])


def test_file_task_without_prompt_file_names_task_prompt_file():
    with pytest.raises(ConfigError, match=r"task\.prompt_file is not set"):
        load_config(None, ["task.name=file"])


def test_schedule_device_id_out_of_range_names_the_change():
    with pytest.raises(ConfigError, match=r"cluster\.schedule\[1\]\.join: device id 8 is outside \[0, 8\)"):
        load_config(None, ["cluster.schedule=[{step: 1, leave: [7]}, {step: 2, join: [8]}]"])


def test_schedule_notice_longer_than_the_run_so_far_is_rejected():
    with pytest.raises(ConfigError, match=r"cluster\.schedule\[0\]\.notice \(5\) must be in \[0, step=3\]"):
        load_config(None, ["cluster.schedule=[{step: 3, leave: [7], notice: 5}]"])


def test_schedule_steps_out_of_order_are_rejected():
    with pytest.raises(ConfigError, match=r"cluster\.schedule\[1\]\.step \(2\) .*in step order"):
        load_config(None, ["cluster.schedule=[{step: 5, leave: [7]}, {step: 2, join: [7]}]"])


def test_unknown_model_preset_lists_the_available_ones_and_where_to_add_one():
    with pytest.raises(
        ConfigError,
        match=r"unknown model preset 'llama3.1-8' — did you mean 'llama3.1-8b'\?"
        r".*available: .*qwen2.5-7b.*create .*models/llama3.1-8.yaml",
    ):
        load_config(None, ["model=llama3.1-8"])
    with pytest.raises(ConfigError, match=r"unknown model preset 'gpt2'"):
        resolve_model("gpt2")


def test_missing_config_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"config file '.*nope\.yaml' not found"):
        load_config(missing)
    with pytest.raises(ConfigError, match=r"config file 'no_such_config' not found .*default"):
        load_config("no_such_config")


def test_top_level_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"expected a mapping of keys at the top level, got list"):
        load_config(_write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("override", ["trainer.steps", "=5", "trainer..steps=5"])
def test_malformed_override_shows_the_expected_form(override):
    with pytest.raises(ConfigError, match=r"malformed override .*key\.sub=value"):
        load_config(None, [override])


def test_override_through_a_scalar_is_rejected():
    with pytest.raises(ConfigError, match=r"cannot set 'trainer\.steps\.x': 'trainer\.steps' is int 20"):
        apply_overrides({"trainer": {"steps": 20}}, ["trainer.steps.x=1"])


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------------- describe and purity
def test_describe_lists_every_key_with_type_and_default():
    text = describe()
    assert "  model.num_heads: int = 4" in text.splitlines()
    assert "  trainer.steps: int = 20" in text.splitlines()
    assert "plan.stages.<name>.tp: int = 1" in text
    assert "algorithm.name: {ppo, grpo, remax, rloo, dapo, dr_grpo, gspo} = ppo" in text


def test_config_module_does_not_import_jax():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cfg', {str(Path(cfgmod.__file__))!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "module.load_config('default', ['model=llama3.1-8b'])\n"
        "assert 'jax' not in sys.modules, 'config.py imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


MOE_MODEL = ["model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algorithm.router_aux_coef=0.01"], r"algorithm\.router_aux_coef act on a mixture-of-experts model's "
                                             r"router, but model\.family=llama has model\.num_experts=0"),
        (["algorithm.routing_replay=true"], r"algorithm\.routing_replay act on a mixture-of-experts"),
        ([*MOE_MODEL, "algorithm.routing_replay=true", "algorithm.router_aux_coef=0.01"],
         r"algorithm\.router_aux_coef > 0 with trainer\.pipeline_schedule=1f1b: .* set "
         r"trainer\.pipeline_schedule=gpipe"),
        ([*MOE_MODEL, "algorithm.routing_replay=true", "trainer.pipeline_schedule=gpipe", "task.env=calculator"],
         r"algorithm\.routing_replay with task\.env='calculator': multi-turn trajectories do not record"),
        ([*MOE_MODEL, "algorithm.router_aux_coef=-1"], r"algorithm\.router_aux_coef must be >= 0"),
    ],
)
def test_mixture_of_experts_training_options_are_refused_where_they_cannot_act(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_moe_job_records_routes_unless_it_is_multi_turn():
    cfg = load_config(None, [*MOE_MODEL, "algorithm.routing_replay=true"])  # 1F1B replays routes too
    assert cfg.records_routes() and cfg.algorithm.routing_replay
    assert not load_config(None, [*MOE_MODEL, "task.env=calculator"]).records_routes()
    assert not load_config(None, []).records_routes()
