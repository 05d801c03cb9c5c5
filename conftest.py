"""Every test suite of the repository (tests/ and both partner packages): the fidelity gate's decisions go to a
folder of the run's own, and loading a model measures none on first use, so a run neither reads nor writes this
machine's decisions and spends no minutes calibrating; tests/test_gate.py turns measuring back on where it tests it.
Links trained on this machine are not read either (a folder of the run's own): a test sees the package's own."""

import os
import shutil
import tempfile


def pytest_configure(config):
    # set before any engine or server subprocess starts; servers inherit the environment
    gates = tempfile.mkdtemp(prefix="cacheblend-gates-")
    config.add_cleanup(lambda: shutil.rmtree(gates, ignore_errors=True))
    os.environ["CACHEBLEND_RAG_GATES"] = gates
    os.environ["CACHEBLEND_RAG_CALIBRATE"] = "0"
    links = tempfile.mkdtemp(prefix="cacheblend-links-")
    config.add_cleanup(lambda: shutil.rmtree(links, ignore_errors=True))
    os.environ["CACHEBLEND_RAG_LINKS"] = links
