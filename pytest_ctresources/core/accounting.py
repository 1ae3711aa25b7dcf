"""Per-test VRAM accounting: the need a test declares, what it measured, and what follows.

The hooks in :mod:`~pytest_ctresources.plugin` call one function here per phase; everything
found goes into the test's state (:mod:`~pytest_ctresources.core.state`), and what the report
needs into its record, which travels to the controller (and to junit XML) in the teardown
report.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import warnings
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import pytest

from pytest_ctresources.core.learned import memory_key
from pytest_ctresources.core.record import PLAIN_RUN_WORKER, UNKNOWN_GPU
from pytest_ctresources.core.runtime import Runtime, own_settings
from pytest_ctresources.core.skips import skip_reason
from pytest_ctresources.core.state import STATE_KEY, TestState, state_of
from pytest_ctresources.exceptions import CtLeakWarning
from pytest_ctresources.gpu.cleanup import cuda_initialised
from pytest_ctresources.settings import markers
from pytest_ctresources.settings.activation import FIXTURES, item_asks
from pytest_ctresources.settings.config import AUTO, CircuitTracerConfig
from pytest_ctresources.settings.options import DEFAULT_INCREASE_PERCENT, Declared
from pytest_ctresources.settings.sources import Source, Sourced
from pytest_ctresources.units import GIB
from pytest_ctresources.xdist.roles import WORKER_ENV

if TYPE_CHECKING:
    # Imported where used: a run whose tests use no ct_session loads no estimator, and one
    # whose tests measure nothing no meter, regression check or OOM explanation.
    from pytest_ctresources.core.regression import Increase
    from pytest_ctresources.estimator.estimate import Estimate
    from pytest_ctresources.gpu.cleanup_between_tests import TestStart
    from pytest_ctresources.gpu.detect import GpuInfo
    from pytest_ctresources.gpu.measure import VramFigures
    from pytest_ctresources.session.cache import ResidentModel
    from pytest_ctresources.session.pruning import PruningOom
    from pytest_ctresources.session.session import CtSession

#: The plugin's fixtures, each of which gives the test a config.
_FIXTURES = frozenset(FIXTURES)
UNMARKED_BYTES = GIB  # a test that used more and declared nothing is flagged


def suggested_marker(peak_bytes: int, nodeid: str = "") -> str:
    """The declaration to write for a measured peak, rounded up to a whole GiB: the marker, or
    for a notebook its metadata."""
    gib = max(1, math.ceil(peak_bytes / GIB))
    if nodeid.rsplit("::", 1)[-1].endswith(".ipynb"):
        return f'"ctresources": {{"vram_gib": {gib}}} in the notebook\'s metadata'
    return f"@pytest.mark.vram(gib={gib})"


def begin(item: pytest.Item, runtime: Runtime) -> str | None:
    """Start measuring; resolve the test's need. Returns the skip reason, if it does not fit.

    Raises :class:`~pytest_ctresources.settings.markers.MarkerError` for a bad marker.
    """
    from pytest_ctresources.gpu.measure import VramMeter

    state = state_of(item)
    state.meter = meter = VramMeter()
    meter.start()
    state.resident_at_start = runtime.model_cache.resident
    state.resident_bytes_at_start = runtime.resident_bytes()
    cfg = state.config  # set at collection for notebook items
    if cfg is not None:
        # a notebook's own experiment config over a session-wide value
        state.record.own_settings = own_settings(runtime.session_config(), cfg)
    key, need = resolve_need(item, runtime)
    state.memory_key = key
    state.need = need
    if need is None:
        return None
    session = _uses_session(item, state.config)
    gpu = runtime.test_gpu()
    reason = skip_reason(need.gib, need.source, gpu, runtime.vram_capacity, runs_on_cpu=session)
    if reason is None and gpu is not None:
        state.record.gpu_ran = gpu.name  # a GPU test, run on a GPU (report/coverage.py)
    return reason


def nothing_to_measure(item: pytest.Item, runtime: Runtime) -> bool:
    """Whether :func:`begin` would find nothing for this test: it asks for nothing itself (no
    fixture or marker of the plugin), nothing is known of it from collection (a notebook's
    config) or an earlier attempt, no need was learned for it, and CUDA is not initialised,
    so its meter would start at nothing and it has no need. Its setup then skips
    :func:`begin`; should anything ask for the test's state (a fixture looked up by name,
    an OOM, a check, a teardown after CUDA was initialised), :func:`begin_late` gives it
    what :func:`begin` would have.
    """
    if STATE_KEY in item.stash or cuda_initialised() or item_asks(item):
        return False
    learned = runtime.learned()
    return not learned or learned.get(_key(item, None, runtime)) is None


def begin_late(
    state: TestState,
    item: pytest.Item,
    runtime: Runtime,
    resident: ResidentModel | None,
    resident_bytes: int,
    cleanup_start: TestStart | None,
) -> None:
    """What :func:`begin` and the cleanup's start would have given a test judged
    :func:`nothing_to_measure` at setup (``resident``, ``resident_bytes``,
    ``cleanup_start``: what was resident and open then), once something asks for its state:
    the meter of a test that started without CUDA, no need, its learned-need key."""
    from pytest_ctresources.gpu.measure import VramMeter

    state.meter = VramMeter()  # its start() without CUDA would have recorded nothing
    state.resident_at_start = resident
    state.resident_bytes_at_start = resident_bytes
    state.cleanup_start = cleanup_start
    state.memory_key = _key(item, None, runtime)


def _key(item: pytest.Item, cfg: CircuitTracerConfig | None, runtime: Runtime) -> str:
    """The test's learned-need key under its config (None: a test without one) and the
    run's ``--ct-vram-capacity``."""
    capacity = runtime.vram_capacity
    return memory_key(item.nodeid, cfg, capacity.value if capacity is not None else None)


