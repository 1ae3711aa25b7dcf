"""Warning classes of the plugin, so users can filter them (``-W ignore::...``)."""

from __future__ import annotations

import pytest


class CtResourcesWarning(pytest.PytestWarning):
    """Base class of every warning pytest-ctresources issues."""


class CtLeakWarning(CtResourcesWarning):
    """A test left CUDA memory allocated after its teardown and cleanup."""


class AllocConfIneffectiveWarning(CtResourcesWarning):
    """PYTORCH_CUDA_ALLOC_CONF was set after CUDA had already initialised."""


class ReportFileWarning(CtResourcesWarning):
    """A report file (``--ct-report-json``, ``--ct-report-plot``) could not be written."""
