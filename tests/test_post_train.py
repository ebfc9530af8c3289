"""Post-training a Hugging Face checkpoint end to end, as a user does it: ``tools/make_pretrained.py`` makes a
small "pretrained" chat model (Qwen3-shaped, BPE tokenizer, ChatML template) and the prompt files, then
``python -m nereus_jax.train configs/hf_grpo_tiny.yaml model.hf_path=...`` (GRPO, math reward, chat prompts
from JSONL) raises its held-out greedy pass@1 by at least 0.15 (training rank-16 LoRA adapters instead: 0.10)
and exports ``RUN_DIR/hf`` (with LoRA also ``RUN_DIR/adapter``); transformers'
greedy generation on that export scores the accuracy our engine scored; ``notebooks/post_train.ipynb`` runs.

    .venv312/bin/python -m pytest tests/test_post_train.py -q -m long      # the learning run + the notebook
    .venv311/bin/python -m pytest tests/test_post_train.py -q -k hf_parity  # transformers vs our engine

The checkpoint and the RL run are made once per module (subprocesses, the real commands) and shared by the
learning and notebook tests. The parity test runs a CI-sized version of the same commands (100 SFT steps,
4 GRPO steps) and compares transformers against that run's ``accuracy_after`` on the same held-out prompts;
it needs torch and transformers (skipped without them unless ``NEREUS_REQUIRE_HF=1``).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MIN_GAIN = 0.15
MIN_LORA_GAIN = 0.10  # rank 16 adapters on the same run (issue 34's bar)
SEED = 0


def _run(args: list[str], timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the job sets its own device count
    env["XLA_FLAGS"] = os.environ.get("NEREUS_TEST_XLA_FLAGS", "")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict:
    """tools/make_pretrained.py's summary (its last stdout line) for a fresh folder."""
    out = tmp_path_factory.mktemp("tiny-math")
    stdout = _run(["tools/make_pretrained.py", "--out", str(out), "--seed", str(SEED)], timeout=1800)
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def post_trained(pretrained, tmp_path_factory) -> tuple[Path, dict]:
    """(RUN_DIR, summary.json) of the GRPO run on that checkpoint."""
    run_dir = tmp_path_factory.mktemp("hf-grpo") / "run"
    _run(["-m", "nereus_jax.train", "configs/hf_grpo_tiny.yaml", f"model.hf_path={pretrained['model']}",
          f"task.prompt_file={pretrained['train']}", f"task.eval_file={pretrained['eval']}",
          f"logging.cache_dir={run_dir.parent / 'cache'}", "logging.progress=false", "--run-dir", str(run_dir)],
         timeout=1800)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")  # module scope: set up before short_run, the other module-scoped fixture
def transformers():
    """Skips (before the pipeline is made) without torch and transformers, unless NEREUS_REQUIRE_HF=1."""
    if os.environ.get("NEREUS_REQUIRE_HF") != "1":
        why = "transformers parity needs torch and transformers (pip install -e '.[hf]' on Python 3.11)"
        pytest.importorskip("torch", reason=why)
        pytest.importorskip("transformers", reason=why)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[dict, Path, dict]:
    """A CI-sized version of the same two commands for the transformers comparison: a briefly supervised
    checkpoint (100 SFT steps, small splits), 4 GRPO steps on it. (pretrained summary, RUN_DIR, summary)"""
    out = tmp_path_factory.mktemp("tiny-math-short")
    made = json.loads(_run(["tools/make_pretrained.py", "--out", str(out), "--seed", str(SEED), "--max-steps", "100",
                            "--check-every", "100", "--target-accuracy", "1", "--sft-size", "4000",
                            "--train-size", "256", "--eval-size", "96"], timeout=1200).strip().splitlines()[-1])
    run_dir = out / "run"
    _run(["-m", "nereus_jax.train", "configs/hf_grpo_tiny.yaml", f"model.hf_path={made['model']}",
          f"task.prompt_file={made['train']}", f"task.eval_file={made['eval']}", "trainer.steps=4",
          f"logging.cache_dir={out / 'cache'}", "logging.progress=false", "--run-dir", str(run_dir)], timeout=1200)
    return made, run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.long  # with the learning test: the full-size checkpoint (800 SFT steps, ~5 min) is theirs alone
