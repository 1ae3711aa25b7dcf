"""VRAM accounting on CPU: the plugin's arithmetic, report, flags, files and learned needs,
fed by a stand-in for torch.cuda's allocator statistics (tests/fake_cuda.py). The real
measurement is exercised on the GPU (tests/gpu)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from pytest_ctresources.core.accounting import batch_size_advice, halving_summary
from pytest_ctresources.core.learned import CACHE_KEY, memory_key
from pytest_ctresources.gpu.oom import Halving
from pytest_ctresources.settings.config import CircuitTracerConfig
from pytest_ctresources.settings.sources import Source
from tests.conftest import TINY_YAML
from tests.fake_cuda import FAKE_CUDA_CONFTEST

pytest_plugins = ["pytester"]

#: Where a project's learned needs are, in its pytest cache.
LEARNED_PATH = f".pytest_cache/v/{CACHE_KEY}"

SUITE = """
import pytest
from conftest import FAKE

def test_no_cuda():
    pass

@pytest.mark.vram(gib=4)
def test_declared_ok():
    FAKE.alloc(3); FAKE.free(3)

@pytest.mark.vram(gib=2)
def test_under_declared():
    FAKE.alloc(3.5); FAKE.free(3.5)

def test_unmarked_big():
    FAKE.alloc(1.5); FAKE.free(1.5)

def test_unmarked_small():
    FAKE.alloc(0.25); FAKE.free(0.25)

LEAKED = []
def test_leaks():
    FAKE.alloc(0.5)
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_report_table_and_flags(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:randomly", "-v")  # the table is -v's
    result.assert_outcomes(passed=6, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*ctresources summary*",
            "VRAM per test (GPU 0 (NVIDIA GeForce RTX 4090) 23.6 GiB); 5 test(s) used CUDA, top 5 by peak reserved:",
            "*peak alloc*peak resv*declared (source)*headroom*leaked*test",
            "*3.50 GiB*3.50 GiB*2.0 GiB (marker)*20.10 GiB*0.00 GiB  test_suite.py::test_under_declared",
            "*3.00 GiB*3.00 GiB*4.0 GiB (marker)*test_suite.py::test_declared_ok",
            "*1.50 GiB*1.50 GiB*-*test_suite.py::test_unmarked_big",
            "UNDER-DECLARED test_suite.py::test_under_declared: peak 3.50 GiB reserved > declared 2.0 GiB (@pytest.mark.vram on test_suite.py::test_under_declared); write @pytest.mark.vram(gib=4)",
            "UNMARKED test_suite.py::test_unmarked_big: peak 1.50 GiB reserved and no declared need; write @pytest.mark.vram(gib=2)",
            "LEAK test_suite.py::test_leaks: 0.50 GiB still allocated after teardown and cleanup",
        ]
    )
    assert "test_no_cuda" not in result.stdout.str().split("ctresources summary")[1]
    assert "UNMARKED test_suite.py::test_unmarked_small" not in result.stdout.str()


