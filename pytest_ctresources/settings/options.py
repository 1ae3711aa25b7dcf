"""Where the plugin's command-line options, ini keys and environment variables are declared.

Every session setting has up to three spellings: an option ``--ct-*``, an ini key ``ct_*``
and an environment variable ``CT_*``. :data:`SETTINGS` lists them in one table that
``pytest_addoption`` and :mod:`pytest_ctresources.settings.resolve` both read, so a new setting is
added in one place.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pytest_ctresources.settings.config import (
    MAX_COUNT,
    MAX_GIB,
    ConfigError,
    bound_text,
    parse_text,
    shown,
)
from pytest_ctresources.units import GIB, MIB

GROUP = "ctresources"
DEFAULT_LEAK_THRESHOLD = "256MiB"
_UNITS = {
    "b": 1,
    "kib": 1 << 10,
    "mib": MIB,
    "gib": GIB,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}
CLEANUP_MODES: tuple[str, ...] = ("auto", "always", "never")
DEFAULT_ALLOC_CONF = "expandable_segments:True"
#: How much a peak may grow, in percent, before it is an increase (``--ct-fail-on-increase``
#: given without a value, and the summary's warning without the option).
DEFAULT_INCREASE_PERCENT = 10.0
BINDING_MODES: tuple[str, ...] = ("auto", "off")
NOTEBOOK_INJECT_MODES: tuple[str, ...] = ("parameters", "top")
NOTEBOOK_CONFIGS_INI = "ct_notebook_configs"
SNAPSHOT_MODES: tuple[str, ...] = ("off", "on-failure", "always")


#: The longest a test may wait for its VRAM lease: a week. (Beyond threading.TIMEOUT_MAX, about
#: 292 years, waits raise OverflowError; a week is longer than any CI job runs.)
MAX_SECONDS = 7 * 24 * 3600.0


def _text(value: object) -> str:
    # Legacy [tool.pytest.ini_options] hands a TOML list to a "string" ini key unchanged.
    if not isinstance(value, str):
        raise ValueError(f"must be a single value, got the {type(value).__name__} {shown(value)}")
    return value


def _number(text: str, *, zero_ok: bool, most: float, unit: str, message: str) -> float:
    """Parse a finite float, positive (or 0 when ``zero_ok``), at most ``most``; else
    ``ValueError(message)``."""
    try:
        value = float(_text(text))
    except ValueError:
        value = -1.0  # nan, too: neither >= 0 nor > 0
    if not (value >= 0 if zero_ok else value > 0):
        raise ValueError(f"{message}, got {shown(text)}")
    if value > most:  # inf (1e400 parses as inf) included
        raise ValueError(f"must be at most {bound_text(most)}{unit}, got {shown(text)}")
    return value


def positive_number(text: str) -> float:
    """Parse a positive number of GiB, at most ``MAX_GIB``; raise ``ValueError`` with a
    user-facing message."""
    return _number(
        text, zero_ok=False, most=MAX_GIB, unit=" GiB", message="must be a positive number of GiB"
    )


def positive_count(text: str) -> int:
    """Parse a positive integer count, at most ``MAX_COUNT``; raise ``ValueError`` with a
    user-facing message."""
    try:
        value = int(_text(text))  # more than 4300 digits: ValueError too
    except ValueError:
        raise ValueError(f"must be a positive integer, got {shown(text)}") from None
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {shown(text)}")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}, got {shown(text)}")
    return value


def non_negative_gib(text: str) -> float:
    """Parse a number of GiB that may be 0, at most ``MAX_GIB``."""
    return _number(
        text, zero_ok=True, most=MAX_GIB, unit=" GiB", message="must be a number of GiB, 0 or more"
    )


def one_of(choices: tuple[str, ...], *, fold_case: bool = False) -> Callable[[str], str]:
    """A parser of a setting that takes one of ``choices`` (compared after stripping, and
    case-folded when ``fold_case``); the error names the choices and what was given."""

    def parse(text: str) -> str:
        value = _text(text).strip()
        if fold_case:
            value = value.lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {shown(text)}")
        return value

    return parse


binding_mode = one_of(BINDING_MODES, fold_case=True)
"""Parse ``ct_gpu_binding``."""
cleanup_mode = one_of(CLEANUP_MODES)
"""Parse ``ct_cleanup``."""
notebook_inject_mode = one_of(NOTEBOOK_INJECT_MODES)
"""Parse ``ct_notebook_inject``."""
snapshot_mode = one_of(SNAPSHOT_MODES, fold_case=True)
"""Parse ``ct_snapshot``."""


def directory_path(text: str) -> str:
    """Parse a directory path (checked where it is resolved, against the file system)."""
    value = _text(text).strip()
    if not value or "\0" in value:
        raise ValueError(f"must be a directory path, got {shown(text)}")
    return value


def fraction(text: str) -> float:
    """Parse a share in [0, 1)."""
    value = _number(
        text, zero_ok=True, most=math.inf, unit="", message="must be a number from 0 to below 1"
    )
    if value >= 1:
        raise ValueError(f"must be a number from 0 to below 1, got {shown(text)}")
    return value


def seconds(text: str) -> float:
    """Parse a positive number of seconds, at most ``MAX_SECONDS``."""
    return _number(
        text,
        zero_ok=False,
        most=MAX_SECONDS,
        unit=" seconds (a week)",
        message="must be a positive number of seconds",
    )


#: The largest ``--ct-fail-on-increase`` percentage and ``--ct-require-gpu-run-within`` days.
MAX_PERCENT = 10_000.0
MAX_DAYS = 3650.0


def _or_off(*, most: float, unit: str, what: str) -> Callable[[str], float | None]:
    """A parser of ``off`` (None) or a number of ``what``, 0 or more, at most ``most``."""

    def parse(text: str) -> float | None:
        if _text(text).strip().lower() == "off":
            return None
        return _number(
            text, zero_ok=True, most=most, unit=unit, message=f"must be {what}, 0 or more, or off"
        )

    return parse


seconds_or_off = _or_off(most=MAX_SECONDS, unit=" seconds (a week)", what="a number of seconds")
"""Parse a number of seconds that may be 0, or ``off`` (None)."""
percent_or_off = _or_off(most=MAX_PERCENT, unit="%", what="a percentage")
"""Parse a percentage, 0 or more, or ``off`` (None)."""
days_or_off = _or_off(most=MAX_DAYS, unit=" days", what="a number of days")
"""Parse a number of days, 0 or more, or ``off`` (None)."""


def byte_size(text: str) -> int:
    """Parse ``256MiB``, ``1GiB``, ``500MB`` or a bare number of MiB into bytes (at most
    ``MAX_GIB`` GiB)."""
    cleaned = _text(text).strip().lower().replace(" ", "")
    number = cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = cleaned[len(number) :] or "mib"
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value >= 0:
        raise ValueError(
            f"must be a size such as 256MiB, 1GiB or 500MB (a bare number is MiB), "
            f"got {shown(text)}"
        )
    if value * _UNITS[unit] > MAX_GIB * _UNITS["gib"]:  # inf included
        raise ValueError(f"must be at most {bound_text(MAX_GIB)}GiB, got {shown(text)}")
    return int(value * _UNITS[unit])


def alloc_conf(text: str) -> str:
    """Parse ``ct_alloc_conf``: the allocator options torch would accept, or empty."""
    from pytest_ctresources.gpu.allocator import check_alloc_conf

    return check_alloc_conf(_text(text).strip())


def _field_parser(field: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            return parse_text(field, _text(text))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    return parse


@dataclass(frozen=True)
class SettingSpec:
    """One session setting: its option, ini key, env var, parser and help."""

    dest: str
    option: str
    ini: str
    env: str | None
    metavar: str
    help: str
    parse: Callable[[str], object]
    field: str | None = None  # the CircuitTracerConfig field it sets, if any


SETTINGS: tuple[SettingSpec, ...] = (
    SettingSpec(
        "ct_batch_size",
        "--ct-batch-size",
        "ct_batch_size",
        "CT_BATCH_SIZE",
        "N|auto",
        "batch size of circuit-tracer attribution for every test (overrides the YAML; a "
        "test's own ct_config marker overrides it); 'auto' lets ct_session choose the largest "
        "whose estimated peak fits the GPU",
        _field_parser("batch_size"),
        field="batch_size",
    ),
    SettingSpec(
        "ct_batch_size_max",
        "--ct-batch-size-max",
        "ct_batch_size_max",
        "CT_BATCH_SIZE_MAX",
        "N",
        "the largest batch size --ct-batch-size auto chooses (default 512)",
        _field_parser("batch_size_max"),
        field="batch_size_max",
    ),
    SettingSpec(
        "ct_max_feature_nodes",
        "--ct-max-feature-nodes",
        "ct_max_feature_nodes",
        "CT_MAX_FEATURE_NODES",
        "N",
        "max_feature_nodes of circuit-tracer attribution for every test",
        _field_parser("max_feature_nodes"),
        field="max_feature_nodes",
    ),
    SettingSpec(
        "ct_config",
        "--ct-config",
        "ct_config",
        "CT_CONFIG",
        "PATH",
        "flat experiment YAML (MODEL_NAME, BATCH_SIZE, ...) applied to every test's config",
        str,
    ),
    SettingSpec(
        "ct_vram_capacity",
        "--ct-vram-capacity",
        "ct_vram_capacity",
        "CT_VRAM_CAPACITY",
        "GIB",
        "act as if the GPU had GIB of memory: used in skip decisions, and the CUDA allocator "
        "of this process is capped at it",
        positive_number,
    ),
    SettingSpec(
        "ct_snapshot",
        "--ct-snapshot",
        "ct_snapshot",
        "CT_SNAPSHOT",
        "off|on-failure|always",
        "record the CUDA allocator's history with Python stacks during each test and dump it "
        "(torch's memory snapshot, for https://pytorch.org/memory_viz) for a test that ran out "
        "of memory, leaked or went over its declared need ('on-failure'), or for every test "
        "('always'); default off",
        snapshot_mode,
    ),
    SettingSpec(
        "ct_snapshot_dir",
        "--ct-snapshot-dir",
        "ct_snapshot_dir",
        "CT_SNAPSHOT_DIR",
        "DIR",
        "where --ct-snapshot writes its files (default: beside --ct-report-json, else in "
        "pytest's cache directory)",
        directory_path,
    ),
)

INI_ONLY: tuple[tuple[str, str, str], ...] = (
    (
        "ct_leak_threshold",
        "CUDA memory still allocated after a test's teardown and cleanup, beyond its baseline, "
        "above which it is reported as a leak (256MiB, 1GiB, ...)",
        DEFAULT_LEAK_THRESHOLD,
    ),
    (
        "ct_oom_retry",
        "ct_session.attribute halves the batch size and retries after CUDA out-of-memory",
        "true",
    ),
    (
        "ct_oom_retry_floor",
        "the smallest batch size ct_session.attribute retries with after out-of-memory",
        "1",
    ),
    (
        "ct_cleanup",
        "after each test: 'auto' (close the figures it opened, release a failed test's "
        "frames; collect garbage when it left CUDA memory beyond its baseline, empty the "
        "CUDA cache when it holds 64 MiB or more), 'always' (also collect after every "
        "test) or 'never'",
        "auto",
    ),
    (
        "ct_gpu_binding",
        "under pytest-xdist: 'auto' binds each worker to one GPU of its host, round robin "
        "over the visible GPUs, before conftests are imported; 'off' leaves "
        "CUDA_VISIBLE_DEVICES alone",
        "auto",
    ),
    (
        "ct_leases",
        "a test with a known VRAM need takes it from its GPU's budget, shared by all of "
        "this user's pytest runs on the host (xdist or not), and waits while it is taken",
        "true",
    ),
    (
        "ct_default_vram_gib",
        "the lease of a test with no declared, configured or learned need (0: no lease)",
        "0",
    ),
    (
        "ct_lease_timeout",
        "seconds a test waits for its VRAM lease before it fails",
        "1800",
    ),
    (
        "ct_auto_margin",
        "share of the GPU's capacity that --ct-batch-size auto keeps free beyond the "
        "estimate's peak (reserved margin and CUDA context included)",
        "0.05",  # estimator/auto.py DEFAULT_AUTO_MARGIN (tests/test_options.py checks)
    ),
    (
        "ct_estimate_prompt_tokens",
        "prompt length in tokens assumed by the VRAM estimate of a ct_session test with no "
        "declared need, made before its prompt is known (skip decisions and leases)",
        "32",
    ),
    (
        "ct_progress_after",
        "seconds an attribution runs before a live progress line shows its phase and backward "
        "batches on the terminal (not under -q, -n or without a terminal); 'off' never",
        "3",
    ),
    (
        "ct_alloc_conf",
        "PYTORCH_CUDA_ALLOC_CONF set (if unset) before CUDA can initialise; empty disables",
        DEFAULT_ALLOC_CONF,
    ),
    (
        "ct_notebook_inject",
        "under --nbmake: 'parameters' injects a notebook's values after its cell tagged "
        "'parameters' (a config's notebook without one fails); 'top' injects them at the top "
        "where it has none (papermill's behaviour: the notebook may overwrite them)",
        "parameters",
    ),
    (
        "ct_fail_on_increase",
        "fail a test whose peak reserved grew by more than this percentage over its last "
        "passing peak on the same GPU model and config (same as --ct-fail-on-increase); "
        "'off' only warns in the summary",
        "off",
    ),
    (
        "ct_require_gpu_run_within",
        "fail the run when a GPU test skipped in it has not really run on a GPU for this "
        "many days (same as --ct-require-gpu-run-within)",
        "off",
    ),
)


def argparse_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """Wrap a parser so argparse reports its message as ``argument --ct-x: message``."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def argparse_text(parse: Callable[[str], object]) -> Callable[[str], str]:
    """As :func:`argparse_type`, but the option keeps its text, checked by ``parse`` now and
    parsed where it is resolved: for a setting whose value can be None (``off``), which an
    option not given is too."""
    check = argparse_type(parse)

    def convert(text: str) -> str:
        check(text)
        return text

    return convert


