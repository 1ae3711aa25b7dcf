"""A table of bad inputs: every option, ini key, environment variable, YAML key, marker,
notebook metadata field and ct-resources flag, given a value a careless or hostile user
would: each is one line naming its source, never a traceback.

Each row asserts the exit status (4, pytest's usage error; 1 where only the test that
carries the bad input fails; 2 for ct-resources, argparse's convention), exactly one error
line, that the line names the input's source, and that no traceback and no INTERNALERROR
is printed. Rows run in-process (``pytester.runpytest``): a usage error costs pytest no
collection, so the table takes seconds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from pytest_ctresources.core.learned import CACHE_KEY, memory_key
from pytest_ctresources.estimator.cli import main as cli_main
from pytest_ctresources.gpu.allocator import check_alloc_conf
from pytest_ctresources.settings.experiment_yaml import MAX_BYTES

# Projects run with --nbmake (tests/conftest.py turns nbmake off elsewhere).
pytestmark = pytest.mark.nbmake

pytest_plugins = ["pytester"]

BIG_INT = "1" * 5000  # Python refuses to read integers over 4300 digits
OVER_COUNT = "1" + "0" * 400  # 10**400: a valid int, far over any count
DEEP = "[" * 20_000 + "]" * 20_000
# Billion laughs: 9 levels of 9 aliases expand to 9**9 values.
BOMB = "  l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9)
)
# Few values, much text: 1,000 aliases of one 100,000-character string.
TEXT_BOMB = f"  s: &s {'x' * 100_000}\n  b: &b [{', '.join(['*s'] * 10)}]\n" + "".join(
    f"  {name}: &{name} [{', '.join([f'*{below}'] * 10)}]\n" for below, name in ("bc", "cd")
)
GOOD_TEST = "def test_good():\n    pass\n"
VICTIM_TEXT = "precious\n"

Kind = Literal["usage", "test", "cli"]


@dataclass(frozen=True)
class Row:
    """One bad input: how to present it, where the error must say it came from, and what."""

    id: str
    kind: Kind
    source: str
    message: str
    args: tuple[str, ...] = ()
    ini: str | None = None  # lines of tox.ini's [pytest]
    pyproject: str | None = None  # a whole pyproject.toml
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    test: str = GOOD_TEST
    prepare: Callable[[Path], None] | None = None  # e.g. plant a symlink, a FIFO
    check: Callable[[Path], None] | None = None  # what must still hold afterwards
    nodeid: str = "test_bad"  # for kind "test": the item that must fail alone
    # True: only as root (mknod); False: never as root. A row that aims at a system device
    # such as /dev/null runs only where the user cannot replace it: as root, code with the
    # bug this table guards against replaced /dev/null with a file, for every process on
    # the machine.
    as_root: bool | None = None
    extra: dict[str, str] = field(default_factory=dict)


def option(id: str, *args: str, message: str, source: str | None = None, **kw: object) -> Row:
    flag = next(a for a in args if a.startswith("--"))
    default = f"argument {flag}:" if flag not in _CHECKED_AT_CONFIGURE else f"{flag}:"
    return Row(id, "usage", source or default, message, args=args, **kw)  # type: ignore[arg-type]


_CHECKED_AT_CONFIGURE = ("--ct-config", "--ct-report-json", "--ct-report-plot")


def ini(id: str, key: str, value: str, message: str) -> Row:
    return Row(id, "usage", f"ini {key} in ", message, ini=f"{key} = {value}")


def toml_list(id: str, key: str, value: str) -> Row:
    return Row(
        id,
        "usage",
        f"ini {key} in ",
        "must be a single value, got the list",
        # pytest's own deprecation of the legacy list (a TypeError in pytest 10), aside.
        args=("-W", "ignore:Passing a value that is not a string"),
        pyproject=f"[tool.pytest.ini_options]\n{key} = {value}\n",
    )


def env(id: str, name: str, value: str, message: str, **kw: object) -> Row:
    source = kw.pop("source", f"env {name}")
    return Row(id, "usage", source, message, env=((name, value),), **kw)  # type: ignore[arg-type]


def yaml(id: str, text: str, message: str) -> Row:
    return Row(
        id,
        "usage",
        "--ct-config: exp.yaml:",
        message,
        args=("--ct-config", "exp.yaml"),
        files=(("exp.yaml", text),),
    )


def marker(
    id: str, decorator: str, message: str, *, files: tuple[tuple[str, str], ...] = ()
) -> Row:
    name = decorator.split("(")[0]
    test = f"import pytest\n\n@pytest.mark.{decorator}\ndef test_bad(ct_config):\n    pass\n\n"
    return Row(
        id,
        "test",
        f"@pytest.mark.{name} on test_bad.py::test_bad",
        message,
        test=test,
        files=files,
    )


def notebook(id: str, metadata: str, message: str, *, source: str = "bad.ipynb") -> Row:
    text = (
        '{"cells": [], "metadata": {"ctresources": ' + metadata + "}, "
        '"nbformat": 4, "nbformat_minor": 5}'
    )
    return Row(
        id, "test", source, message, args=("--nbmake",), files=(("bad.ipynb", text),), nodeid="bad"
    )


def notebook_config(id: str, text: str, message: str) -> Row:
    # The notebook is never read (the config fails first), so none is written: nbmake would
    # collect and run it. Named on the command line, the config is ours (ct_notebook_configs).
    return Row(
        id,
        "test",
        "exp.yaml:",
        message,
        args=("--nbmake", "exp.yaml", "test_good.py"),
        files=(("exp.yaml", "NOTEBOOK: nb.ipynb\n" + text),),
        nodeid="exp.yaml",
    )


def cli(id: str, *argv: str, message: str, source: str | None = None, **kw: object) -> Row:
    flag = next((a for a in argv if a.startswith("--")), "")
    return Row(
        id,
        "cli",
        source or f"argument {flag}:",
        message,
        args=argv,
        **kw,  # type: ignore[arg-type]
    )


# --- what attacks on the report files leave behind ---------------------------------------


def _symlink_to_victim(path: Path) -> None:
    (path / "victim.txt").write_text(VICTIM_TEXT)
    (path / "r.out").symlink_to(path / "victim.txt")


def _victim_intact(path: Path) -> None:
    assert (path / "victim.txt").read_text() == VICTIM_TEXT
    assert (path / "r.out").is_symlink()


def _char_device(path: Path) -> None:
    # /dev/full's numbers (1, 7) and /dev/null's (1, 3), in the test's own directory.
    os.mknod(path / "full", stat.S_IFCHR | 0o600, os.makedev(1, 7))
    os.mknod(path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))


def _still_a_device(path: Path) -> None:
    assert stat.S_ISCHR(os.lstat(path / "full").st_mode)
    assert stat.S_ISCHR(os.lstat(path / "null").st_mode)


def _fifo(path: Path) -> None:
    os.mkfifo(path / "pipe")


def _still_a_fifo(path: Path) -> None:
    assert stat.S_ISFIFO(os.lstat(path / "pipe").st_mode)


def _conftest_unchanged(path: Path) -> None:
    assert (path / "notes.txt").read_text() == VICTIM_TEXT


def _directory(path: Path) -> None:
    (path / "out").mkdir()


ROWS: list[Row] = [
    # --- command-line options --------------------------------------------------------------
    option("batch-size-zero", "--ct-batch-size", "0", message="positive integer or 'auto'"),
    option("batch-size-negative", "--ct-batch-size", "-3", message="positive integer"),
    option("batch-size-text", "--ct-batch-size", "many", message="got 'many'"),
    option("batch-size-float", "--ct-batch-size", "1.5", message="got '1.5'"),
    option("batch-size-5000-digits", "--ct-batch-size", BIG_INT, message="(5000 characters)"),
    option("batch-size-10**400", "--ct-batch-size", OVER_COUNT, message="at most 2147483647"),
    option("batch-size-max-zero", "--ct-batch-size-max", "0", message="positive integer"),
    option("batch-size-max-auto", "--ct-batch-size-max", "auto", message="got 'auto'"),
    option("feature-nodes-text", "--ct-max-feature-nodes", "x", message="positive integer"),
    option("feature-nodes-huge", "--ct-max-feature-nodes", OVER_COUNT, message="at most"),
    option("capacity-zero", "--ct-vram-capacity", "0", message="positive number of GiB"),
    option("capacity-negative", "--ct-vram-capacity", "-8", message="positive number of GiB"),
    option("capacity-1e308", "--ct-vram-capacity", "1e308", message="at most 1024 GiB"),
    option("capacity-1e400", "--ct-vram-capacity", "1e400", message="at most 1024 GiB"),
    option("capacity-inf", "--ct-vram-capacity", "inf", message="at most 1024 GiB"),
    option("capacity-nan", "--ct-vram-capacity", "nan", message="positive number of GiB"),
    option("capacity-2000", "--ct-vram-capacity", "2000", message="at most 1024 GiB"),
    option("report-top-zero", "--ct-report-top", "0", message="positive integer"),
    # --- --ct-plan, --ct-runner-gpus, --ct-shard, --ct-plan-workers: bounded, quoted short --
    # (10**20 GPUs was an OverflowError traceback, 10**6 a hang; 10**20 jobs an INTERNALERROR,
    # 10**9 a MemoryError; 3,000,000 workers a hang; a 5000-character value quoted whole.)
    option("plan-10**20-gpus", "--ct-plan", f"{10**20}x80", message="more than 256 GPUs"),
    option("plan-million-gpus", "--ct-plan", "1000000x80", message="more than 256 GPUs"),
    option("plan-2000-gib", "--ct-plan", "2000", message="at most 1024 GiB"),  # was taken
    option("plan-5000-characters", "--ct-plan", "x" * 5000, message="(5000 characters) is"),
    option(
        "runner-gpus-10**20",
        "--ct-runner-gpus",
        f"{10**20}x80",
        "--ct-shard",
        "1/2",
        message="more than 256 GPUs",
    ),
    option("shard-10**20-jobs", "--ct-shard", f"1/{10**20}", message="at most 1024 jobs"),
    option("shard-5000-characters", "--ct-shard", "1/" + "x" * 5000, message="is not K/N"),
    option("plan-workers-3000000", "--ct-plan-workers", "3000000", message="at most 16"),
    option("fail-on-increase-word", "--ct-fail-on-increase", "lots", message="a percentage"),
    option(
        "fail-on-increase-1e400",
        "--ct-fail-on-increase=1e400",
        message="at most 10000%",
        source="argument --ct-fail-on-increase:",
    ),
    option("gpu-run-within-word", "--ct-require-gpu-run-within", "soon", message="of days"),
    option("gpu-run-within-inf", "--ct-require-gpu-run-within", "inf", message="at most 3650"),
    option("report-top-5000-digits", "--ct-report-top", BIG_INT, message="(5000 characters)"),
    option("config-missing", "--ct-config", "missing.yaml", message="No such file"),
    option(
        "config-directory",
        "--ct-config",
        "out",
        message="Is a directory",
        prepare=_directory,
    ),
    option("config-fifo", "--ct-config", "pipe", message="not a regular file", prepare=_fifo),
    option("config-dev-zero", "--ct-config", "/dev/zero", message="not a regular file"),
    option("config-nul", "--ct-config", "a\0b.yaml", message="not a valid path"),
    option(
        "config-too-large",
        "--ct-config",
        "exp.yaml",
        message="larger than 1 MiB",
        files=(("exp.yaml", "#" * (MAX_BYTES + 1)),),
    ),
    # --- the report files: refused at start-up, and left as they were ----------------------
    option(
        "json-through-symlink",
        "--ct-report-json",
        "r.out",
        message="is a symbolic link",
        prepare=_symlink_to_victim,
        check=_victim_intact,
    ),
    option(
        "plot-through-symlink",
        "--ct-report-plot",
        "r.out",
        message="is a symbolic link",
        prepare=_symlink_to_victim,
        check=_victim_intact,
    ),
    option(
        "json-over-char-device",
        "--ct-report-json",
        "full",
        message="is a device node",
        prepare=_char_device,
        check=_still_a_device,
        as_root=True,
    ),
    option(
        "json-over-null-device",
        "--ct-report-json",
        "null",
        message="is a device node",
        prepare=_char_device,
        check=_still_a_device,
        as_root=True,
    ),
    option(
        "plot-over-char-device",
        "--ct-report-plot",
        "full",
        message="is a device node",
        prepare=_char_device,
        check=_still_a_device,
        as_root=True,
    ),
    option(
        "json-over-dev-null",
        "--ct-report-json",
        "/dev/null",
        message="is a device node",
        as_root=False,
    ),
    option(
        "json-over-fifo",
        "--ct-report-json",
        "pipe",
        message="is a FIFO",
        prepare=_fifo,
        check=_still_a_fifo,
    ),
    option("json-a-directory", "--ct-report-json", ".", message="is a directory"),
    option("plot-a-directory", "--ct-report-plot", ".", message="is a directory"),
    option(
        "json-over-a-file-not-ours",
        "--ct-report-json",
        "notes.txt",
        message="is not a pytest-ctresources JSON report",
        files=(("notes.txt", VICTIM_TEXT),),
        check=_conftest_unchanged,
    ),
    option(
        "plot-over-a-file-not-ours",
        "--ct-report-plot",
        "notes.txt",
        message="is not a VRAM plot that pytest-ctresources wrote",
        files=(("notes.txt", VICTIM_TEXT),),
        check=_conftest_unchanged,
    ),
    option(
        "plot-an-extension-it-cannot-write",
        "--ct-report-plot",
        "vram.jpg",
        message="has the extension .jpg: the plot's format comes from it, *.png, .svg, .pdf",
    ),
    option(
        "json-under-a-file",
        "--ct-report-json",
        "notes.txt/r.json",
        message="Not a directory",
        files=(("notes.txt", VICTIM_TEXT),),
    ),
    option("json-nul", "--ct-report-json", "r\0.json", message="contains a NUL character"),
    option(
        "json-and-plot-one-path",
        "--ct-report-json",
        "r.png",
        "--ct-report-plot",
        "./r.png",
        message="is also the --ct-report-json path",
        source="--ct-report-plot:",
    ),
    # --- ini keys --------------------------------------------------------------------------
    ini("ini-batch-size-float", "ct_batch_size", "1.5", "positive integer"),
    ini("ini-batch-size-5000-digits", "ct_batch_size", BIG_INT, "(5000 characters)"),
    ini("ini-batch-size-max-zero", "ct_batch_size_max", "0", "positive integer"),
    ini("ini-feature-nodes-negative", "ct_max_feature_nodes", "-1", "positive integer"),
    ini("ini-config-missing", "ct_config", "missing.yaml", "No such file"),
    ini("ini-capacity-negative", "ct_vram_capacity", "-1", "positive number of GiB"),
    ini("ini-capacity-1e308", "ct_vram_capacity", "1e308", "at most 1024 GiB"),
    ini("ini-leak-unit", "ct_leak_threshold", "12 parsecs", "a size such as 256MiB"),
    ini("ini-leak-1e300GiB", "ct_leak_threshold", "1e300GiB", "at most 1024GiB"),
    ini("ini-leak-1e400GiB", "ct_leak_threshold", "1e400GiB", "at most 1024GiB"),
    ini("ini-leak-negative", "ct_leak_threshold", "-1MiB", "a size such as"),
    ini("ini-leak-spaced-digits", "ct_leak_threshold", "1 0", "a size such as"),  # not 10
    ini("ini-oom-retry-word", "ct_oom_retry", "perhaps", "true or false"),
    ini("ini-oom-retry-floor-zero", "ct_oom_retry_floor", "0", "positive integer"),
    ini("ini-oom-retry-floor-huge", "ct_oom_retry_floor", OVER_COUNT, "at most 2147483647"),
    ini("ini-cleanup-word", "ct_cleanup", "sometimes", "one of auto, always, never"),
    ini("ini-gpu-binding-word", "ct_gpu_binding", "maybe", "one of auto, off"),
    ini("ini-leases-word", "ct_leases", "perhaps", "true or false"),
    ini("ini-default-vram-negative", "ct_default_vram_gib", "-1", "0 or more"),
    ini("ini-notebook-inject-word", "ct_notebook_inject", "first", "one of parameters, top"),
    ini("ini-default-vram-1e308", "ct_default_vram_gib", "1e308", "at most 1024 GiB"),
    ini("ini-lease-timeout-zero", "ct_lease_timeout", "0", "positive number of seconds"),
    ini("ini-lease-timeout-1e308", "ct_lease_timeout", "1e308", "at most 604800 seconds"),
    ini("ini-auto-margin-one", "ct_auto_margin", "1", "from 0 to below 1"),
    ini("ini-auto-margin-inf", "ct_auto_margin", "inf", "from 0 to below 1"),
    ini("ini-prompt-tokens-5000-digits", "ct_estimate_prompt_tokens", BIG_INT, "characters)"),
    ini("ini-progress-after-word", "ct_progress_after", "soon", "or off, got 'soon'"),
    ini("ini-progress-after-negative", "ct_progress_after", "-1", "0 or more, or off, got '-1'"),
    ini("ini-progress-after-1e400", "ct_progress_after", "1e400", "at most 604800 seconds"),
    ini("ini-progress-after-nan", "ct_progress_after", "nan", "or off, got 'nan'"),
    ini("ini-fail-on-increase-word", "ct_fail_on_increase", "ten", "a percentage, 0 or more"),
    ini("ini-fail-on-increase-1e400", "ct_fail_on_increase", "1e400", "at most 10000%"),
    ini("ini-gpu-run-within-negative", "ct_require_gpu_run_within", "-1", "number of days"),
    ini("ini-gpu-run-within-nan", "ct_require_gpu_run_within", "nan", "number of days"),
    toml_list("toml-fail-on-increase", "ct_fail_on_increase", "[10]"),
    ini("ini-alloc-conf-typo", "ct_alloc_conf", "expandable_segment:True", "did you mean"),
    ini("ini-alloc-conf-lowercase-bool", "ct_alloc_conf", "expandable_segments:true", "True or"),
    ini("ini-alloc-conf-no-value", "ct_alloc_conf", "max_split_size_mb", "needs a value"),
    ini("ini-alloc-conf-small-split", "ct_alloc_conf", "max_split_size_mb:10", "at least 20"),
    ini(
        "ini-alloc-conf-gc-threshold",
        "ct_alloc_conf",
        "garbage_collection_threshold:1.5",
        "between 0 and 1",
    ),
    ini("ini-alloc-conf-backend", "ct_alloc_conf", "backend:jemalloc", "cudaMallocAsync"),
    toml_list("toml-list-cleanup", "ct_cleanup", "['x']"),
    toml_list("toml-list-alloc-conf", "ct_alloc_conf", "['expandable_segments:True']"),
    toml_list("toml-list-gpu-binding", "ct_gpu_binding", "['auto']"),
    toml_list("toml-list-batch-size", "ct_batch_size", "[8, 16]"),
    # --- environment variables ---------------------------------------------------------------
    env("env-batch-size-word", "CT_BATCH_SIZE", "big", "got 'big'"),
    env("env-batch-size-5000-digits", "CT_BATCH_SIZE", BIG_INT, "(5000 characters)"),
    env("env-batch-size-max-negative", "CT_BATCH_SIZE_MAX", "-2", "positive integer"),
    env("env-feature-nodes-float", "CT_MAX_FEATURE_NODES", "2.5", "positive integer"),
    env("env-capacity-zero", "CT_VRAM_CAPACITY", "0", "positive number of GiB"),
    env("env-capacity-1e308", "CT_VRAM_CAPACITY", "1e308", "at most 1024 GiB"),
    env("env-config-missing", "CT_CONFIG", "missing.yaml", "No such file"),
    env("env-config-fifo", "CT_CONFIG", "pipe", "not a regular file", prepare=_fifo),
    env(
        "env-fake-gpus-word",
        "CT_FAKE_GPUS",
        "H200=lots",
        "not a number of GiB",
        source="CT_FAKE_GPUS",
    ),
    env("env-fake-gpus-zero", "CT_FAKE_GPUS", "H200=0", "positive number", source="CT_FAKE_GPUS"),
    env("env-fake-gpus-1e308", "CT_FAKE_GPUS", "H200=1e308", "at most 1024", source="CT_FAKE_GPUS"),
    env("env-fake-gpus-no-name", "CT_FAKE_GPUS", "=80", "empty name", source="CT_FAKE_GPUS"),
    # --- experiment YAML keys --------------------------------------------------------------
    yaml("yaml-top-level-list", "- a\n- b\n", "the top level must be a mapping"),
    yaml(
        "yaml-unknown-key", "BATCH_SIZ: 3\n", "unknown key 'BATCH_SIZ' (did you mean BATCH_SIZE?)"
    ),
    yaml("yaml-malformed", "MODEL_NAME: [unclosed\n", "malformed YAML at line"),
    yaml("yaml-python-tag", "PARAMS: !!python/object/apply:os.system ['true']\n", "malformed"),
    yaml("yaml-two-documents", "BATCH_SIZE: 1\n---\nBATCH_SIZE: 2\n", "malformed YAML"),
    yaml("yaml-duplicate-key", "BATCH_SIZE: 1\nBATCH_SIZE: 2\n", "duplicate key 'BATCH_SIZE'"),
    yaml("yaml-model-family-list", "MODEL_FAMILY: [a]\n", "MODEL_FAMILY must be a non-empty"),
    yaml("yaml-model-name-newline", 'MODEL_NAME: "a\\nb"\n', "MODEL_NAME must be one line"),
    yaml("yaml-transcoder-set-empty", "TRANSCODER_SET: ''\n", "TRANSCODER_SET must be"),
    yaml("yaml-backend", "BACKEND: tensorflow\n", "BACKEND must be one of nnsight"),
    yaml("yaml-dtype", "DTYPE: fp64\n", "DTYPE must be one of float32"),
    yaml("yaml-batch-size-bool", "BATCH_SIZE: true\n", "BATCH_SIZE must be a positive integer"),
    yaml("yaml-batch-size-5000-digits", f"BATCH_SIZE: {BIG_INT}\n", "has 5000 digits"),
    yaml("yaml-batch-size-10**400", f"BATCH_SIZE: {OVER_COUNT}\n", "at most 2147483647"),
    yaml("yaml-batch-size-max-zero", "BATCH_SIZE_MAX: 0\n", "BATCH_SIZE_MAX must be"),
    yaml("yaml-feature-nodes-float", "MAX_FEATURE_NODES: 2.5\n", "MAX_FEATURE_NODES must be"),
    yaml("yaml-n-logits-negative", "MAX_N_LOGITS: -1\n", "MAX_N_LOGITS must be"),
    yaml("yaml-logit-prob-over-one", "DESIRED_LOGIT_PROB: 1.5\n", "in (0, 1]"),
    yaml("yaml-offload", "OFFLOAD: gpu\n", "OFFLOAD must be one of cpu, disk"),
    yaml("yaml-lazy-encoder-word", "LAZY_ENCODER: sometimes\n", "LAZY_ENCODER must be true"),
    yaml("yaml-lazy-decoder-number", "LAZY_DECODER: 2\n", "LAZY_DECODER must be true"),
    yaml("yaml-verbose-word", "VERBOSE: loud\n", "VERBOSE must be true"),
    yaml("yaml-vram-1e400-text", "VRAM_GIB: 1e400\n", "VRAM_GIB must be a positive number"),
    yaml(
        "yaml-vram-exponent-text",
        "VRAM_GIB: 2e1\n",
        "VRAM_GIB must be a positive number of GiB, got '2e1' (text, not a number: YAML reads "
        "an exponent without a dot and a signed exponent as text; write 20.0)",
    ),
    yaml(
        "yaml-probability-exponent-text",
        "DESIRED_LOGIT_PROB: 5e-1\n",
        "DESIRED_LOGIT_PROB must be a number in (0, 1], got '5e-1' (text, not a number: *; "
        "write 0.5)",
    ),
    yaml("yaml-vram-float-overflow", "VRAM_GIB: 1.0e+400\n", "beyond a float's range"),
    yaml("yaml-vram-inf", "VRAM_GIB: .inf\n", "at most 1024 GiB"),
    yaml("yaml-vram-nan", "VRAM_GIB: .nan\n", "positive number of GiB"),
    yaml("yaml-vram-2000", "VRAM_GIB: 2000\n", "at most 1024 GiB"),
    yaml("yaml-params-not-mapping", "PARAMS: 3\n", "PARAMS must be a mapping"),
    yaml("yaml-params-5000-digits", f"PARAMS:\n  seed: {BIG_INT}\n", "line 2 has 5000 digits"),
    # Base 60: built by multiplication, in time quadratic in its length (a MiB took minutes).
    yaml(
        "yaml-params-base-60",
        f"PARAMS:\n  seed: {'1:' * 2200}1\n",
        "line 2 is 4401 characters, more",
    ),
    yaml("yaml-params-20000-deep", f"PARAMS: {DEEP}\n", "nested deeper than 64 levels"),
    yaml("yaml-params-billion-laughs", "PARAMS:\n" + BOMB, "more than 100000 values"),
    yaml("yaml-params-laughs-of-text", "PARAMS:\n" + TEXT_BOMB, "more than 16777216 characters"),
    yaml("yaml-params-recursive-alias", "PARAMS:\n  a: &a [1, *a]\n", "recursive alias"),
    yaml("yaml-notebook-not-a-path", "NOTEBOOK: 3\n", "NOTEBOOK must be a notebook path"),
    yaml(
        "yaml-notebook-escape-sequence",  # was the item's name, shown raw
        'NOTEBOOK: "nope\\nFAKE PASSED\\e[2J.ipynb"\n',
        "NOTEBOOK must be a notebook path, got 'nope\\nFAKE PASSED\\x1b[2J.ipynb'",
    ),
    yaml("yaml-not-utf8", "BATCH_SIZE: \udcff\n", "not UTF-8 text"),
    # --- markers: the test that carries one fails alone, at setup ---------------------------
    marker("vram-inf", "vram(gib=float('inf'))", "at most 1024 GiB, got inf"),
    marker("vram-nan", "vram(gib=float('nan'))", "positive number of GiB, got nan"),
    marker("vram-10**400", "vram(gib=10**400)", "an integer of about 401 digits"),
    marker("vram-zero", "vram(0)", "positive number of GiB, got 0"),
    marker("vram-bool", "vram(True)", "got True"),
    marker("vram-string", "vram('8')", "got '8'"),
    marker("vram-missing", "vram()", "missing a required argument"),
    marker("vram-unknown-keyword", "vram(gb=8)", "unknown keyword 'gb'"),
    marker("ct-config-unknown-field", "ct_config(batch=8)", "unknown field 'batch'"),
    marker("ct-config-batch-10**400", "ct_config(batch_size=10**400)", "at most 2147483647"),
    marker("ct-config-batch-zero", "ct_config(batch_size=0)", "positive integer or 'auto'"),
    marker("ct-config-vram-inf", "ct_config(vram_gib=float('inf'))", "at most 1024 GiB"),
    marker("ct-config-dtype", "ct_config(dtype='fp64')", "must be one of float32"),
    marker("ct-config-path-not-str", "ct_config(path=3)", "path must be a string, got 3"),
    marker("ct-config-path-missing", "ct_config(path='nope.yaml')", "No such file"),
    marker("ct-config-path-nul", "ct_config(path='a\\0b')", "not a valid path"),
    marker(
        "ct-config-path-5000-digits",
        "ct_config(path='bad.yaml')",
        "has 5000 digits",
        files=(("bad.yaml", f"MAX_N_LOGITS: {BIG_INT}\n"),),
    ),
    marker(
        "ct-config-path-deep",
        "ct_config(path='bad.yaml')",
        "nested deeper than 64",
        files=(("bad.yaml", f"PARAMS: {DEEP}\n"),),
    ),
    marker(
        "ct-config-path-bomb",
        "ct_config(path='bad.yaml')",
        "more than 100000 values",
        files=(("bad.yaml", "PARAMS:\n" + BOMB),),
    ),
    # --- notebook metadata and NOTEBOOK configs (pytest --nbmake) --------------------------
    notebook("nb-metadata-not-object", "[1]", "metadata 'ctresources' must be an object"),
    notebook("nb-metadata-unknown-key", '{"vram": 8}', "unknown key(s) vram"),
    notebook("nb-marks-not-list", '{"marks": "slow"}', "must be a list of mark names"),
    notebook("nb-marks-bad-name", '{"marks": ["not a name"]}', "must be a list of mark names"),
    notebook("nb-vram-negative", '{"vram_gib": -2}', "must be a positive number"),
    notebook("nb-vram-string", '{"vram_gib": "20"}', "must be a positive number"),
    notebook(
        "nb-vram-1e400",
        '{"vram_gib": 1e400}',
        "at most 1024 GiB, got inf",
        source="@pytest.mark.vram on bad.ipynb",
    ),
    notebook(
        "nb-vram-2000",
        '{"vram_gib": 2000}',
        "at most 1024 GiB",
        source="@pytest.mark.vram on bad.ipynb",
    ),
    notebook_config("nb-config-5000-digits", f"BATCH_SIZE: {BIG_INT}\n", "has 5000 digits"),
    notebook_config("nb-config-deep", f"PARAMS: {DEEP}\n", "nested deeper than 64"),
    notebook_config("nb-config-unknown-key", "BATCH: 3\n", "unknown key 'BATCH'"),
    # --- ct-resources -----------------------------------------------------------------------
    cli(
        "cli-gpu-gib-1e308",
        "estimate",
        "--model",
        "google/gemma-2-2b",
        "--transcoders",
        "gemma",
        "--gpu-gib",
        "1e308",
        message="at most 1024",
        source="argument --gpu-gib:",
    ),
    cli("cli-gpu-gib-inf", "estimate", "--gpu-gib", "inf", message="at most 1024"),
    cli("cli-gpu-gib-nan", "estimate", "--gpu-gib", "nan", message="positive number of GiB"),
    cli("cli-gpu-gib-zero", "estimate", "--gpu-gib", "0", message="positive number of GiB"),
    cli("cli-gpu-gib-word", "estimate", "--gpu-gib", "big", message="got 'big'"),
    cli("cli-prompt-tokens-zero", "estimate", "--prompt-tokens", "0", message="positive integer"),
    cli("cli-prompt-tokens-float", "estimate", "--prompt-tokens", "1.5", message="positive"),
    cli(
        "cli-prompt-tokens-5000-digits",
        "estimate",
        "--prompt-tokens",
        BIG_INT,
        message="(5000 characters)",
    ),
    cli("cli-prompt-tokens-huge", "estimate", "--prompt-tokens", OVER_COUNT, message="at most"),
    cli("cli-batch-size-zero", "estimate", "--batch-size", "0", message="positive integer"),
    cli("cli-batch-size-word", "estimate", "--batch-size", "lots", message="got 'lots'"),
    cli("cli-ceiling-huge", "estimate", "--ceiling", OVER_COUNT, message="at most 2147483647"),
    cli("cli-feature-nodes-negative", "estimate", "--max-feature-nodes", "-4", message="positive"),
    cli("cli-active-features-1e308", "estimate", "--active-features", "1e308", message="at most"),
    cli("cli-active-features-zero", "estimate", "--active-features", "0", message="positive"),
    cli("cli-dtype", "estimate", "--dtype", "fp64", message="must be one of float32"),
    cli(
        "cli-config-missing",
        "estimate",
        "--config",
        "missing.yaml",
        message="No such file",
        source="ct-resources: error: missing.yaml",
    ),
    cli(
        "cli-config-deep",
        "estimate",
        "--config",
        "exp.yaml",
        message="nested deeper than 64",
        source="ct-resources: error: exp.yaml",
        files=(("exp.yaml", f"PARAMS: {DEEP}\n"),),
    ),
    cli(
        "cli-config-bomb",
        "estimate",
        "--config",
        "exp.yaml",
        message="more than 100000",
        source="ct-resources: error: exp.yaml",
        files=(("exp.yaml", "PARAMS:\n" + BOMB),),
    ),
    cli(
        "cli-config-5000-digits",
        "estimate",
        "--config",
        "exp.yaml",
        message="5000 digits",
        source="ct-resources: error: exp.yaml",
        files=(("exp.yaml", f"BATCH_SIZE: {BIG_INT}\n"),),
    ),
    cli(
        "cli-unknown-model",
        "estimate",
        "--model",
        "nobody/none",
        "--transcoders",
        "gemma",
        "--gpu-gib",
        "24",
        message="nobody/none",
        source="ct-resources: error:",
    ),
    cli(
        "cli-unknown-transcoders",
        "estimate",
        "--model",
        "google/gemma-2-2b",
        "--transcoders",
        "nope/none",
        "--gpu-gib",
        "24",
        message="unknown transcoder set 'nope/none'",
        source="ct-resources: error:",
    ),
    cli("cli-table-active-features-nan", "table", "--active-features", "nan", message="positive"),
    cli(
        "cli-table-cards-1e308",
        "table",
        "--cards",
        "24,1e308",
        message="at most 1024",
        source="ct-resources: error: bad list",
    ),
    cli(
        "cli-table-cards-word",
        "table",
        "--cards",
        "big",
        message="positive number of GiB",
        source="ct-resources: error: bad list",
    ),
    cli(
        "cli-table-prompt-tokens",
        "table",
        "--prompt-tokens",
        "32,0",
        message="positive integer",
        source="ct-resources: error: bad list",
    ),
    cli(
        "cli-table-dtypes",
        "table",
        "--dtypes",
        "bfloat16,fp64",
        message="one of float32",
        source="ct-resources: error: bad list",
    ),
    cli("cli-table-ceiling-zero", "table", "--ceiling", "0", message="positive integer"),
    # A list of nothing printed a table with empty cells; 60,000 entries ran for minutes.
    cli(
        "cli-table-cards-none",
        "table",
        "--cards",
        ",",
        message="give 1 to 32 values",
        source="ct-resources: error: bad list",
    ),
    cli(
        "cli-table-cards-2000",
        "table",
        "--cards",
        ",".join(["24"] * 2000),
        message="give 1 to 32 values",
        source="ct-resources: error: bad list",
    ),
    cli(
        "cli-gpus-fake-gpus",
        "gpus",
        message="CT_FAKE_GPUS: entry 1",
        source="ct-resources: error:",
        env=(("CT_FAKE_GPUS", "H200=lots"),),
    ),
    # --- --ct-snapshot, --ct-snapshot-dir: option, ini key, variable -----------------------
    option("snapshot-mode", "--ct-snapshot", "sometimes", message="one of off, on-failure"),
    ini("ini-snapshot-mode", "ct_snapshot", "yes", "one of off, on-failure, always"),
    env("env-snapshot-mode", "CT_SNAPSHOT", "on", "one of off, on-failure, always"),
    option(
        "snapshot-dir-file",
        "--ct-snapshot-dir",
        "notes.txt",
        message="notes.txt is a regular file, not a directory",
        source="--ct-snapshot-dir:",
        files=(("notes.txt", VICTIM_TEXT),),
    ),
    option(
        "snapshot-dir-symlink",
        "--ct-snapshot-dir",
        "link",
        message="is a symbolic link",
        source="--ct-snapshot-dir:",
        prepare=lambda path: (path / "link").symlink_to("."),
    ),
    Row(
        "ini-snapshot-dir-fifo",
        "usage",
        "ini ct_snapshot_dir in ",
        "is a FIFO, not a directory",
        ini="ct_snapshot_dir = pipe",
        prepare=_fifo,
    ),
    env(
        "env-snapshot-dir-file",
        "CT_SNAPSHOT_DIR",
        "notes.txt",
        "is a regular file, not a directory",
        files=(("notes.txt", VICTIM_TEXT),),
    ),
    toml_list("toml-snapshot", "ct_snapshot", '["always"]'),
]


# --- characters YAML does not allow, from every way a config is named ----------------------

#: The characters PyYAML's reader refuses (YAML 1.1's printable set): the C0 controls but tab,
#: newline and carriage return; DEL; the C1 controls but NEL; the non-characters U+FFFE, U+FFFF.
UNPRINTABLE_IN_YAML = (
    *(chr(code) for code in range(0x20) if code not in (0x09, 0x0A, 0x0D)),
    "\x7f",
    *(chr(code) for code in range(0x80, 0xA0) if code != 0x85),
    "\ufffe",
    "\uffff",
)


def _refused(char: str, line: int, column: int) -> str:
    return (
        f"malformed YAML at line {line}, column {column}: the character U+{ord(char):04X} "
        "is not allowed in YAML*"
    )


def _mkfifo(name: str) -> Callable[[Path], None]:
    return lambda path: os.mkfifo(path / name)


def _symlink(name: str, target: str) -> Callable[[Path], None]:
    return lambda path: (path / name).symlink_to(target)


LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
}


def _config_json(**changes: object) -> str:
    import json

    return json.dumps({**LLAMA_CONFIG, **changes}).replace('"@RAW@', "").replace('@RAW@"', "")


def model_json(id: str, text: str | None, message: str, **kw: object) -> Row:
    """``ct-resources estimate --model config.json`` with ``text`` as the file."""
    return cli(
        id,
        "estimate",
        "--model",
        "config.json",
        "--transcoders",
        "gemma",
        "--gpu-gib",
        "24",
        message=message,
        source="argument --model: ",
        files=(("config.json", text),) if text is not None else (),
        **kw,
    )


ROWS.extend(
    [
        *(
            yaml(f"yaml-{name}-character", f"MODEL_NAME: a{char}b\n", _refused(char, 1, 14))
            for name, char in (
                ("nul", "\0"),
                ("esc", "\x1b"),
                ("c1-csi", "\x9b"),
                ("ufffe", "\ufffe"),
            )
        ),
        env(
            "env-config-esc-character",
            "CT_CONFIG",
            "exp.yaml",
            "exp.yaml: " + _refused("\x1b", 2, 1),
            files=(("exp.yaml", "BATCH_SIZE: 2\n\x1b[2J\n"),),
        ),
        Row(
            "ini-config-nul-character",
            "usage",
            "ini ct_config in ",
            "exp.yaml: " + _refused("\0", 1, 1),
            ini="ct_config = exp.yaml",
            files=(("exp.yaml", "\0"),),
        ),
        marker(
            "ct-config-path-esc-character",
            "ct_config(path='bad.yaml')",
            "bad.yaml: " + _refused("\x1b", 1, 9),
            files=(("bad.yaml", "PARAMS: \x1b]0;owned\x07\n"),),
        ),
        notebook_config("nb-config-nul-character", 'PARAMS: {a: "\0"}\n', _refused("\0", 2, 14)),
        notebook_config(
            "nb-config-c1-character", "BATCH_SIZE: 2\x85\x9b\n", _refused("\x9b", 2, 15)
        ),
        *(
            cli(
                f"cli-config-{name}-character",
                "estimate",
                "--config",
                "exp.yaml",
                message=_refused(char, 1, 1),
                source="ct-resources: error: exp.yaml: ",
                files=(("exp.yaml", f"{char}BATCH_SIZE: 2\n"),),
            )
            for name, char in (("nul", "\0"), ("esc", "\x1b"), ("ufffe", "\ufffe"))
        ),
        # A file name holding an escape sequence is named escaped.
        option(
            "config-name-escape-sequence",
            "--ct-config",
            "\x1b[2Jexp.yaml",
            message="\\x1b[[]2Jexp.yaml: cannot read experiment config: No such file*",
        ),
        # --- ct-resources estimate --model config.json -------------------------------------
        model_json(
            "model-json-fifo",
            None,
            "config.json: not a regular file",
            prepare=_mkfifo("config.json"),
        ),
        model_json(
            "model-json-dev-zero",
            None,
            "config.json: not a regular file",
            prepare=_symlink("config.json", "/dev/zero"),
        ),
        model_json("model-json-too-large", " " * (1 << 20) + "{}", "larger than 1 MiB"),
        model_json(
            "model-json-layers-1e400",
            _config_json(num_hidden_layers="@RAW@1e400@RAW@"),
            "num_hidden_layers must be a whole number, got inf",
        ),
        model_json(
            "model-json-layers-400-digits",
            _config_json(num_hidden_layers="@RAW@" + "9" * 400 + "@RAW@"),
            "num_hidden_layers must be at most 16777216, got an integer of about 40? digits",
        ),
        model_json(
            "model-json-layers-5000-digits",
            _config_json(num_hidden_layers="@RAW@" + "9" * 5000 + "@RAW@"),
            "cannot read model config config.json: an integer of over 4300 digits",
        ),
        model_json("model-json-deep", "[" * 100_000 + "]" * 100_000, "nested too deep"),
        model_json(
            "model-json-nan",
            _config_json(hidden_size="@RAW@NaN@RAW@"),
            "NaN is not a JSON number",
        ),
        model_json(
            "model-json-infinity",
            _config_json(vocab_size="@RAW@Infinity@RAW@"),
            "Infinity is not a JSON number",
        ),
        model_json(
            "model-json-minus-infinity",
            _config_json(vocab_size="@RAW@-Infinity@RAW@"),
            "-Infinity is not a JSON number",
        ),
        model_json(
            "model-json-layers-text",
            _config_json(num_hidden_layers="26"),
            "num_hidden_layers must be a whole number, got '26'",
        ),
        model_json(
            "model-json-layers-bool",
            _config_json(num_hidden_layers=True),
            "num_hidden_layers must be a whole number, got True",
        ),
        model_json(
            "model-json-layers-float",
            _config_json(num_hidden_layers=2.5),
            "num_hidden_layers must be a whole number, got 2.5",
        ),
        model_json(
            "model-json-layers-negative",
            _config_json(num_hidden_layers=-3),
            "n_layers must be positive, got -3",
        ),
        model_json(
            "model-json-vocab-2**30",
            _config_json(vocab_size=2**30),
            "vocab_size must be at most 16777216",
        ),
        model_json(
            "model-json-kv-heads-list",
            _config_json(num_key_value_heads=[4]),
            "num_key_value_heads must be a whole number, got [[]4]",
        ),
        model_json(
            "model-json-head-dim-zero",
            _config_json(hidden_size=2, num_attention_heads=4),
            "head_dim must be positive, got 0",
        ),
        model_json(
            "model-json-softcap-text",
            _config_json(final_logit_softcapping="abc"),
            "final_logit_softcapping must be a number from 0 to 1e6 or null, got 'abc'",
        ),
        model_json(
            "model-json-softcap-1e400",
            _config_json(final_logit_softcapping="@RAW@1e400@RAW@"),
            "final_logit_softcapping must be a number*, got inf",
        ),
        model_json(
            "model-json-model-type-list",
            _config_json(model_type=["llama"]),
            "model_type [[]'llama'] is not one of",
        ),
        model_json(
            "model-json-model-type-5000-characters",
            _config_json(model_type="x" * 5000),
            "(5000 characters) is not one of",
        ),
        model_json(
            "model-json-text-config-list",
            '{"text_config": [1], "model_type": "gemma3"}',
            "not a model config",
        ),
        model_json("model-json-a-string", '"llama"', "not a model config"),
        model_json("model-json-empty", "", "cannot read model config config.json: 'Expecting"),
        model_json(
            "model-json-missing-key",
            '{"model_type": "llama"}',
            "missing or invalid key 'num_attention_heads'",
        ),
        model_json("model-json-not-utf8", '{"model_type": "\udcff"}', "not UTF-8 text"),
        model_json(
            "model-json-a-directory",
            None,
            "config.json/config.json: No such file",
            prepare=lambda path: (path / "config.json").mkdir(),
        ),
    ]
)


def test_every_character_yaml_refuses_is_one_line_naming_file_and_position(
    tmp_path: Path,
) -> None:
    """The pure reader, for each of the characters, in a key, a value and a PARAMS list:
    one line naming the file, the line and the column, the character escaped."""
    from pytest_ctresources.settings.config import ConfigError
    from pytest_ctresources.settings.experiment_yaml import load_experiment_yaml

    inputs = 0
    for char in UNPRINTABLE_IN_YAML:
        for text, line, column in (
            (f"MODEL_NAME: gemma{char}\n", 1, 18),
            (f"BATCH_SIZE: 2\nPARAMS:\n  layers: [1, {char}]\n", 3, 15),
            (f"# {char}\n", 1, 3),
        ):
            path = tmp_path / f"exp{inputs}.yaml"
            path.write_text(text, errors="surrogateescape")
            with pytest.raises(ConfigError) as error:
                load_experiment_yaml(path)
            message = str(error.value)
            assert message.startswith(f"{path}: "), message
            assert fnmatch.fnmatchcase(message, f"*{_refused(char, line, column)}"), message
            assert message.isprintable() and "\n" not in message
            inputs += 1
    assert inputs == 3 * len(UNPRINTABLE_IN_YAML) == 189


# --- the pytest cache's learned needs are data that may be corrupt --------------------------

GOOD_NEED = '{"gib": 1.5, "gpu": "H200", "date": "2026-01-01"}'
NEEDS_PATH = f".pytest_cache/v/{CACHE_KEY}"
#: A key core/learned.py's memory_key writes (a JSON array: node id, config, capacity).
GOOD_KEY = '["t.py::test_good",null,null]'


@dataclass(frozen=True)
class CacheRow:
    """One bad learned-needs cache: its bytes (or what ``prepare`` plants at the path) and
    what the one warning says. ``kept``: the keys still learned afterwards."""

    id: str
    message: str
    content: bytes | None = None
    prepare: Callable[[Path], None] | None = None
    kept: tuple[str, ...] = ()
    as_root: bool | None = None


def bad_entry(
    id: str, entry: str, *, key: str = json.dumps('["t.py::test_bad",null,null]')
) -> CacheRow:
    """A cache of one good need and one bad one: the bad one is dropped, the good kept.
    (``key``: as the cache's JSON text holds it.)"""
    text = f"{{{json.dumps(GOOD_KEY)}: {GOOD_NEED}, {key}: {entry}}}"
    return CacheRow(
        id,
        "dropped 1 learned VRAM need(s) from pytest's cache that are not valid*",
        text.encode("utf-8", "surrogateescape"),
        kept=(GOOD_KEY,),
    )


def _need(gib: str = "1.5", gpu: str = '"H200"', date: str = '"2026-01-01"') -> str:
    return f'{{"gib": {gib}, "gpu": {gpu}, "date": {date}}}'


def _plant(make: Callable[[Path], None]) -> Callable[[Path], None]:
    def prepare(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        make(path)

    return prepare


def _socket_at(path: Path) -> None:
    import socket

    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()


def _victim_beside(path: Path) -> None:
    victim = path.parent / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    path.symlink_to(victim)


CACHE_ROWS: list[CacheRow] = [
    bad_entry("cache-gib-10**400", _need("1" + "0" * 400)),
    bad_entry("cache-gib-1e400", _need("1e400")),
    bad_entry("cache-gib-negative", _need("-1")),
    bad_entry("cache-gib-2000", _need("2000")),
    bad_entry("cache-gib-text", _need('"8"')),
    bad_entry("cache-gib-bool", _need("true")),
    bad_entry("cache-gib-null", _need("null")),
    bad_entry("cache-gib-nan", _need("NaN")),
    bad_entry("cache-gib-infinity", _need("Infinity")),
    bad_entry("cache-gib-minus-infinity", _need("-Infinity")),
    bad_entry("cache-gib-list", _need("[8]")),
    bad_entry("cache-gib-object", _need('{"gib": 8}')),
    bad_entry("cache-gib-missing", '{"gpu": "H200", "date": "2026-01-01"}'),
    bad_entry("cache-gpu-missing", '{"gib": 1.5, "date": "2026-01-01"}'),
    bad_entry("cache-date-missing", '{"gib": 1.5, "gpu": "H200"}'),
    bad_entry("cache-gpu-5000-characters", _need(gpu='"' + "x" * 5000 + '"')),
    bad_entry("cache-gpu-escape-sequence", _need(gpu='"\\u001b[2J"')),
    bad_entry("cache-gpu-number", _need(gpu="3")),
    bad_entry("cache-date-null", _need(date="null")),
    bad_entry("cache-date-nul", _need(date='"\\u0000"')),
    bad_entry("cache-versions-list", _need()[:-1] + ', "versions": ["torch"]}'),
    bad_entry("cache-versions-number", _need()[:-1] + ', "versions": {"torch": 2}}'),
    bad_entry("cache-entry-list", "[1.5]"),
    bad_entry("cache-entry-text", '"1.5"'),
    bad_entry("cache-entry-number", "1.5"),
    bad_entry("cache-entry-null", "null"),
    bad_entry("cache-entry-bool", "true"),
    bad_entry("cache-key-empty", GOOD_NEED, key='""'),
    bad_entry("cache-key-20000-characters", GOOD_NEED, key='"' + "k" * 20_000 + '"'),
    bad_entry("cache-key-nul", GOOD_NEED, key='"t.py::\\u0000"'),
    # Keys that are no JSON array of node id, config and capacity: an earlier version's
    # ``node id|config`` among them.
    bad_entry("cache-key-bar-joined", GOOD_NEED, key=json.dumps('t.py::test_bad|{"dtype":1}')),
    bad_entry("cache-key-short-array", GOOD_NEED, key=json.dumps('["t.py::test_bad"]')),
    bad_entry("cache-key-node-id-number", GOOD_NEED, key=json.dumps("[1,null,null]")),
    bad_entry("cache-key-capacity-text", GOOD_NEED, key=json.dumps('["t.py::x",null,"24"]')),
    CacheRow("cache-not-json", "*are not valid JSON; discarded", b"{"),
    CacheRow("cache-not-utf8", "*are not valid JSON; discarded", b'{"\xff": 1}'),
    CacheRow("cache-5000-digits", "*are not valid JSON; discarded", b"1" * 5000),
    CacheRow("cache-deep", "*are nested too deep; discarded", b"[" * 100_000 + b"]" * 100_000),
    CacheRow("cache-a-list", "*are a list, not a mapping; discarded", b"[1, 2]"),
    CacheRow("cache-a-string", "*are a str, not a mapping; discarded", b'"needs"'),
    CacheRow("cache-null", "*are a NoneType, not a mapping; discarded", b"null"),
    CacheRow("cache-too-large", "*are larger than 32 MiB; discarded", b" " * (32 << 20) + b"{}"),
    CacheRow(
        "cache-fifo",
        "*is not a regular file, not learned VRAM needs; ignored and left alone*",
        prepare=_plant(os.mkfifo),
    ),
    CacheRow(
        "cache-directory",
        "*is not a regular file, not learned VRAM needs; ignored and left alone*",
        prepare=_plant(lambda path: path.mkdir()),
    ),
    CacheRow(
        "cache-socket",
        "cannot read the learned VRAM needs at *: No such device or address; ignored and left alone",
        prepare=_plant(_socket_at),
    ),
    CacheRow(
        "cache-symlink-to-a-file",
        "*is a symbolic link, not learned VRAM needs; ignored and left alone*",
        prepare=_plant(_victim_beside),
    ),
    CacheRow(
        "cache-symlink-to-dev-zero",
        "*is a symbolic link, not learned VRAM needs; ignored and left alone*",
        prepare=_plant(lambda path: path.symlink_to("/dev/zero")),
    ),
    CacheRow(
        "cache-dangling-symlink",
        "*is a symbolic link, not learned VRAM needs; ignored and left alone*",
        prepare=_plant(lambda path: path.symlink_to(path.parent / "nowhere")),
    ),
    CacheRow(
        "cache-char-device",
        "*is not a regular file, not learned VRAM needs; ignored and left alone*",
        prepare=_plant(lambda path: os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))),
        as_root=True,
    ),
]


