"""The parsers of the plugin's setting values: text (an option, an ini key, a variable) in,
a checked value or a ``ValueError`` with a one-line message out.

Every parser is given text (a TOML list that a legacy ``[tool.pytest.ini_options]`` hands
to a string key is refused before, where the settings are resolved), bounds numbers
(``nan``, ``inf`` and ``1e400`` included), and quotes what it was given short and printable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pytest_ctresources.settings.config import (
    MAX_COUNT,
    MAX_GIB,
    ConfigError,
    bound_text,
    parse_bool,
    parse_text,
    shown,
)
from pytest_ctresources.units import GIB, MIB

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
BINDING_MODES: tuple[str, ...] = ("auto", "off")
NOTEBOOK_INJECT_MODES: tuple[str, ...] = ("parameters", "top")
SNAPSHOT_MODES: tuple[str, ...] = ("off", "on-failure", "always")


#: The longest a test may wait for its VRAM lease: a week. (Beyond threading.TIMEOUT_MAX, about
#: 292 years, waits raise OverflowError; a week is longer than any CI job runs.)
MAX_SECONDS = 7 * 24 * 3600.0


def _number(text: str, *, zero_ok: bool, most: float, unit: str, message: str) -> float:
    """Parse a finite float, positive (or 0 when ``zero_ok``), at most ``most``; else
    ``ValueError(message)``."""
    try:
        value = float(text)
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
        value = int(text)  # more than 4300 digits: ValueError too
    except ValueError:
        raise ValueError(f"must be a positive integer, got {shown(text)}") from None
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {shown(text)}")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}, got {shown(text)}")
    return value


#: The most xdist workers ``--ct-plan`` puts on one GPU: more than a GPU's memory divides
#: among, few enough that simulating them stays instant.
MAX_WORKERS_PER_GPU = 16


def workers_per_gpu(text: str) -> int:
    """Parse ``--ct-plan-workers``: a positive count, at most :data:`MAX_WORKERS_PER_GPU`."""
    value = positive_count(text)
    if value > MAX_WORKERS_PER_GPU:
        raise ValueError(f"must be at most {MAX_WORKERS_PER_GPU}, got {shown(text)}")
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
        value = text.strip()
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
    value = text.strip()
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
        if text.strip().lower() == "off":
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
    cleaned = text.strip().lower()
    unit = cleaned[len(cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")) :]
    number = cleaned.removesuffix(unit).rstrip()  # a space before the unit, none inside
    unit = unit or "mib"
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

    return check_alloc_conf(text.strip())


def field_parser(field: str) -> Callable[[str], object]:
    """The parser of config field ``field``'s text form (``--ct-batch-size``'s ``auto``)."""

    def parse(text: str) -> object:
        try:
            return parse_text(field, text)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    return parse


def text(value: str) -> str:
    """A setting's text as given (a path checked where it is resolved)."""
    return value


def boolean(value: str) -> bool:
    """Parse ``true/false``, ``yes/no``, ``on/off``, ``1/0``."""
    return parse_bool(value)  # a ConfigError is a ValueError


def plan_gpus(value: str) -> str:
    """Parse ``--ct-plan``'s GPUS (``2x80,4x24``, names, or ``detected``), kept as text: the
    detected GPUs are known only once the run starts."""
    from pytest_ctresources.xdist.plan import parse_gpus

    if value.strip().lower() != "detected":
        parse_gpus(value)
    return value


def shard(value: str) -> tuple[int, int]:
    """Parse ``--ct-shard K/N``."""
    from pytest_ctresources.xdist.placement import parse_shard

    return parse_shard(value)


def runner_gpus(value: str) -> tuple[float, ...]:
    """Parse ``--ct-runner-gpus``: each job's GPU capacity in GiB."""
    from pytest_ctresources.xdist.plan import parse_gpus

    return tuple(gpu.capacity_gib for gpu in parse_gpus(value))
