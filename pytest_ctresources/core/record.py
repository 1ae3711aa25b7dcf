"""The one record a test sends to the end-of-run report: written once, read once.

Under pytest-xdist the test runs in a worker and the report is made on the controller; the
only channel between them that every report consumer shares (junit XML included) is the
teardown report's ``user_properties``. So each test attempt's record is written there at the
end of its teardown, as one flat ``ct_<field>`` property per field that has a value
(:meth:`TestRecord.to_properties`), and read back on the controller from that report
(:meth:`TestRecord.from_properties`). The field names are the one list both sides use: rename
a field and both sides follow. Every field has a default, so a record from a worker of another
version reads with what it has, and an unknown property is ignored. The properties are data: a
project's own test may set a ``ct_`` one, or an entry that is not a pair; only a pair whose
value has its field's type is read.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from pytest_ctresources.units import named_pair

if TYPE_CHECKING:
    from pytest_ctresources.gpu.detect import GpuInfo

#: The prefix of every user property the plugin writes: its namespace in junit XML too.
PROPERTY_PREFIX = "ct_"
#: The worker name of a test that a plain (non-xdist) run leased for.
PLAIN_RUN_WORKER = "main"
#: The GPU a record names where the run could not tell which (and a worker's record lacks one).
UNKNOWN_GPU = "unknown GPU"
#: Where a notebook's injected cell went (``TestRecord.notebook_values``, the JSON report).
AFTER_PARAMETERS = "after_parameters"
AT_TOP = "top"


class OwnSetting(TypedDict):
    """A setting a test's own marker (or a notebook item's own config) kept over the value
    the session set: the field, the session's source and value, and the test's."""

    field: str
    session_source: str
    session_value: str
    value: str
    source: str


class NotebookValue(TypedDict):
    """A value injected into a notebook item, as the JSON report's ``notebook_values`` lists
    it: its ``name``, the Python literal assigned, where it came from, and where the cell went
    (:data:`AFTER_PARAMETERS` or :data:`AT_TOP`)."""

    name: str
    value: str
    source: str
    injected: str


@dataclass
class TestRecord:
    """What one test attempt reports, beyond its outcome (which pytest's report carries)."""

    # -- CUDA memory in the test's process (None: the test used no CUDA) --------------------
    device: int | None = None
    """CUDA ordinal the test used."""
    gpu: str | None = None
    """That GPU's name."""
    baseline_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    after_bytes: int | None = None
    leaked_bytes: int | None = None
    resident_bytes: int = 0
    """What the models ct_session keeps loaded grew by during the test (not a leak)."""
    others_resident_bytes: int = 0
    """Another test's resident model, left out of this test's peaks."""
    memory_key: str | None = None
    """The learned-need key: node id and the memory-relevant config."""
    date: str | None = None
    # -- its need ------------------------------------------------------------------------
    need_gib: float | None = None
    need_source: str | None = None
    need_kind: str | None = None
    need_most_gib: float | None = None
    # -- what ct_session did -------------------------------------------------------------
    attribution_batch_sizes: list[int] = field(default_factory=list)
    attribution_timings: list[dict[str, Any]] = field(default_factory=list)
    pruning_calls: list[dict[str, Any]] = field(default_factory=list)
    """One entry per successful ``ct_session.graph_files`` or ``prune`` call
    (session/pruning.py's ``PruningCall.to_dict``)."""
    auto_batch_sizes: list[str] = field(default_factory=list)
    """One line per call whose batch size ``auto`` chose: the choice and why."""
    oom_halvings: str | None = None
    resident_model: dict[str, Any] | None = None
    """The model this test loaded into ct_session's cache, which stays resident."""
    own_settings: list[OwnSetting] = field(default_factory=list)
    notebook_values: list[NotebookValue] = field(default_factory=list)
    """A notebook item's injected values, in its cell's order."""
    # -- cleanup -------------------------------------------------------------------------
    figures_closed: int = 0
    # -- where it ran, and its VRAM lease ------------------------------------------------
    worker: str | None = None
    """The xdist worker (``gw0``), or ``main`` for a plain run's test that took a lease."""
    gpu_name: str | None = None
    gpu_physical_index: int | None = None
    gpu_uuid: str | None = None
    lease_gib: float | None = None
    lease_wait_s: float | None = None
    """Seconds the test waited for its lease; -1 when it gave up (``ct_lease_timeout``)."""
    lease_gave_up_after_s: float | None = None
    """When it gave up: the seconds it waited before it did."""
    lease_reused_gib: float | None = None
    placed_because: str | None = None
    """Why the VRAM scheduler sent the test to this worker (xdist/scheduler.py)."""
    placed_kind: str | None = None
    """The kind of that reason (xdist/exchange.py's ``Placed.kind``)."""
    placed_beside: int = 0
    """How many other workers' tests it was packed beside on its GPU."""
    # -- its CUDA memory snapshot (--ct-snapshot) ----------------------------------------
    snapshot_file: str | None = None
    snapshot_why: str | None = None
    """out of memory, leak, over its declared need (or always)."""
    snapshot_moment: str | None = None
    """When ``snapshot_sites`` were alive: at the peak, when it ran out of memory."""
    snapshot_sites: list[dict[str, Any]] = field(default_factory=list)
    # -- what earlier runs tell ------------------------------------------------------------
    peak_increase: dict[str, Any] | None = None
    """Its peak grew over its last passing one (core/regression.py's ``Increase``)."""
    vram_skip: str | None = None
    """The plugin skipped it: its VRAM need did not fit (no GPU, or too small); the reason."""
    gpu_ran: str | None = None
    """The GPU it ran on, for a GPU test that was not skipped for VRAM (report/coverage.py)."""

    @property
    def used_cuda(self) -> bool:
        return self.peak_allocated_bytes is not None

    @property
    def placed(self) -> bool:
        """Whether it carries where it ran (a bound worker's test, or one that took a lease)."""
        return self.worker is not None

    def place(self, worker: str, gpu: GpuInfo) -> None:
        """Where the test ran: a bound xdist worker and its GPU, or the GPU a plain run's
        lease came from."""
        self.worker = worker
        self.gpu_name = gpu.name
        self.gpu_physical_index = gpu.physical_index
        self.gpu_uuid = gpu.uuid

    def to_properties(self) -> list[tuple[str, object]]:
        """The ``ct_*`` user properties of the fields that differ from their defaults: a test
        the plugin had nothing to say about carries none (its junit XML is as without it)."""
        return [
            (PROPERTY_PREFIX + name, value)
            for name, default in _defaults()
            if (value := getattr(self, name)) != default
        ]

    @classmethod
    def from_properties(cls, properties: Iterable[tuple[str, object]]) -> TestRecord:
        """The record a teardown report's ``user_properties`` carry (the last of a name wins;
        properties that are not the plugin's are ignored)."""
        hints = _field_types()
        values: dict[str, Any] = {}
        for key, value in _pairs(properties):
            if key.startswith(PROPERTY_PREFIX):
                name = key[len(PROPERTY_PREFIX) :]
                if name in hints and _fits(value, hints[name]):
                    values[name] = value
        return cls(**values)

    @staticmethod
    def carries(properties: Iterable[tuple[str, object]]) -> bool:
        """Whether any of ``properties`` is the plugin's."""
        return any(key.startswith(PROPERTY_PREFIX) for key, _value in _pairs(properties))


def _pairs(properties: Iterable[object]) -> Iterator[tuple[str, object]]:
    """The entries of ``properties`` that are named pairs (``units.named_pair``)."""
    return (pair for entry in properties if (pair := named_pair(entry)) is not None)


@functools.cache
def _field_types() -> dict[str, Any]:
    """The type of each of a record's fields, resolved once."""
    return typing.get_type_hints(TestRecord)


@functools.cache
def _key_types(kind: Any) -> dict[str, Any]:
    """The type of each of a TypedDict's keys, resolved once."""
    return typing.get_type_hints(kind)


def _fits(value: object, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` names (a record's field: scalars, optionals,
    lists, dicts, the TypedDicts above; a dict's contents are the plugin's own)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if typing.is_typeddict(hint):
        return isinstance(value, dict) and all(
            key in value and _fits(value[key], kind) for key, kind in _key_types(hint).items()
        )
    return isinstance(value, origin or hint)


#: The least int execnet (pytest-xdist's transport) can send: it writes any int up to
#: 2**31 - 1 in four bytes and fails below -2**31 (``_save_integral`` checks the upper bound
#: only). A record's byte counts can be that negative: ``resident_bytes`` of a test that
#: evicted a model of several GiB.
_LEAST_SENDABLE_INT = -(2**31)
#: How such an int travels: ``{"ct_int": "-3221225472"}``.
_SHIPPED_INT = "ct_int"


def shipped(properties: list[tuple[str, object]]) -> list[tuple[str, object]] | None:
    """``properties`` as pytest-xdist can send them, or None where they can go as they are:
    the plugin's ints below what execnet sends, as text (:func:`unshipped` reads them)."""
    if not any(_unsendable(name, value) for name, value in _pairs(properties)):
        return None
    return [_sendable(entry) for entry in properties]


def _sendable(entry: tuple[str, object]) -> tuple[str, object]:
    pair = named_pair(entry)  # (an entry that is not a pair goes as it is)
    if pair is not None and _unsendable(*pair):
        return pair[0], {_SHIPPED_INT: str(pair[1])}
    return entry


def unshipped(properties: list[Any]) -> list[Any] | None:
    """The properties :func:`shipped` sent, as they were (None: there was nothing to undo)."""
    if not any(_shipped_int(name, value) is not None for name, value in _pairs(properties)):
        return None
    out: list[Any] = []
    for entry in properties:
        pair = named_pair(entry)
        number = _shipped_int(*pair) if pair is not None else None
        out.append(entry if number is None else (entry[0], number))
    return out


def _unsendable(name: str, value: object) -> bool:
    return name.startswith(PROPERTY_PREFIX) and type(value) is int and value < _LEAST_SENDABLE_INT


def _shipped_int(name: object, value: object) -> int | None:
    if not (isinstance(name, str) and name.startswith(PROPERTY_PREFIX)):
        return None  # another plugin's property, whatever it holds
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get(_SHIPPED_INT), str):
        try:
            return int(value[_SHIPPED_INT])
        except ValueError:
            return None
    return None


def _default(spec: dataclasses.Field[Any]) -> object:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return None


@functools.cache
def _defaults() -> tuple[tuple[str, object], ...]:
    """Each field of :class:`TestRecord` and its default, made once: every test's teardown
    compares its record with them (the defaults are compared with, never handed out)."""
    return tuple((spec.name, _default(spec)) for spec in dataclasses.fields(TestRecord))
