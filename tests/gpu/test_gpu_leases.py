"""Real-GPU tests of the VRAM lease budget: skipped where torch sees no CUDA GPU.

What the CPU tests prove with fake GPUs (tests/test_xdist_gpus.py), measured on the card:
each test reads how much of the card other processes use while it holds its lease
(``torch.cuda.mem_get_info`` less its own reservations), so an overlap the budget should have
prevented shows as memory, not only as timestamps.

    python -m pytest tests/gpu/test_gpu_leases.py -v -p no:randomly

(Set ``CT_GPU_ARTIFACTS`` to a directory to keep the reports and logs.)
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.test_gpu import keep_artifacts

torch = pytest.importorskip("torch")
pytest.importorskip("xdist")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest_plugins = ["pytester"]


CONFTEST = """
import json, os, time
import torch

GIB = 2**30

def mark(name):
    open(name, "w").close()

def wait_for(*names, seconds=600):
    deadline = time.time() + seconds
    while not all(os.path.exists(name) for name in names):
        assert time.time() < deadline, f"no {names} after {seconds} s"
        time.sleep(0.05)

def others_gib():
    # Everything on the card but this process's own PyTorch memory: other processes'
    # allocations and CUDA contexts, and this process's context.
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / GIB

def hold(gib, name, seconds=2.0):
    x = torch.empty(int(gib * GIB), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    start, seen = time.time(), []
    while time.time() - start < seconds:
        seen.append(others_gib())
        time.sleep(0.1)
    with open(f"span-{name}.json", "w") as handle:
        json.dump({"start": start, "end": time.time(), "others_gib": max(seen)}, handle)
    del x
"""


def spans(path: Path) -> dict[str, dict[str, float]]:
    return {
        item.stem.removeprefix("span-"): json.loads(item.read_text())
        for item in path.glob("span-*.json")
    }


def test_two_concurrent_runs_queue_on_one_real_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One budget per card across runs: a plain run and a -n 2 run at once, both under
    # --ct-vram-capacity 24 (one budget of 24 GiB of the card's first units), tests of 16 GiB
    # holding 14 GiB each for 2 s. No two may be on the card at once.
    pytester.makeconftest(
        CONFTEST
        + """
def pytest_configure(config):
    if os.environ["RUN_LABEL"] == "plain" or hasattr(config, "workerinput"):
        mark(f"started-{os.environ['RUN_LABEL']}")
"""
    )
    pytester.makepyfile(
        """
        import os, pytest
        from conftest import hold, wait_for

        @pytest.mark.parametrize("i", range(3))
        @pytest.mark.vram(gib=16)
        def test_x(i):
            wait_for("started-plain", "started-xdist")
            hold(14, f"{os.environ['RUN_LABEL']}-{i}")
        """
    )
    runs = {}
    for label, args in (("plain", []), ("xdist", ["-n", "2"])):
        monkeypatch.setenv("RUN_LABEL", label)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:randomly",
            "-o",
            "ct_lease_timeout=600",
        ]
        with open(pytester.path / f"leases-{label}.log", "w") as log:
            runs[label] = pytester.popen(
                [
                    *command,
                    "--ct-vram-capacity",
                    "24",
                    *args,
                    f"--ct-report-json=leases-{label}.json",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    for label, run in runs.items():
        assert run.wait(timeout=900) == 0, (pytester.path / f"leases-{label}.log").read_text()
    found = spans(pytester.path)
    assert len(found) == 6, found
    ordered = sorted(found.values(), key=lambda span: span["start"])
    for first, second in itertools.pairwise(ordered):
        assert second["start"] >= first["end"] - 0.1, found
    assert max(span["others_gib"] for span in found.values()) < 8, found  # no other 14 GiB
    (pytester.path / "leases-spans.json").write_text(json.dumps(found, indent=1))
    keep_artifacts(
        *(pytester.path / f"leases-{label}.{ext}" for label in runs for ext in ("json", "log")),
        pytester.path / "leases-spans.json",
    )


HOG = """
import sys, torch
free, total = torch.cuda.mem_get_info()
x = torch.empty(free - 10 * 2**30, dtype=torch.uint8, device="cuda")
print("held", flush=True)
sys.stdin.read()
"""


def test_memory_another_process_holds_counts_against_the_leases(
    pytester: pytest.Pytester,
) -> None:
    # A process outside the budget takes all but 10 GiB of the card: a 16 GiB lease must wait
    # (here: time out), a 4 GiB one fits; once it exits, both run.
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.vram(gib=16)
        def test_sixteen():
            torch.empty(15 * 2**30, dtype=torch.uint8, device="cuda").fill_(1)

        @pytest.mark.vram(gib=4)
        def test_four():
            torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda").fill_(1)
        """
    )
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        result = pytester.runpytest_subprocess("-p", "no:randomly", "-o", "ct_lease_timeout=5")
        result.assert_outcomes(passed=1, errors=1)
        result.stdout.fnmatch_lines(
            ["*waited 5 s for a VRAM lease of 16.0 GiB*is used beyond the leases*"]
        )
    finally:
        hog.kill()
        hog.wait()
    log = pytester.path / "leases-used.log"
    log.write_text(str(result.stdout), encoding="utf-8")
    pytester.runpytest_subprocess("-p", "no:randomly").assert_outcomes(passed=2)
    keep_artifacts(log)


def test_an_idle_resident_model_is_freed_for_another_workers_test(
    pytester: pytest.Pytester,
) -> None:
    # An idle resident model freed for a waiting worker, --ct-vram-capacity 24: gw-A caches the real-size
    # random gemma-2-2b in bf16 (about 8.6 GiB) and runs a test that does not use it; gw-B's
    # test needs 16 GiB. B waits, A's watcher frees the idle model, B gets the card: while B
    # holds 15 GiB, the others on the card hold less than the model.
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_a="""
        import pytest
        from conftest import mark, wait_for

        @pytest.mark.ct_config(
            model_name="ctresources/random-gemma-2-2b",
            transcoder_set="ctresources/random-jumprelu",
            dtype="bfloat16",
        )
        @pytest.mark.vram(gib=16)
        def test_a1_loads_the_model(ct_session):
            ct_session.load_model()
            mark("a-loaded")

        def test_a2_idles_with_the_model_cached():
            wait_for("b-done")
        """,
        test_b="""
        import pytest
        from conftest import hold, mark, wait_for

        def test_b1_waits_for_the_model():
            wait_for("a-loaded")

        @pytest.mark.vram(gib=16)
        def test_b2_needs_16_gib():
            hold(15, "b2")
            mark("b-done")
        """,
    )
    result = pytester.runpytest_subprocess(
        "-n",
        "2",
        "--dist",
        "loadfile",
        "-p",
        "no:randomly",
        "--ct-vram-capacity",
        "24",
        "-o",
        "ct_lease_timeout=600",
        "--ct-report-json=resident.json",
    )
    result.assert_outcomes(passed=4)
    b2 = spans(pytester.path)["b2"]
    assert b2["others_gib"] < 8, b2  # the model (8.6 GiB) was no longer on the card
    placements = {
        p["nodeid"].rsplit("::", 1)[1]: p
        for p in json.loads((pytester.path / "resident.json").read_text())["placements"]
    }
    assert placements["test_b2_needs_16_gib"]["lease_wait_s"] > 0
    (pytester.path / "resident.log").write_text(str(result.stdout), encoding="utf-8")
    (pytester.path / "resident-b2.json").write_text(json.dumps(b2))
    keep_artifacts(
        pytester.path / "resident.json",
        pytester.path / "resident.log",
        pytester.path / "resident-b2.json",
    )