def resolve_need(item: pytest.Item, runtime: Runtime) -> tuple[str, markers.VramNeed | None]:
    """The test's learned-need key and its need, in the documented order: ``vram`` marker,
    the config's ``VRAM_GIB``, a learned need, an estimate (None: none of them). Used at
    setup and, under VRAM placement, at collection (what the xdist scheduler places by).

    Raises :class:`~pytest_ctresources.settings.markers.MarkerError` for a bad marker.
    """
    cfg = state_of(item).config  # set at collection for notebook items
    if cfg is None and not _FIXTURES.isdisjoint(getattr(item, "fixturenames", ())):
        cfg = runtime.config_for(item)
    key = _key(item, cfg, runtime)
    need = markers.vram_need(item)
    if need is None and cfg is not None and cfg.vram_gib is not None:
        need = markers.VramNeed(cfg.vram_gib, cfg.source_of("vram_gib"))
    session = _uses_session(item, cfg)
    if need is None and key and runtime.learned():
        learned = runtime.learned().get(key)
        if learned is not None:
            need = markers.VramNeed(learned.gib, learned.source)
            if session and cfg is not None:
                need = learned_need_with_retry(need, cfg, runtime)
    if need is None and session and cfg is not None:
        need = estimated_need(cfg, runtime)
    return key, need


def _uses_session(item: pytest.Item, cfg: CircuitTracerConfig | None) -> bool:
    return cfg is not None and "ct_session" in getattr(item, "fixturenames", ())


def learned_need_with_retry(
    need: markers.VramNeed, cfg: CircuitTracerConfig, runtime: Runtime
) -> markers.VramNeed:
    """A learned peak is what the test took at its batch size; with ct_session's OOM retry
    it may still pass at a smaller one. So the skip is decided, as for an estimate, at the
    retry's floor: the least the estimate says it needs there (never skipped on the learned
    peak alone when the estimator does not know the model), while the learned peak stays
    the most it may take (its lease, the UNDER-DECLARED check)."""
    settings = runtime.settings
    floor = settings.oom_retry_floor.value
    if not settings.oom_retry.value or cfg.batch_size == AUTO or int(cfg.batch_size) <= floor:
        return need
    at_floor = estimated_need(cfg, runtime)
    least = min(need.gib, at_floor.gib) if at_floor is not None else 0.0
    if least >= need.gib:
        return need
    source = Source(
        "learned",
        f"{need.source}; {least:.1f} GiB at the OOM retry's floor, batch {floor}, estimated"
        if at_floor is not None
        else f"{need.source}; the OOM retry may need less",
    )
    # The most it may take, as for an estimate, is capped at the card: it will retry smaller.
    card = runtime.auto_budget().capacity_gib
    most = need.gib if card is None else min(need.gib, card)
    return markers.VramNeed(least, source, most_gib=most)


