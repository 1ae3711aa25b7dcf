"""Real-GPU tests: skipped where torch sees no CUDA GPU, run on the device (docs/gpu-validation.md).

Each scenario is a pytester project run in a subprocess, so CUDA initialises fresh in it and
the plugin's settings (capacity cap, cleanup) act exactly as in a user's run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
SCENARIOS = Path(__file__).parent

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest_plugins = ["pytester"]


def test_vram_marker_against_the_real_gpu(pytester: pytest.Pytester) -> None:
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    pytester.makepyfile(
        f"""
        import pytest, torch

        @pytest.mark.vram(gib={total_gib + 50:.1f})
        def test_over_capacity(): pass

        @pytest.mark.vram(gib=1)
        def test_under_capacity():
            x = torch.ones(1024, device="cuda")
            assert x.sum().item() == 1024
        """
    )
    # The project asks as a whole (settings/activation.py): the -v header names the GPU.
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    result = pytester.runpytest_subprocess("-rs", "-v")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "ctresources: GPU 0: *(nvml*",
            f"*needs {total_gib + 50:.1f} GiB VRAM; GPU 0 (*) has * GiB",
        ]
    )


def test_allocator_stats_match_torchs_getters_on_a_real_gpu(pytester: pytest.Pytester) -> None:
    # The meter reads torch's nested statistics once (gpu/measure.py): the same figures as
    # torch's getters, on a real allocator, after allocating, freeing and resetting peaks.
    pytester.makepyfile(
        """
        import torch
        from pytest_ctresources.gpu.measure import AllocatorStats, allocator_stats

        def figures():
            cuda = torch.cuda
            return AllocatorStats(
                cuda.memory_allocated(0), cuda.memory_reserved(0), cuda.max_memory_allocated(0),
                cuda.max_memory_reserved(0), cuda.memory_stats(0)["allocation.all.allocated"],
            )

        def test_figures():
            kept = torch.ones(2**20, device="cuda")
            big = torch.ones(2**26, device="cuda")
            assert allocator_stats(torch.cuda, 0) == figures()
            del big
            torch.cuda.reset_peak_memory_stats(0)
            stats = allocator_stats(torch.cuda, 0)
            assert stats == figures()
            assert stats.allocated >= kept.numel() * 4 and stats.cached >= 2**28
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=1)


def test_capacity_option_caps_the_allocator(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        GIB = 2**30

        def test_ten_gib_is_out_of_memory():
            with pytest.raises(torch.cuda.OutOfMemoryError):
                torch.empty(10 * GIB, dtype=torch.uint8, device="cuda")

        def test_four_gib_fits():
            x = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
            assert x.numel() == 4 * GIB

        @pytest.mark.vram(gib=12)
        def test_skipped_by_the_emulated_card(): pass
        """
    )
    result = pytester.runpytest_subprocess("--ct-vram-capacity", "8", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        ["*needs 12.0 GiB VRAM; GPU 0 (*) is capped at 8.0 GiB by --ct-vram-capacity"]
    )


def test_memory_returns_to_baseline_after_a_real_size_attribution(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_ctresources import testing

        BASELINE = []
        PROMPT = " ".join(["the capital of france is paris and"] * 3) + " the"  # ~25 tokens

        def test_warm_up(ct_session):
            # The process-lifetime CUDA state (cuBLAS workspaces, one per handle and stream,
            # autograd's backward thread included) is created by a first attribution on the
            # tiny model; it is no test's memory, so it belongs in the baseline.
            model = testing.build_replacement_model(testing.TINY_GEMMA2_DIMS, device="cuda")
            ct_session.attribute("the capital of france is", model)

        def test_baseline():
            BASELINE.append(torch.cuda.memory_allocated())

        def test_gemma_2_2b_attribution(ct_session):
            model = testing.build_replacement_model(
                testing.GEMMA_2_2B_DIMS, dtype="bfloat16", device="cuda"
            )
            graph = ct_session.attribute(PROMPT, model)
            assert len(graph.selected_features) > 0
            print("PEAK_GIB", torch.cuda.max_memory_allocated() / 2**30)
            print("TOKENS", len(graph.input_tokens))

        def test_back_to_baseline():
            print("AFTER", torch.cuda.memory_allocated(), "BASELINE", BASELINE[0])
            blocks = [b["size"] for seg in torch.cuda.memory_snapshot()
                      for b in seg["blocks"] if b["state"] == "active_allocated"]
            print("ACTIVE_BLOCKS", blocks)
            assert torch.cuda.memory_allocated() == BASELINE[0]
        """
    )
    result = pytester.runpytest_subprocess(
        "-s", "-p", "no:randomly", "--ct-batch-size", "256", "--ct-max-feature-nodes", "1024"
    )
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*PEAK_GIB *", "*AFTER * BASELINE *"])


