"""pytest-ctresources hook wiring. Each hook is a few lines calling a module that does the work.

- options and ini keys: :mod:`~pytest_ctresources.options`
- settings resolution: :mod:`~pytest_ctresources.settings`
- GPU facts: :mod:`~pytest_ctresources.gpus`; skip decisions: :mod:`~pytest_ctresources.vram`
- cleanup: :mod:`~pytest_ctresources.cleanup`; allocator: :mod:`~pytest_ctresources.allocator`
- fixtures: :mod:`~pytest_ctresources.fixtures`
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from pytest_ctresources import accounting, markers
from pytest_ctresources.allocator import ALLOC_CONF_ENV, AllocConf, CapacityCap
from pytest_ctresources.cleanup import cleanup_after_test, cuda_initialised
from pytest_ctresources.exceptions import AllocConfIneffectiveWarning
from pytest_ctresources.fixtures import ct_config, ct_session
from pytest_ctresources.gpus import FAKE_GPUS_ENV, parse_fake_gpus
from pytest_ctresources.options import DEFAULT_ALLOC_CONF, add_options
from pytest_ctresources.runtime import RUNTIME_KEY, Runtime, runtime_of
from pytest_ctresources.settings import settings_from_config
from pytest_ctresources.summary import FIGURES_PROPERTY, SummaryReporter

__all__ = ["ct_config", "ct_session"]

_ALLOC_KEY = pytest.StashKey[AllocConf]()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Conftests are imported right after this hook and may import torch and touch CUDA:
    # the allocator default must be in the environment before then.
    value = early_config.getini("ct_alloc_conf")
    alloc = AllocConf(DEFAULT_ALLOC_CONF if value is None else value.strip())
    alloc.apply()
    early_config.stash[_ALLOC_KEY] = alloc
    early_config.add_cleanup(alloc.undo)


def pytest_configure(config: pytest.Config) -> None:
    for name in markers.MARKERS:
        config.addinivalue_line("markers", markers.marker_help(name))
    settings = settings_from_config(config)
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake is not None:
        try:
            parse_fake_gpus(fake)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    alloc = config.stash.get(_ALLOC_KEY, None) or AllocConf(settings.alloc_conf.value)
    if alloc.value and cuda_initialised():
        config.issue_config_time_warning(
            AllocConfIneffectiveWarning(
                f"CUDA was initialised before pytest-ctresources configured, so "
                f"{ALLOC_CONF_ENV}={alloc.effective() or alloc.value!r} had no effect; "
                "import torch lazily in conftest.py or set it in the environment"
            ),
            stacklevel=2,
        )
    capacity = settings.vram_capacity_gib
    runtime = Runtime(
        settings=settings,
        alloc_conf=alloc,
        capacity_cap=CapacityCap(capacity.value) if capacity else None,
        cache=getattr(config, "cache", None),  # None under -p no:cacheprovider
    )
    config.stash[RUNTIME_KEY] = runtime
    if runtime.capacity_cap is not None:
        # The emulated card must bind from the first CUDA allocation, whoever imports torch
        # and whenever: importing torch here does not initialise CUDA.
        runtime.capacity_cap.arm(import_torch=True)
    if not hasattr(config, "workerinput"):  # xdist workers report to the controller instead
        if settings.forget:
            runtime.learned().forget()
        config.pluginmanager.register(SummaryReporter(runtime, config), SummaryReporter.name)
    if settings.strict:
        config.pluginmanager.register(
            accounting.StrictChecks(runtime), accounting.StrictChecks.name
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime = config.stash.get(RUNTIME_KEY, None)
    if runtime is not None:
        runtime.model_cache.evict()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if config.get_verbosity() < 1:
        return None
    runtime = runtime_of(config)
    return [
        *runtime.settings.header_lines(),
        *(f"ctresources: {line}" for line in runtime.gpu_facts().summary_lines()),
    ]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    runtime = runtime_of(item.config)
    if runtime.capacity_cap is not None:
        runtime.capacity_cap.arm()
    try:
        reason = accounting.begin(item, runtime)
    except markers.MarkerError as exc:
        failure = str(exc)
    else:
        if reason is not None:
            # A skip mark, evaluated by pytest's skipping plugin right after this hook, reports
            # the test's own location rather than this file's.
            item.add_marker(pytest.mark.skip(reason=reason))
        return
    pytest.fail(failure, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        runtime = runtime_of(item.config)
        result = cleanup_after_test(runtime.settings.cleanup.value)
        if result.figures_closed:
            # Reported through the teardown report: output written here would be captured.
            item.user_properties.append((FIGURES_PROPERTY, result.figures_closed))
        accounting.end(item, runtime)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    except BaseException as exc:
        accounting.explain_oom(item, runtime_of(item.config), exc)
        raise