def estimated_need(cfg: CircuitTracerConfig, runtime: Runtime) -> markers.VramNeed | None:
    """The estimate of a ct_session test whose model and transcoders the registry knows.

    Two figures: the least it needs, at the smallest batch size ct_session may end up using
    (1 for ``auto``, ``ct_oom_retry_floor`` when the OOM retry is on, else the configured
    one), for the skip decision; and the most it may take, at the largest (``batch_size_max``
    for ``auto``, else the configured one) capped at the GPU, for its lease. Under
    ``--ct-vram-capacity``, a cap on PyTorch's allocator, the CUDA context is left out.
    """
    from pytest_ctresources.estimator.auto import counted
    from pytest_ctresources.estimator.of_config import estimate_config

    settings = runtime.settings
    tokens = settings.estimate_prompt_tokens.value
    auto = cfg.batch_size == AUTO
    most_batch = cfg.batch_size_max if auto else int(cfg.batch_size)
    if auto:
        least_batch, why = 1, " (auto's least)"
    elif settings.oom_retry.value and settings.oom_retry_floor.value < most_batch:
        least_batch, why = settings.oom_retry_floor.value, " (the OOM retry's floor)"
    else:
        least_batch, why = most_batch, ""
    least = estimate_config(cfg, tokens, batch_size=least_batch)
    most = estimate_config(cfg, tokens, batch_size=most_batch)
    if least is None or most is None:
        return None
    # The card auto would fill; an estimated need counts the reserved peak (what the test
    # takes from the card), plus the CUDA context on a real card.
    budget = runtime.auto_budget()

    def gib(prediction: Estimate) -> float:
        return round(counted(prediction, budget) / GIB, 2)

    # The lease is capped at the card (never below the least), the text says the estimate.
    ceiling = budget.capacity_gib
    most_gib = gib(most) if ceiling is None else max(gib(least), min(gib(most), ceiling))
    most_text = "" if most_batch == least_batch else f", {gib(most):.1f} GiB at batch {most_batch}"
    what = (
        f"{cfg.model_name}, {cfg.dtype}, batch {least_batch}{why}{most_text}, {tokens} prompt "
        "tokens"
    )
    return markers.VramNeed(gib(least), Source.estimate(what), most_gib=most_gib)


def allocated_beyond_baseline(item: pytest.Item) -> Callable[[], int | None]:
    """What the cleanup asks to decide whether garbage holds CUDA memory: the test's meter."""
    meter = state_of(item).meter
    return meter.allocated_beyond_baseline if meter is not None else lambda: None


def own_figures(item: pytest.Item, runtime: Runtime, *, finished: bool) -> VramFigures | None:
    """The test's figures as its own: a notebook's from its kernel; else the meter's, with a
    resident model the test did not use (another test's, still on the card) left out of the
    peaks, and what it made resident (or freed) left out of its leak."""
    state = state_of(item)
    if state.kernel_figures is not None:
        return state.kernel_figures
    meter = state.meter
    figures = meter.figures(finished=finished) if meter is not None else None
    if figures is None:
        return None
    resident_then = state.resident_at_start
    resident_now = runtime.model_cache.resident
    if finished:
        growth = runtime.resident_bytes() - state.resident_bytes_at_start
        figures = dataclasses.replace(figures, resident_bytes=growth)
    cfg = state.config
    reused = (
        cfg is not None
        and "ct_session" in getattr(item, "fixturenames", ())
        and resident_then is not None
        and runtime.model_cache.resident_for(cfg) is resident_then
    )
    if resident_then is not None and resident_now is resident_then and not reused:
        figures = figures.without_others_resident(resident_then.bytes)
    return figures