def test_failed_test_frees_its_gpu_memory_before_the_next_setup(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest, torch

        BASELINE = []

        def test_baseline():
            torch.cuda.init()
            BASELINE.append(torch.cuda.memory_allocated())

        def test_fails_holding_two_gib():
            big = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
            assert big.numel() == 0

        @pytest.fixture
        def check_memory():
            assert torch.cuda.memory_allocated() == BASELINE[0]

        def test_next_setup_has_the_memory(check_memory):
            pass
        """
    )
    # Tests that use nothing of the plugin are cleaned up where the project asks for it.
    pytester.makeini("[pytest]\nct_cleanup = auto\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1)


def test_a_cycle_holding_a_cuda_tensor_is_freed_before_the_next_setup(
    pytester: pytest.Pytester,
) -> None:
    # Only a garbage collection frees a tensor caught in a reference cycle; the automatic
    # collector is off in this project, so only the plugin's cleanup can (and, being cheap,
    # it collects only because CUDA memory is above the test's baseline).
    pytester.makepyfile(
        """
        import gc, weakref
        import pytest, torch

        BASELINE, REFS = [], []

        @pytest.fixture(scope="session", autouse=True)
        def no_automatic_collections():
            gc.disable()
            yield
            gc.enable()

        class Holder:
            def __init__(self):
                self.tensor = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
                self.me = self

        def test_baseline():
            torch.cuda.init()
            BASELINE.append(torch.cuda.memory_allocated())

        def test_leaves_a_cycle():
            REFS.append(weakref.ref(Holder()))

        @pytest.fixture
        def check_memory():
            assert REFS[0]() is None
            assert torch.cuda.memory_allocated() == BASELINE[0]

        def test_next_setup_has_the_memory(check_memory):
            pass
        """
    )
    pytester.makeini("[pytest]\nct_cleanup = auto\n")  # the project asks (activation.py)
    pytester.runpytest_subprocess("-p", "no:randomly").assert_outcomes(passed=3)


def test_strict_ct_session_suite_on_a_real_size_model(pytester: pytest.Pytester) -> None:
    # The model ct_session keeps loaded (8.6 GiB in bfloat16) is resident, not the first
    # test's leak: --ct-strict passes a normal suite, and the summary lists the model.
    pytester.makefile(
        ".yaml",
        exp="MODEL_NAME: ctresources/random-gemma-2-2b\n"
        "TRANSCODER_SET: ctresources/random-jumprelu\nDTYPE: bfloat16\nBATCH_SIZE: 64\n"
        "MAX_FEATURE_NODES: 1024\n",
    )
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.parametrize("prompt", ["the capital of france is", "the big red city was"])
        def test_attribution(ct_session, prompt):
            graph = ct_session.attribute(prompt)
            assert len(graph.selected_features) > 0

        def test_uses_the_same_model(ct_session, request):
            from pytest_ctresources.core.runtime import runtime_of
            ct_session.attribute("the capital of france is")
            assert runtime_of(request.config).model_cache.loads == 1
        """
    )
    result = pytester.runpytest_subprocess(
        "--ct-config",
        "exp.yaml",
        "--ct-strict",
        "-p",
        "no:randomly",
        "-v",  # -v: the details
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        [
            "resident models (kept loaded between tests by ct_session; not leaks):",
            "  main GPU 0: ctresources/random-gemma-2-2b (bfloat16) * GiB, loaded by "
            "test_strict_ct_session_suite_on_a_real_size_model.py::test_attribution[[]the capital of france is[]]",
        ]
    )
    assert "LEAK " not in result.stdout.str()