class _Cache:
    """What the learned needs use of ``pytest.Cache``: where its values are."""

    def __init__(self, cachedir: Path) -> None:
        self._cachedir = cachedir

    def set(self, key: str, value: object) -> None:  # only where nothing is at the path
        import json

        path = self._cachedir / "v" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


class Hang(Exception):
    """Raised by :class:`_Bounded`: not an ``OSError`` (as ``TimeoutError`` is), which code
    around an ``open`` may catch and go on to block again (pytest's ``Cache.get`` does)."""


class _Bounded:
    """Fails the test after ``seconds`` instead of letting it hang (a FIFO opened for
    reading without O_NONBLOCK waits for a writer forever)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        import signal

        def expire(signum: int, frame: object) -> None:
            raise Hang(f"still running after {self.seconds} s: a hang")

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        import signal

        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


@pytest.mark.parametrize("row", CACHE_ROWS, ids=lambda r: r.id)
def test_a_bad_learned_needs_cache_is_one_warning(tmp_path: Path, row: CacheRow) -> None:
    """Loaded, each bad cache is exactly one LearnedNeedsWarning naming what is wrong; the
    valid needs stay; nothing raises, nothing blocks; saving (``--ct-forget`` included)
    writes through nothing and replaces only a regular file."""
    from typing import cast

    from pytest_ctresources.core.learned import LearnedNeeds, LearnedNeedsWarning

    root = os.geteuid() == 0
    if row.as_root is True and not root:
        pytest.skip("mknod of a character device needs root")
    path = tmp_path / NEEDS_PATH.removeprefix(".pytest_cache/")
    if row.content is not None:
        path.parent.mkdir(parents=True)
        path.write_bytes(row.content)
    if row.prepare is not None:
        row.prepare(path)
    before = os.lstat(path)
    cache = cast(pytest.Cache, _Cache(tmp_path))
    with _Bounded(60), pytest.warns(LearnedNeedsWarning) as warned:
        needs = LearnedNeeds(cache)
        for key in needs.keys():
            needs.get(key)
        forgotten = needs.forget()
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert fnmatch.fnmatchcase(message, f"ctresources: {row.message}"), message
    assert message.isprintable() and len(message) < 1000
    assert needs.keys() == [] and forgotten == len(row.kept)
    after = os.lstat(path)
    if stat.S_ISREG(before.st_mode):
        assert path.read_text() == "{}"  # a corrupt regular file is replaced by the save
    else:
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    victim = path.parent / "victim.txt"
    if victim.exists():
        assert victim.read_text() == VICTIM_TEXT


def test_a_bad_need_keeps_the_good_ones(tmp_path: Path) -> None:
    from typing import cast

    from pytest_ctresources.core.learned import LearnedNeeds, LearnedNeedsWarning

    rows = [row for row in CACHE_ROWS if row.kept]
    for row in rows:
        path = tmp_path / row.id / NEEDS_PATH.removeprefix(".pytest_cache/")
        path.parent.mkdir(parents=True)
        assert row.content is not None
        path.write_bytes(row.content)
        with pytest.warns(LearnedNeedsWarning):
            needs = LearnedNeeds(cast(pytest.Cache, _Cache(tmp_path / row.id)))
        assert needs.keys() == list(row.kept), row.id
        assert needs.get(GOOD_KEY) is not None


CORRUPT_CACHE_TEST = """
import pytest

