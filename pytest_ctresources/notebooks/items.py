"""Notebooks through nbmake, driven by the same configs and VRAM rules as tests.

Registered only when nbmake is installed and ``--nbmake`` is given. Each notebook runs in its
own kernel, as nbmake runs it (:mod:`~pytest_ctresources.notebooks.run`); this module holds the
collection and the item:

- experiment YAML files that name a ``NOTEBOOK`` are collected as one test item each, when
  they are ours: listed by the ``ct_notebook_configs`` ini key (files, folders, globs) or
  named on the command line. Any other YAML file is left to whoever owns it;
- nbmake's own notebook items are turned into the same item class where the plugin has
  something to say to them: the project asks for the plugin (settings/activation.py), or the
  notebook has ``ctresources`` metadata. Any other notebook keeps nbmake's own item, and runs
  exactly as under nbmake alone. The swap happens in the notebook file's collect report,
  before ``pytest_itemcollected``, so every hook after that sees (and marks) the item that runs;
- notebook metadata (``"ctresources": {"vram_gib": 20, "marks": ["slow"]}``) becomes marks,
  so ``-m`` and VRAM skips work on notebooks as on tests;
- a notebook that receives values (an experiment item, or a setting the user set) runs with
  an ``injected-parameters`` cell added in memory (:mod:`~pytest_ctresources.notebooks.params`);
  one that receives nothing runs as it is on disk. The file on disk changes only under
  nbmake's ``--overwrite``, which writes what ran;
- the kernel is started with the session's settings
  (:mod:`~pytest_ctresources.notebooks.kernels`), and a dead kernel fails only its item.
  Failures are reported as nbmake reports them; the plugin's own (a config error, a dead
  kernel, a warning made an error by ``-W error``) in one line naming the file.
"""

from __future__ import annotations

import dataclasses
import glob
import stat
import warnings
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_ctresources.core.record import AT_TOP
from pytest_ctresources.core.runtime import runtime_of
from pytest_ctresources.core.state import state_of
from pytest_ctresources.exceptions import CtResourcesWarning
from pytest_ctresources.notebooks.configs import YAML_SUFFIXES, names_a_notebook, shown_path
from pytest_ctresources.notebooks.inputs import read_notebook, trusted_notebook
from pytest_ctresources.notebooks.kernels import kernel_environment, kernel_launch
from pytest_ctresources.notebooks.params import (
    METADATA_KEY,
    check_params,
    has_parameters_cell,
    inject_parameters,
    injected_values,
    notebook_metadata,
    values_with_sources,
)
from pytest_ctresources.settings.activation import ACTIVATION_KEY, ASKED
from pytest_ctresources.settings.config import AUTO, CircuitTracerConfig, ConfigError
from pytest_ctresources.settings.experiment_yaml import (
    ExperimentFile,
    load_experiment_yaml,
)
from pytest_ctresources.settings.options import Declared

NOTEBOOK_CONFIGS_INI = str(Declared.notebook_configs.ini)

