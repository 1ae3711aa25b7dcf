"""Notebooks through nbmake, driven by the same configs and VRAM rules as tests.

Registered only when nbmake is installed and ``--nbmake`` is given. Each notebook runs in its
own kernel through nbmake's runner; this module holds the collection and the item:

- experiment YAML files that name a ``NOTEBOOK`` are collected as one test item each, and
  nbmake's own notebook items are turned into the same item class;
- notebook metadata (``"ctresources": {"vram_gib": 20, "marks": ["slow"]}``) becomes marks,
  so ``-m`` and VRAM skips work on notebooks as on tests;
- the item runs an injected copy of the notebook (``notebook_params``) in a kernel started
  with the session's settings (``kernels``), so the file on disk is unchanged (except under
  nbmake's ``--overwrite``), and a dead kernel fails only its item.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_ctresources.accounting import KERNEL_FIGURES_KEY
from pytest_ctresources.config import AUTO, CircuitTracerConfig, ConfigError
from pytest_ctresources.exceptions import CtResourcesWarning
from pytest_ctresources.experiment_yaml import ExperimentFile, load_experiment_yaml
from pytest_ctresources.kernels import kernel_environment, kernel_launch
from pytest_ctresources.notebook_params import (
    inject_parameters,
    injected_values,
    notebook_metadata,
)
from pytest_ctresources.runtime import CONFIG_KEY, runtime_of

ERROR_KEY = pytest.StashKey[str]()


class NotebookWarning(CtResourcesWarning):
    """Something about a notebook that the run should say, e.g. no ``parameters`` cell."""


class KernelDied(Exception):
    """The notebook's kernel process died (``os._exit``, a segfault, the OOM killer)."""


def _item_base() -> type:
    from nbmake.pytest_items import NotebookItem

    return NotebookItem  # type: ignore[no-any-return]


def make_item_class() -> type:
    """The notebook item class (built lazily: nbmake is imported only under ``--nbmake``)."""
    base = _item_base()

    class CtNotebookItem(base):  # type: ignore[misc, valid-type]
        """A notebook run through nbmake with an experiment's values and the VRAM rules."""

        def __init__(
            self,
            name: str,
            parent: Any,
            filename: str,
            experiment: ExperimentFile | None = None,
            **kwargs: Any,
        ) -> None:
            pytest.Item.__init__(self, name, parent, **kwargs)
            self.filename = filename
            self.experiment = experiment
            self._prepare()

        def _prepare(self) -> None:
            import nbformat

            runtime = runtime_of(self.config)
            settings = runtime.settings
            try:
                below = settings.config_below_markers()
                if self.experiment is not None:
                    below = self.experiment.apply(below)
                cfg = settings.config_above_markers(below)
                self.stash[CONFIG_KEY] = cfg
            except ConfigError as exc:
                self.stash[ERROR_KEY] = str(exc)
                return
            try:
                nb = nbformat.read(self.filename, as_version=4)
            except Exception as exc:  # nbformat raises many kinds for a file that is no notebook
                self.stash[ERROR_KEY] = f"{self.filename}: not a readable notebook: {exc}"
                return
            try:
                marks, need = notebook_metadata(nb, self.filename)
                for mark in marks:
                    # Under --strict-markers an unregistered name fails here (pytest.fail).
                    self.add_marker(mark)
            except (ConfigError, pytest.fail.Exception) as exc:
                self.stash[ERROR_KEY] = str(exc)
                return
            if need is not None:
                self.add_marker(pytest.mark.vram(gib=need))

        def setup(self) -> None:
            error = self.stash.get(ERROR_KEY, None)
            if error is not None:
                pytest.fail(error, pytrace=False)

        def runtest(self) -> None:
            run_notebook(self)

        def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
            if isinstance(excinfo.value, KernelDied):
                return str(excinfo.value)
            return super().repr_failure(excinfo, style)

    return CtNotebookItem


def _resolve_auto(item: Any, runtime: Any, cfg: CircuitTracerConfig) -> CircuitTracerConfig:
    """A notebook passes BATCH_SIZE to attribute() itself, so ``auto`` is resolved before its
    kernel starts, from the estimate of its configured model (no model loaded here)."""
    from pytest_ctresources.autobatch import choose_from_config
    from pytest_ctresources.summary import AUTO_PROPERTY

    tokens = runtime.settings.estimate_prompt_tokens.value
    choice = choose_from_config(cfg, runtime.auto_budget(item), tokens)
    if choice is None:
        pytest.fail(
            f"{item.filename}: batch_size 'auto' ({cfg.source_of('batch_size')}) needs a model "
            f"and transcoder set the estimator knows, and {cfg.model_name!r} with "
            f"{cfg.transcoder_set!r} is not one: set a number (--ct-batch-size N, or "
            "BATCH_SIZE: N in its config)",
            pytrace=False,
        )
    item.user_properties.append((AUTO_PROPERTY, [choice.describe()]))
    return dataclasses.replace(cfg, batch_size=choice.batch_size)