def test_leak_warning_names_test_amount_and_holders(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:randomly")
    result.stdout.fnmatch_lines(
        [
            "*CtLeakWarning: test_suite.py::test_leaks left 0.50 GiB of CUDA memory allocated after "
            "teardown and cleanup (threshold 0.25 GiB, ct_leak_threshold); usual holders: a "
            "module-level or global reference, a wider-scoped fixture, a cache of the test's own "
            "(models ct_session keeps loaded are counted apart, as resident)",
        ]
    )


def test_leak_threshold_ini(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\nct_leak_threshold = 1GiB\n")
    result = project.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=6)
    assert "CtLeakWarning" not in result.stdout.str()


def test_strict_fails_under_declared_and_leaks(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:randomly", "--ct-strict")
    # test_leaks passes its call and errors at teardown: pytest counts both.
    result.assert_outcomes(passed=5, failed=1, errors=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "*ctresources --ct-strict: test_suite.py::test_leaks left 0.50 GiB*",
            "*ctresources --ct-strict: UNDER-DECLARED: peak 3.50 GiB reserved exceeds the declared 2.0 GiB*write @pytest.mark.vram(gib=4)",
        ]
    )


def test_json_report(project: pytest.Pytester) -> None:
    (project.path / "out").mkdir()
    project.runpytest(
        "-p", "no:randomly", "--ct-report-json", "out/report.json", "--ct-batch-size", "64"
    )
    document = json.loads((project.path / "out" / "report.json").read_text())
    assert document["schema"] == "pytest-ctresources-report"
    assert document["schema_version"] == 2
    assert document["interrupted"] is False
    assert document["gpus"]["gpus"][0]["name"] == "NVIDIA GeForce RTX 4090"
    assert document["settings"]["config"]["batch_size"] == {
        "value": 64,
        "source": "--ct-batch-size",
    }
    tests = {t["nodeid"].split("::")[1]: t for t in document["tests"]}
    assert set(tests) == {
        "test_declared_ok",
        "test_under_declared",
        "test_unmarked_big",
        "test_unmarked_small",
        "test_leaks",
    }
    assert tests["test_under_declared"]["peak_allocated_bytes"] == int(3.5 * 2**30)
    assert tests["test_under_declared"]["need_kind"] == "marker"
    assert tests["test_leaks"]["leaked_bytes"] == 2**29
    assert any(f.startswith("UNDER-DECLARED") for f in tests["test_under_declared"]["flags"])
    assert not list((project.path / "out").glob(".report.json.*"))  # no temporary left


def test_json_written_when_interrupted(project: pytest.Pytester) -> None:
    project.makepyfile(test_zz_interrupt="def test_ctrl_c():\n    raise KeyboardInterrupt\n")
    # In a subprocess: in-process, the KeyboardInterrupt would stop this suite too.
    result = project.runpytest_subprocess("-p", "no:randomly", "--ct-report-json", "r.json")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    document = json.loads((project.path / "r.json").read_text())
    assert document["interrupted"] is True
    assert len(document["tests"]) == 5


def test_junitxml_properties(project: pytest.Pytester) -> None:
    project.runpytest("-p", "no:randomly", "--junitxml", "junit.xml")
    root = ET.parse(project.path / "junit.xml").getroot()
    case = next(c for c in root.iter("testcase") if c.get("name") == "test_declared_ok")
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["ct_peak_allocated_bytes"] == str(3 * 2**30)
    assert properties["ct_peak_reserved_bytes"] == str(3 * 2**30)
    assert properties["ct_need_gib"] == "4.0"


def test_only_tests_that_ask_or_find_cuda_initialised_are_metered_at_setup(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a test that asks for nothing costs: before CUDA is initialised its setup has
    # nothing to meter (accounting.nothing_to_measure), so none is started; the tests after
    # the first that initialised CUDA (test_declared_ok) are metered from their setup on.
    # (A test that initialises CUDA itself is measured from its teardown: the table above.)
    from pytest_ctresources.core import accounting
    from pytest_ctresources.core.runtime import Runtime

    begun: list[str] = []
    begin = accounting.begin

    def counted(item: pytest.Item, runtime: Runtime) -> str | None:
        begun.append(item.name)
        return begin(item, runtime)

    monkeypatch.setattr(accounting, "begin", counted)
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=6)
    assert begun == [
        "test_declared_ok",
        "test_under_declared",
        "test_unmarked_big",
        "test_unmarked_small",
        "test_leaks",
    ]


PLAIN_OOM = """
import torch
from conftest import FAKE

def test_first_to_use_cuda():
    FAKE.alloc(2)
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
"""


@pytest.fixture
def asking(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project that asks as a whole (its ini), on a fake CUDA card, with no tests yet."""
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    return pytester


def test_a_test_that_asked_for_nothing_is_measured_once_it_runs_out_of_memory(
    asking: pytest.Pytester,
) -> None:
    # Its setup skipped the accounting (no marker, no fixture, CUDA not yet initialised):
    # the OOM's explanation asks for its state, and gets the meter its setup would have
    # started, so the peak before the failure is there as for any test.
    asking.makepyfile(test_plain=PLAIN_OOM)
    result = asking.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*ctresources: CUDA out of memory*",
            "peak before the failure: 2.00 GiB allocated, 2.00 GiB reserved",
        ]
    )


FREED_BY_THE_CLEANUP = """
from conftest import FAKE

class TouchesCudaWhenFreed:  # a handle whose __del__ initialises CUDA (torch.cuda.synchronize)
    def __del__(self):
        FAKE.alloc(1)

def test_fails_holding_it():
    handle = TouchesCudaWhenFreed()
    assert False
"""


def test_a_test_that_asked_for_nothing_is_measured_when_its_cleanup_initialises_cuda(
    asking: pytest.Pytester,
) -> None:
    # The cleanup frees the failed test's frames, whose object initialises CUDA and leaks
    # 1 GiB: measured (figures, leak warning) as if its setup had not skipped the accounting.
    asking.makepyfile(test_freed=FREED_BY_THE_CLEANUP)
    result = asking.runpytest("--junitxml", "j.xml")
    result.assert_outcomes(failed=1, warnings=1)
    result.stdout.fnmatch_lines(
        ["*CtLeakWarning: test_freed.py::test_fails_holding_it left 1.00 GiB*"]
    )
    assert 'name="ct_leaked_bytes" value="1073741824"' in (asking.path / "j.xml").read_text()


def test_plot(project: pytest.Pytester) -> None:
    project.runpytest("-p", "no:randomly", "--ct-report-plot", "peaks.png")
    assert (project.path / "peaks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_forced_without_cuda(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest("--ct-report")
    result.stdout.fnmatch_lines(["*ctresources summary*", "VRAM per test (*); 0 test(s) used CUDA"])
    assert "ctresources summary" not in pytester.runpytest().stdout.str()


def test_no_empty_summary_section_for_a_lease_that_made_nobody_wait(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain run's leases are worth a line only when a test waited: with nothing else to
    # say, no "ctresources summary" title stands over nothing.
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=8")
    pytester.makepyfile("import pytest\n\n@pytest.mark.vram(gib=2)\ndef test_leased():\n    pass\n")
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1)
    assert "ctresources summary" not in result.stdout.str()


def test_report_top(project: pytest.Pytester) -> None:
    result = project.runpytest("-p", "no:randomly", "-v", "--ct-report-top", "1")
    text = result.stdout.str()
    assert "top 1 by peak reserved" in text
    assert "  test_suite.py::test_declared_ok" not in text


def test_learned_need_skips_next_run_and_forget_clears_it(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=6, warnings=1)
    monkeypatch.setenv("CT_FAKE_GPUS", "Small card=1.0")
    result = project.runpytest("-p", "no:randomly", "-rs", "-k", "unmarked_big")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*needs 1.5 GiB VRAM (measured 1.5 GiB on NVIDIA GeForce RTX 4090, ????-??-??); GPU 0 (Small card) has 1.0 GiB"
        ]
    )
    result = project.runpytest("-p", "no:randomly", "-rs", "-k", "unmarked_big", "--ct-forget")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["ctresources: --ct-forget cleared 5 learned VRAM need(s)"])


#: A worker on another host (``--tx ssh``) has no cache of the project's; these workers have
#: theirs taken away before the plugin configures.
NO_CACHE_IN_WORKERS = """
import os
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if hasattr(config, "workerinput"):
        config.cache = None
"""


def test_workers_decide_from_the_learned_needs_the_controller_ships(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.runpytest("-p", "no:randomly").assert_outcomes(passed=6, warnings=1)
    conftest = project.path / "conftest.py"
    conftest.write_text(conftest.read_text() + NO_CACHE_IN_WORKERS)
    monkeypatch.setenv("CT_FAKE_GPUS", "Small card=1.0")
    # One worker: what the controller ships is the subject, not how tests spread.
    result = project.runpytest("-n", "1", "-rs", "-k", "unmarked_big")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 1.5 GiB VRAM (measured 1.5 GiB on *) has 1.0 GiB"])
    # After --ct-forget the controller ships nothing: the workers know no need.
    result = project.runpytest("-n", "1", "-k", "unmarked_big", "--ct-forget")
    result.assert_outcomes(passed=1)


def test_merged_report_under_xdist(project: pytest.Pytester) -> None:
    result = project.runpytest("-n", "2", "-v", "--ct-report-json", "r.json")
    result.assert_outcomes(passed=6, warnings=1)
    result.stdout.fnmatch_lines(["VRAM per test (*); 5 test(s) used CUDA*"])
    assert len(json.loads((project.path / "r.json").read_text())["tests"]) == 5


OOM_TEST = """
import pytest, torch

@pytest.mark.ct_config(batch_size=96)
def test_oom(ct_config):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

def test_after():
    pass
"""


def test_oom_is_explained(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA H200=139.8")
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_o=OOM_TEST)
    result = pytester.runpytest("--ct-config", "exp.yaml", "--ct-vram-capacity", "24")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*ctresources: CUDA out of memory*",
            "GPU 0 (NVIDIA H200): 139.8 GiB, emulated capacity 24.0 GiB (--ct-vram-capacity)",
            "config in effect:",
            "  model_name = 'ctresources/tiny-gemma-2' (MODEL_NAME in exp.yaml)",
            "  batch_size = 96 (@pytest.mark.ct_config on test_o.py::test_oom)",
            "next step: try `@pytest.mark.ct_config(batch_size=48)`",
        ]
    )


RETRY_TEST = """
import pytest, torch
from circuit_tracer.replacement_model.replacement_model_nnsight import NNSightReplacementModel

@pytest.fixture(autouse=True)
def small_card(monkeypatch):
    # Behaves like a card on which the forward pass fits only at batch 32 or less.
    original = NNSightReplacementModel.run_forward_pass
    def forward(self, input_ids, batch_size, ctx):
        if batch_size > 32:
            big = torch.ones(1024, 1024)  # held by the failing frame, freed before the retry
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at batch {batch_size}")
        return original(self, input_ids, batch_size, ctx)
    monkeypatch.setattr(NNSightReplacementModel, "run_forward_pass", forward)

def test_halves(ct_session):
    graph = ct_session.attribute(ct_session.cfg.params["PROMPT"])
    assert [(h.failed_batch_size, h.next_batch_size) for h in ct_session.halvings] == [(128, 64), (64, 32)]
    assert ct_session.calls[-1].kwargs["batch_size"] == 32
    assert len(graph.selected_features) > 0
"""


def retry_project(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_retry=RETRY_TEST)


def test_oom_retry_halves_and_reports(pytester: pytest.Pytester) -> None:
    retry_project(pytester)
    result = pytester.runpytest("--ct-config", "exp.yaml")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "  test_retry.py::test_halves: OOM at batch 128, passed at 32 — use `BATCH_SIZE: 32` in exp.yaml"
        ]
    )


@pytest.mark.parametrize(
    ("source", "advice"),
    [
        (Source.marker("ct_config", "t.py::t"), "`@pytest.mark.ct_config(batch_size=32)`"),
        (Source.yaml("exp.yaml", "BATCH_SIZE"), "`BATCH_SIZE: 32` in exp.yaml"),
        (Source.option("--ct-batch-size"), "`--ct-batch-size 32`"),
        (Source.env("CT_BATCH_SIZE"), "`--ct-batch-size 32`"),
        (Source.default(), "`--ct-batch-size 32`"),
    ],
    ids=["marker", "yaml", "option", "env", "default"],
)
def test_the_batch_size_advice_names_the_layer_that_set_it(source: Source, advice: str) -> None:
    # A lower layer loses to the one that set the batch size (a marker's over --ct-batch-size):
    # the OOM's next step and the halving's summary name that layer, and only it.
    cfg = CircuitTracerConfig.defaults().layered({"batch_size": 128}, source)
    halved = SimpleNamespace(halvings=[Halving(128, 64), Halving(64, 32)], cfg=cfg)
    assert batch_size_advice(cfg, 32) == advice
    assert halving_summary(halved) == f"OOM at batch 128, passed at 32 — use {advice}"  # type: ignore[arg-type]


def test_oom_retry_can_be_turned_off(pytester: pytest.Pytester) -> None:
    retry_project(pytester)
    pytester.runpytest("--ct-config", "exp.yaml", "--ct-no-oom-retry").assert_outcomes(failed=1)
    pytester.makeini("[pytest]\nct_oom_retry = false\n")
    pytester.runpytest("--ct-config", "exp.yaml").assert_outcomes(failed=1)


def test_oom_retry_floor(pytester: pytest.Pytester) -> None:
    retry_project(pytester)
    pytester.makeini("[pytest]\nct_oom_retry_floor = 64\n")
    result = pytester.runpytest("--ct-config", "exp.yaml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*CUDA out of memory at batch 64*"])


def test_strict_fails_a_test_that_passed_only_after_halving(pytester: pytest.Pytester) -> None:
    retry_project(pytester)
    result = pytester.runpytest("--ct-config", "exp.yaml", "--ct-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*--ct-strict: passed only after halving the batch size: OOM at batch 128, passed at 32*"]
    )


@pytest.mark.parametrize(
    ("args", "ini", "line"),
    [
        (
            ["--ct-report-top", "0"],
            "",
            "*argument --ct-report-top: must be a positive integer, got '0'",
        ),
        (
            ["--ct-report-top", "abc"],
            "",
            "*argument --ct-report-top: must be a positive integer, got 'abc'",
        ),
        (
            [],
            "ct_leak_threshold = lots",
            "ERROR: ini ct_leak_threshold in *: must be a size such as 256MiB*",
        ),
        (
            [],
            "ct_oom_retry = maybe",
            "ERROR: ini ct_oom_retry in *: must be true or false, got 'maybe'",
        ),
        (
            [],
            "ct_oom_retry_floor = 0",
            "ERROR: ini ct_oom_retry_floor in *: must be a positive integer*",
        ),
        # (A missing directory is no error: it is made when the report is written,
        # tests/test_report_files.py.)
        (
            ["--ct-report-json", "."],
            "",
            "ERROR: --ct-report-json: . is a directory, not a file path",
        ),
    ],
)
def test_bad_report_settings(
    pytester: pytest.Pytester, args: list[str], ini: str, line: str
) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_a(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([line])
    assert "Traceback" not in result.stderr.str()


def test_json_written_after_an_internal_error(project: pytest.Pytester) -> None:
    project.makeconftest(
        FAKE_CUDA_CONFTEST
        + """
def pytest_runtest_logreport(report):
    if report.when == "teardown" and report.nodeid.endswith("test_unmarked_small"):
        raise RuntimeError("a broken plugin")
"""
    )
    result = project.runpytest("-p", "no:randomly", "--ct-report-json", "r.json")
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR
    document = json.loads((project.path / "r.json").read_text())
    assert document["exitstatus"] == int(pytest.ExitCode.INTERNAL_ERROR)
    assert len(document["tests"]) >= 3


def test_a_test_reads_its_own_figures_through_ct_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makepyfile(
        """
        from conftest import FAKE

        def test_figures(ct_session):
            assert ct_session.vram() is None  # no CUDA used yet
            FAKE.alloc(2); FAKE.free(1)
            figures = ct_session.vram()
            assert figures.peak_allocated_bytes == 2 * 2**30
            assert figures.baseline_bytes == 0
            FAKE.free(1)
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


# ct_session's cache holds a "model" whose build takes 9 GiB of (fake) CUDA memory: it stays
# loaded between tests by design, so it is a resident model, not the first test's leak.
RESIDENT_SUITE = """
import pytest
from conftest import FAKE
import pytest_ctresources.session.cache as session_module

def build(cfg, device):
    FAKE.alloc(9)
    return object()

@pytest.fixture(autouse=True)
def stand_in_builder(monkeypatch):
    # Through monkeypatch: the project may run in-process, sharing the plugin's modules.
    monkeypatch.setattr(session_module, "build_model", build)

def test_loads_the_model(ct_session):
    ct_session.load_model(device="cuda")

def test_reuses_it(ct_session):
    ct_session.load_model(device="cuda")
    FAKE.alloc(2); FAKE.free(2)

@pytest.mark.vram(gib=1)
def test_small_beside_the_model():
    FAKE.alloc(0.5); FAKE.free(0.5)

def test_small_unmarked_beside_the_model():
    FAKE.alloc(0.5); FAKE.free(0.5)

LEAKED = []
def test_really_leaks(ct_session):
    ct_session.load_model(device="cuda")
    FAKE.alloc(0.5)
"""


def test_the_resident_model_is_no_leak_and_strict_still_fails_a_real_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA GeForce RTX 4090=23.6")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_resident=RESIDENT_SUITE)
    result = pytester.runpytest("--ct-config", "exp.yaml", "--ct-strict", "-v")
    # test_really_leaks passes its call and errors at teardown: pytest counts both. The small
    # tests beside the model are measured without it: no UNDER-DECLARED, no UNMARKED.
    result.assert_outcomes(passed=5, errors=1, warnings=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*ctresources --ct-strict: test_resident.py::test_really_leaks left 0.50 GiB*",
            "LEAK test_resident.py::test_really_leaks: 0.50 GiB still allocated after teardown and cleanup",
        ]
    )
    result.stdout.fnmatch_lines(  # -v's details, after the actions
        [
            "resident models (kept loaded between tests by ct_session; not leaks):",
            "  main GPU 0: ctresources/tiny-gemma-2 (float32) 9.00 GiB, loaded by test_resident.py::test_loads_the_model",
        ]
    )
    assert "LEAK test_resident.py::test_loads_the_model" not in out
    assert "CtLeakWarning: test_resident.py::test_loads_the_model" not in out
    assert "UNDER-DECLARED" not in out and "UNMARKED test_resident.py::test_small" not in out


def test_no_need_is_learned_from_a_test_that_passed_only_after_halving() -> None:
    from pytest_ctresources.core.record import TestRecord
    from pytest_ctresources.report.results import TestResult
    from pytest_ctresources.report.run_summary import RunSummary

    def result(nodeid: str, halvings: str | None) -> TestResult:
        record = TestRecord(
            device=0,
            gpu="Card",
            date="2026-12-01",
            memory_key=nodeid,
            baseline_bytes=0,
            peak_allocated_bytes=4 << 30,
            peak_reserved_bytes=5 << 30,
            after_bytes=0,
            leaked_bytes=0,
            oom_halvings=halvings,
        )
        return TestResult(nodeid, record)

    summary = RunSummary()
    summary.results = {
        "t::plain": result("t::plain", None),
        "t::halved": result("t::halved", "OOM at batch 256, passed at 128"),
    }
    assert set(summary.learned()) == {"t::plain"}


def test_a_need_learned_under_a_capacity_is_keyed_by_it() -> None:
    from pytest_ctresources.settings.config import CircuitTracerConfig

    cfg = CircuitTracerConfig.defaults()
    assert memory_key("t::a", cfg) != memory_key("t::a", cfg, 24.0)
    assert json.loads(memory_key("t::a", None, 24.0)) == ["t::a", None, 24.0]
    assert json.loads(memory_key("t::a", cfg, 24.0))[::2] == ["t::a", 24.0]


def test_stale_keys_are_those_of_tests_that_no_longer_exist() -> None:
    from pytest_ctresources.core.learned import stale_keys

    kept, renamed, gone, elsewhere = (
        memory_key(nodeid, None)
        for nodeid in ("a.py::test_kept", "a.py::test_renamed", "gone.py::test_x", "b.py::test_y")
    )
    collected = {"a.py::test_kept", "a.py::test_new"}  # b.py not collected this run
    exists = {"a.py", "b.py"}.__contains__
    keys = [kept, renamed, gone, elsewhere]
    assert stale_keys(keys, collected, exists) == {renamed, gone}


LEARNED_SESSION = """
from conftest import FAKE

def test_attribution(ct_session):
    FAKE.alloc(13); FAKE.free(13)

def test_other(ct_session):
    pass
"""


def test_a_learned_need_never_skips_what_the_oom_retry_could_pass(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_learned=LEARNED_SESSION)
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    pytester.runpytest("--ct-config", "exp.yaml").assert_outcomes(passed=2)
    needs = json.loads((pytester.path / LEARNED_PATH).read_text())
    assert [json.loads(key)[0] for key in needs] == ["test_learned.py::test_attribution"]
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=10")
    # 13 GiB at batch 128 does not fit 10, but the OOM retry may pass at a smaller batch.
    result = pytester.runpytest("--ct-config", "exp.yaml", "-rs")
    result.assert_outcomes(passed=2)
    result = pytester.runpytest("--ct-config", "exp.yaml", "-rs", "--ct-no-oom-retry")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*test_learned.py:*: needs 13.0 GiB VRAM (measured 13.0 GiB on Card, ????-??-??); GPU 0 (Card) has 10.0 GiB"
        ]
    )
    # Without a GPU, ct_session runs the model on the CPU: a learned need skips nothing.
    monkeypatch.setenv("CT_FAKE_GPUS", "")
    result = pytester.runpytest("--ct-config", "exp.yaml", "--ct-no-oom-retry")
    result.assert_outcomes(passed=2)


