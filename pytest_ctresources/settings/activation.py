"""When the plugin acts: the one rule, decided here and nowhere else.

The plugin is a ``pytest11`` entry point, so it loads in every pytest run of every project in
the environment. Like pytest-memray, it acts only where it is asked:

- **for the whole project**, by any of its ini keys (``ct_*``, in the ini file or through
  ``-o``), any of its ``--ct-*`` options, or any of its ``CT_*`` environment variables (an
  experiment config is one of these: ``--ct-config``, ``ct_config``, ``CT_CONFIG``);
- **for one test**, when the test uses one of its fixtures (``ct_session``, ``ct_config``) or
  carries a ``vram``, ``ct_config`` or ``ct_parametrize`` marker, or is a notebook item the
  plugin has something to say to (``ctresources`` metadata, an experiment config naming
  it), which the notebook support marks with :data:`ASKED`.

A test the plugin does not act for gets nothing: no cleanup, accounting, record, lease or
report line. What must happen before conftests are imported (binding an xdist worker to a GPU)
follows the project-wide request alone, since no test is known then; the allocator default
(``ct_alloc_conf``) is set then too, or, for a project that asks only through its tests, once
collection found one (before any test runs, while CUDA is not yet initialised).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from pytest_ctresources.settings import markers
from pytest_ctresources.settings.options import SETTINGS
from pytest_ctresources.settings.sources import Source

#: The plugin's fixtures: a test that uses one (directly or through another fixture) asks.
FIXTURES: tuple[str, ...] = ("ct_session", "ct_config")
#: The plugin's markers (settings/markers.py declares them): a test that carries one asks.
MARKERS: tuple[str, ...] = tuple(markers.MARKERS)
_FIXTURE_SET = frozenset(FIXTURES)
_MARKER_SET = frozenset(MARKERS)
#: Set on an item that asks by what it is (a notebook item the plugin runs its own way).
ASKED = pytest.StashKey[bool]()
_ACTS = pytest.StashKey[bool]()


@dataclass(frozen=True)
class Activation:
    """Whether the plugin acts, for the run and per test (see the module's rule)."""

    request: Source | None
    """What asks for the whole project (None: nothing; then only tests that ask)."""

    @property
    def project_wide(self) -> bool:
        return self.request is not None

    def acts_for(self, item: pytest.Item) -> bool:
        """Whether the plugin acts for ``item`` (decided once per item)."""
        if self.request is not None:
            return True
        acts = item.stash.get(_ACTS, None)
        if acts is None:
            acts = item_asks(item)
            item.stash[_ACTS] = acts
        return acts

    def header_line(self) -> str:
        """What ``pytest -v``'s header says of it."""
        if self.request is not None:
            return f"ctresources: active ({self.request} asks for it)"
        return (
            "ctresources: inactive (nothing in this project asks for it); it acts for "
            f"tests that use {' or '.join(FIXTURES)} or carry a "
            f"{' or '.join(MARKERS)} marker"
        )


def overridden_ini_keys(config: pytest.Config, namespace: object = None) -> frozenset[str]:
    """The ini keys given on the command line with pytest's ``-o key=value`` (read from
    ``namespace`` before the command line is fully parsed: pytest's known arguments)."""
    given = getattr(namespace or config.option, "override_ini", None) or []
    return frozenset(entry.split("=", 1)[0].strip() for entry in given if "=" in entry)


def activation_from_config(config: pytest.Config, namespace: object) -> Activation:
    """Whether the project asks the plugin to act (the module's rule), from the options in
    ``namespace`` (pytest's known arguments, before conftests load), the environment and the
    ini file, as the settings declare them (options.py)."""
    from pytest_ctresources.gpu.fake import FAKE_GPUS_ENV, FAKE_GPUS_USED_ENV

    overridden = overridden_ini_keys(config, namespace)
    inifile = str(config.inipath) if config.inipath else None
    for setting in SETTINGS:
        # Every option of the plugin defaults to None (options.py): any other value asks.
        if setting.option and getattr(namespace, setting.dest, None) is not None:
            return Activation(Source.option(setting.option))
    for name in [*(s.env for s in SETTINGS if s.env), FAKE_GPUS_ENV, FAKE_GPUS_USED_ENV]:
        if name in os.environ:
            return Activation(Source.env(name))
    for key in [setting.ini for setting in SETTINGS if setting.ini]:
        value = config.getini(key)  # None or an empty list: unset
        if value is not None and value != []:
            return Activation(Source.ini(key, inifile, overridden))
    return Activation(None)


def item_asks(item: pytest.Item) -> bool:
    """Whether ``item`` asks by itself: a fixture or a marker of the plugin, or :data:`ASKED`."""
    # Not ``Stash.get``: it raises and catches a KeyError for a missing key, the common case.
    if ASKED in item.stash and item.stash[ASKED]:  # noqa: RUF019
        return True
    if not _FIXTURE_SET.isdisjoint(getattr(item, "fixturenames", ())):
        return True
    # One walk over the markers of the item and its parents (what ``iter_markers`` yields),
    # without the lists and tuples it builds: this runs for every test of a run that acts.
    node: pytest.Item | pytest.Collector | None = item
    while node is not None:
        for mark in node.own_markers:
            if mark.name in _MARKER_SET:
                return True
        node = node.parent
    return False


ACTIVATION_KEY = pytest.StashKey[Activation]()


def activation_of(config: pytest.Config) -> Activation:
    """The run's :class:`Activation` (decided before conftests are imported)."""
    return config.stash[ACTIVATION_KEY]