@pytest.mark.parametrize("case", ["a|b", "c"])
def test_good(case):
    pass
"""


def _all_bad_entries() -> bytes:
    """Every bad entry of the table in one cache, each keyed to a test that runs, so each is
    looked up at setup (a 10**400 need was an OverflowError there)."""

    def key(nodeid: str, capacity: int | None = None) -> str:
        return json.dumps(memory_key(nodeid, None, capacity))

    parts = [f"{key('test_gone.py::test_x')}: {GOOD_NEED}"]  # valid, and stale: pruned
    for number, row in enumerate(r for r in CACHE_ROWS if r.kept):
        assert row.content is not None
        entry = row.content.decode("utf-8", "surrogateescape")
        bad = entry[entry.index("}, ") + 3 : -1]
        bad_key, _, value = bad.partition(": ")
        if bad_key == json.dumps('["t.py::test_bad",null,null]'):
            # A key of a test that runs, one per row (the capacity makes it its own).
            bad_key = key("test_it.py::test_good[a|b]", number)
        parts.append(f"{bad_key}: {value}")
    # A key no file can have: the stale-key check was an INTERNALERROR (File name too long).
    parts.append(f"{key('x' * 5000 + '.py::test_x')}: {GOOD_NEED}")
    return ("{" + ", ".join(parts) + "}").encode("utf-8", "surrogateescape")


@pytest.mark.parametrize(
    "case",
    ["every-bad-entry", "deep", "fifo", "forget-through-symlink"],
)
def test_a_corrupt_cache_is_one_warning_and_the_run_goes_on(
    pytester: pytest.Pytester, case: str
) -> None:
    """A whole run on a corrupt cache (in-process, under a bound): no traceback, no
    INTERNALERROR, no hang; one LearnedNeedsWarning; the tests run; nothing written through."""
    from pytest_ctresources.core.learned import LearnedNeedsWarning

    path = pytester.path / NEEDS_PATH
    path.parent.mkdir(parents=True)
    args: tuple[str, ...] = ()
    if case == "every-bad-entry":
        path.write_bytes(_all_bad_entries())
    elif case == "deep":
        path.write_bytes(b"{" + b'"a": {' * 50_000 + b"}" * 50_001)
    elif case == "fifo":
        os.mkfifo(path)
    else:
        _victim_beside(path)
        args = ("--ct-forget",)
    pytester.makepyfile(test_it=CORRUPT_CACHE_TEST)
    # The learned needs are read where the plugin acts: this project asks (a project that
    # does not never reads them, settings/activation.py).
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    content = path.read_bytes() if case == "deep" else b""
    # In-process, a warning at configure reaches this test's recorder; one at the end of
    # the session, the run's own summary.
    with _Bounded(60), warnings.catch_warnings(record=True) as at_configure:
        warnings.simplefilter("always")
        result = pytester.runpytest("-p", "no:randomly", *args)
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output
    result.assert_outcomes(passed=2)
    ours = [w for w in at_configure if issubclass(w.category, LearnedNeedsWarning)]
    assert len(ours) + output.count("LearnedNeedsWarning") == 1, output
    if case == "deep":
        assert path.read_bytes() == content  # nothing learned: no save, nothing written
    elif case == "fifo":
        assert stat.S_ISFIFO(os.lstat(path).st_mode)
    elif case == "forget-through-symlink":
        assert path.is_symlink() and (path.parent / "victim.txt").read_text() == VICTIM_TEXT
    else:
        assert path.read_text() == "{}"  # the bad entries pruned by the save


DURATIONS_PATH = ".pytest_cache/v/ctresources/learned-durations"


@pytest.mark.parametrize(
    ("case", "args"),
    [
        ("fifo", ()),
        ("fifo", ("--ct-shard", "1/1", "--ct-runner-gpus", "80")),  # read by the shard too
        ("symlink-to-a-victim", ()),
        ("not-json", ()),
    ],
    ids=["fifo", "fifo-sharded", "symlink-to-a-victim", "not-json"],
)
def test_a_bad_durations_cache_is_one_warning_and_never_written_through(
    pytester: pytest.Pytester, case: str, args: tuple[str, ...]
) -> None:
    """The learned durations are read and saved as the learned needs are: a FIFO at their
    path once blocked the end of every run of a project that asks, and a link there was
    written through. One LearnedNeedsWarning; a regular file that is not JSON is replaced."""
    path = pytester.path / DURATIONS_PATH
    path.parent.mkdir(parents=True)
    if case.startswith("fifo"):
        os.mkfifo(path)
    elif case == "symlink-to-a-victim":
        _victim_beside(path)
    else:
        path.write_text("{")
    pytester.makepyfile(test_it="def test_one():\n    pass\n")
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    with _Bounded(60):
        result = pytester.runpytest("-p", "no:randomly", *args)
    output = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=1, warnings=1)
    assert output.count("LearnedNeedsWarning") == 1, output
    left_alone = "not learned test durations; ignored and left alone"
    if case.startswith("fifo"):
        assert left_alone in output
        assert stat.S_ISFIFO(os.lstat(path).st_mode)
    elif case == "symlink-to-a-victim":
        assert left_alone in output
        assert path.is_symlink() and (path.parent / "victim.txt").read_text() == VICTIM_TEXT
    else:
        assert "are not valid JSON" in output
        assert list(json.loads(path.read_text())) == ["test_it.py::test_one"]


@pytest.mark.parametrize(
    ("case", "content"),
    [
        ("huge-int", '{"test_it.py::test_one": 1' + "0" * 400 + "}"),
        ("nan", '{"test_it.py::test_one": NaN}'),
        ("lone-surrogate-key", '{"gone\\ud800.py::test": 1.0}'),
    ],
    ids=["huge-int", "nan", "lone-surrogate-key"],
)
def test_malformed_durations_are_left_out_and_saved_over(
    pytester: pytest.Pytester, case: str, content: str
) -> None:
    """JSON that reads but is no duration (an int over a float's range once ended every run
    in an OverflowError, and ``--ct-plan`` in an INTERNALERROR) is left out, as a malformed
    learned need is; a key UTF-8 cannot encode (a lone surrogate, valid JSON) once ended every
    run in a UnicodeEncodeError at the save, and is saved as it was read."""
    path = pytester.path / DURATIONS_PATH
    path.parent.mkdir(parents=True)
    path.write_text(content)
    pytester.makepyfile(test_it="def test_one():\n    pass\n")
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    planned = pytester.runpytest("-p", "no:randomly", "--ct-plan", "80")
    result = pytester.runpytest("-p", "no:randomly")
    for run in (planned, result):
        output = run.stdout.str() + run.stderr.str()
        assert "Traceback" not in output and "INTERNALERROR" not in output, output
    assert planned.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1)
    saved = json.loads(path.read_text())
    assert isinstance(saved.pop("test_it.py::test_one"), float)
    assert saved == ({"gone\ud800.py::test": 1.0} if case == "lone-surrogate-key" else {})


OWN_PROPERTIES = """
import pytest