def add_options(parser: pytest.Parser) -> None:
    """Declare the ``ctresources`` option group and the ``ct_*`` ini keys."""
    # Every option defaults to None: a value other than None is the project asking the plugin
    # to act (settings/activation.py).
    group = parser.getgroup(GROUP, "circuit-tracer GPU resources (pytest-ctresources)")
    for spec in SETTINGS:
        env = f" [env {spec.env}]" if spec.env else ""
        group.addoption(
            spec.option,
            dest=spec.dest,
            metavar=spec.metavar,
            type=argparse_type(spec.parse),
            default=None,
            help=f"{spec.help}{env}",
        )
        parser.addini(spec.ini, f"{spec.help} (same as {spec.option})", type="string", default=None)
    group.addoption(
        "--ct-report",
        action="store_true",
        default=None,
        help="print the VRAM report even when no test used CUDA",
    )
    group.addoption(
        "--ct-report-top",
        dest="ct_report_top",
        metavar="N",
        default=None,
        type=argparse_type(positive_count),
        help="how many tests (by peak) the VRAM report lists (default 10)",
    )
    group.addoption(
        "--ct-report-json",
        dest="ct_report_json",
        metavar="PATH",
        default=None,
        help="write every test's VRAM record, the GPU facts and the settings as JSON to PATH",
    )
    group.addoption(
        "--ct-report-plot",
        dest="ct_report_plot",
        metavar="PATH",
        default=None,
        help="write a bar chart (PNG) of per-test VRAM peaks against capacity to PATH",
    )
    group.addoption(
        "--ct-strict",
        action="store_true",
        default=None,
        help="fail tests that exceed their declared VRAM need, leak above ct_leak_threshold, "
        "or pass only after ct_session halved the batch size",
    )
    group.addoption(
        "--ct-no-oom-retry",
        dest="ct_oom_retry",
        action="store_false",
        default=None,
        help="ct_session.attribute does not halve the batch size and retry after OOM",
    )
    group.addoption(
        "--ct-no-leases",
        dest="ct_leases",
        action="store_false",
        default=None,
        help="run tests without taking VRAM leases (tests of this run's workers and of "
        "other runs may then exceed a shared GPU's memory)",
    )
    group.addoption(
        "--ct-forget",
        action="store_true",
        default=None,
        help="clear the VRAM needs learned by earlier runs (kept in pytest's cache)",
    )
    _add_placement_options(group)
    _add_history_options(group)
    for name, help_text, default in INI_ONLY:
        # default=None tells "unset" from "set to the default" (or to empty, for ct_alloc_conf)
        parser.addini(name, f"{help_text} [default: {default}]", type="string", default=None)
    parser.addini(
        NOTEBOOK_CONFIGS_INI,
        "under --nbmake: experiment YAML files collected as notebook items (files, folders, "
        "globs; relative to the ini file); a YAML file named on the command line always is",
        type="linelist",
        default=[],
    )


