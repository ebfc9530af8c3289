"""notebooks/quickstart.ipynb runs top to bottom (nbclient, a fresh kernel on this interpreter) so it can't rot.

The kernel is this test's own Python (``sys.executable``): a kernelspec pointing at it is written to a temporary
``JUPYTER_PATH`` folder, so a ``python3`` kernelspec installed elsewhere on the machine can't pick another
interpreter. About 1 minute on 2 CPU cores (at most 300 warm-start steps and 12 GRPO steps of the tiny model).
"""

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "nereus-test-python"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec that runs ipykernel on sys.executable, found first on JUPYTER_PATH."""
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
def test_quickstart_runs_and_reports_accuracies(kernel_name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's run folder (tempfile.mkdtemp) lands in tmp_path
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    # The notebook's own folder as the working directory, as in Jupyter: it finds the checkout from there.
    NotebookClient(nb, kernel_name=kernel_name, timeout=600, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    summary = dict(re.findall(r"^\s*(accuracy_\w+): ([-+.\deE]+)$", _text(_tagged(nb, "summary")), re.MULTILINE))
    assert {"accuracy_before", "accuracy_after"} <= set(summary), summary  # the notebook skips the SFT control
    for key, value in summary.items():
        assert 0.0 <= float(value) <= 1.0, (key, value)
    plot = _tagged(nb, "plot")
    assert "wrote" in _text(plot), "the plot cell should use tools/plot_run.py inside the repository"
    assert any("image/png" in o.get("data", {}) for o in plot.outputs), "the plot cell shows no image"
    (png,) = tmp_path.glob("nereus_quickstart_*/run/run.png")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
