"""Shared by the runtime tests: the tiny job's overrides and one warm-started actor per session."""

import os
import signal

import pytest
from jobs import tiny_config, warm_actor


@pytest.fixture(scope="session")
def warm(tmp_path_factory):
    """A warm-started actor (150 supervised steps of the tiny job), so RL steps have real reward signal: with
    none, the update is float noise that advantage whitening and Adam scale up, and nothing is compared.
    Cached in BASETEMP/warm-cache, where subprocess tests (test_faults) find it too."""
    cache = str(tmp_path_factory.getbasetemp() / "warm-cache")
    return warm_actor(tiny_config(["trainer.warmup_sft_steps=150"]), cache)


@pytest.fixture
def sigterm_after(monkeypatch):
    """``sigterm_after(n)``: this process gets SIGTERM right after the run report logs step ``n`` (the step
    has finished, as when a scheduler preempts the job then); it returns a function that disarms it."""
    from nereus_jax.runtime import report as report_mod

    step = report_mod.RunReport.step

    def arm(at: int):
        def step_then_signal(self, metrics):
            step(self, metrics)
            if metrics["step"] == at:
                os.kill(os.getpid(), signal.SIGTERM)

        monkeypatch.setattr(report_mod.RunReport, "step", step_then_signal)
        return lambda: monkeypatch.setattr(report_mod.RunReport, "step", step)

    return arm