def test_make_pretrained_writes_a_loadable_chat_checkpoint_and_disjoint_prompt_files(pretrained):
    model = Path(pretrained["model"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (model / name).is_file(), name
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert "chat_template" in json.loads((model / "tokenizer_config.json").read_text())
    train, held_out = ([json.loads(line) for line in Path(pretrained[k]).read_text().splitlines()]
                       for k in ("train", "eval"))
    questions = {r["prompt"][0]["content"] for r in train}
    assert not questions & {r["prompt"][0]["content"] for r in held_out}, "held-out prompts leak into RL training"
    assert all(r["prompt"][0]["role"] == "user" and r["answer"].lstrip("-").isdigit() for r in train + held_out)
    # "pretrained", with room left for RL: solves some of the validation split, far from all
    assert pretrained["sft_steps"] == 800 and 0.3 <= pretrained["validation_accuracy"] < 0.8, pretrained


@pytest.mark.slow
@pytest.mark.long  # ~7 min with its checkpoint; CI runs the same commands CI-sized in the transformers parity test
def test_grpo_on_the_checkpoint_raises_held_out_pass_at_1_and_exports_it(post_trained):
    run_dir, summary = post_trained
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    assert gain >= MIN_GAIN, summary
    assert summary["eval_prompts"] == 256 and summary["prompts_dropped_overlong"] == 0, summary
    hf = run_dir / "hf"
    assert summary["hf_export"] and Path(summary["hf_export"]).resolve() == hf.resolve()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf / name).is_file(), name
    assert list(hf.glob("*.safetensors")), "no weights in the export"


@pytest.mark.slow
def test_exported_checkpoint_hf_parity_transformers_greedy_scores_our_engines_accuracy(transformers, short_run):
    """transformers' greedy generation (its own chat template rendering and stopping) on RUN_DIR/hf scores
    the held-out accuracy our engine measured at the end of the run (summary.json's accuracy_after), on
    the CI-sized pipeline (docs/results.md states both figures for the full one)."""
    sys.path.insert(0, str(REPO / "tools"))
    import eval_hf

    from nereus_jax.config import load_config

    made, run_dir, summary = short_run
    config = load_config(str(REPO / "configs" / "hf_grpo_tiny.yaml"))
    result = eval_hf.evaluate(run_dir / "hf", made["eval"], config.rollout.max_response_length)
    assert result["n"] == summary["eval_prompts"] == 96
    assert summary["accuracy_after"] > 0, summary  # a comparison of something: some answers are right
    assert result["accuracy"] == pytest.approx(summary["accuracy_after"], abs=1e-9), (result["accuracy"], summary)


@pytest.mark.slow
@pytest.mark.long  # the notebook repeats the learning run's commands (20 RL steps)
def test_post_train_notebook_runs_and_reports_before_and_after(pretrained, run_notebook, monkeypatch):
    """The notebook top to bottom, reusing the module's checkpoint (NEREUS_TINY_MATH) rather than making a
    second one: its own make-cell calls the same make_pretrained() the fixture ran as a command."""
    monkeypatch.setenv("NEREUS_TINY_MATH", str(Path(pretrained["model"]).parent))
    nb = run_notebook("post_train.ipynb")
    assert "reusing" in run_notebook.text(nb, "make")
    text = run_notebook.text(nb, "summary")
    scores = dict(re.findall(r"^\s*(accuracy_before|accuracy_after): ([-+.\deE]+)$", text, re.MULTILINE))
    assert set(scores) == {"accuracy_before", "accuracy_after"}, text
    assert all(0.0 <= float(v) <= 1.0 for v in scores.values()), scores
    assert "hf" in run_notebook.text(nb, "export")


@pytest.fixture(scope="module")
def lora_trained(pretrained, tmp_path_factory) -> tuple[Path, dict]:
    """(RUN_DIR, summary.json) of the same GRPO run training rank-16 LoRA adapters instead of the model."""
    run_dir = tmp_path_factory.mktemp("hf-grpo-lora") / "run"
    _run(["-m", "nereus_jax.train", "configs/hf_grpo_tiny.yaml", f"model.hf_path={pretrained['model']}",
          f"task.prompt_file={pretrained['train']}", f"task.eval_file={pretrained['eval']}", "model.lora_rank=16",
          "model.lora_alpha=32", "trainer.actor_lr=2e-3", f"logging.cache_dir={run_dir.parent / 'cache'}",
          "logging.progress=false", "--run-dir", str(run_dir)], timeout=1800)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.long  # ~2 min beyond the module's checkpoint
def test_lora_grpo_on_the_checkpoint_raises_held_out_pass_at_1_and_exports_an_adapter(lora_trained):
    run_dir, summary = lora_trained
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    assert gain >= MIN_LORA_GAIN, summary
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (run_dir / "adapter" / name).is_file(), name
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["r"] == 16
    assert list((run_dir / "hf").glob("*.safetensors")), "no merged weights in the export"