@pytest.mark.parametrize("name, value", [
    ("ct_resident_model", "my-model"),
    ("ct_own_settings", "abc"),
    ("ct_own_settings", ["abc"]),
    ("ct_peak_allocated_bytes", "x"),
    ("ct_peak_increase", "x"),
    ("ct_figures_closed", True),
])
def test_own_property(record_property, name, value):
    record_property(name, value)

def test_not_a_pair(request):
    request.node.user_properties.append(("mine", 1, 2))

def test_after():
    pass
"""


@pytest.mark.parametrize(
    "args",
    [("-v", "-o", "ct_cleanup=auto"), ("-n", "2", "-o", "ct_cleanup=auto"), ("-n", "2")],
    ids=["asking", "asking-xdist", "not-asking-xdist"],
)
def test_a_projects_own_properties_are_data(
    pytester: pytest.Pytester, args: tuple[str, ...]
) -> None:
    """A test's own ``ct_*`` property of another type than the plugin's field (an
    INTERNALERROR that ended the run, or a traceback in the summary) is not the plugin's
    record, and an entry that is not a pair (pytest copes) crashed the run, or an xdist worker
    of a project that never asked for the plugin."""
    pytester.makepyfile(test_own=OWN_PROPERTIES)
    result = pytester.runpytest("-p", "no:randomly", *args)
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback" not in output, output
    assert "node down" not in output and "crashed" not in output, output
    result.assert_outcomes(passed=8)


def test_a_node_id_with_a_bar_keeps_its_learned_need() -> None:
    """A key is a JSON array, not text joined by a separator: a parameter id holding a
    ``|`` (``test[a|b]``) once made its need stale, so it was pruned at every run and never
    used."""
    from pytest_ctresources.core.learned import nodeid_of, stale_keys
    from pytest_ctresources.settings.config import CircuitTracerConfig

    cfg = CircuitTracerConfig.defaults()
    nodeids = ["t.py::test[a|b]", "t.py::test[100%|7C]", "t.py::test[%7C]", "t.py::plain"]
    for nodeid in nodeids:
        for key in (
            memory_key(nodeid, cfg),
            memory_key(nodeid, None, 24.0),
            memory_key(nodeid, None),
        ):
            assert nodeid_of(key) == nodeid, key
    keys = [memory_key(nodeid, cfg) for nodeid in nodeids]
    assert len(set(keys)) == len(keys)
    assert stale_keys(keys, set(nodeids), lambda file: True) == set()
    # What no memory_key wrote (an earlier version's "node id|config") belongs to no test.
    legacy = 't.py::plain|{"dtype": "bfloat16"}'
    assert nodeid_of(legacy) is None
    assert stale_keys([legacy], set(nodeids), lambda file: True) == {legacy}


# --- settings through the pure resolution: every ini key and environment variable ----------

_COUNTS = ("0", "-1", "1.5", "abc", BIG_INT, OVER_COUNT, "1e3", "0x10", "\x1b[31m8", "8 8")
_GIBS = ("0", "-1", "nan", "inf", "1e400", "abc", "2000", "-inf", "1e-400", "\x00")
_WORDS = ("ALWAYS", "yes", "\x1b[2J", "auto,never", "never never", "é", "None", "true\x00")
_BOOLS = ("ALWAYS", "\x1b[2J", "never never", "é", "None", "true\x00", "2", "on off")
_ALLOC_CONFS = (
    "ALWAYS",
    "\x1b[2J",
    "expandable_segments:True:False",
    ":",
    "max_split_size_mb:1e400",
    "max_split_size_mb:-1",
    "garbage_collection_threshold:nan",
    "roundup_power2_divisions:[",
    "backend:",
    "true\x00",
    # Accepted once, and refused by torch at the first allocation (stoull, its minimum):
    "max_split_size_mb:99999999999999999999999",
    "large_segment_size_mb:5",
    "max_split_size_mb:\uff15\uff11\uff12",
    "garbage_collection_threshold:\u0660.\u0665",
    "max_split_size_mb:\u00b2",  # was Python's own int() message
)
#: Each key or variable, what it must say, and the values it is given.
SETTING_VALUES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("ct_batch_size", "must be *", _COUNTS),
    ("ct_batch_size_max", "must be *", _COUNTS),
    ("ct_max_feature_nodes", "must be *", _COUNTS),
    ("ct_vram_capacity", "must be *GiB*", _GIBS),
    ("ct_oom_retry_floor", "must be *", _COUNTS),
    ("ct_estimate_prompt_tokens", "must be *", _COUNTS),
    ("ct_default_vram_gib", "must be *GiB*", tuple(v for v in _GIBS if v not in ("0", "1e-400"))),
    ("ct_lease_timeout", "must be *seconds*", tuple(v for v in _GIBS if v != "2000")),
    ("ct_auto_margin", "must be a number from 0 to below 1*", _GIBS[1:8] + _GIBS[9:]),
    (
        "ct_progress_after",
        "must be *seconds*",
        ("-1", "nan", "inf", "1e400", "abc", "-inf", "\x00"),
    ),
    ("ct_leak_threshold", "must be *", ("-1", "nan", "inf", "1e400", "abc", "-inf", "\x00")),
    ("ct_cleanup", "must be one of auto, always, never*", _WORDS),
    ("ct_gpu_binding", "must be one of auto, off*", _WORDS),
    ("ct_notebook_inject", "must be one of parameters, top*", _WORDS),
    ("ct_leases", "must be true or false*", _BOOLS),
    ("ct_oom_retry", "must be true or false*", _BOOLS),
    ("ct_alloc_conf", "*option*", _ALLOC_CONFS),
    ("CT_BATCH_SIZE", "must be *", _COUNTS),
    ("CT_BATCH_SIZE_MAX", "must be *", _COUNTS),
    ("CT_MAX_FEATURE_NODES", "must be *", _COUNTS),
    ("CT_VRAM_CAPACITY", "must be *GiB*", _GIBS),
)


def _already_in_rows(name: str, value: str) -> bool:
    return any(row.ini == f"{name} = {value}" or (name, value) in row.env for row in ROWS)


SETTING_ROWS = [
    (name, value, message)
    for name, message, values in SETTING_VALUES
    for value in values
    if not _already_in_rows(name, value)
]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    SETTING_ROWS,
    ids=[f"{name}={ascii(value)[1:21]}" for name, value, _m in SETTING_ROWS],
)
def test_every_setting_refuses_its_bad_values_in_one_line(
    tmp_path: Path, name: str, value: str, message: str
) -> None:
    """The resolution every run does (pure, so a row costs no pytest run): a usage error of
    one printable line naming the ini file and key, or the variable, quoting the value short."""
    from pytest_ctresources.settings.resolve import resolve_settings

    inifile = str(tmp_path / "tox.ini")
    with pytest.raises(pytest.UsageError) as error:
        if name.isupper():
            resolve_settings({}, {}, {name: value}, None, tmp_path)
        else:
            resolve_settings({}, {name: value}, {}, inifile, tmp_path)
    line = str(error.value)
    source = f"env {name}: " if name.isupper() else f"ini {name} in {inifile}: "
    assert line.startswith(source), line
    assert fnmatch.fnmatchcase(line[len(source) :], message), line
    assert line.isprintable() and len(line) < 1000, line


# --- markers: many bad ones in one run, each failing its own test ---------------------------

MARKER_BATCH: tuple[tuple[str, str], ...] = (
    ("vram(gib=-1)", "gib must be a positive number of GiB, got -1"),
    ("vram(gib='inf')", "got 'inf'"),
    ("vram(gib=[8])", "got [[]8]"),
    ("vram(gib=None)", "got None"),
    ("vram(8, 9)", "too many positional arguments"),
    ("vram(gib=8, extra=1)", "unknown keyword 'extra'"),
    ("vram(gib=1e400)", "at most 1024 GiB, got inf"),
    ("vram(gib=2000)", "at most 1024 GiB, got 2000"),
    ("vram(gib=1e-400)", "positive number of GiB, got 0.0"),
    ("vram(gib=complex(1, 1))", "got (1+1j)"),
    ("vram(gib=float('-inf'))", "got -inf"),
    ("ct_config(batch_size=-1)", "batch_size must be a positive integer or 'auto', got -1"),
    ("ct_config(batch_size='8')", "got '8'"),
    ("ct_config(batch_size=1.5)", "got 1.5"),
    ("ct_config(batch_size=True)", "got True"),
    ("ct_config(batch_size=2**31)", "at most 2147483647, got 2147483648"),
    ("ct_config(max_feature_nodes=0)", "max_feature_nodes must be a positive integer, got 0"),
    ("ct_config(max_n_logits=10**400)", "an integer of about 401 digits"),
    ("ct_config(desired_logit_prob=2)", "a number in (0, 1], got 2"),
    ("ct_config(offload='gpu')", "offload must be one of cpu, disk"),
    ("ct_config(backend='tf')", "backend must be one of nnsight"),
    ("ct_config(model_name='a\\nb')", "model_name must be one line of printable text"),
    ("ct_config(model_name='')", "model_name must be a non-empty string"),
    ("ct_config(lazy_encoder='yes')", "lazy_encoder must be true or false"),
    ("ct_config(vram_gib=-1)", "vram_gib must be a positive number of GiB"),
    ("ct_config(dtype=None)", "dtype must be one of float32"),
    ("ct_config(batch_size_max=0)", "batch_size_max must be a positive integer"),
    ("ct_config(verbose='loud')", "verbose must be true or false"),
    ("ct_config(transcoder_set=3)", "transcoder_set must be a non-empty string, got 3"),
    ("ct_config(model_family='')", "model_family must be a non-empty string"),
    ("ct_config(path='')", ".: cannot read experiment config: Is a directory"),
    ("ct_config(path='/dev/zero')", "/dev/zero: cannot read experiment config: not a regular"),
    ("ct_config(path='a' * 5000)", "(5000 characters): cannot read experiment config: File name"),
    ("ct_config(path='\\x1b[2J.yaml')", "\\x1b[[]2J.yaml: cannot read experiment config: No such"),
    ("ct_config('exp.yaml')", "exp.yaml: cannot read experiment config: No such file"),
    *(
        (
            f"ct_config(path='bad{code:02x}.yaml')",
            f"bad{code:02x}.yaml: " + _refused(chr(code), 1, 9),
        )
        for code in (0x00, 0x01, 0x08, 0x0B, 0x0C, 0x1B, 0x7F, 0x80, 0x9B, 0x9F)
    ),
)


def test_bad_markers_each_fail_their_own_test_in_one_run(pytester: pytest.Pytester) -> None:
    """45 bad markers in one in-process run: each test fails at setup with one line naming
    its marker and test; the good test passes; no traceback."""
    source = "import pytest\n\n"
    for number, (decorator, _message) in enumerate(MARKER_BATCH):
        source += f"@pytest.mark.{decorator}\ndef test_bad_{number}(ct_config):\n    pass\n\n"
    pytester.makepyfile(test_bad=source, test_good=GOOD_TEST)
    for code in (0x00, 0x01, 0x08, 0x0B, 0x0C, 0x1B, 0x7F, 0x80, 0x9B, 0x9F):
        (pytester.path / f"bad{code:02x}.yaml").write_text(f"PARAMS: {chr(code)}\n")
    recorder = Reports()
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", plugins=[recorder])
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "INTERNALERROR" not in output
    failed = {r.nodeid: r for r in recorder.reports if r.failed}
    assert len(failed) == len(MARKER_BATCH)
    for number, (decorator, message) in enumerate(MARKER_BATCH):
        report = failed[f"test_bad.py::test_bad_{number}"]
        assert report.when == "setup"
        lines = [line for line in report.longreprtext.splitlines() if line]
        name = decorator.split("(")[0]
        row = Row(
            decorator, "test", f"@pytest.mark.{name} on test_bad.py::test_bad_{number}:", message
        )
        _assert_one_line(lines, row, output)
        assert lines[0].isprintable(), lines[0]
    assert [r.nodeid for r in recorder.reports if r.passed and r.when == "call"] == [
        "test_good.py::test_good"
    ]


# --- CT_FAKE_GPUS and ct-resources flags: pure, in-process -------------------------------

FAKE_GPUS_ROWS: tuple[tuple[str, str], ...] = (
    ("H200=-1", "capacity must be a positive number"),
    ("=", "has an empty name"),
    ("H200=", "is not a number of GiB"),
    ("H200=1e400", "capacity must be a positive number"),
    ("H200=nan", "capacity must be a positive number"),
    ("H200=inf", "capacity must be a positive number"),
    ("H200=-inf", "capacity must be a positive number"),
    ("H200=0x10", "'0x10' is not a number of GiB"),
    ("H200=24GiB", "'24GiB' is not a number of GiB"),
    ("H200==", "is not a number of GiB"),
    (";;=5", "entry 3 '=5' has an empty name"),
    ("H200=2000", "at most 1024"),
    ("H200=1e-400", "capacity must be a positive number"),
    (" = 3", "has an empty name"),
    ("a=b=c", "'c' is not a number of GiB"),
    ("H200=--1", "is not a number of GiB"),
    ("H200=8;H100=x", "entry 2 'H100=x'"),
    ("\x1b[2J=\x1b[2J", "'\\x1b[[]2J' is not a number of GiB"),
    ("H200=1" + "0" * 5000, "(5006 characters)"),
    ("H200=\x00", "is not a number of GiB"),
)


@pytest.mark.parametrize(
    ("value", "message"), FAKE_GPUS_ROWS, ids=[ascii(v)[1:21] for v, _ in FAKE_GPUS_ROWS]
)
def test_a_bad_fake_gpus_entry_is_one_line(value: str, message: str) -> None:
    from pytest_ctresources.gpu.fake import parse_fake_gpus

    with pytest.raises(ValueError) as error:
        parse_fake_gpus(value)
    line = str(error.value)
    assert line.startswith("CT_FAKE_GPUS: entry "), line
    assert fnmatch.fnmatchcase(line, f"*{message}*"), line
    assert line.isprintable() and len(line) < 1000, line


CLI_FLAG_VALUES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("estimate", "--gpu-gib", ("-1", "", "1e400", "-inf", "0x1p3", "1,5", "24GB", "\x1b[2J")),
    ("estimate", "--prompt-tokens", ("-1", "", "abc", "1e3", "0x10", "2147483648", "\x00")),
    ("estimate", "--batch-size", ("-1", "1.0", "", "2147483648", "\x1b[2J")),
    ("estimate", "--max-feature-nodes", ("0", "abc", OVER_COUNT, "1.5")),
    ("estimate", "--active-features", ("-1", "nan", "inf", "abc", "1e400")),
    ("estimate", "--ceiling", ("0", "-1", "abc", "1.5")),
    ("estimate", "--dtype", ("", "float", "\x1b[2J")),
    ("table", "--ceiling", ("-1", "abc", OVER_COUNT)),
    ("table", "--active-features", ("0", "-1", "inf", "abc")),
)
CLI_ROWS = [
    (command, flag, value)
    for command, flag, values in CLI_FLAG_VALUES
    for value in values
    if not any(row.args == (command, flag, value) for row in ROWS)
]


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    CLI_ROWS,
    ids=[f"{c}{f}={ascii(v)[1:21]}" for c, f, v in CLI_ROWS],
)
def test_every_ct_resources_flag_refuses_its_bad_values_in_one_line(
    capsys: pytest.CaptureFixture[str], command: str, flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main([command, f"{flag}={value}"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    lines = _error_lines(err)
    _assert_one_line(lines, Row(flag, "cli", f"argument {flag}: ", ""), out + err)
    assert lines[0].isprintable(), lines[0]


TABLE_LIST_ROWS: tuple[tuple[str, str], ...] = (
    ("--cards", "0"),
    ("--cards", "-24"),
    ("--cards", "nan"),
    ("--cards", "inf"),
    ("--cards", "24,abc"),
    ("--cards", "\x1b[2J"),
    ("--prompt-tokens", "a,b"),
    ("--prompt-tokens", "-1"),
    ("--prompt-tokens", OVER_COUNT),
    ("--dtypes", "x"),
    ("--dtypes", "float32,\x00"),
)


@pytest.mark.parametrize(
    ("flag", "value"), TABLE_LIST_ROWS, ids=[f"{f}={ascii(v)[1:21]}" for f, v in TABLE_LIST_ROWS]
)
def test_ct_resources_table_lists_refuse_bad_entries_in_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["table", flag, value])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    lines = _error_lines(err)
    _assert_one_line(lines, Row(flag, "cli", "ct-resources: error: bad list", ""), out + err)
    assert lines[0].isprintable(), lines[0]


# --- names from files and devices reach the terminal escaped --------------------------------


def test_escape_sequences_in_names_are_shown_escaped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config file and a GPU whose names hold escape sequences: the -v header and the
    summary show them escaped, as pytest shows node ids; nothing raw reaches the terminal."""
    name = "\x1b]0;owned\x07\x1b[2Jexp.yaml"
    (pytester.path / name).write_text("BATCH_SIZE: 4\n")
    monkeypatch.setenv("CT_FAKE_GPUS", "\x1b[31mEvil\x1b[0m=24")
    pytester.makepyfile(test_it=GOOD_TEST)
    result = pytester.runpytest("-v", "-p", "no:randomly", "--ct-config", name)
    result.assert_outcomes(passed=1)
    output = result.stdout.str() + result.stderr.str()
    assert "\x1b" not in output and "\x07" not in output
    assert "\\x1b]0;owned\\x07\\x1b[2Jexp.yaml" in output
    assert "\\x1b[31mEvil\\x1b[0m" in output