def end(item: pytest.Item, runtime: Runtime) -> None:
    """After teardown and cleanup: record the figures, warn about a leak."""
    state = state_of(item)
    resident_now = runtime.model_cache.resident
    figures = own_figures(item, runtime, finished=True)
    if figures is None:
        return
    state.figures = figures
    need = state.need
    gpu = runtime.gpu_facts().gpu(figures.device)
    record = state.record
    record.device = figures.device
    record.gpu = gpu.name if gpu is not None else UNKNOWN_GPU
    if gpu is not None:
        record.gpu_ran = gpu.name
    record.baseline_bytes = figures.baseline_bytes
    record.peak_allocated_bytes = figures.peak_allocated_bytes
    record.peak_reserved_bytes = figures.peak_reserved_bytes
    record.after_bytes = figures.after_bytes
    record.leaked_bytes = figures.leaked_bytes
    record.resident_bytes = figures.resident_bytes
    record.others_resident_bytes = figures.others_resident_bytes
    record.memory_key = state.memory_key
    record.date = datetime.date.today().isoformat()
    found = peak_increase(item, runtime, figures)
    if found is not None:
        record.peak_increase = found.to_dict()
    if need is not None:
        record.need_gib = need.gib
        record.need_source = str(need.source)
        record.need_kind = need.source.kind
        record.need_most_gib = need.lease_gib
    if resident_now is not None and resident_now is not state.resident_at_start:
        record.resident_model = resident_record(resident_now, figures.device)
    threshold = runtime.settings.leak_threshold.value
    if figures.leaked_bytes > threshold:
        warnings.warn(CtLeakWarning(leak_message(item.nodeid, figures, threshold)), stacklevel=1)


def peak_increase(item: pytest.Item, runtime: Runtime, figures: VramFigures) -> Increase | None:
    """How far the test's peak reserved grew over its last passing one, on the same GPU
    model and config, beyond ``--ct-fail-on-increase`` (10% without it; None: no further)."""
    key = state_of(item).memory_key
    learned = runtime.learned()
    before = learned.get(key) if key and learned else None
    if before is None:
        return None
    gpu = runtime.gpu_facts().gpu(figures.device)
    limit = runtime.settings.fail_on_increase.value
    from pytest_ctresources.core import regression

    return regression.increase(
        item.nodeid,
        before,
        figures.peak_reserved_gib,
        gpu.name if gpu is not None else UNKNOWN_GPU,
        datetime.date.today().isoformat(),
        runtime.library_versions(),
        DEFAULT_INCREASE_PERCENT if limit is None else limit,
    )


def resident_record(resident: ResidentModel, device: int) -> dict[str, object]:
    """What the report says of a resident model: which, how big, where, loaded by whom."""
    return {
        "model": resident.label,
        "bytes": resident.bytes,
        "device": device,
        "worker": os.environ.get(WORKER_ENV, PLAIN_RUN_WORKER),
        "loaded_by": resident.loaded_by,
    }


def leak_message(nodeid: str, figures: VramFigures, threshold: int) -> str:
    return (
        f"{nodeid} left {figures.leaked_bytes / GIB:.2f} GiB of CUDA memory allocated after "
        f"teardown and cleanup (threshold {threshold / GIB:.2f} GiB, ct_leak_threshold); "
        "usual holders: a module-level or global reference, a wider-scoped fixture, a cache "
        "of the test's own (models ct_session keeps loaded are counted apart, as resident)"
    )


def explain_oom(item: pytest.Item, runtime: Runtime, exc: BaseException) -> None:
    """Attach the ``ctresources: CUDA out of memory`` section to a test that raised OOM."""
    from pytest_ctresources.gpu import oom

    if not oom.is_oom(exc):
        return
    state = state_of(item)
    figures = state.meter.figures() if state.meter is not None else None
    session = state.session
    item.add_report_section(
        "call",
        "ctresources: CUDA out of memory",
        oom_section(
            state.config,
            runtime.gpu_facts().gpu(figures.device if figures else 0),
            runtime.vram_capacity,
            figures,
            pruning=session.pruning_oom_of(exc) if session is not None else None,
        ),
    )


def batch_size_advice(cfg: CircuitTracerConfig, batch_size: int) -> str:
    """Where to write ``batch_size`` so that it takes effect: in the layer that set the one in
    force, since a lower layer loses to it (docs/configuration.md's precedence): the test's
    ``ct_config`` marker, the experiment YAML that set it, else ``--ct-batch-size``."""
    source = cfg.source_of("batch_size")
    if source.kind == "marker":
        return f"`@pytest.mark.ct_config(batch_size={batch_size})`"
    if source.path is not None:
        return f"`BATCH_SIZE: {batch_size}` in {source.path}"
    return f"`--ct-batch-size {batch_size}`"