def test_safe_clean_cuda_frees_transients_and_moves_back(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_ctresources import cleanup_python_cuda, safe_clean_cuda

        KEPT_BY_ACCIDENT = []

        def test_scope():
            model = torch.nn.Linear(256, 256)
            cleanup_python_cuda()
            before = torch.cuda.memory_allocated()
            with safe_clean_cuda(model) as scope:
                assert next(scope.model.parameters()).is_cuda
                KEPT_BY_ACCIDENT.append(torch.empty(2**30, dtype=torch.uint8, device="cuda"))
                result = torch.ones(2**19, device="cuda")  # 2 MiB: above min_bytes, so keep it
                scope.keep(result)
            assert next(model.parameters()).device.type == "cpu"
            assert KEPT_BY_ACCIDENT[0].untyped_storage().nbytes() == 0
            assert result.sum().item() == 2**19
            kept = result.untyped_storage().nbytes()
            assert torch.cuda.memory_allocated() - before - kept < 2**20
        """
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def keep_artifacts(*paths: Path) -> None:
    """Copy report files to $CT_GPU_ARTIFACTS (bench/gpu_validation.sh sets it to its output folder)."""
    target = os.environ.get("CT_GPU_ARTIFACTS")
    if target:
        for path in paths:
            shutil.copy(path, Path(target) / path.name)


def run_scenario(pytester: pytest.Pytester, scenario: str, *args: str) -> pytest.RunResult:
    """Copy ``tests/gpu/<scenario>`` into the pytester project and run it in a subprocess."""
    shutil.copy(SCENARIOS / scenario, pytester.path)
    return pytester.runpytest_subprocess(scenario, *args)


def test_five_tests_second_runs_out_of_memory(pytester: pytest.Pytester) -> None:
    result = run_scenario(
        pytester,
        "scenario_five_tests.py",
        "-p",
        "no:randomly",
        "--ct-vram-capacity",
        "16",
        "--ct-report-json",
        "five_tests.json",
    )
    result.assert_outcomes(passed=4, failed=1)
    # The OOM section names the card as detection does in the summary's header (any card).
    card = re.search(r"^GPU 0: (.+), [\d.]+ GiB \(nvml", result.stdout.str(), re.MULTILINE)
    assert card is not None, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*ctresources: CUDA out of memory*",
            f"GPU 0 ({card.group(1)}): *, emulated capacity 16.0 GiB (--ct-vram-capacity)",
            "peak before the failure: 6.00 GiB allocated*",
        ]
    )
    report = json.loads((pytester.path / "five_tests.json").read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in report["tests"]}
    assert len(tests) == 5
    for record in tests.values():
        assert record["after_bytes"] == record["baseline_bytes"], record
    assert tests["test_2_runs_out_of_memory"]["outcome"] == "failed"
    keep_artifacts(pytester.path / "five_tests.json")


def test_gemma_2_2b_oom_recovered_by_halving(pytester: pytest.Pytester) -> None:
    result = run_scenario(
        pytester,
        "scenario_gemma_halving.py",
        "-s",
        "--ct-vram-capacity",
        "14",
        "--ct-report-json",
        "gemma_halving.json",
        "--ct-report-plot",
        "gemma_halving.png",
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["  scenario_gemma_halving.py::*: OOM at batch 256, passed at * — use `--ct-batch-size *`"]
    )
    report = json.loads((pytester.path / "gemma_halving.json").read_text())
    (record,) = report["tests"]
    assert record["oom_halvings"].startswith("OOM at batch 256, passed at ")
    assert record["peak_reserved_bytes"] <= 14 * 2**30
    keep_artifacts(pytester.path / "gemma_halving.json", pytester.path / "gemma_halving.png")


def test_oom_retry_gets_the_card_back_after_ooms_in_the_forward_pass(
    pytester: pytest.Pytester,
) -> None:
    result = run_scenario(pytester, "scenario_oom_in_forward.py", "-s", "--ct-vram-capacity", "24")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*HALVINGS [[](512, 256), (256, 128), (128, 64)[]]*"])


def test_auto_batch_size_fits_where_256_does_not(pytester: pytest.Pytester) -> None:
    result = run_scenario(
        pytester,
        "scenario_auto_batch.py",
        "-s",
        "-vv",  # the summary's per-attribution detail (docs/vram-report.md)
        "--ct-batch-size",
        "auto",
        "--ct-vram-capacity",
        "14",
        "--ct-report-json",
        "auto_batch.json",
    )
    result.assert_outcomes(passed=1)
    # The summary's detail line wraps to the terminal's width: read it with the wrapping undone.
    summary = " ".join(result.stdout.str().split("ctresources summary", 1)[1].split())
    assert re.search(
        r"scenario_auto_batch.py::\S+: auto batch size \d+ \(25 prompt tokens, \d+ active "
        r"features.*, predicted [\d.]+ GiB.*; \d+ is the largest that fits.*; budget 13.3 GiB = "
        r"14.0 GiB \(--ct-vram-capacity\) less 5% margin\)",
        summary,
    ), summary
    report = json.loads((pytester.path / "auto_batch.json").read_text())
    (record,) = report["tests"]
    assert record["peak_reserved_bytes"] <= 14 * 2**30
    assert record["oom_halvings"] is None
    (choices,) = report["auto_batch_sizes"].values()
    assert len(choices) == 1
    keep_artifacts(pytester.path / "auto_batch.json")


def test_long_prompts_under_auto_refused_or_fitting(pytester: pytest.Pytester) -> None:
    """A prompt the pipeline cannot fit is refused before the forward pass, naming the phase;
    one it fits runs, and prunes on the GPU, inside the emulated card."""
    result = run_scenario(
        pytester,
        "scenario_long_prompt.py",
        "-s",
        "-p",
        "no:randomly",
        "--ct-batch-size",
        "auto",
        "--ct-vram-capacity",
        "24",
        "--ct-report-json",
        "long_prompt.json",
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*REFUSED --ct-batch-size auto: 1600 prompt tokens *", "*AUTO *"])
    keep_artifacts(pytester.path / "long_prompt.json")


def _gpu_notebook(path: Path, source: str, vram_gib: float) -> None:
    nbformat = pytest.importorskip("nbformat")
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell(source)])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["ctresources"] = {"vram_gib": vram_gib}
    nbformat.write(nb, path)


@pytest.mark.nbmake
def test_two_notebooks_at_sixty_percent_and_one_over_capacity(pytester: pytest.Pytester) -> None:
    pytest.importorskip("nbmake")
    total = torch.cuda.get_device_properties(0).total_memory
    share = int(total * 0.6)
    capacity_gib = round(total * 0.8 / 2**30)  # the emulated card holds one notebook, not two
    allocate = (
        "import torch\n"
        "free, total = torch.cuda.mem_get_info()\n"
        # The previous notebook's kernel has exited and its memory is back.
        f"assert free >= {share}, f'only {{free / 2**30:.1f}} GiB free before allocating'\n"
        f"x = torch.empty({share}, dtype=torch.uint8, device='cuda')\n"
        "x.fill_(1)\n"
        f"assert torch.cuda.memory_allocated() >= {share}\n"
    )
    need = round(share / 2**30 + 1, 1)
    _gpu_notebook(pytester.path / "nb_first.ipynb", allocate, need)
    _gpu_notebook(pytester.path / "nb_second.ipynb", allocate, need)
    _gpu_notebook(
        pytester.path / "nb_too_big.ipynb", "raise AssertionError('ran')", capacity_gib + 10
    )
    result = pytester.runpytest_subprocess(
        "--nbmake",
        "-p",
        "no:randomly",
        "--ct-vram-capacity",
        str(capacity_gib),
        "--ct-report",
        "--ct-report-json",
        "notebooks.json",
        "-rs",
    )
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        [f"*nb_too_big.ipynb: needs {capacity_gib + 10:.1f} GiB VRAM; GPU 0 (*) is capped at *"]
    )
    records = {
        r["nodeid"]: r for r in json.loads((pytester.path / "notebooks.json").read_text())["tests"]
    }
    for name in ("nb_first.ipynb", "nb_second.ipynb"):
        record = records[f"{name}::{name}"]
        assert record["peak_allocated_bytes"] >= share, record  # measured inside the kernel
        assert record["after_bytes"] == 0, record  # the kernel exited: nothing is left
    result.stdout.fnmatch_lines(["*nb_first.ipynb*", "*nb_second.ipynb*"])  # in the summary
    assert "LEAK" not in str(result.stdout)
    (pytester.path / "notebooks.log").write_text(str(result.stdout), encoding="utf-8")
    keep_artifacts(pytester.path / "notebooks.json", pytester.path / "notebooks.log")


@pytest.mark.nbmake
def test_the_cap_binds_inside_a_notebook_kernel_started_in_the_project_profile(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up file reaches the kernel on ipykernel's command line: --ct-vram-capacity
    caps the kernel's allocator and the kernel reports its peak, while the project's own
    IPYTHONDIR start-up file runs too."""
    pytest.importorskip("nbmake")
    startup = pytester.path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-project.py").write_text("GIB = 2**30\n")
    monkeypatch.setenv("IPYTHONDIR", str(pytester.path / "ipython"))
    _gpu_notebook(
        pytester.path / "nb_capped.ipynb",
        "import torch\n"
        "x = torch.empty(4 * GIB, dtype=torch.uint8, device='cuda')\n"
        "try:\n"
        "    y = torch.empty(6 * GIB, dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('10 GiB allocated in a kernel capped at 8 GiB')\n",
        5,
    )
    result = pytester.runpytest_subprocess(
        "--nbmake", "-p", "no:randomly", "--ct-vram-capacity", "8", "--ct-report-json", "r.json"
    )
    result.assert_outcomes(passed=1)
    (record,) = json.loads((pytester.path / "r.json").read_text())["tests"]
    assert 4 * 2**30 <= record["peak_allocated_bytes"] < 8 * 2**30, record
    # Without the cap the same notebook allocates the 10 GiB: the cap above did the refusing.
    result = pytester.runpytest_subprocess("--nbmake", "-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*10 GiB allocated in a kernel capped at 8 GiB*"])