#: Every distinct hostile input the tables above present, with its surface (at least 400:
#: the coverage this suite promises). The characters YAML refuses count once each, as the three places each is put
#: are the same input to the reader.
HOSTILE_INPUTS = {
    *((row.kind, row.id) for row in ROWS),
    *(("yaml-character", char) for char in UNPRINTABLE_IN_YAML),
    *(("cache", row.id) for row in CACHE_ROWS),
    *(("setting", name, value) for name, value, _m in SETTING_ROWS),
    *(("marker", decorator) for decorator, _m in MARKER_BATCH),
    *(("CT_FAKE_GPUS", value) for value, _m in FAKE_GPUS_ROWS),
    *(("ct-resources", command, flag, value) for command, flag, value in CLI_ROWS),
    *(("ct-resources table", flag, value) for flag, value in TABLE_LIST_ROWS),
}


def test_the_table_is_large_and_its_ids_distinct() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))
    assert len(ROWS) >= 100
    assert len({row.id for row in CACHE_ROWS}) == len(CACHE_ROWS)
    assert len(set(SETTING_ROWS)) == len(SETTING_ROWS)
    assert len(set(CLI_ROWS)) == len(CLI_ROWS)
    assert len({decorator for decorator, _m in MARKER_BATCH}) == len(MARKER_BATCH)
    assert len(HOSTILE_INPUTS) >= 400, len(HOSTILE_INPUTS)


