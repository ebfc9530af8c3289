"""Learning speed of algorithm variants (issue 22), measured end to end with ``run_job``: DAPO vs GRPO on 2-digit
addition and on 3-number countdown (``configs/dapo_tiny.yaml``'s task), PPO's mini-batches on 2-digit addition.

Long tests (``python -m pytest -q -m long tests/runtime/test_learning_variants.py``); FIGURES in the docstrings
are runs on the 2-core development host (2026-12-02, jax 0.12); the CLI and this file gave the same numbers.
Total: about 6 min (366 s: two 60-step runs from one warm start, two 200-step PPO runs from another) plus the
countdown pair (two 100-step runs from a third warm start).
"""

import json

import pytest

from nereus_jax.config import load_config
from nereus_jax.runtime.run import run_job

# the GRPO learning test's settings (tests/runtime/test_job.py), for both algorithms
LEARNING = ["trainer.steps=60", "task.eval_size=128", "trainer.sft_control=false", "logging.progress=false",
            "logging.tensorboard=false"]
# grpo_tiny's task, which dapo_tiny no longer has (it runs countdown)
ADDITION = ["task.name=addition", "task.num_digits=2"]
# dapo_tiny's task, for both algorithms, over 100 steps
COUNTDOWN = [o for o in LEARNING if not o.startswith("trainer.steps=")] + [
    "trainer.steps=100", "task.name=countdown", "task.num_digits=3"]


def _steps(run_dir) -> list[dict]:
    """metrics.jsonl's per-step rows (the rollouts' accuracy is the step's own prompts, round 0)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step" in r and "accuracy" in r]


def _mean(values) -> float:
    return sum(values) / len(values)


def _grpo_and_dapo(root, overrides: list[str]) -> dict:
    """grpo_tiny and dapo_tiny with the same overrides from one warm start (trained once, in a shared cache
    dir): {config name: (summary, per-step rows)}."""
    runs, grpo = {}, load_config("grpo_tiny", overrides)
    for name in ("grpo_tiny", "dapo_tiny"):
        cfg = load_config(name, overrides + [f"logging.cache_dir={root / 'cache'}"])
        # the overrides reach both: the same task, rollouts and steps
        assert cfg.task.to_dict() == grpo.task.to_dict() and cfg.rollout.to_dict() == grpo.rollout.to_dict()
        assert cfg.trainer.steps == grpo.trainer.steps
        summary = run_job(cfg, str(root / name))
        runs[name] = summary, _steps(root / name)
    return runs


@pytest.fixture(scope="module")
def grpo_and_dapo(tmp_path_factory):
    """grpo_tiny and dapo_tiny on 2-digit addition, 60 steps each from one warm start."""
    return _grpo_and_dapo(tmp_path_factory.mktemp("grpo-vs-dapo"), LEARNING + ADDITION)


@pytest.fixture(scope="module")
def grpo_and_dapo_countdown(tmp_path_factory):
    """grpo_tiny and dapo_tiny on dapo_tiny's task (3-number countdown), 100 steps each from one warm start."""
    return _grpo_and_dapo(tmp_path_factory.mktemp("grpo-vs-dapo-countdown"), COUNTDOWN)


@pytest.mark.slow
@pytest.mark.long
def test_dapo_raises_sampled_accuracy_at_least_as_fast_as_grpo(grpo_and_dapo):
    """The same warm start, seed, prompts and 60 steps: DAPO's rollout accuracy (temperature 1, the step's own
    32 prompts x 4 samples) averaged over steps 30-59 is at least GRPO's. Measured (CLI, seed 0): 0.295 vs
    0.288; DAPO was ahead on this average in all 7 pairs measured (trainer.seed 0-3; rollout.seed 1-3 on
    trainer.seed 0), by 0.005-0.024."""
    (grpo, grpo_steps), (dapo, dapo_steps) = grpo_and_dapo["grpo_tiny"], grpo_and_dapo["dapo_tiny"]
    assert dapo["warm_start_cache_hit"] and dapo["accuracy_before"] == grpo["accuracy_before"]  # one warm start
    assert len(grpo_steps) == len(dapo_steps) == 60
    late = {name: _mean([r["accuracy"] for r in steps[30:]])
            for name, steps in (("grpo", grpo_steps), ("dapo", dapo_steps))}
    assert late["dapo"] >= late["grpo"], late


