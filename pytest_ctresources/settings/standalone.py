"""The plugin's config layering outside pytest, for a notebook or a script.

Built-in defaults < the experiment YAML (the path given, else ``CT_CONFIG``) < the ``CT_*``
environment < keyword overrides: the layers a test's config has, less the ini file and the
command line, which exist only in a pytest run. Each value keeps its source, as in a test
(``cfg.source_of("batch_size")``). What :meth:`~pytest_ctresources.CtSession.from_yaml`
builds on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pytest_ctresources.settings.config import (
    CircuitTracerConfig,
    ConfigError,
    checked_fields,
)
from pytest_ctresources.settings.experiment_yaml import load_experiment_yaml
from pytest_ctresources.settings.options import SETTINGS, Declared
from pytest_ctresources.settings.sources import Source

#: The variable naming the experiment YAML when no path is given (``--ct-config``'s).
CONFIG_ENV = str(Declared.config.env)


def config_outside_pytest(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    caller: str = "CtSession.from_yaml",
) -> CircuitTracerConfig:
    """The config of ``path`` with the environment and ``overrides`` (field names of
    :class:`~pytest_ctresources.CircuitTracerConfig`) laid over it.

    Raises :class:`~pytest_ctresources.ConfigError`, one line naming the source: the file,
    the variable, or ``caller``'s keyword.
    """
    env = os.environ if environ is None else environ
    cfg = CircuitTracerConfig.defaults()
    if path is not None:
        cfg = load_experiment_yaml(Path(path)).apply(cfg)
    elif env.get(CONFIG_ENV, "").strip():
        try:
            cfg = load_experiment_yaml(Path(env[CONFIG_ENV].strip())).apply(cfg)
        except ConfigError as exc:
            # As under pytest: the variable that named the file comes first.
            raise ConfigError(f"{Source.env(CONFIG_ENV)}: {exc}") from None
    for setting in SETTINGS:
        raw = env.get(setting.env, "").strip() if setting.env else ""
        if setting.field is None or setting.env is None or not raw:
            continue
        source = Source.env(setting.env)
        try:
            value = setting.parse(raw)
        except ValueError as exc:  # a ConfigError is one
            raise ConfigError(f"{source}: {exc}") from None
        cfg = cfg.layered({setting.field: value}, source)
    try:
        checked = checked_fields(overrides or {})
    except ConfigError as exc:
        raise ConfigError(f"{caller}: {exc}") from None
    return cfg.layered(checked, lambda name: Source("option", f"{caller}({name}=...)"))