class Reports:
    """Collects the test reports of an in-process run (a plugin object)."""

    def __init__(self) -> None:
        self.reports: list[pytest.TestReport] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.reports.append(report)


def _error_lines(text: str) -> list[str]:
    """pytest's ``ERROR: ...`` usage lines and argparse's ``prog: error: ...`` lines (not
    the ``ERROR: usage: ...`` synopsis argparse prints first)."""
    return [
        line
        for line in text.splitlines()
        if (line.startswith("ERROR:") and not line.startswith("ERROR: usage:"))
        or ": error: " in line
    ]


def _assert_one_line(lines: list[str], row: Row, output: str) -> None:
    assert "Traceback" not in output
    assert "INTERNALERROR" not in output
    assert len(lines) == 1, lines
    line = lines[0]
    assert row.source in line
    assert fnmatch.fnmatchcase(line, f"*{row.message}*"), (row.message, line)
    # The bad value is quoted short: 5000 digits, a 1 MiB file, a bomb never appear whole.
    assert len(line) < 1000, len(line)


def _setup_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, row: Row) -> None:
    root = os.geteuid() == 0
    if row.as_root is True and not root:
        pytest.skip("mknod of a character device needs root")
    if row.as_root is False and root:
        pytest.skip("aims at a system device, which root could destroy")
    for name, text in row.files:
        (pytester.path / name).write_text(text, errors="surrogateescape")
    if row.ini is not None:
        pytester.makeini(f"[pytest]\n{row.ini}\n")
    if row.pyproject is not None:
        pytester.makepyprojecttoml(row.pyproject)
    for name, value in row.env:
        monkeypatch.setenv(name, value)
    if row.prepare is not None:
        row.prepare(pytester.path)