if TYPE_CHECKING:
    from pytest_ctresources.core.runtime import Runtime
    from pytest_ctresources.estimator.auto import Budget, Room


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
            config_error: str | None = None,
            **kwargs: Any,
        ) -> None:
            pytest.Item.__init__(self, name, parent, **kwargs)
            self.filename = filename
            self.experiment = experiment
            self.stash[ASKED] = True  # the plugin runs it: it acts for it (activation.py)
            if config_error is not None:  # a config that could not be read: nothing to prepare
                state_of(self).config_error = config_error
            else:
                self._prepare()

        def _prepare(self) -> None:
            settings = runtime_of(self.config).settings
            try:
                # The item's own experiment config (the YAML naming the notebook) beats the
                # session's environment and options, as a test's own marker does.
                cfg = settings.session_config()
                if self.experiment is not None:
                    cfg = self.experiment.apply(cfg)
                for experiment in (settings.experiment, self.experiment):
                    if experiment is not None:
                        check_params(experiment.params, experiment.path)
                state_of(self).config = cfg
                if self.experiment is not None:
                    # A config is data anyone may have written: it names only a notebook
                    # of the user's, in its own tree or the rootdir (docs/security.md).
                    config_path = Path(self.experiment.path).resolve()
                    self.filename = str(
                        trusted_notebook(
                            self.experiment.path,
                            Path(self.filename),
                            shown_path(self.filename, self.config),
                            (config_path.parent, self.config.rootpath),
                        )
                    )
                where = shown_path(self.filename, self.config)
                # Read once here, so that a notebook nbformat or nbclient cannot run fails
                # its own item at setup in one line, and its metadata marks select it.
                nb = read_notebook(Path(self.filename), where)
                marks, need = notebook_metadata(nb, where)
                if self.experiment is not None:
                    check_parameters_cell(
                        nb,
                        injected_values(cfg),
                        settings.notebook_inject.value,
                        where,
                        shown_path(self.experiment.path, self.config),
                    )
            except ConfigError as exc:
                state_of(self).config_error = str(exc)
                return
            try:
                for mark in marks:
                    # Under --strict-markers an unregistered name fails here (pytest.fail).
                    self.add_marker(mark)
            except pytest.fail.Exception as exc:
                state_of(self).config_error = f"{where}: metadata 'ctresources.marks': {exc.msg}"
                return
            if need is not None:
                self.add_marker(pytest.mark.vram(gib=need))

        def setup(self) -> None:
            error = state_of(self).config_error
            if error is not None:
                pytest.fail(error, pytrace=False)

        def runtest(self) -> None:
            run_notebook(self)

        def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
            exc = excinfo.value
            if isinstance(exc, KernelDied):
                return str(exc)
            if isinstance(exc, pytest.fail.Exception) and not exc.pytrace:
                return exc.msg
            if isinstance(exc, Warning):
                # -W error / filterwarnings = error made a warning raised while running the
                # notebook an exception: nbmake would call it an internal error.
                where = shown_path(self.filename, self.config)
                text = str(exc)
                return (
                    f"{type(exc).__name__}: {text}"
                    if text.startswith(where)
                    else f"{where}: {type(exc).__name__}: {text}"
                )
            return super().repr_failure(excinfo, style)

    return CtNotebookItem


def check_parameters_cell(
    nb: Any, values: dict[str, Any], inject: str, where: str, config_where: str
) -> None:
    """Refuse a config's notebook that would receive values but has no cell tagged
    ``parameters``: injected first, they could be overwritten by the notebook's own
    assignments while the reports say they were used. ``ct_notebook_inject = top`` allows it
    (papermill's behaviour; the reports then say they were injected at the top)."""
    if not values or inject == AT_TOP or has_parameters_cell(nb):
        return
    raise ConfigError(
        f"{where} (the NOTEBOOK of {config_where}) receives {', '.join(values)} but has no "
        "cell tagged 'parameters', so its own assignments could overwrite them: tag the cell "
        "that sets them 'parameters', or set the ini key ct_notebook_inject = top to inject "
        "them at the top (papermill's behaviour)"
    )


def _resolve_auto(item: Any, runtime: Any, cfg: CircuitTracerConfig) -> CircuitTracerConfig:
    """A notebook passes BATCH_SIZE to attribute() itself, so ``auto`` is resolved before its
    kernel starts, from the estimate of its configured model (no model loaded here), within
    what the GPU has free now (NVML; this process never touches CUDA for it) or, without a
    GPU, the host's available memory (the kernel runs on this host)."""
    from pytest_ctresources.estimator.auto import choose_from_config

    where = shown_path(item.filename, item.config)
    tokens = runtime.settings.estimate_prompt_tokens.value
    budget = runtime.auto_budget(item)
    try:
        choice = choose_from_config(
            cfg, budget, tokens, host=True, room=_free_room(runtime, budget)
        )
    except ConfigError as exc:
        pytest.fail(f"{where}: batch_size 'auto': {exc}", pytrace=False)
    if choice is None:
        what = (
            f"{cfg.model_name!r} with {cfg.transcoder_set!r}"
            if cfg.transcoder_set
            else f"{cfg.model_name!r} with no TRANSCODER_SET"
        )
        pytest.fail(
            f"{where}: batch_size 'auto' ({cfg.source_of('batch_size')}) needs a model "
            f"and transcoder set the estimator knows, and {what} is not one: set a number "
            "(--ct-batch-size N, or "
            "BATCH_SIZE: N in its config)",
            pytrace=False,
        )
    state_of(item).record.auto_batch_sizes = [choice.describe()]
    return dataclasses.replace(cfg, batch_size=choice.batch_size)


def _free_room(runtime: Runtime, budget: Budget) -> Room | None:
    """The room a kernel about to start has on the test's GPU (None where nothing can say)."""
    from pytest_ctresources.estimator.auto import kernel_room
    from pytest_ctresources.gpu.detect import free_bytes

    facts = runtime.gpu_facts()
    if not facts.gpus or budget.capacity_gib is None:
        return None
    try:
        free = free_bytes(facts, may_use_torch=False)[0]  # the test's GPU: the first visible
    except ValueError:  # a malformed CT_FAKE_GPUS_USED: the ledger reports it
        return None
    return None if free is None else kernel_room(free, budget)


