"""pytest-ctresources hook wiring: the one place that registers hooks. Each hook is a few
lines that call the room doing the work (docs/architecture.md draws the map):

- ``settings/``: the options, ini keys and variables declared, the settings resolved, configs
  and markers;
- ``gpu/``: GPU facts, the allocator, measurement, skip decisions, OOM, cleanup;
- ``session/``: ``ct_session``, the model cache, the fixtures, progress;
- ``core/``: the run's state and each test's accounting;
- ``report/``: the summary, the report files, learned needs, placements;
- ``leases/``: one VRAM budget per GPU for all the user's runs;
- ``xdist/``: workers bound to GPUs;
- ``notebooks/``: notebooks through nbmake (registered only under ``--nbmake``);
- ``estimator/``: the VRAM estimator, ``--ct-batch-size auto``, ``ct-resources``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

from pytest_ctresources.core.fixtures import ct_config, ct_session
from pytest_ctresources.settings import markers
from pytest_ctresources.settings.activation import (
    ACTIVATION_KEY,
    activation_from_config,
    activation_of,
    item_asks,
)
from pytest_ctresources.settings.options import Declared, add_options
from pytest_ctresources.units import named_pair
from pytest_ctresources.xdist.roles import runs_no_tests

if TYPE_CHECKING:
    from pytest_ctresources.core.learned import LearnedNeeds
    from pytest_ctresources.core.runtime import Runtime
    from pytest_ctresources.report.summary import SummaryReporter
    from pytest_ctresources.xdist.binding import Binding

# Only what every pytest start-up needs is imported above: the options, and whether the project
# asks for the plugin (settings/activation.py). Everything the plugin does once it acts is
# imported in the hook that does it, so a project that does not ask pays for none of it.

__all__ = ["ct_config", "ct_session"]

_BINDING_KEY: pytest.StashKey[Binding] = pytest.StashKey()
#: Set once the per-test hooks are registered (per_test.py), so they are registered once.
_ACTING_KEY = pytest.StashKey[bool]()
#: The run's runtime once started (core/runtime.py's own key is not imported before then).
_RUNTIME_KEY: pytest.StashKey[Runtime] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # Whether the project asks the plugin to act, decided before its conftests run: a project
    # that does not ask keeps its environment as it is (settings/activation.py).
    activation = activation_from_config(early_config, early_config.known_args_namespace)
    early_config.stash[ACTIVATION_KEY] = activation
    if not activation.project_wide:
        return
    # Conftests are imported right after this hook and may import torch and touch CUDA:
    # the allocator default must be in the environment before then.
    _apply_alloc_conf(early_config)
    # An xdist worker is bound to its GPU here, before conftests can initialise CUDA.
    # (A bad ct_gpu_binding is left for the settings to report, at configure.)
    try:
        setting = Declared.gpu_binding
        mode = setting.parse(str(setting.early_ini(early_config) or setting.default))
    except ValueError:
        mode = "off"
    from pytest_ctresources.xdist.roles import is_worker

    if mode == "auto" and is_worker(os.environ):
        binding = _bind_worker()
        if binding is not None:
            early_config.stash[_BINDING_KEY] = binding


def _apply_alloc_conf(config: pytest.Config) -> None:
    """Put ``ct_alloc_conf`` (or the default) into the environment unless the user set an
    allocator variable. (A bad value, a TOML list included, is not applied; the settings
    report it at configure.)"""
    from pytest_ctresources.gpu.allocator import ALLOC_KEY, AllocConf

    setting = Declared.alloc_conf
    value = setting.early_ini(config)
    alloc = AllocConf(str(setting.default if value is None else value).strip())
    alloc.apply()
    config.stash[ALLOC_KEY] = alloc
    config.add_cleanup(alloc.undo)


def _bind_worker() -> Binding | None:
    from pytest_ctresources.gpu.detect import detect_gpus
    from pytest_ctresources.leases.leases import open_seats
    from pytest_ctresources.xdist.binding import bind_worker

    try:
        facts = detect_gpus(torch_fallback=False)  # NVML only: no torch import at start-up
    except ValueError:
        return None  # a malformed CT_FAKE_GPUS: reported as a usage error at configure
    if not facts.gpus:
        return None
    return bind_worker(os.environ, facts, open_seats())


def pytest_configure(config: pytest.Config) -> None:
    for name in markers.MARKERS:
        config.addinivalue_line("markers", markers.marker_help(name))
    if ACTIVATION_KEY not in config.stash:  # a config made without the early hook
        config.stash[ACTIVATION_KEY] = activation_from_config(config, config.option)
    # A plain run of a project that does not ask: nothing more until collection shows whether
    # a test asks (pytest_collection_finish). Notebooks (their configs ask once collected)
    # and an xdist controller (its workers collect) start at once, as a project that asks.
    if (
        activation_of(config).project_wide
        or config.getoption("nbmake", False)
        or hasattr(config, "workerinput")
        or runs_no_tests(config)
    ):
        _start(config)
    _find_stale_learned(config)


def _find_stale_learned(config: pytest.Config) -> None:
    """Learned needs of tests that no longer exist are pruned (core/learned.py), in every
    process that collects, as collection goes; the needs are read at its end, and only where
    the plugin then acts."""
    if runs_no_tests(config) or not hasattr(config, "cache"):
        return  # the workers collect; without pytest's cache nothing is learned
    from pytest_ctresources.core.stale_learned import StaleLearnedNeeds, narrowed_files

    def learned() -> LearnedNeeds | None:
        runtime = config.stash.get(_RUNTIME_KEY, None)
        return runtime.learned() if runtime is not None else None

    config.pluginmanager.register(
        StaleLearnedNeeds(
            learned,
            lambda file: (config.rootpath / file).exists(),
            lambda stale: _report_stale(config, stale),
            narrowed_files(config),
        ),
        StaleLearnedNeeds.name,
    )


def _start(config: pytest.Config) -> Runtime:
    """Resolve the settings, start the run's :class:`Runtime` and register what the run
    needs: once per run, at configure or when the first test that asks is collected."""
    from pytest_ctresources.core import accounting
    from pytest_ctresources.core.runtime import RUNTIME_KEY, start_runtime
    from pytest_ctresources.gpu.allocator import ALLOC_KEY
    from pytest_ctresources.leases import leases
    from pytest_ctresources.report.summary import SummaryReporter

    if _RUNTIME_KEY in config.stash:
        return config.stash[_RUNTIME_KEY]
    activation = activation_of(config)
    binding = config.stash.get(_BINDING_KEY, None)
    if binding is not None and not hasattr(config, "workerinput"):
        # Not an xdist worker after all: a pytest run started from inside one inherits its
        # PYTEST_XDIST_WORKER. Undo the binding.
        binding.undo(os.environ)
        binding = None
    runtime = start_runtime(config, config.stash.get(ALLOC_KEY, None), binding)
    config.stash[RUNTIME_KEY] = config.stash[_RUNTIME_KEY] = runtime
    if activation.project_wide:
        _act_per_test(config, runtime)
        if hasattr(config, "workerinput"):
            _report_to_placement(config, runtime)
    if not hasattr(config, "workerinput"):  # xdist workers report to the controller instead
        reporter = SummaryReporter(runtime, config)
        if runtime.settings.forget.value:
            reporter.forgotten = runtime.learned().forget()
        config.pluginmanager.register(reporter, SummaryReporter.name)
        if config.pluginmanager.hasplugin("xdist"):
            from pytest_ctresources.xdist.learned_exchange import LearnedNeedsExchange

            config.pluginmanager.register(
                LearnedNeedsExchange(
                    lambda: runtime.learned().to_mapping(), reporter.stale_learned.update
                ),
                LearnedNeedsExchange.name,
            )
        if activation.project_wide:
            _learn_durations_and_place(config, reporter)
        # pytest-html's hooks exist only where it is loaded; it writes on this process only.
        # Its table's header is drawn before any test runs: the VRAM columns appear where the
        # project asks for the plugin as a whole.
        html_report = config.pluginmanager.hasplugin("html") and config.getoption("htmlpath", None)
        if html_report and activation.project_wide:
            from pytest_ctresources.report.html import HtmlReport

            config.pluginmanager.register(HtmlReport(reporter), HtmlReport.name)
        if runtime.settings.report_json_path is not None:
            from pytest_ctresources.report.files import on_sigterm

            on_sigterm(config, lambda signal_name: reporter.finish(None, signal_name))
    # --nbmake exists only where nbmake is loaded, under whatever name: "nbmake" from its
    # entry point, "nbmake.pytest_plugin" from -p or PYTEST_PLUGINS.
    if config.getoption("nbmake", False):
        from pytest_ctresources.notebooks.items import NotebookSupport

        config.pluginmanager.register(NotebookSupport(config), NotebookSupport.name)
    elif activation.project_wide:
        from pytest_ctresources.notebooks.configs import NotebookHint

        config.pluginmanager.register(NotebookHint(), NotebookHint.name)
    _plan_and_shard(config, runtime)
    if activation.project_wide:  # else once collection found a test that asks
        leases.start(config, runtime)  # VRAM leases where tests run; the ledger dir checked
    if runtime.settings.strict.value:
        config.pluginmanager.register(
            accounting.StrictChecks(runtime), accounting.StrictChecks.name
        )
    _register_history_checks(config, runtime)
    return runtime


def _register_history_checks(config: pytest.Config, runtime: Runtime) -> None:
    """``--ct-fail-on-increase`` where tests run, ``--ct-require-gpu-run-within`` where the
    summary is made."""
    from pytest_ctresources.core import accounting
    from pytest_ctresources.report.summary import SummaryReporter

    if runtime.settings.fail_on_increase.value is not None:
        config.pluginmanager.register(
            accounting.IncreaseGate(runtime), accounting.IncreaseGate.name
        )
    reporter = config.pluginmanager.get_plugin(SummaryReporter.name)
    if runtime.settings.require_gpu_run_within.value is not None and reporter is not None:
        from pytest_ctresources.report.coverage import GpuRunRequirement

        config.pluginmanager.register(
            GpuRunRequirement(lambda: reporter.summary.coverage), GpuRunRequirement.name
        )


def _learn_durations_and_place(config: pytest.Config, reporter: SummaryReporter) -> None:
    """On the controller (or the plain run) of a project that asks: learn durations (as the
    summary read them), and where xdist distributes, place tests by VRAM
    (xdist/scheduler.py)."""
    from pytest_ctresources.report.durations import LearnedDurations

    cache = config.cache if hasattr(config, "cache") else None
    durations = LearnedDurations(cache, reporter.summary.durations)
    config.pluginmanager.register(durations, LearnedDurations.name)
    if config.pluginmanager.hasplugin("xdist") and runs_no_tests(config):
        from pytest_ctresources.xdist.scheduler import PlacementController

        config.pluginmanager.register(
            PlacementController(durations.known), PlacementController.name
        )


def _report_to_placement(config: pytest.Config, runtime: Runtime) -> None:
    """In an xdist worker of a run placed by VRAM: report the GPU, and the needs once
    collected (xdist/exchange.py)."""
    from pytest_ctresources.xdist.exchange import PlacementWorker, placement_channel, worker_gpu

    channel = placement_channel(config)
    if channel is None:
        return
    worker = PlacementWorker(channel, _need_of(runtime))
    facts = runtime.gpu_facts(may_import_torch=False)
    gpu = runtime.binding.gpu if runtime.binding is not None else facts.gpu(0)
    capacity = runtime.vram_capacity
    worker.report_gpu(worker_gpu(gpu, facts, capacity.value if capacity is not None else None))
    config.pluginmanager.register(worker, PlacementWorker.name)


def _need_of(runtime: Runtime) -> Callable[[pytest.Item], float | None]:
    """A collected test's need in GiB, as its setup will decide it (None: none)."""
    from pytest_ctresources.core import accounting

    def need_of(item: pytest.Item) -> float | None:
        try:
            need = accounting.resolve_need(item, runtime)[1]
        except markers.MarkerError:
            return None  # it fails at setup, with its own message
        return need.gib if need is not None else None

    return need_of


