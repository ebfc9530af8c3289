"""notebooks/simulator.ipynb runs top to bottom (nbclient, a fresh kernel on this interpreter) and reports
simulated savings and a plot; the pattern of tests/test_notebooks.py."""

import json
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
KERNEL = "nereus-sim-test-python"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec that runs ipykernel on sys.executable, found first on JUPYTER_PATH."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == sys.executable
    return KERNEL


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _tagged(nb, tag: str):
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell


@pytest.mark.slow
def test_simulator_notebook_runs_and_reports_simulated_savings(kernel_name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nb = nbformat.read(NOTEBOOKS / "simulator.ipynb", as_version=4)
    nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    summary = _text(_tagged(nb, "summary"))
    assert "SIMULATED" in summary and "hardware table 'a100'" in summary
    values = dict(re.findall(r"^(savings_vs_fixed|excess_over_oracle): ([-+.\deE]+)$", summary, re.MULTILINE))
    assert set(values) == {"savings_vs_fixed", "excess_over_oracle"}
    assert float(values["excess_over_oracle"]) >= 0.0  # the oracle is a lower bound
    plot = _tagged(nb, "plot")
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)
    assert list(tmp_path.rglob("what_if.png"))