def run_notebook(item: Any) -> None:
    """Run one notebook item: inject if it receives values, start the kernel with the
    session's settings, run it as nbmake does, report."""
    import nbformat
    from nbclient.exceptions import DeadKernelError
    from nbmake.pytest_items import NotebookFailedException

    from pytest_ctresources.notebooks.run import KernelRun

    runtime = runtime_of(item.config)
    option = item.config.option
    cfg = state_of(item).config
    assert cfg is not None  # resolved at collection; a config error fails the item's setup
    if cfg.batch_size == AUTO:
        cfg = _resolve_auto(item, runtime, cfg)
    source = Path(item.filename)
    where = shown_path(source, item.config)
    try:  # read again: the file may have changed since collection
        nb = read_notebook(source, where)
    except ConfigError as exc:
        pytest.fail(str(exc), pytrace=False)
    values = injected_values(cfg)
    settings = runtime.settings
    experiment = item.experiment or settings.experiment
    params_from = {
        key: str(layer.path)
        for layer in (settings.experiment, item.experiment)  # the item's own wins
        if layer is not None
        for key in layer.params
    }
    if values:
        injected = inject_parameters(nb, values)
        if injected == AT_TOP and settings.notebook_inject.value != AT_TOP:
            warnings.warn(
                NotebookWarning(
                    f"{where} has no cell tagged 'parameters': the injected parameters run "
                    "first (the notebook may overwrite them)"
                ),
                stacklevel=1,
            )
        state_of(item).record.notebook_values = values_with_sources(
            cfg, values, params_from, injected, lambda path: shown_path(path, item.config)
        )
    capacity = runtime.vram_capacity
    env = kernel_environment(
        cfg,
        # Absolute: the kernel's working directory is the notebook's, not pytest's.
        str(Path(experiment.path).resolve()) if experiment else None,
        runtime.alloc_conf.effective(),
        capacity.value if capacity else None,
    )
    launch = None
    try:
        with kernel_launch(env, snapshot=settings.snapshot.value != "off") as launch:
            run = KernelRun(
                source,
                nb,
                launch,
                option.nbmake_timeout,
                verbose=bool(option.verbose),
                kernel=option.nbmake_kernel,
                find_import_errors=option.nbmake_find_import_errors,
            )
            try:
                result = run.execute()
            except DeadKernelError as exc:
                raise KernelDied(f"the kernel running {source} died: {exc}") from None
            except RuntimeError as exc:
                # jupyter_client's word for a kernel that exited before it answered, or did
                # not answer within the start-up timeout.
                raise KernelDied(f"{where}: its kernel did not start: {exc}") from None
    finally:
        if launch is not None and launch.figures is not None:
            state_of(item).kernel_figures = launch.figures
        if launch is not None:
            state_of(item).kernel_snapshot = launch.snapshot
    if option.overwrite:
        nbformat.write(result.nb, str(source))
    if result.error is not None:
        raise NotebookFailedException(result)


class NotebookConfigs:
    """The experiment configs listed by ``ct_notebook_configs``, resolved once.

    Each line is a file, a folder (every YAML file in it, at any depth) or a glob (``**``
    included), relative to the ini file's folder (the rootdir without one).
    """

    def __init__(self, config: pytest.Config) -> None:
        # The folder entries are relative to.
        self.base = base = config.inipath.parent if config.inipath else config.rootpath
        self.files: set[Path] = set()
        self.folders: set[Path] = set()
        self.unmatched: list[str] = []
        for line in config.getini(NOTEBOOK_CONFIGS_INI):
            pattern = str(line).strip()
            if not pattern:
                continue
            matches = glob.glob(pattern, root_dir=base, recursive=True)
            if not matches:
                self.unmatched.append(pattern)
            for match in matches:
                path = (base / match).resolve()
                if path.is_dir():
                    self.folders.add(path)
                elif path.suffix in YAML_SUFFIXES:
                    self.files.add(path)

    def lists(self, path: Path) -> bool:
        resolved = path.resolve()
        return resolved in self.files or any(folder in resolved.parents for folder in self.folders)