def _plan_and_shard(config: pytest.Config, runtime: Runtime) -> None:
    """``--ct-plan`` (collect only, print the plan) and ``--ct-shard K/N`` (job K's share)."""
    settings = runtime.settings
    plan = settings.plan.value if settings.plan is not None else None
    shard = settings.shard.value if settings.shard is not None else None
    if plan is None and shard is None:
        return
    # Names imported from the modules themselves (not ``from package import module``): the
    # stash key ``ct-resources plan`` reads must be this very module's.
    from pytest_ctresources.report.durations import LearnedDurations, read
    from pytest_ctresources.xdist.plan_hooks import (
        PlanGpu,
        PlanReporter,
        ShardSelection,
        detected_gpus,
        plan_gpus,
    )

    def learned() -> Mapping[str, float]:
        # Where the run learns durations (the controller or the plain run), its own reader:
        # the cache is read once there, so a bad entry is one warning. (Each xdist worker of a
        # sharded run reads it again, and warns again.)
        durations: LearnedDurations | None = config.pluginmanager.get_plugin(LearnedDurations.name)
        if durations is not None:
            return durations.known()
        return read(config.cache if hasattr(config, "cache") else None)

    capacity = runtime.vram_capacity

    def detected() -> list[PlanGpu]:
        facts = runtime.gpu_facts(may_import_torch=False)
        return detected_gpus(facts, capacity.value if capacity is not None else None)

    if plan is not None:
        config.option.collectonly = True
        workers = settings.plan_workers.value
        config.pluginmanager.register(
            PlanReporter(config, plan_gpus(plan, detected), workers, _need_of(runtime), learned),
            PlanReporter.name,
        )
    if shard is not None:
        given = settings.runner_gpus.value if settings.runner_gpus is not None else None

        def runners() -> list[float]:
            if given:
                return list(given)
            gpus = detected()
            if not gpus:
                raise pytest.UsageError(
                    "--ct-shard: no GPU detected; give the jobs' GPUs (--ct-runner-gpus 80)"
                )
            return [gpus[0].capacity_gib]

        job, jobs = shard
        config.pluginmanager.register(
            ShardSelection(job, jobs, runners, _need_of(runtime), learned),
            ShardSelection.name,
        )


