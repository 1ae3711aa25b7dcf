"""The ``pytest -v`` header's lines: the settings with their sources, the GPUs, and the xdist
plan, folded at the terminal's width as the summary's lines are.

The GPUs come from NVML only (``may_import_torch=False``): the header must never be what
imports torch (docs/architecture.md, "Things learned the hard way").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pytest_ctresources.report.run_summary import wrapped
from pytest_ctresources.settings.sources import printable
from pytest_ctresources.xdist.binding import plan_line

if TYPE_CHECKING:
    import pytest

    from pytest_ctresources.core.runtime import Runtime


def header_lines(config: pytest.Config, runtime: Runtime) -> list[str]:
    """What ``-v`` prints once: settings, GPUs, and where xdist workers will run."""
    facts = runtime.gpu_facts(may_import_torch=False)
    lines = [
        *runtime.settings.header_lines(runtime.vram_capacity),
        *(f"ctresources: {line}" for line in facts.summary_lines()),
    ]
    workers = config.getoption("numprocesses", None)
    most = config.getoption("maxprocesses", None)
    if isinstance(workers, int) and isinstance(most, int):
        workers = min(workers, most)
    if runtime.settings.gpu_binding.value == "auto" and isinstance(workers, int):
        plan = plan_line(facts, workers)
        if plan is not None:
            lines.append(f"ctresources: {plan}")
    width = config.get_terminal_writer().fullwidth
    # Each line quotes names from files and devices (an experiment config's path, a model
    # name, a GPU's): escaped, an escape sequence in one cannot rewrite the terminal.
    return [part for line in lines for part in wrapped(printable(line), width)]
