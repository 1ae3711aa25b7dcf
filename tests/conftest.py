"""Shared helpers for the plugin's own tests.

Plugin behaviour is tested with ``pytester`` projects; every run there must be offline and
must not see a GPU unless a test presents fake ones through ``CT_FAKE_GPUS``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# huggingface_hub reads HF_HUB_OFFLINE once, when imported (below): nothing in this suite may
# reach the hub, in-process runs included.
os.environ["HF_HUB_OFFLINE"] = "1"

from pytest_ctresources.xdist.roles import runs_no_tests


def pytest_configure(config: pytest.Config) -> None:
    # In-process pytester runs restore sys.modules afterwards, so a C-extension package first
    # imported inside one (torch, when a run uses --ct-vram-capacity or a test imports it)
    # would be imported a second time by the next run and crash ("SystemError: bad call
    # flags"). Importing it once here, before any test, keeps it in the snapshot; likewise the
    # stack the tiny models use, so that projects running an attribution run in-process
    # (fast) rather than in a subprocess that imports it all again. Not in an xdist
    # controller, which runs no test: the stack (some 5 CPU-s) would only delay its workers'
    # start.
    if runs_no_tests(config):
        return
    import circuit_tracer
    import circuit_tracer.attribution.attribute
    import circuit_tracer.replacement_model.replacement_model_nnsight  # noqa: F401
    import nnsight  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.models.gemma2.modeling_gemma2
    import transformers.models.gemma3.modeling_gemma3
    import transformers.models.llama.modeling_llama
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    import pytest_ctresources.testing  # noqa: F401


CT_ENV_VARS = (
    "CT_BATCH_SIZE",
    "CT_BATCH_SIZE_MAX",
    "CT_MAX_FEATURE_NODES",
    "CT_CONFIG",
    "CT_VRAM_CAPACITY",
    "CT_FAKE_GPUS",
    "CT_FAKE_GPUS_USED",
)


@pytest.fixture(autouse=True)
def _offline_and_clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in CT_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    # This suite runs under `-n 2`: a pytester run must not inherit the outer worker's
    # identity (a nested pytest is no worker; tests that want one set these themselves).
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def private_temp_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A temp directory of the test's own (``TMPDIR``, and ``tempfile`` in this process), so
    the VRAM ledger directory in it is the test's own: the budget is one per GPU for every run
    of the user on the host, and fake GPUs have the same UUIDs in every run, so tests (and
    other suites running at the same time) would share budgets otherwise. Short, because
    Jupyter kernels put their IPC sockets under it (a socket path has at most 107 bytes).
    """
    tmp_path_factory.getbasetemp()  # pytest's own, chosen before TMPDIR changes
    path = Path(tempfile.mkdtemp(prefix="ct-"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


#: Plugins the test environment installs that the projects pytester runs do without:
#: pytest-randomly (in the test extra) would shuffle their tests, which often depend on their
#: order; typeguard's and jaxtyping's (circuit-tracer's dependencies) and anyio's (Jupyter's)
#: serve no project here. Loading them is most of a pytest start-up (0.17 s of 0.65 s CPU on
#: the 2-core machine, and nbmake another 0.19 s), paid by every subprocess run and xdist
#: worker of the suite.
OFF_IN_PROJECTS = ("randomly", "typeguard", "jaxtyping", "anyio")


@pytest.fixture
def pytester(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> pytest.Pytester:
    """pytest's own ``pytester``, with :data:`OFF_IN_PROJECTS` off in the projects it runs,
    and nbmake too unless the test carries the ``nbmake`` marker. (Pytester clears
    PYTEST_ADDOPTS when it starts, hence an override; subprocesses and xdist workers inherit
    it.) The coexistence tests turn them back on where they want them."""
    off = [*OFF_IN_PROJECTS]
    if request.node.get_closest_marker("nbmake") is None:
        off.append("nbmake")
    monkeypatch.setenv("PYTEST_ADDOPTS", " ".join(f"-p no:{name}" for name in off))
    # The summary folds its lines at the terminal's width; tests match whole lines, so their
    # projects get a wide terminal (tests of the folding set their own).
    monkeypatch.setenv("COLUMNS", "300")
    return pytester


TINY_YAML = """\
# the bundled tiny offline model
MODEL_FAMILY: gemma2
MODEL_NAME: ctresources/tiny-gemma-2
TRANSCODER_SET: ctresources/random-jumprelu
BATCH_SIZE: 128
MAX_FEATURE_NODES: 40
PARAMS:
  PROMPT: the capital of france is
"""