def _act_per_test(config: pytest.Config, runtime: Runtime) -> None:
    """Register what the plugin does around each test: only in a run it acts in, so that a
    project that does not ask has none of its hooks on the stack of any test."""
    from pytest_ctresources.gpu.cleanup_between_tests import BetweenTests

    cleaner = None
    if runtime.settings.cleanup.value != "never":
        cache = runtime.model_cache
        cleaner = BetweenTests(runtime.settings.cleanup.value, lambda: cache.unfreezes)
        config.pluginmanager.register(cleaner, BetweenTests.name)
    settings = runtime.settings
    recorder = None
    if settings.snapshot.value != "off":  # with off, no recording call at all
        from pytest_ctresources.report import snapshots

        recorder = snapshots.register(
            config, settings.snapshot.value, settings.snapshot_directory, settings.report_json_path
        )
    from pytest_ctresources.per_test import PerTestHooks

    config.pluginmanager.register(
        PerTestHooks(activation_of(config), runtime, cleaner, recorder), PerTestHooks.name
    )
    config.stash[_ACTING_KEY] = True


def pytest_collection_finish(session: pytest.Session) -> None:
    # A project that asks only through its tests: the plugin acts once collection found such a
    # test, before any test runs. The allocator default then too, while CUDA is not yet
    # initialised (torch reads the variable when CUDA initialises).
    config = session.config
    activation = activation_of(config)
    if activation.project_wide or _ACTING_KEY in config.stash:
        return
    # item_asks, not acts_for: nothing is cached on the 2,000 items of a project that asks
    # for nothing; a run that acts decides each test again, and caches it then.
    if not any(item_asks(item) for item in session.items):
        return
    from pytest_ctresources.gpu.allocator import ALLOC_KEY
    from pytest_ctresources.gpu.cleanup import cuda_initialised
    from pytest_ctresources.leases import leases

    if ALLOC_KEY not in config.stash and not cuda_initialised():
        _apply_alloc_conf(config)
    runtime = _start(config)
    _act_per_test(config, runtime)
    leases.start(config, runtime)