def test_learned_needs_of_tests_that_no_longer_exist_are_pruned(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Card=24")
    pytester.makeconftest(FAKE_CUDA_CONFTEST)
    uses = "from conftest import FAKE\n\ndef test_{}():\n    FAKE.alloc(1); FAKE.free(1)\n"
    pytester.makepyfile(
        test_a=uses.format("kept") + "\n" + uses.format("renamed").split("\n", 2)[2]
    )
    pytester.makepyfile(test_b=uses.format("deselected"), test_gone=uses.format("gone"))
    pytester.runpytest().assert_outcomes(passed=4)
    cache = pytester.path / LEARNED_PATH
    assert len(json.loads(cache.read_text())) == 4
    (pytester.path / "test_gone.py").unlink()
    pytester.makepyfile(test_a=uses.format("kept") + "\n" + uses.format("new").split("\n", 2)[2])
    result = pytester.runpytest("-k", "not deselected", "-n", "2")
    result.assert_outcomes(passed=2)
    assert sorted(json.loads(key)[0] for key in json.loads(cache.read_text())) == [
        "test_a.py::test_kept",
        "test_a.py::test_new",
        "test_b.py::test_deselected",
    ]
    # Selecting one test by node id is no reason to forget its neighbours.
    pytester.runpytest("test_a.py::test_kept").assert_outcomes(passed=1)
    assert memory_key("test_a.py::test_new", None) in json.loads(cache.read_text())


def test_the_summary_a_reader_can_scan(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Folded at the terminal's width; under -v the settings are said once (in the header);
    # counts of nothing are left out; the files it wrote are named.
    monkeypatch.setenv("COLUMNS", "80")
    result = project.runpytest("-v", "--ct-report-json", "r.json")
    out = result.stdout.str()
    summary = out.split("ctresources summary")[1]
    assert out.count("cleanup=auto") == 1 and "cleanup=auto" not in summary
    # The -v header's own lines are folded too, their continuations indented under them.
    top = out.split("rootdir:")[0].splitlines()
    ours = [n for n, line in enumerate(top) if line.startswith("ctresources: ")]
    header = top[ours[0] : ours[-1] + 1]
    assert any(line.startswith("    ") for line in header)
    assert all(len(line) <= 80 for line in header)
    assert "attributions: 0" not in summary and "skipped for VRAM: 0" not in summary
    result.stdout.fnmatch_lines(
        [
            "UNDER-DECLARED test_suite.py::test_under_declared: peak 3.50 GiB reserved >",
            "    declared 2.0 GiB (@pytest.mark.vram on test_suite.py::test_under_declared);",
            "    write @pytest.mark.vram(gib=4)",
            "wrote the JSON report: r.json",
        ]
    )
    lines = summary.splitlines()[1:]
    folded = [line for line in lines if not line.startswith(("=", " peak", "   "))]
    assert all(len(line) <= 80 for line in folded)


def test_a_record_int_execnet_cannot_send_travels_from_a_worker() -> None:
    """execnet writes an int below -2**31 in four bytes and fails: the plugin's properties
    travel with such ints as text and arrive as they were; others' are left alone."""
    from execnet.gateway_base import dumps_internal, loads_internal

    from pytest_ctresources.core.record import shipped, unshipped

    evicted = -(3 << 30)  # resident_bytes of a test that evicted a 3 GiB model
    properties = [("ct_resident_bytes", evicted), ("ct_worker", "gw0"), ("theirs", 1)]
    with pytest.raises(Exception, match="format requires"):
        dumps_internal(properties)
    sendable = shipped(properties)
    assert sendable is not None
    arrived = loads_internal(dumps_internal(sendable))
    assert unshipped(arrived) == properties
    assert shipped([("ct_x", -5), ("theirs", evicted)]) is None  # nothing of ours to change
    assert unshipped([("theirs", {"ct_int": "-1"})]) is None


def test_a_workers_report_with_such_an_int_reaches_the_controller(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    pytester.makepyfile(
        "def test_a(record_property):\n    record_property('ct_mine', -(3 << 30))\n"
    )
    result = pytester.runpytest("-n", "1", "--junitxml", "j.xml", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    properties = ET.parse(pytester.path / "j.xml").getroot().iter("property")
    assert {p.get("name"): p.get("value") for p in properties}["ct_mine"] == str(-(3 << 30))