def test_xdist_workers_are_bound_and_the_controller_never_touches_cuda(
    pytester: pytest.Pytester,
) -> None:
    pytest.importorskip("xdist")
    count = torch.cuda.device_count()
    pytester.makeconftest(
        """
        import json, os, sys

        def pytest_sessionfinish(session):
            if not hasattr(session.config, "workerinput"):  # the controller
                torch = sys.modules.get("torch")
                with open("controller.json", "w") as handle:
                    json.dump({"cuda_initialised": bool(torch and torch.cuda.is_initialized())},
                              handle)
        """
    )
    pytester.makepyfile(
        """
        import json, os, pytest, torch

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.vram(gib=2)
        def test_on_my_gpu(i):
            x = torch.ones(2**28, device="cuda")  # 1 GiB
            props = torch.cuda.get_device_properties(0)
            with open(f"run-{i}.json", "w") as handle:
                json.dump({"worker": os.environ["PYTEST_XDIST_WORKER"],
                           "visible": os.environ["CUDA_VISIBLE_DEVICES"],
                           "devices": torch.cuda.device_count(),
                           "uuid": str(props.uuid)}, handle)
            assert x.sum().item() == 2**28
        """
    )
    result = pytester.runpytest_subprocess(
        "-n", "2", "-v", "--ct-report-json", "xdist.json", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["ctresources: xdist: 2 worker(s) bound round robin to *"])
    runs = [json.loads(path.read_text()) for path in pytester.path.glob("run-*.json")]
    by_worker = {run["worker"]: run for run in runs}
    assert all(run["devices"] == 1 for run in runs)  # each worker sees its GPU only
    assert all(run["visible"] == "GPU-" + run["uuid"] for run in runs)
    if count >= 2 and len(by_worker) == 2:
        assert by_worker["gw0"]["uuid"] != by_worker["gw1"]["uuid"]
    assert json.loads((pytester.path / "controller.json").read_text()) == {
        "cuda_initialised": False
    }
    report = json.loads((pytester.path / "xdist.json").read_text())
    assert len(report["placements"]) == 4
    assert {p["lease_gib"] for p in report["placements"]} == {2.0}
    (pytester.path / "xdist.log").write_text(str(result.stdout), encoding="utf-8")
    keep_artifacts(pytester.path / "xdist.json", pytester.path / "xdist.log")