def _report_stale(config: pytest.Config, stale: set[str]) -> None:
    from pytest_ctresources.report.summary import SummaryReporter
    from pytest_ctresources.xdist.learned_exchange import send_stale

    if hasattr(config, "workerinput"):  # an xdist worker: the controller prunes
        send_stale(config, stale)
        return
    reporter = config.pluginmanager.get_plugin(SummaryReporter.name)
    if reporter is not None:
        reporter.stale_learned.update(stale)


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime = config.stash.get(_RUNTIME_KEY, None)
    if runtime is not None:
        runtime.model_cache.evict()
        from pytest_ctresources.gpu.cleanup_between_tests import BetweenTests

        cleaner = config.pluginmanager.get_plugin(BetweenTests.name)
        if cleaner is not None:
            cleaner.close()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if config.get_verbosity() < 1:
        return None
    activation = activation_of(config)
    if not activation.project_wide:
        return [activation.header_line()]
    from pytest_ctresources.report.header import header_lines

    return [activation.header_line(), *header_lines(config, _start(config))]


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(
    config: pytest.Config, report: pytest.TestReport | pytest.CollectReport
) -> Generator[None, dict[str, Any] | None, dict[str, Any] | None]:
    # An xdist worker sends its reports through execnet, which cannot send every int the
    # test's record holds (core/record.py's ``shipped``).
    data = yield
    if data is not None and _ACTING_KEY in config.stash and data.get("user_properties"):
        from pytest_ctresources.core.record import shipped

        sendable = shipped(data["user_properties"])
        if sendable is not None:
            data["user_properties"] = sendable  # a new list: the report keeps its own
    return data


@pytest.hookimpl(tryfirst=True)
def pytest_report_from_serializable(config: pytest.Config, data: dict[str, Any]) -> None:
    # The controller's side of the above, before pytest makes the report of ``data``.
    properties = data.get("user_properties")
    # Any entry a project appended, pairs or not: only a named pair holding a dict was shipped.
    if properties and any(
        (pair := named_pair(entry)) is not None and isinstance(pair[1], dict)
        for entry in properties
    ):
        from pytest_ctresources.core.record import unshipped

        received = unshipped(properties)
        if received is not None:
            data["user_properties"] = received


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # @pytest.mark.ct_parametrize: one test per element of a PARAMS list. This runs for every
    # test function of every project: the keywords (a few dict look-ups up the node chain)
    # rule out almost all of them before the markers are walked.
    definition = metafunc.definition
    if "ct_parametrize" not in definition.keywords:
        return
    if definition.get_closest_marker("ct_parametrize") is None:
        return
    from pytest_ctresources.settings.parametrize_tests import parametrize_from_params

    parametrize_from_params(metafunc, _start(metafunc.config).settings.experiment)
