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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_ctresources.gpu.allocator import ALLOC_CONF_ENV, ALLOC_KEY, alloc_conf_in_environment
from pytest_ctresources.settings.activation import overridden_ini_keys
from pytest_ctresources.settings.config import (
    FIELDS,
    CircuitTracerConfig,
    ConfigError,
    shown,
)
from pytest_ctresources.settings.experiment_yaml import ExperimentFile, load_experiment_yaml
from pytest_ctresources.settings.options import SETTINGS, Declaration, Declared
from pytest_ctresources.settings.report_paths import (
    JSON_FLAG,
    PLOT_FLAG,
    TargetError,
    check_directory,
    check_plot_support,
    check_target,
)
from pytest_ctresources.settings.sources import Source, Sourced

_LAYERS = ("ini", "env", "option")  # lowest first


@dataclass(frozen=True)
class Settings(Declared):
    """Everything the plugin was told for this run, each value with its source.

    Every declared setting (:class:`~pytest_ctresources.settings.options.Declared`) is an
    attribute: ``settings.cleanup`` is its ``Sourced`` value (None for an unset
    ``OptionalSetting``). What the resolution derives from them is a field.
    """

    values: Mapping[str, Sourced[object]]
    """Every set or defaulted setting by name: the highest of ini < environment < option,
    else its default."""
    layers: Mapping[str, Mapping[str, Sourced[object]]]
    """The config fields each session layer sets (``ini``, ``env``, ``option``), by field."""
    experiment: ExperimentFile | None = None
    """The experiment YAML ``config`` names, loaded."""
    report_json_path: Path | None = None
    """``--ct-report-json``, checked (a path the plugin may write)."""
    report_plot_path: Path | None = None
    """``--ct-report-plot``, checked."""
    snapshot_directory: Path | None = None
    """``--ct-snapshot-dir``, checked (None: the default, decided where the run starts)."""

    def session_config(self) -> CircuitTracerConfig:
        """The session-wide config, defaults < ini < experiment YAML < environment < command
        line: the config of a test with no ``ct_config`` marker, and the layers a test's own
        marker (or a notebook item's own experiment config) goes on top of."""
        cfg = _apply(CircuitTracerConfig.defaults(), self.layers["ini"])
        if self.experiment:
            cfg = self.experiment.apply(cfg)
        return _apply(_apply(cfg, self.layers["env"]), self.layers["option"])

    def header_lines(self, vram_capacity: Sourced[float] | None) -> list[str]:
        """Lines for the ``pytest -v`` header: effective settings and their sources, with
        ``vram_capacity`` as it applies (core/runtime.py clamps the setting to the card)."""
        cfg = self.session_config()
        lines = [
            "ctresources: "
            + ", ".join(
                f"{name}={getattr(cfg, name)} ({cfg.source_of(name)})"
                for name in ("batch_size", "max_feature_nodes", "dtype", "backend")
            )
        ]
        if self.experiment is not None and self.config is not None:
            lines.append(
                f"ctresources: experiment config {self.experiment.path} ({self.config.source})"
            )
        if cfg.model_name:
            lines.append(
                f"ctresources: model {cfg.model_name} ({cfg.source_of('model_name')}), "
                f"transcoders {cfg.transcoder_set}"
            )
        capacity = (
            f"{vram_capacity.value:g} GiB ({vram_capacity.source})"
            if vram_capacity
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
        layers = (self.layers["option"], self.layers["env"], experiment, self.layers["ini"])
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


def _parse(setting: Declaration[object], text: str, source: Source) -> object:
    try:
        return setting.parse(text)
    except ValueError as exc:  # a ConfigError is one
        raise pytest.UsageError(f"{source}: {exc}") from None


def resolve_settings(
    options: Mapping[str, object],
    ini: Mapping[str, object],
    environ: Mapping[str, str],
    inifile: str | None,
    invocation_dir: Path,
    overridden: frozenset[str] = frozenset(),
) -> Settings:
    """Resolve every declared setting from its spellings, and check what it names.

    ``options`` maps option destinations to their text (None when not given; argparse has
    checked it), ``ini`` maps ini keys to their raw text (None when unset; a ``linelist``
    key's lines joined); ``overridden`` names the keys given with pytest's ``-o`` (their
    source is that option, not the ini file). A blank value is unset, unless the setting
    keeps blanks. Pure: testable without a pytest run.
    """

    def ini_source(key: str) -> Source:
        return Source.ini(key, inifile, overridden)

    ini_dir = Path(inifile).parent if inifile else invocation_dir
    values: dict[str, Sourced[object]] = {}
    layers: dict[str, dict[str, Sourced[object]]] = {layer: {} for layer in _LAYERS}
    for setting in SETTINGS:
        given: list[tuple[str, Sourced[object]]] = []
        raw = ini.get(setting.ini) if setting.ini else None
        if raw is not None and not isinstance(raw, str):
            # Legacy [tool.pytest.ini_options] hands a TOML list to a "string" key unchanged.
            raise pytest.UsageError(
                f"{ini_source(str(setting.ini))}: must be a single value, got the "
                f"{type(raw).__name__} {shown(raw)}"
            )
        if setting.ini and raw is not None and (raw.strip() or setting.keeps_blank):
            source = ini_source(setting.ini)
            value = _parse(setting, raw.strip(), source)
            if setting.relative:
                # An ini file's path is relative to that file; -o's to where pytest runs.
                base = invocation_dir if setting.ini in overridden else ini_dir
                value = str(base / str(value))
            given.append(("ini", Sourced(value, source)))
        raw = environ.get(setting.env, "").strip() if setting.env else ""
        if setting.env and raw:
            source = Source.env(setting.env)
            given.append(("env", Sourced(_parse(setting, raw, source), source)))
        if setting.option and options.get(setting.dest) is not None:
            source = Source.option(setting.option)
            text = str(options[setting.dest])
            given.append(("option", Sourced(_parse(setting, text, source), source)))
        if setting.field is not None:
            for layer, item in given:
                layers[layer][setting.field] = item
        if given:
            values[setting.name] = given[-1][1]
        elif setting.default is not None:
            values[setting.name] = Sourced(setting.parse(setting.default), Source.default())
    in_environment = alloc_conf_in_environment(environ)
    if in_environment is not None:
        # The user's own variable wins over ct_alloc_conf (which is still checked above).
        name, value = in_environment
        values["alloc_conf"] = Sourced(value, Source.env(name))
    told = Settings(values=values, layers=layers)
    json_path, plot_path, directory = _report_paths(told, invocation_dir)
    return Settings(
        values=values,
        layers=layers,
        experiment=_experiment(told.config),
        report_json_path=json_path,
        report_plot_path=plot_path,
        snapshot_directory=directory,
    )


def _experiment(config: Sourced[str] | None) -> ExperimentFile | None:
    if config is None:
        return None
    try:
        return load_experiment_yaml(config.value)
    except ConfigError as exc:
        raise pytest.UsageError(f"{config.source}: {exc}") from None


def _report_paths(
    settings: Settings, invocation_dir: Path
) -> tuple[Path | None, Path | None, Path | None]:
    """The files and folder the reports are written to, checked now rather than after an
    hour of tests."""
    json_path = _writable(settings.report_json, JSON_FLAG, invocation_dir)
    plot_path = _writable(settings.report_plot, PLOT_FLAG, invocation_dir)
    if plot_path is not None:
        unsupported = check_plot_support()
        if unsupported is not None:
            raise pytest.UsageError(f"{PLOT_FLAG}: {unsupported}")
        if json_path is not None and os.path.abspath(json_path) == os.path.abspath(plot_path):
            raise pytest.UsageError(f"{PLOT_FLAG}: {plot_path} is also the {JSON_FLAG} path")
    directory = settings.snapshot_dir
    checked = None
    if directory is not None:
        try:
            checked = check_directory(directory.value, invocation_dir)
        except TargetError as exc:
            raise pytest.UsageError(f"{directory.source}: {exc}") from None
    return json_path, plot_path, checked


def _writable(value: Sourced[str] | None, flag: str, invocation_dir: Path) -> Path | None:
    if value is None:
        return None
    try:
        return check_target(value.value, flag, invocation_dir)
    except TargetError as exc:
        raise pytest.UsageError(f"{flag}: {exc}") from None


def ini_values(config: pytest.Config) -> dict[str, object]:
    """The raw value of every ``ct_*`` ini key, None where unset (a ``linelist`` key's lines
    joined, None where it has none)."""
    raw: dict[str, object] = {}
    for setting in SETTINGS:
        if setting.ini is not None:
            value = config.getini(setting.ini)
            if setting.lines:
                value = "\n".join(str(line) for line in value) if value else None
            raw[setting.ini] = value
    return raw


def settings_from_config(config: pytest.Config) -> Settings:
    """Resolve :class:`Settings` for a pytest run (raises ``pytest.UsageError``)."""
    environ: Mapping[str, str] = os.environ
    applied = config.stash.get(ALLOC_KEY, None)
    if applied is not None and applied.set_by_us:
        # The variable the plugin set itself at start-up is the setting's, not the user's.
        environ = {name: value for name, value in os.environ.items() if name != ALLOC_CONF_ENV}
    return resolve_settings(
        options={s.dest: config.getoption(s.dest) for s in SETTINGS if s.option},
        ini=ini_values(config),
        environ=environ,
        inifile=str(config.inipath) if config.inipath else None,
        invocation_dir=config.invocation_params.dir,
        overridden=overridden_ini_keys(config),
    )