@pytest.mark.parametrize("row", [r for r in ROWS if r.kind == "usage"], ids=lambda r: r.id)
def test_usage_error_is_one_line_naming_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, row: Row
) -> None:
    _setup_project(pytester, monkeypatch, row)
    pytester.makepyfile(test_it=row.test)
    result = pytester.runpytest(*row.args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stdout.str() + result.stderr.str()
    _assert_one_line(_error_lines(result.stderr.str()), row, output)
    if row.check is not None:
        row.check(pytester.path)


@pytest.mark.parametrize("row", [r for r in ROWS if r.kind == "test"], ids=lambda r: r.id)
def test_bad_input_fails_only_its_own_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, row: Row
) -> None:
    _setup_project(pytester, monkeypatch, row)
    if row.nodeid == "test_bad":
        pytester.makepyfile(test_bad=row.test)
    pytester.makepyfile(test_good=GOOD_TEST)
    recorder = Reports()
    result = pytester.runpytest(*row.args, "-p", "no:cacheprovider", plugins=[recorder])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    output = result.stdout.str() + result.stderr.str()
    failed = [r for r in recorder.reports if r.failed]
    assert len(failed) == 1, [r.nodeid for r in failed]
    assert row.nodeid in failed[0].nodeid
    assert failed[0].when == "setup"
    assert [r.nodeid for r in recorder.reports if r.passed and r.when == "call"] == [
        "test_good.py::test_good"
    ]
    _assert_one_line([line for line in failed[0].longreprtext.splitlines() if line], row, output)