def oom_section(
    cfg: CircuitTracerConfig | None,
    gpu: GpuInfo | None,
    capacity: Sourced[float] | None,
    figures: VramFigures | None,
    *,
    pruning: PruningOom | None = None,
) -> str:
    """The report section of a test that raised ``torch.cuda.OutOfMemoryError``: ``pruning``
    when it came out of ``ct_session.graph_files`` or ``ct_session.prune`` (the batch size
    changes nothing there), else the attribution's."""
    lines = []
    if gpu is not None:
        line = f"{gpu.describe()}: {gpu.total_gib:.1f} GiB"
        if capacity is not None:
            line += f", emulated capacity {capacity.value:.1f} GiB ({capacity.source})"
        lines.append(line)
    if figures is not None:
        lines.append(
            f"peak before the failure: {figures.peak_allocated_bytes / GIB:.2f} GiB allocated, "
            f"{figures.peak_reserved_bytes / GIB:.2f} GiB reserved"
        )
    if pruning is not None:
        lines += pruning.explanation()
    if cfg is not None:
        lines.append("config in effect:")
        lines += [f"  {line}" for line in cfg.describe()]
    if pruning is not None:
        lines.append(pruning.next_step(cfg))
    elif cfg is not None:
        if isinstance(cfg.batch_size, int):
            half = max(1, cfg.batch_size // 2)
            lines.append(f"next step: try {batch_size_advice(cfg, half)}")
        else:
            lines.append(
                "next step: the estimate behind --ct-batch-size auto was too low here; raise "
                "ct_auto_margin, or set a batch size below the one auto chose"
            )
    else:
        lines.append(
            "next step: lower the test's memory use, or declare its need with "
            "@pytest.mark.vram(gib=...) so it is skipped where it does not fit"
        )
    return "\n".join(lines)


class _FailsPassedPhases:
    """A check registered only under its option: it fails a phase (setup, call, teardown)
    that passed, with one line naming the option, where :meth:`problems` finds any."""

    name: str
    option: str

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        if report.passed:
            problems = self.problems(item, call.when)
            if problems:
                report.outcome = "failed"
                report.longrepr = f"ctresources {self.option}: " + "; ".join(problems)
        return report

    def problems(self, item: pytest.Item, when: str) -> list[str]:
        raise NotImplementedError


class StrictChecks(_FailsPassedPhases):
    """``--ct-strict``: registered only then. Fails, after the test ran, what passed by luck."""

    name = "ctresources-strict"
    option = str(Declared.strict.option)

    def problems(self, item: pytest.Item, when: str) -> list[str]:
        if when == "call":
            return self.call_problems(item)
        if when == "teardown":
            figures = state_of(item).figures
            threshold = self.runtime.settings.leak_threshold.value
            if figures is not None and figures.leaked_bytes > threshold:
                return [leak_message(item.nodeid, figures, threshold)]
        return []

    def call_problems(self, item: pytest.Item) -> list[str]:
        figures = own_figures(item, self.runtime, finished=False)
        need = state_of(item).need
        problems = []
        if figures is not None and need is not None and need.exceeded_by(figures.peak_reserved_gib):
            problems.append(
                f"UNDER-DECLARED: peak {figures.peak_reserved_gib:.2f} GiB reserved exceeds the "
                f"declared {need.lease_gib:.1f} GiB ({need.source}); write "
                f"{suggested_marker(figures.peak_reserved_bytes, item.nodeid)}"
            )
        session = state_of(item).session
        if session is not None and session.halvings:
            problems.append(f"passed only after halving the batch size: {halving_summary(session)}")
        return problems


class IncreaseGate(_FailsPassedPhases):
    """``--ct-fail-on-increase``: registered only then. Fails a passed call whose peak grew
    over its last passing peak by more than the percentage given."""

    name = "ctresources-fail-on-increase"
    option = str(Declared.fail_on_increase.option)

    def problems(self, item: pytest.Item, when: str) -> list[str]:
        if when != "call":
            return []
        figures = own_figures(item, self.runtime, finished=False)
        found = peak_increase(item, self.runtime, figures) if figures is not None else None
        return [found.line()] if found is not None else []


def halving_summary(session: CtSession) -> str:
    """``OOM at batch 256, passed at 64 — use `BATCH_SIZE: 64` in x.yaml``."""
    first = session.halvings[0].failed_batch_size
    final = session.halvings[-1].next_batch_size
    return f"OOM at batch {first}, passed at {final} — use {batch_size_advice(session.cfg, final)}"