def run_notebook(item: Any) -> None:
    """Run one notebook item: inject, start the kernel with the session's settings, report."""
    import nbformat
    from nbclient.exceptions import DeadKernelError
    from nbmake.nb_run import NotebookRun
    from nbmake.pytest_items import NotebookFailedException

    runtime = runtime_of(item.config)
    option = item.config.option
    cfg: CircuitTracerConfig = item.stash[CONFIG_KEY]
    if cfg.batch_size == AUTO:
        cfg = _resolve_auto(item, runtime, cfg)
    source = Path(item.filename)
    nb = nbformat.read(source, as_version=4)
    note = inject_parameters(nb, injected_values(cfg))
    if note:
        warnings.warn(NotebookWarning(f"{source.name} {note}"), stacklevel=1)
    # The injected copy sits next to the notebook, so its relative paths and cwd still hold.
    # Its name does not end in .ipynb: if a killed worker leaves it behind, nbmake does not
    # collect it as a notebook.
    copy = source.parent / f".{source.stem}.ctresources-{os.getpid()}.ipynb-run"
    settings = runtime.settings
    experiment = item.experiment or settings.experiment
    capacity = settings.vram_capacity_gib
    env = kernel_environment(
        cfg,
        # Absolute: the kernel's working directory is the notebook's, not pytest's.
        str(Path(experiment.path).resolve()) if experiment else None,
        runtime.alloc_conf.effective(),
        capacity.value if capacity else None,
    )
    report = None
    try:
        nbformat.write(nb, copy)
        with kernel_launch(env) as report:
            run = NotebookRun(
                copy,
                option.nbmake_timeout,
                verbose=bool(option.verbose),
                kernel=option.nbmake_kernel,
                find_import_errors=option.nbmake_find_import_errors,
            )
            try:
                result = run.execute()
            except DeadKernelError as exc:
                raise KernelDied(f"the kernel running {source} died: {exc}") from None
    finally:
        copy.unlink(missing_ok=True)
        if report is not None and report.figures is not None:
            item.stash[KERNEL_FIGURES_KEY] = report.figures
    if option.overwrite:
        nbformat.write(result.nb, str(source))
    if result.error is not None:
        raise NotebookFailedException(result)


class NotebookSupport:
    """Collection hooks for notebooks, registered only under ``--nbmake``."""

    name = "ctresources-notebooks"

    def __init__(self) -> None:
        self._item_class: Any = None

    @property
    def item_class(self) -> Any:
        if self._item_class is None:
            self._item_class = make_item_class()
        return self._item_class

    def pytest_collect_file(self, file_path: Path, parent: pytest.Collector) -> pytest.File | None:
        if file_path.suffix in (".yaml", ".yml") and _names_a_notebook(file_path):
            return ExperimentNotebookFile.from_parent(parent, path=file_path)
        return None

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # Before -m deselection runs: nbmake's items become ours, with the metadata marks.
        for index, item in enumerate(items):
            if getattr(item, "nbmake", False) and not isinstance(item, self.item_class):
                items[index] = self.item_class.from_parent(
                    item.parent,
                    name=item.name,
                    filename=item.filename,  # type: ignore[attr-defined]
                )


def _names_a_notebook(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as handle:
            return any(line.startswith("NOTEBOOK:") for line in handle)
    except (OSError, UnicodeDecodeError):
        return False


class ExperimentNotebookFile(pytest.File):
    """An experiment YAML with ``NOTEBOOK:``: one item running that notebook with its values."""

    def collect(self) -> Iterator[pytest.Item]:
        support = self.config.pluginmanager.get_plugin(NotebookSupport.name)
        assert support is not None  # this file type is collected only by that plugin
        item_class = support.item_class
        try:
            experiment = load_experiment_yaml(self.path)
        except ConfigError as exc:
            item = item_class.from_parent(self, name=self.path.name, filename=str(self.path))
            item.stash[ERROR_KEY] = str(exc)
            yield item
            return
        assert experiment.notebook is not None
        yield item_class.from_parent(
            self,
            name=experiment.notebook.name,
            filename=str(experiment.notebook),
            experiment=experiment,
        )