class NotebookSupport:
    """Collection hooks for notebooks, registered only under ``--nbmake``."""

    name = "ctresources-notebooks"

    def __init__(self, config: pytest.Config) -> None:
        self._item_class: Any = None
        self.project_wide = project_wide(config)
        self.configs = NotebookConfigs(config)
        self.unlisted: list[str] = []  # configs naming a NOTEBOOK, not ours: the hint's
        for pattern in self.configs.unmatched:
            # As pytest says of testpaths that match nothing: a typo would collect nothing.
            warning = CtResourcesWarning(
                f"{NOTEBOOK_CONFIGS_INI}: {pattern!r} matches no file or folder "
                f"(relative to {self.configs.base})"
            )
            try:
                config.issue_config_time_warning(warning, stacklevel=2)
            except CtResourcesWarning:  # -W error: one line, never an internal error
                raise pytest.UsageError(str(warning)) from None

    @property
    def item_class(self) -> Any:
        if self._item_class is None:
            self._item_class = make_item_class()
        return self._item_class

    def pytest_collect_file(self, file_path: Path, parent: pytest.Collector) -> pytest.File | None:
        if file_path.suffix not in YAML_SUFFIXES:
            return None
        # Ours when listed, or named on the command line (as pytest collects a test file
        # named there whatever python_files says); a YAML file that merely has a NOTEBOOK
        # line may be another tool's.
        if not names_a_notebook(file_path):
            return None
        if not (self.configs.lists(file_path) or parent.session.isinitpath(file_path)):
            self.unlisted.append(shown_path(file_path, parent.config))
            return None
        return ExperimentNotebookFile.from_parent(parent, path=file_path)

    def pytest_report_collectionfinish(self, items: list[pytest.Item]) -> str | None:
        """Where nothing was collected, the configs that would have been, and how."""
        if items or not self.unlisted:
            return None
        more = f" and {len(self.unlisted) - 3} more" if len(self.unlisted) > 3 else ""
        return (
            f"ctresources: {', '.join(self.unlisted[:3])}{more} name a NOTEBOOK but are not "
            f"listed in the ini key {NOTEBOOK_CONFIGS_INI}: list them there (files, folders, "
            "globs), or name them on the command line, to run them"
        )

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_make_collect_report(
        self, collector: pytest.Collector
    ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        # Innermost of the wrappers, so that every other plugin's wrapper, and every hook
        # after collection (pytest_itemcollected, modifyitems), sees the item that will run.
        report = yield
        if report.result:
            report.result = [self._ours(node) for node in report.result]
        return report

    def _ours(self, node: pytest.Item | pytest.Collector) -> pytest.Item | pytest.Collector:
        """``node`` itself, or the plugin's item in place of nbmake's item where the plugin
        has something to say to that notebook."""
        if not getattr(node, "nbmake", False) or isinstance(node, self.item_class):
            return node
        filename = str(node.filename)  # type: ignore[union-attr]
        if not (self.project_wide or has_ctresources_metadata(Path(filename))):
            return node
        item: pytest.Item = self.item_class.from_parent(
            node.parent, name=node.name, filename=filename
        )
        return item


def project_wide(config: pytest.Config) -> bool:
    """Whether the project asks the plugin to act for every test (settings/activation.py)."""
    activation = config.stash.get(ACTIVATION_KEY, None)
    if activation is None:  # not decided by the plugin's wiring yet: decide it the same way
        from pytest_ctresources.settings.activation import activation_from_config

        activation = activation_from_config(config, config.option)
    return activation.project_wide


def has_ctresources_metadata(path: Path) -> bool:
    """Whether the notebook at ``path`` has ``ctresources`` metadata (then the plugin runs
    it). A file that cannot be read as JSON has none: nbmake reports it as it would alone."""
    import json

    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block collection
            return False
        data = path.read_bytes()
    except OSError:
        return False
    if METADATA_KEY.encode() not in data:  # most notebooks: no JSON parse at collection
        return False
    try:
        nb = json.loads(data)
    except (ValueError, RecursionError):
        return False
    metadata = nb.get("metadata") if isinstance(nb, dict) else None
    return isinstance(metadata, dict) and METADATA_KEY in metadata


class ExperimentNotebookFile(pytest.File):
    """An experiment YAML with ``NOTEBOOK:``: one item running that notebook with its values."""

    def collect(self) -> Iterator[pytest.Item]:
        support = self.config.pluginmanager.get_plugin(NotebookSupport.name)
        assert support is not None  # this file type is collected only by that plugin
        item_class = support.item_class
        try:
            experiment = load_experiment_yaml(self.path)
        except ConfigError as exc:
            yield item_class.from_parent(
                self, name=self.path.name, filename=str(self.path), config_error=str(exc)
            )
            return
        assert experiment.notebook is not None
        yield item_class.from_parent(
            self,
            name=experiment.notebook.name,
            filename=str(experiment.notebook),
            experiment=experiment,
        )
