"""notebooks/quickstart.ipynb runs top to bottom (nbclient, a fresh kernel on this interpreter) so it can't rot.

The kernel is this test's own Python (``sys.executable``; see the ``run_notebook`` fixture in conftest.py).
About 1 minute on 2 CPU cores (at most 300 warm-start steps and 12 GRPO steps of the tiny model).
"""

import re

import pytest


@pytest.mark.slow
def test_quickstart_runs_and_reports_accuracies(run_notebook, tmp_path):
    nb = run_notebook("quickstart.ipynb")  # its run folder (tempfile.mkdtemp) lands in tmp_path
    summary = dict(re.findall(r"^\s*(accuracy_\w+): ([-+.\deE]+)$", run_notebook.text(nb, "summary"), re.MULTILINE))
    assert {"accuracy_before", "accuracy_after"} <= set(summary), summary  # the notebook skips the SFT control
    for key, value in summary.items():
        assert 0.0 <= float(value) <= 1.0, (key, value)
    plot = run_notebook.cell(nb, "plot")
    assert "wrote" in run_notebook.text(nb, "plot"), "the plot cell should use tools/plot_run.py inside the repository"
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "the plot cell shows no image"
    (png,) = tmp_path.glob("nereus_quickstart_*/run/run.png")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