@pytest.mark.parametrize("row", [r for r in ROWS if r.kind == "cli"], ids=lambda r: r.id)
def test_ct_resources_error_is_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    row: Row,
) -> None:
    monkeypatch.chdir(tmp_path)
    for name, text in row.files:
        (tmp_path / name).write_text(text, errors="surrogateescape")
    for name, value in row.env:
        monkeypatch.setenv(name, value)
    if row.prepare is not None:
        row.prepare(tmp_path)
    with _Bounded(60), pytest.raises(SystemExit) as exc:  # a FIFO read whole hung
        cli_main(list(row.args))
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    _assert_one_line(_error_lines(err), row, out + err)


@pytest.mark.parametrize("argv", [["gpus", "--json"], ["table"]], ids=["gpus", "table"])
def test_ct_resources_into_a_closed_pipe_ends_quietly(argv: list[str]) -> None:
    """`ct-resources ... | head`: the reader has gone before the output is written (a pipe
    whose read end is closed, the deterministic form of `| head -c 0`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.run(
            [sys.executable, "-m", "pytest_ctresources.estimator.cli", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "CT_FAKE_GPUS": "H200=139.8"},
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert process.returncode == 1
    assert process.stderr == ""


@pytest.mark.parametrize("closed", [False, True], ids=["full-disk", "closed-stdout"])
def test_ct_resources_that_cannot_write_its_output_says_so_in_one_line(closed: bool) -> None:
    """stdout on a full disk (/dev/full) or closed (``>&-``): a traceback from the write
    (OSError, or an AttributeError on a None stdout), now one line."""
    with open(os.devnull if closed else "/dev/full", "wb") as target:
        process = subprocess.run(
            [sys.executable, "-m", "pytest_ctresources.estimator.cli", "models"],
            stdout=subprocess.DEVNULL if closed else target,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            # The child's fd 1 closed before it starts: Python's sys.stdout is None.
            preexec_fn=(lambda: os.close(1)) if closed else None,
        )
    assert process.returncode == 1
    assert process.stderr.count("\n") == 1 and process.stderr.startswith("ct-resources: error:")
    assert "Traceback" not in process.stderr


XDIST_ROWS = (
    "yaml-params-billion-laughs",
    "json-through-symlink",
    "vram-inf",
    "ct-config-path-deep",
)


@pytest.mark.parametrize("row", [r for r in ROWS if r.id in XDIST_ROWS], ids=lambda r: r.id)
def test_under_xdist_too(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, row: Row
) -> None:
    """The controller refuses a bad setting before starting workers; a bad marker fails its
    test in the worker that runs it, and the line reaches the controller's report."""
    _setup_project(pytester, monkeypatch, row)
    pytester.makepyfile(
        test_good=GOOD_TEST, **({"test_bad": row.test} if row.kind == "test" else {})
    )
    result = pytester.runpytest_subprocess("-n", "2", *row.args)
    output = result.stdout.str() + result.stderr.str()
    if row.kind == "usage":
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        _assert_one_line(_error_lines(result.stderr.str()), row, output)
    else:
        result.assert_outcomes(passed=1, errors=1)
        lines = [line for line in result.stdout.lines if row.source in line and "ERROR" not in line]
        _assert_one_line(lines, row, output)
    if row.check is not None:
        row.check(pytester.path)


# --- ct_alloc_conf: what the check accepts is what torch accepts -------------------------

GOOD_ALLOC_CONFS = [
    "expandable_segments:True",
    "expandable_segments:False,max_split_size_mb:128",
    " expandable_segments : True , garbage_collection_threshold:0.6 ",
    "roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True",
    "roundup_power2_divisions:4",
    "backend:native",
    "backend:cudaMallocAsync",
    "pinned_num_register_threads:8,pinned_use_cuda_host_register:True",
    "release_lock_on_cudamalloc:True,per_process_memory_fraction:0.5",
    "expandable_segments:True,",
    "",
]


@pytest.mark.parametrize("text", GOOD_ALLOC_CONFS)
def test_alloc_conf_accepts_what_torch_accepts(text: str) -> None:
    assert check_alloc_conf(text) == text


def test_alloc_conf_check_agrees_with_torchs_own_parser_on_the_device_generic_options() -> None:
    """torch's CPU build parses the device-generic options (its CUDA ones live in the CUDA
    library): for those, the check must reject what torch rejects and accept what it takes."""
    import torch

    parse = torch._C._accelerator_setAllocatorSettings
    cases = [
        "expandable_segments:True",
        "expandable_segments:true",
        "max_split_size_mb:128",
        "max_split_size_mb:10",
        "max_split_size_mb:abc",
        "garbage_collection_threshold:0.6",
        "garbage_collection_threshold:1.5",
        "roundup_power2_divisions:[256:1,512:2,>:4]",
        "pinned_max_cached_size_mb:100",
        "large_segment_size_mb:64",
    ]
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        for text in cases:
            try:
                parse(text)
                torch_ok = True
            except (ValueError, RuntimeError):
                torch_ok = False
            try:
                check_alloc_conf(text)
                ours_ok = True
            except ValueError:
                ours_ok = False
            assert ours_ok == torch_ok, text
    finally:
        parse(before)