@pytest.mark.slow
@pytest.mark.long
def test_dapo_raises_held_out_accuracy_about_as_much_as_grpo(grpo_and_dapo):
    """Held-out greedy accuracy (128 prompts) after the 60 steps. Measured (CLI, seed 0): GRPO 0.234 -> 0.438,
    DAPO 0.234 -> 0.422. DAPO >= GRPO does NOT hold here (2 prompts fewer) and is a toss-up over seeds: DAPO
    ahead on trainer.seed 1-3 (0.766/0.750, 0.438/0.273, 0.625/0.586), behind on rollout.seed 0-3 of
    trainer.seed 0 (0.422/0.438, 0.391/0.477, 0.320/0.398, 0.336/0.477). So this asserts that DAPO learns
    (+0.10 over the warm start, GRPO's own test's bar) and stays within 0.05 (6 of 128 prompts) of GRPO."""
    (grpo, _), (dapo, _) = grpo_and_dapo["grpo_tiny"], grpo_and_dapo["dapo_tiny"]
    assert dapo["accuracy_after"] >= dapo["accuracy_before"] + 0.10, dapo
    assert dapo["accuracy_after"] >= grpo["accuracy_after"] - 0.05, (grpo["accuracy_after"], dapo["accuracy_after"])


@pytest.mark.slow
@pytest.mark.long
def test_dapo_raises_held_out_accuracy_at_least_as_fast_as_grpo_on_countdown(grpo_and_dapo_countdown):
    """Issue 22 on dapo_tiny's task, 3-number countdown, where about half the prompt groups after the warm start
    score all the same (dynamic sampling kept 0.42-0.49 of the groups it drew): the same warm start, seed,
    prompts, learning rate and 100 steps, only the algorithm section (and dapo_tiny's 2 mini-batches) differs.
    Held-out greedy accuracy (128 prompts), measured (CLI, seed 0): GRPO 0.477 -> 0.484, DAPO 0.477 -> 0.531.
    Over 7 seed pairs DAPO >= GRPO in 6 (GRPO/DAPO: rollout.seed 1-3 on trainer.seed 0 0.555/0.539,
    0.555/0.563, 0.508/0.547; trainer.seed 1-3 from their own warm starts 0.359/0.414, 0.492/0.555,
    0.438/0.438; mean 0.484 vs 0.512), and its rollout accuracy over steps 30-99 was ahead in all 7 (by
    0.034-0.045; seed 0: 0.486 vs 0.449). At 60 steps: DAPO >= GRPO in 6 of 7 too, but seed 0 ties (0.500)."""
    (grpo, grpo_steps), (dapo, dapo_steps) = grpo_and_dapo_countdown["grpo_tiny"], grpo_and_dapo_countdown["dapo_tiny"]
    assert dapo["warm_start_cache_hit"] and dapo["accuracy_before"] == grpo["accuracy_before"]  # one warm start
    assert len(grpo_steps) == len(dapo_steps) == 100
    assert dapo["accuracy_after"] > dapo["accuracy_before"], dapo  # it learns, so a tie is no empty tie
    assert dapo["accuracy_after"] >= grpo["accuracy_after"], (grpo["accuracy_after"], dapo["accuracy_after"])


def _first_step_reaching(accuracy: list[float], target: float, window: int = 10) -> int | None:
    """The first step whose trailing mean of ``window`` steps' rollout accuracy is >= target."""
    for i in range(len(accuracy)):
        if _mean(accuracy[max(0, i - window + 1): i + 1]) >= target:
            return i
    return None


@pytest.mark.slow
@pytest.mark.long
def test_ppo_with_four_mini_batches_reaches_the_default_runs_accuracy_no_later(tmp_path):
    """The default run (ppo_tiny: ``python -m nereus_jax.train``, 200 PPO steps, devices 6-7 leaving at 100 and
    back at 150) with trainer.mini_batches=1 (its default) and 4, the same seed. Target: the mini_batches=1
    run's rollout accuracy averaged over its last 10 steps (190-199); a run reaches it at the first step whose
    trailing 10-step mean is >= it. Measured (CLI, seed 0): target 0.688, reached at step 120 (mini_batches=1)
    and 114 (4); held-out greedy accuracy (256 prompts) 0.461 -> 0.859 (1) and 0.461 -> 0.883 (4; 0.891
    under pytest, the only figure that differed from the CLI).
    configs/default.yaml itself is no test of this: without a warm start its 20 steps score 0 throughout."""
    runs = {}
    for mini in (1, 4):
        cfg = load_config("ppo_tiny", [f"trainer.mini_batches={mini}", "trainer.sft_control=false",
                                       "logging.progress=false", "logging.tensorboard=false",
                                       f"logging.cache_dir={tmp_path / 'cache'}"])
        summary = run_job(cfg, str(tmp_path / f"mb{mini}"))
        runs[mini] = summary, [r["accuracy"] for r in _steps(tmp_path / f"mb{mini}")]
    target = _mean(runs[1][1][-10:])
    reached = {mini: _first_step_reaching(acc, target) for mini, (_, acc) in runs.items()}
    assert reached[4] is not None and reached[4] <= reached[1], (target, reached)
    after = {mini: summary["accuracy_after"] for mini, (summary, _) in runs.items()}
    assert after[4] >= after[1], after
