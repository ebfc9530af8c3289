"""Test setup: 8 CPU virtual devices and a fast-compiling XLA:CPU backend, set before JAX is imported anywhere;
float32 matmuls exact; one
persistent compilation cache per session; compiled programs dropped after every test module."""

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Tests compile far more than they compute: XLA:CPU's backend (LLVM) optimisation is most of a compile, so the suite
# runs with it at level 0 and without LLVM's expensive passes (measured: 20-29% less wall time for the modules
# tried, compute-heavy ones included; see docs/results.md). The HLO passes (fusion, sharding, buffer assignment)
# are unchanged, so memory figures and what the partitioner emits are the product's. NEREUS_TEST_XLA_OPT=1 keeps
# XLA's defaults (the code users run) for a check of the optimised backend.
_FAST_COMPILE = "" if os.environ.get("NEREUS_TEST_XLA_OPT") == "1" else (
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["NEREUS_TEST_XLA_FLAGS"] = _FAST_COMPILE.strip()  # for subprocesses that set their own device count
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           + _FAST_COMPILE).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole session, subprocesses included (they inherit the variables):
# fresh Jobs, CLIs and worker processes compile the same programs again and again (test_job.py: 300 -> 177 s).
# Entries are keyed by the program, jax version and flags, so a hit is the program a compile would produce.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="nereus-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """Drops every compiled program after each test module. XLA:CPU maps each executable's code into memory
    pages of its own; a process holding the whole suite's programs passes the kernel's vm.max_map_count
    (65,530 here: about 15,000 maps after two minutes of engine tests) and XLA aborts or segfaults in whatever
    compiles or (de)serializes next (test_job at 58%)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests need 8 CPU devices, got {len(devs)}: XLA_FLAGS was set too late"
    return devs


NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


class NotebookRun:
    """Executes ``notebooks/NAME`` top to bottom in a fresh kernel on this interpreter; ``text``/``cell`` read
    a tagged cell's stream output and the cell itself."""

    def __init__(self, kernel: str):
        self.kernel = kernel

    def __call__(self, name: str):
        import nbclient
        import nbformat

        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        # The notebook's own folder as the working directory, as in Jupyter: it finds the checkout from there.
        nbclient.NotebookClient(nb, kernel_name=self.kernel, timeout=600,
                                resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert not errors, errors
        return nb

    @staticmethod
    def cell(nb, tag: str):
        (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
        return cell

    @classmethod
    def text(cls, nb, tag: str) -> str:
        return "".join(o.get("text", "") for o in cls.cell(nb, tag).outputs if o.output_type == "stream")


@pytest.fixture
def run_notebook(tmp_path, monkeypatch) -> NotebookRun:
    """A kernelspec running ipykernel on sys.executable, found first on a temporary JUPYTER_PATH (so a
    ``python3`` kernelspec installed elsewhere can't pick another interpreter); TMPDIR is the test's
    tmp_path, so what a notebook writes with tempfile lands there. Skips without the notebook packages."""
    pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import KernelSpecManager

    kernel = "nereus-test-python"
    spec_dir = tmp_path / "jupyter" / "kernels" / kernel
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert KernelSpecManager().get_kernel_spec(kernel).argv[0] == sys.executable
    return NotebookRun(kernel)
