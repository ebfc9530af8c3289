"""notebooks/simulator.ipynb runs top to bottom (nbclient, a fresh kernel on this interpreter) and reports
simulated savings and a plot; the pattern of tests/test_notebooks.py."""

import re

import pytest

pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_simulator_notebook_runs_and_reports_simulated_savings(run_notebook, tmp_path):
    nb = run_notebook("simulator.ipynb")
    summary = run_notebook.text(nb, "summary")
    assert "SIMULATED" in summary and "hardware table 'a100'" in summary
    values = dict(re.findall(r"^(savings_vs_fixed|excess_over_oracle): ([-+.\deE]+)$", summary, re.MULTILINE))
    assert set(values) == {"savings_vs_fixed", "excess_over_oracle"}
    assert float(values["excess_over_oracle"]) >= 0.0  # the oracle is a lower bound
    plot = run_notebook.cell(nb, "plot")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    assert list(tmp_path.rglob("what_if.png"))