def _plan_gpus(text: str) -> str:
    from pytest_ctresources.xdist.plan import parse_gpus

    if text.strip().lower() != "detected":
        parse_gpus(text)
    return text


def _shard(text: str) -> tuple[int, int]:
    from pytest_ctresources.xdist.placement import parse_shard

    return parse_shard(text)


def _runner_gpus(text: str) -> list[float]:
    from pytest_ctresources.xdist.plan import parse_gpus

    return [gpu.capacity_gib for gpu in parse_gpus(text)]


def _add_placement_options(group: pytest.OptionGroup) -> None:
    """VRAM placement's options: the plan before a run, and a CI matrix's shard."""
    group.addoption(
        "--ct-plan",
        dest="ct_plan",
        metavar="GPUS",
        nargs="?",
        const="detected",
        default=None,
        type=argparse_type(_plan_gpus),
        help="collect only, and print which tests would run on which GPU, which skip and why, "
        "and the predicted wall time; GPUS: 2x80,4x24 or names (H200, A100-80GB, RTX-4090), "
        "default the GPUs detected",
    )
    group.addoption(
        "--ct-plan-workers",
        dest="ct_plan_workers",
        metavar="N",
        default=None,
        type=argparse_type(positive_count),
        help="workers per GPU in --ct-plan (default 1)",
    )
    group.addoption(
        "--ct-shard",
        dest="ct_shard",
        metavar="K/N",
        default=None,
        type=argparse_type(_shard),
        help="run job K's share of an N-job GPU matrix: every test once, on the smallest "
        "runner class that fits it, shares balanced by learned durations",
    )
    group.addoption(
        "--ct-runner-gpus",
        dest="ct_runner_gpus",
        metavar="GPUS",
        default=None,
        type=argparse_type(_runner_gpus),
        help="with --ct-shard: the GPU of each of the N jobs (80 for all; 2x24,80 job by job; "
        "default: this job's GPU, for all)",
    )


def _add_history_options(group: pytest.OptionGroup) -> None:
    """What earlier runs tell: the VRAM regression gate and the GPU tests' last real runs."""
    group.addoption(
        "--ct-fail-on-increase",
        dest="ct_fail_on_increase",
        metavar="PCT",
        nargs="?",
        const=f"{DEFAULT_INCREASE_PERCENT:g}",
        default=None,
        type=argparse_text(percent_or_off),
        help="fail a test whose peak reserved grew by more than PCT percent (default "
        f"{DEFAULT_INCREASE_PERCENT:g}) over its last passing peak on the same GPU model and "
        "config; "
        "without it the summary warns",
    )
    group.addoption(
        "--ct-require-gpu-run-within",
        dest="ct_require_gpu_run_within",
        metavar="DAYS",
        default=None,
        type=argparse_text(days_or_off),
        help="fail the run when a GPU test skipped in it has not really run on a GPU "
        "within DAYS days (or never did)",
    )
