"""Every setting of the plugin, declared once: its option, ini key, environment variable,
parser, default and help.

A setting is a :class:`Setting` (or an :class:`OptionalSetting`, which has no default) in the
body of :class:`Declared`, under its name: ``cleanup`` is the ini key ``ct_cleanup``, the
option ``--ct-cleanup`` where it has one, and the variable ``CT_CLEANUP`` where it reads one.
``pytest_addoption`` (:func:`add_options`), the resolution
(:mod:`pytest_ctresources.settings.resolve`), the project's request to act
(:mod:`pytest_ctresources.settings.activation`), ``pytest --help`` and the README's table
(``tests/test_readme.py`` renders it from them and compares) all read these
declarations; a new setting is one more entry here. The resolved :class:`Settings
<pytest_ctresources.settings.resolve.Settings>` inherits the declarations, so that
``settings.cleanup`` is the resolved ``Sourced[str]``, typed by its parser.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar, cast, overload

import pytest

from pytest_ctresources.settings.config import DEFAULT_AUTO_MARGIN, DEFAULT_PROMPT_TOKENS, FIELDS
from pytest_ctresources.settings.parsers import (
    MAX_WORKERS_PER_GPU,
    alloc_conf,
    binding_mode,
    boolean,
    byte_size,
    cleanup_mode,
    days_or_off,
    directory_path,
    field_parser,
    fraction,
    non_negative_gib,
    notebook_inject_mode,
    percent_or_off,
    plan_gpus,
    positive_count,
    positive_number,
    runner_gpus,
    seconds,
    seconds_or_off,
    shard,
    snapshot_mode,
    text,
    workers_per_gpu,
)
from pytest_ctresources.settings.sources import Sourced

GROUP = "ctresources"
#: How much a peak may grow, in percent, before it is an increase (``--ct-fail-on-increase``
#: given without a value, and the summary's warning without the option).
DEFAULT_INCREASE_PERCENT = 10.0

T = TypeVar("T")


class Declaration(Generic[T]):
    """What a setting is called where, how its text is parsed, and what it means.

    ``option``: True for ``--ct-<name>``, a string for another spelling (``--ct-no-leases``),
    False for none; ``ini``: whether the ini key ``ct_<name>`` exists; ``env``: whether the
    variable ``CT_<NAME>`` is read. ``flag``: the option takes no value and sets this text
    (``"true"``); ``const``: the option's value may be left out, and is then this text.
    ``field``: the :class:`~pytest_ctresources.CircuitTracerConfig` field it sets. ``relative``:
    a path, relative to the ini file where the ini file sets it. ``keeps_blank``: an empty
    ini value means something (``ct_alloc_conf =`` disables it); elsewhere a blank value is
    unset. ``lines``: a ``linelist`` ini key (its value is a tuple of the lines).
    ``help`` is Markdown (the README's cell); ``{default}`` in it stands for the default.
    """

    name: str

    def __init__(
        self,
        parse: Callable[[str], T],
        help: str,
        *,
        metavar: str = "",
        option: bool | str = True,
        ini: bool = True,
        env: bool = False,
        flag: str | None = None,
        const: str | None = None,
        field: str | None = None,
        relative: bool = False,
        keeps_blank: bool = False,
        lines: bool = False,
        default: str | None = None,
    ) -> None:
        self.parse = parse
        self.help = help
        self.metavar = metavar
        self._option = option
        self.has_ini = ini
        self.has_env = env
        self.flag = flag
        self.const = const
        self.field = field
        self.relative = relative
        self.keeps_blank = keeps_blank
        self.lines = lines
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        if (self.default is None) != isinstance(self, OptionalSetting):
            raise TypeError(
                f"setting {name} has no default: declare it an OptionalSetting"
                if self.default is None
                else f"setting {name} has a default: declare it a Setting"
            )
        self.name = name

    @property
    def dest(self) -> str:
        """The option's destination, ``config.getoption(dest)``: the ini key's name."""
        return f"ct_{self.name}"

    @property
    def ini(self) -> str | None:
        return f"ct_{self.name}" if self.has_ini else None

    @property
    def env(self) -> str | None:
        return f"CT_{self.name.upper()}" if self.has_env else None

    @property
    def option(self) -> str | None:
        if self._option is True:
            return "--ct-" + self.name.replace("_", "-")
        return self._option or None

    def early_ini(self, config: pytest.Config) -> object:
        """The raw ini value (None: unset), for hooks that run before the settings are
        resolved (``pytest_load_initial_conftests``)."""
        return config.getini(self.ini) if self.ini is not None else None

    def shown_default(self) -> str | None:
        """The default as the help states it (None: not stated: none, or a switch's off)."""
        if self.field is not None:
            value = FIELDS[self.field].default
            return None if value is None else str(value)
        if self.default is None or (self.flag == "true" and self.default == "false"):
            return None
        return self.default

    def markdown(self) -> str:
        """The help as the README states it, with the default in its place."""
        default = self.shown_default()
        if default is None:
            return self.help.replace(" ({default})", "")
        shown = f"default `{default}`"
        if "{default}" in self.help:
            return self.help.replace("{default}", shown)
        return f"{self.help} ({shown})"

    def plain(self) -> str:
        """The help for ``pytest --help``: the README's text without its markup."""
        return re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", self.markdown()).replace("`", "")


class Setting(Declaration[T]):
    """A setting with a default (its text, parsed as any other value)."""

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, obj: Declared, owner: type) -> Sourced[T]: ...
    def __get__(self, obj: Declared | None, owner: type) -> Setting[T] | Sourced[T]:
        if obj is None:
            return self
        # The resolution stored what this setting's parser returned: a T.
        return cast("Sourced[T]", obj.values[self.name])


class OptionalSetting(Declaration[T]):
    """A setting that is None (unset) unless something sets it."""

    @overload
    def __get__(self, obj: None, owner: type) -> OptionalSetting[T]: ...
    @overload
    def __get__(self, obj: Declared, owner: type) -> Sourced[T] | None: ...
    def __get__(self, obj: Declared | None, owner: type) -> OptionalSetting[T] | Sourced[T] | None:
        if obj is None:
            return self
        return cast("Sourced[T] | None", obj.values.get(self.name))


class Declared:
    """The plugin's settings, in the order ``pytest --help`` and the README list them.

    The resolved :class:`~pytest_ctresources.settings.resolve.Settings` inherits these, and
    holds their values, by name, in :attr:`values`.
    """

    values: Mapping[str, Sourced[object]]

    batch_size = OptionalSetting(
        field_parser("batch_size"),
        "`batch_size` of `attribute()` for every test (over the experiment YAML; a test's own "
        "`ct_config` marker overrides it); `auto` lets `ct_session` choose the largest whose "
        "estimated peak fits the GPU ({default}): see [Know before you run](docs/estimator-cli.md)",
        metavar="N|auto",
        env=True,
        field="batch_size",
    )
    batch_size_max = OptionalSetting(
        field_parser("batch_size_max"),
        "the largest batch size `--ct-batch-size auto` chooses",
        metavar="N",
        env=True,
        field="batch_size_max",
    )
    max_feature_nodes = OptionalSetting(
        field_parser("max_feature_nodes"),
        "`max_feature_nodes` of `attribute()` for every test",
        metavar="N",
        env=True,
        field="max_feature_nodes",
    )
    config = OptionalSetting(
        text,
        "flat experiment YAML (`MODEL_NAME`, `BATCH_SIZE`, ...) applied to every test's config "
        "(ini: relative to the ini file)",
        metavar="PATH",
        env=True,
        relative=True,
    )
    vram_capacity = OptionalSetting(
        positive_number,
        "act as if the GPU had GIB of memory (at most 1024): used in skip decisions, and this "
        "process's CUDA allocator is capped at it",
        metavar="GIB",
        env=True,
    )
    cleanup = Setting(
        cleanup_mode,
        "after each test: `auto` (close the figures it opened, release a failed test's frames; "
        "collect garbage when it left CUDA memory beyond its baseline, empty the CUDA cache "
        "when it holds 64 MiB or more), `always` (also collect after every test) or `never` "
        "({default}); see [Cleanup](docs/cleanup.md)",
        option=False,
        default="auto",
    )
    alloc_conf = Setting(
        alloc_conf,
        "`PYTORCH_CUDA_ALLOC_CONF` set before CUDA can initialise, when neither it nor "
        "`PYTORCH_ALLOC_CONF` is in the environment (yours wins; {default}); empty disables; "
        "checked at start-up against the CUDA caching allocator's options",
        option=False,
        default="expandable_segments:True",
        keeps_blank=True,
    )
    notebook_configs = OptionalSetting(
        text,
        "under `--nbmake`: experiment YAML files collected as notebook items (files, folders, "
        "globs; relative to the ini file); a YAML file named on the command line always is; "
        "see [Notebooks](docs/notebooks.md)",
        option=False,
        lines=True,
    )
    notebook_inject = Setting(
        notebook_inject_mode,
        "under `--nbmake`: `parameters` ({default}) injects a notebook's values after its cell "
        "tagged `parameters` (a config's notebook without one fails); `top` injects them at the "
        "top where it has none (papermill's behaviour: the notebook may overwrite them); see "
        "[Notebooks](docs/notebooks.md)",
        option=False,
        default="parameters",
    )
    report = Setting(
        boolean,
        "print the VRAM report even when no test used CUDA",
        ini=False,
        flag="true",
        default="false",
    )
    report_top = Setting(
        positive_count,
        "how many tests the VRAM report lists, by peak",
        metavar="N",
        ini=False,
        default="10",
    )
    report_json = OptionalSetting(
        text,
        "write every test's VRAM record, the GPU facts and the settings as JSON to PATH "
        "([schema](docs/report-schema.md)), also on Ctrl-C and SIGTERM; see [Report "
        "files](docs/vram-report.md#report-files)",
        metavar="PATH",
        ini=False,
    )
    report_plot = OptionalSetting(
        text,
        "write a bar chart (PNG) of per-test VRAM peaks against the declared needs and the "
        "capacity to PATH (needs matplotlib); see "
        "[Pictures](docs/vram-report.md#pictures-the-plot-and-pytest-html)",
        metavar="PATH",
        ini=False,
    )
    strict = Setting(
        boolean,
        "fail tests that exceed their declared VRAM need (UNDER-DECLARED), leak above "
        "`ct_leak_threshold`, or pass only after `ct_session` halved the batch size",
        ini=False,
        flag="true",
        default="false",
    )
    leak_threshold = Setting(
        byte_size,
        "CUDA memory still allocated after a test's teardown and cleanup, beyond its baseline, "
        "above which it is reported as a leak ({default}; `1GiB`, `500MB`, a bare number is "
        "MiB)",
        option=False,
        default="256MiB",
    )
    oom_retry = Setting(
        boolean,
        "`ct_session.attribute` halves the batch size and retries after CUDA out-of-memory "
        "({default}; `--ct-no-oom-retry`: it does not)",
        option="--ct-no-oom-retry",
        flag="false",
        default="true",
    )
    oom_retry_floor = Setting(
        positive_count,
        "the smallest batch size `ct_session.attribute` retries with after out-of-memory",
        option=False,
        default="1",
    )
    forget = Setting(
        boolean,
        "clear the VRAM needs learned by earlier runs (kept in pytest's cache)",
        ini=False,
        flag="true",
        default="false",
    )
    gpu_binding = Setting(
        binding_mode,
        "under pytest-xdist: `auto` binds each worker to one GPU of its host, round robin over "
        "the visible GPUs, before conftests are imported ({default}); `off` leaves "
        "`CUDA_VISIBLE_DEVICES` alone",
        option=False,
        default="auto",
    )
    plan = OptionalSetting(
        plan_gpus,
        "collect only, and print which tests would run on which GPU, which skip and why, and "
        "the predicted wall time; GPUS: `2x80,4x24` or names (`H200`, `A100-80GB`, "
        "`RTX-4090`), the GPUs detected when left out; see [placement](docs/xdist.md)",
        metavar="GPUS",
        ini=False,
        const="detected",
    )
    plan_workers = Setting(
        workers_per_gpu,
        f"workers per GPU in `--ct-plan` (at most {MAX_WORKERS_PER_GPU})",
        metavar="N",
        ini=False,
        default="1",
    )
    shard = OptionalSetting(
        shard,
        "run job K's share of an N-job GPU matrix: every test once, on the smallest runner "
        "class that fits it, shares balanced by learned durations",
        metavar="K/N",
        ini=False,
    )
    runner_gpus = OptionalSetting(
        runner_gpus,
        "with `--ct-shard`: the GPU of each of the N jobs (`80` for all; `2x24,80` job by job; "
        "this job's GPU for all when left out)",
        metavar="GPUS",
        ini=False,
    )
    leases = Setting(
        boolean,
        "a test with a known VRAM need takes it from its GPU's budget, shared by all of this "
        "user's pytest runs on the host (xdist or not), and waits while it is taken "
        "({default}; `--ct-no-leases`: tests of this run's workers and of other runs may then "
        "exceed a shared GPU's memory)",
        option="--ct-no-leases",
        flag="false",
        default="true",
    )
    default_vram_gib = Setting(
        non_negative_gib,
        "the lease of a test with no declared, configured or learned need ({default}: no lease)",
        option=False,
        default="0",
    )
    lease_timeout = Setting(
        seconds,
        "seconds a test waits for its VRAM lease before it fails",
        option=False,
        default="1800",
    )
    auto_margin = Setting(
        fraction,
        "share of the GPU's capacity that `--ct-batch-size auto` keeps free beyond the "
        "estimate's peak ({default}; reserved margin and CUDA context included)",
        option=False,
        default=str(DEFAULT_AUTO_MARGIN),
    )
    estimate_prompt_tokens = Setting(
        positive_count,
        "prompt length in tokens assumed by the VRAM estimate of a `ct_session` test with no "
        "declared need, made before its prompt is known (skip decisions and leases; {default})",
        option=False,
        default=str(DEFAULT_PROMPT_TOKENS),
    )
    progress_after = Setting(
        seconds_or_off,
        "seconds an attribution runs before a live progress line shows its phase and backward "
        "batches on the terminal (not under `-q`, `-n` or without a terminal; {default}); "
        "`off` never; see [Progress](docs/vram-report.md#progress-and-timings-of-attributions)",
        option=False,
        default="3",
    )
    snapshot = Setting(
        snapshot_mode,
        "record the CUDA allocator's history with Python stacks during each test and keep it "
        "(torch's memory snapshot, for https://pytorch.org/memory_viz) for a test that ran out "
        "of memory, leaked or went over its declared need (`on-failure`), or for every test "
        "(`always`); `off` records nothing ({default}); see [Memory "
        "snapshots](docs/vram-report.md#memory-snapshots)",
        metavar="off|on-failure|always",
        env=True,
        default="off",
    )
    snapshot_dir = OptionalSetting(
        directory_path,
        "where `--ct-snapshot` writes its files (ini: relative to the ini file): by default "
        "beside `--ct-report-json` (`r.json` → `r-snapshots/`), else "
        "`.pytest_cache/d/ctresources-snapshots`; made with mode 0700; a file, a FIFO or a "
        "symbolic link there is a usage error",
        metavar="DIR",
        env=True,
        relative=True,
    )
    fail_on_increase = Setting(
        percent_or_off,
        "fail a test whose peak reserved grew by more than PCT percent "
        f"(`--ct-fail-on-increase` alone: {DEFAULT_INCREASE_PERCENT:g}) over its last passing "
        "peak on the same GPU model and config; `off` only warns in the summary ({default}); "
        "see [Peaks that grow](docs/vram-report.md#peaks-that-grow-and-gpu-tests-that-never-run)",
        metavar="PCT",
        const=f"{DEFAULT_INCREASE_PERCENT:g}",
        default="off",
    )
    require_gpu_run_within = Setting(
        days_or_off,
        "fail the run when a GPU test skipped in it has not really run on a GPU within DAYS "
        "days (or never has); `off` requires nothing ({default})",
        metavar="DAYS",
        default="off",
    )


def _declarations() -> Iterator[Declaration[object]]:
    for value in vars(Declared).values():
        if isinstance(value, Declaration):
            yield value


#: Every declared setting, in order.
SETTINGS: tuple[Declaration[object], ...] = tuple(_declarations())


def argparse_text(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An option's argparse ``type``: the text is checked by ``parse`` now (so argparse
    reports ``argument --ct-x: message``) and kept as text, parsed where it is resolved with
    the other spellings."""

    def convert(value: str) -> str:
        try:
            parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return convert


def add_options(parser: pytest.Parser) -> None:
    """Declare the ``ctresources`` option group and the ``ct_*`` ini keys."""
    group = parser.getgroup(GROUP, "circuit-tracer GPU resources (pytest-ctresources)")
    for setting in SETTINGS:
        if setting.option is not None:
            # Every option defaults to None: a value other than None is the project asking
            # the plugin to act (settings/activation.py).
            env = f" [env {setting.env}]" if setting.env else ""
            if setting.flag is not None:
                how: dict[str, object] = {"action": "store_const", "const": setting.flag}
            else:
                how = {
                    "metavar": setting.metavar,
                    "type": argparse_text(setting.parse),
                    "nargs": "?" if setting.const is not None else None,
                    "const": setting.const,
                }
            group.addoption(
                setting.option, dest=setting.dest, default=None, help=setting.plain() + env, **how
            )
        if setting.ini is not None:
            also = f" (also {setting.option})" if setting.option else ""
            # default=None tells "unset" from "set to the default" (or to empty).
            if setting.lines:
                parser.addini(setting.ini, setting.plain() + also, type="linelist", default=[])
            else:
                parser.addini(setting.ini, setting.plain() + also, type="string", default=None)
