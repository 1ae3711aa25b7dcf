"""Where session settings are resolved: once per run, into a frozen :class:`Settings`.

Order, lowest to highest, for the config fields (batch size, max feature nodes):
built-in default < ini ``ct_*`` < experiment YAML (``--ct-config``) < environment ``CT_*`` <
command-line ``--ct-*`` < the test's own ``@pytest.mark.ct_config`` (its ``path=`` YAML, then
its fields; module, then class, then function: the closest wins). As in pytest's own plugins
(``@pytest.mark.timeout`` over ``--timeout``), a test's own marker beats the session-wide
option. Session-only settings (the YAML path, the emulated capacity) take the highest of
ini < environment < option. Each value keeps its
:class:`~pytest_ctresources.settings.sources.Source`; any bad value raises ``pytest.UsageError``
naming that source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from pytest_ctresources.gpu.allocator import ALLOC_CONF_ENV, ALLOC_KEY, alloc_conf_in_environment
from pytest_ctresources.settings.activation import Activation, flag_of, project_request
from pytest_ctresources.settings.config import (
    FIELDS,
    CircuitTracerConfig,
    ConfigError,
    parse_bool,
    shown,
)
from pytest_ctresources.settings.experiment_yaml import ExperimentFile, load_experiment_yaml
from pytest_ctresources.settings.options import (
    INI_ONLY,
    NOTEBOOK_CONFIGS_INI,
    SETTINGS,
    SettingSpec,
    alloc_conf,
    binding_mode,
    byte_size,
    cleanup_mode,
    days_or_off,
    fraction,
    non_negative_gib,
    notebook_inject_mode,
    percent_or_off,
    positive_count,
    seconds,
    seconds_or_off,
)
from pytest_ctresources.settings.report_paths import (
    JSON_FLAG,
    PLOT_FLAG,
    TargetError,
    check_directory,
    check_plot_support,
    check_target,
)
from pytest_ctresources.settings.sources import Source, Sourced

_INI_DEFAULTS = {name: default for name, _help, default in INI_ONLY}
SNAPSHOT_OFF: Sourced[str] = Sourced("off", Source.default())
REPORT_DESTS = (
    "ct_report",
    "ct_report_top",
    "ct_report_json",
    "ct_report_plot",
    "ct_strict",
    "ct_oom_retry",
    "ct_forget",
    "ct_leases",
    "ct_fail_on_increase",
    "ct_require_gpu_run_within",
)

T = TypeVar("T")

#: A setting that is off unless asked for (its default).
_OFF: Sourced[float | None] = Sourced(None, Source.default())


@dataclass(frozen=True)
class Settings:
    """Everything the plugin was told for this run, each value with its source."""

    ini_layer: Mapping[str, Sourced[object]]
    experiment: ExperimentFile | None
    experiment_source: Source | None
    env_layer: Mapping[str, Sourced[object]]
    option_layer: Mapping[str, Sourced[object]]
    vram_capacity_gib: Sourced[float] | None
    cleanup: Sourced[str]
    alloc_conf: Sourced[str]
    leak_threshold_bytes: Sourced[int]
    oom_retry: Sourced[bool]
    oom_retry_floor: Sourced[int]
    gpu_binding: Sourced[str]
    leases: Sourced[bool]
    default_vram_gib: Sourced[float]
    lease_timeout_s: Sourced[float]
    auto_margin: Sourced[float]
    estimate_prompt_tokens: Sourced[int]
    progress_after_s: Sourced[float | None]
    notebook_inject: Sourced[str]
    report_forced: bool = False
    report_top: int = 10
    report_json: Path | None = None
    report_plot: Path | None = None
    strict: bool = False
    forget: bool = False
    snapshot: Sourced[str] = SNAPSHOT_OFF
    """``--ct-snapshot``: off, on-failure or always."""
    snapshot_dir: Path | None = None
    """``--ct-snapshot-dir``, checked (None: the default, decided where the run starts)."""
    fail_on_increase: Sourced[float | None] = _OFF
    """The percentage over its last passing peak above which a test fails (None: it warns)."""
    require_gpu_run_within: Sourced[float | None] = _OFF
    """Days within which each GPU test skipped in this run must have really run (None: no
    requirement)."""

    def session_config(self) -> CircuitTracerConfig:
        """The session-wide config, defaults < ini < experiment YAML < environment < command
        line: the config of a test with no ``ct_config`` marker, and the layers a test's own
        marker (or a notebook item's own experiment config) goes on top of."""
        cfg = _apply(CircuitTracerConfig.defaults(), self.ini_layer)
        if self.experiment:
            cfg = self.experiment.apply(cfg)
        return _apply(_apply(cfg, self.env_layer), self.option_layer)

    def header_lines(self) -> list[str]:
        """Lines for the ``pytest -v`` header: effective settings and their sources."""
        cfg = self.session_config()
        lines = [
            "ctresources: "
            + ", ".join(
                f"{name}={getattr(cfg, name)} ({cfg.source_of(name)})"
                for name in ("batch_size", "max_feature_nodes", "dtype", "backend")
            )
        ]
        if self.experiment is not None:
            lines.append(
                f"ctresources: experiment config {self.experiment.path} ({self.experiment_source})"
            )
        if cfg.model_name:
            lines.append(
                f"ctresources: model {cfg.model_name} ({cfg.source_of('model_name')}), "
                f"transcoders {cfg.transcoder_set}"
            )
        capacity = (
            f"{self.vram_capacity_gib.value:g} GiB ({self.vram_capacity_gib.source})"
            if self.vram_capacity_gib
            else "as detected"
        )
        alloc = self.alloc_conf.value or "(not set)"
        source = self.alloc_conf.source
        variable = source.where.removeprefix("env ") if source.kind == "env" else ALLOC_CONF_ENV
        lines.append(
            f"ctresources: vram capacity {capacity}, cleanup={self.cleanup.value} "
            f"({self.cleanup.source}), {variable}={alloc} ({source})"
        )
        return lines + self.overridden_lines()

    def overridden_lines(self) -> list[str]:
        """A line per config field set in more than one session layer: which won, which lost
        (``ct_batch_size`` in the ini under the experiment YAML's ``BATCH_SIZE``)."""
        experiment: dict[str, Sourced[object]] = {}
        if self.experiment is not None:
            path = self.experiment.path
            experiment = {
                name: Sourced(value, Source.yaml(path, FIELDS[name].yaml_key))
                for name, value in self.experiment.values.items()
            }
        layers = (self.option_layer, self.env_layer, experiment, self.ini_layer)  # highest first
        lines = []
        for name in FIELDS:
            setters = [layer[name] for layer in layers if name in layer]
            if len(setters) > 1:
                won, *lost = setters
                losers = "; ".join(f"{item.value} ({item.source})" for item in lost)
                lines.append(f"ctresources: {name}={won.value} ({won.source}) wins over {losers}")
        return lines


def _apply(cfg: CircuitTracerConfig, layer: Mapping[str, Sourced[object]]) -> CircuitTracerConfig:
    if not layer:
        return cfg
    return cfg.layered(
        {name: item.value for name, item in layer.items()}, lambda name: layer[name].source
    )


def _parse(spec: SettingSpec, text: str, source: Source) -> object:
    try:
        return spec.parse(text)
    except (ValueError, ConfigError) as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


def resolve_settings(
    options: Mapping[str, object],
    ini: Mapping[str, str | None],
    environ: Mapping[str, str],
    inifile: str | None,
    invocation_dir: Path,
    overridden: frozenset[str] = frozenset(),
) -> Settings:
    """Resolve every session setting from its three spellings.

    ``options`` maps option dests to parsed values (None when not given), ``ini`` maps ini
    keys to their raw text (None when unset); ``overridden`` names the keys given with
    pytest's ``-o`` (their source is that option, not the ini file). Pure: testable without
    a pytest run.
    """

    def ini_source(key: str) -> Source:
        return Source.override(key) if key in overridden else Source.ini(key, inifile)

    for key, raw in ini.items():
        if raw is not None and not isinstance(raw, str):
            # Legacy [tool.pytest.ini_options] hands a TOML list to a "string" key unchanged.
            raise pytest.UsageError(
                f"{ini_source(key)}: must be a single value, got the "
                f"{type(raw).__name__} {shown(raw)}"
            )
    ini_layer: dict[str, Sourced[object]] = {}
    env_layer: dict[str, Sourced[object]] = {}
    option_layer: dict[str, Sourced[object]] = {}
    session: dict[str, Sourced[object]] = {}
    ini_dir = Path(inifile).parent if inifile else invocation_dir
    for spec in SETTINGS:
        layers: list[tuple[dict[str, Sourced[object]], Sourced[object]]] = []
        raw_ini = (ini.get(spec.ini) or "").strip()
        if raw_ini:
            source = ini_source(spec.ini)
            value = _parse(spec, raw_ini, source)
            if spec.dest in ("ct_config", "ct_snapshot_dir"):
                # An ini file's path is relative to that file; -o's to where pytest runs.
                base = invocation_dir if spec.ini in overridden else ini_dir
                value = str(base / str(value))
            layers.append((ini_layer, Sourced(value, source)))
        raw_env = environ.get(spec.env, "").strip() if spec.env else ""
        if spec.env and raw_env:
            source = Source.env(spec.env)
            layers.append((env_layer, Sourced(_parse(spec, raw_env, source), source)))
        if options.get(spec.dest) is not None:
            layers.append((option_layer, Sourced(options[spec.dest], Source.option(spec.option))))
        for layer, item in layers:
            if spec.field is not None:
                layer[spec.field] = item
        if layers:
            session[spec.dest] = layers[-1][1]

    experiment = None
    experiment_source = None
    if "ct_config" in session:
        experiment_source = session["ct_config"].source
        try:
            experiment = load_experiment_yaml(str(session["ct_config"].value))
        except ConfigError as exc:
            raise pytest.UsageError(f"{experiment_source}: {exc}") from None

    cleanup = _ini_or_default(ini, "ct_cleanup", ini_source, cleanup_mode)
    allocator = _ini_or_default(ini, "ct_alloc_conf", ini_source, alloc_conf)
    in_environment = alloc_conf_in_environment(environ)
    if in_environment is not None:
        # The user's own variable wins over ct_alloc_conf (which is still checked above).
        name, value = in_environment
        allocator = Sourced(value, Source.env(name))
    capacity = session.get("ct_vram_capacity")
    leak = _ini_or_default(ini, "ct_leak_threshold", ini_source, byte_size)
    floor = _ini_or_default(ini, "ct_oom_retry_floor", ini_source, positive_count)
    retry = _ini_or_default(ini, "ct_oom_retry", ini_source, parse_bool)
    if options.get("ct_oom_retry") is False:
        retry = Sourced(False, Source.option("--ct-no-oom-retry"))
    leases = _ini_or_default(ini, "ct_leases", ini_source, parse_bool)
    if options.get("ct_leases") is False:
        leases = Sourced(False, Source.option("--ct-no-leases"))
    binding = _ini_or_default(ini, "ct_gpu_binding", ini_source, binding_mode)
    default_gib = _ini_or_default(ini, "ct_default_vram_gib", ini_source, non_negative_gib)
    timeout = _ini_or_default(ini, "ct_lease_timeout", ini_source, seconds)
    margin = _ini_or_default(ini, "ct_auto_margin", ini_source, fraction)
    prompt_tokens = _ini_or_default(ini, "ct_estimate_prompt_tokens", ini_source, positive_count)
    progress = _ini_or_default(ini, "ct_progress_after", ini_source, seconds_or_off)
    report_json = _writable(options.get("ct_report_json"), JSON_FLAG, invocation_dir)
    report_plot = _writable(options.get("ct_report_plot"), PLOT_FLAG, invocation_dir)
    if report_plot is not None:
        unsupported = check_plot_support()
        if unsupported is not None:
            raise pytest.UsageError(f"{PLOT_FLAG}: {unsupported}")
        if report_json is not None and os.path.abspath(report_json) == os.path.abspath(report_plot):
            raise pytest.UsageError(f"{PLOT_FLAG}: {report_plot} is also the {JSON_FLAG} path")
    snapshot = session.get("ct_snapshot", SNAPSHOT_OFF)
    snapshot_dir = session.get("ct_snapshot_dir")
    if snapshot_dir is not None:
        try:
            checked_dir = check_directory(str(snapshot_dir.value), invocation_dir)
        except TargetError as exc:
            raise pytest.UsageError(f"{snapshot_dir.source}: {exc}") from None
    return Settings(
        ini_layer=ini_layer,
        experiment=experiment,
        experiment_source=experiment_source,
        env_layer=env_layer,
        option_layer=option_layer,
        vram_capacity_gib=_as(float, capacity) if capacity else None,
        cleanup=cleanup,
        alloc_conf=allocator,
        leak_threshold_bytes=leak,
        oom_retry=retry,
        oom_retry_floor=floor,
        gpu_binding=binding,
        leases=leases,
        default_vram_gib=default_gib,
        lease_timeout_s=timeout,
        auto_margin=margin,
        estimate_prompt_tokens=prompt_tokens,
        progress_after_s=progress,
        notebook_inject=_ini_or_default(
            ini, "ct_notebook_inject", ini_source, notebook_inject_mode
        ),
        report_forced=bool(options.get("ct_report")),
        report_top=_option_value(options, "ct_report_top", int) or 10,
        report_json=report_json,
        report_plot=report_plot,
        strict=bool(options.get("ct_strict")),
        forget=bool(options.get("ct_forget")),
        snapshot=_as(str, snapshot),
        snapshot_dir=checked_dir if snapshot_dir is not None else None,
        fail_on_increase=_option_or_ini(
            options, ini, "ct_fail_on_increase", ini_source, percent_or_off
        ),
        require_gpu_run_within=_option_or_ini(
            options, ini, "ct_require_gpu_run_within", ini_source, days_or_off
        ),
    )


def _as(kind: type[T], sourced: Sourced[object]) -> Sourced[T]:
    """A session setting's value, which its parser made a ``kind``: checked, so that the
    frozen settings are what their types say."""
    value = sourced.value
    if isinstance(value, int) and not isinstance(value, bool) and kind is float:
        value = float(value)
    if not isinstance(value, kind):
        raise TypeError(f"{sourced.source}: {shown(value)} is not a {kind.__name__}")
    return Sourced(value, sourced.source)


def _option_value(options: Mapping[str, object], dest: str, kind: type[T]) -> T | None:
    """An option's value as its argparse type made it, None when not given."""
    value = options.get(dest)
    if value is None:
        return None
    return _as(kind, Sourced(value, Source.option(flag_of(dest)))).value


def _option_or_ini(
    options: Mapping[str, object],
    ini: Mapping[str, str | None],
    key: str,
    ini_source: Callable[[str], Source],
    parse: Callable[[str], T],
) -> Sourced[T]:
    """An option whose ini key has the same name: the option if given, else the ini key.
    The option keeps its text (``options.argparse_text``), checked when it was read: its
    parsed value may be None (``off``), which a not-given option is too."""
    text = options.get(key)
    if isinstance(text, str):
        return Sourced(parse(text), Source.option(flag_of(key)))
    return _ini_or_default(ini, key, ini_source, parse)


def _ini_or_default(
    ini: Mapping[str, str | None],
    key: str,
    ini_source: Callable[[str], Source],
    parse: Callable[[str], T],
) -> Sourced[T]:
    text = ini.get(key)
    if text is None:
        return Sourced(parse(_INI_DEFAULTS[key]), Source.default())
    source = ini_source(key)
    try:
        return Sourced(parse(text), source)
    except ValueError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None


def _writable(value: object, flag: str, invocation_dir: Path) -> Path | None:
    """The report path of ``flag``, checked now rather than after an hour of tests."""
    if value is None:
        return None
    try:
        return check_target(str(value), flag, invocation_dir)
    except TargetError as exc:
        raise pytest.UsageError(f"{flag}: {exc}") from None


def ini_values_keys() -> list[str]:
    """Every ``ct_*`` ini key of a single value."""
    return [spec.ini for spec in SETTINGS] + [name for name, _h, _d in INI_ONLY]


def ini_values(config: pytest.Config) -> dict[str, str | None]:
    """The raw text of every ``ct_*`` ini key, None where unset."""
    return {key: config.getini(key) for key in ini_values_keys()}


def settings_from_config(config: pytest.Config) -> Settings:
    """Resolve :class:`Settings` for a pytest run (raises ``pytest.UsageError``)."""
    environ: Mapping[str, str] = os.environ
    applied = config.stash.get(ALLOC_KEY, None)
    if applied is not None and applied.set_by_us:
        # The variable the plugin set itself at start-up is the setting's, not the user's.
        environ = {name: value for name, value in os.environ.items() if name != ALLOC_CONF_ENV}
    return resolve_settings(
        options={
            **{spec.dest: config.getoption(spec.dest) for spec in SETTINGS},
            **{dest: config.getoption(dest) for dest in REPORT_DESTS},
        },
        ini=ini_values(config),
        environ=environ,
        inifile=str(config.inipath) if config.inipath else None,
        invocation_dir=config.invocation_params.dir,
        overridden=overridden_ini_keys(config),
    )


def overridden_ini_keys(config: pytest.Config, namespace: object = None) -> frozenset[str]:
    """The ini keys given on the command line with pytest's ``-o key=value`` (read from
    ``namespace`` before the command line is fully parsed: pytest's known arguments)."""
    given = getattr(namespace or config.option, "override_ini", None) or []
    return frozenset(entry.split("=", 1)[0].strip() for entry in given if "=" in entry)


def activation_from_config(config: pytest.Config, namespace: object) -> Activation:
    """Whether the project asks the plugin to act (settings/activation.py), from the options
    in ``namespace`` (pytest's known arguments, before conftests load), the environment and
    the ini file."""
    from pytest_ctresources.gpu.fake import FAKE_GPUS_ENV, FAKE_GPUS_USED_ENV

    overridden = overridden_ini_keys(config, namespace)
    inifile = str(config.inipath) if config.inipath else None
    # Every option of the plugin has a ``ct_`` destination and defaults to None (options.py):
    # the namespace itself lists them, so an option added later asks without another list.
    options = {dest: value for dest, value in vars(namespace).items() if dest.startswith("ct_")}
    request = project_request(
        options=options,
        environ=os.environ,
        variables=[*(spec.env for spec in SETTINGS if spec.env), FAKE_GPUS_ENV, FAKE_GPUS_USED_ENV],
        ini_value=config.getini,
        ini_keys=[*ini_values_keys(), NOTEBOOK_CONFIGS_INI],
        ini_source=lambda key: (
            Source.override(key) if key in overridden else Source.ini(key, inifile)
        ),
    )
    return Activation(request)
