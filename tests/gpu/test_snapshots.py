"""``--ct-snapshot`` on a real GPU: skipped where torch sees no CUDA GPU (docs/gpu-validation.md).

The three findings of scenario_snapshots.py (an attribution out of memory under a capped
allocator, a leak into a module global, a test over its declared need) each leave a snapshot
in torch's format, and the summary names the line of the test that allocated.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tests.gpu.test_gpu import keep_artifacts

torch = pytest.importorskip("torch")
SCENARIO = Path(__file__).parent / "scenario_snapshots.py"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest_plugins = ["pytester"]


def test_each_finding_leaves_a_snapshot_naming_the_tests_line(pytester: pytest.Pytester) -> None:
    shutil.copy(SCENARIO, pytester.path)
    sites: dict[str, list[int]] = {}  # test -> its lines marked # SITE
    test = ""
    for number, line in enumerate(SCENARIO.read_text().splitlines(), 1):
        if line.startswith("def test_"):
            test = line[len("def ") :].split("(")[0]
        if line.endswith("# SITE"):
            sites.setdefault(test, []).append(number)
    result = pytester.runpytest_subprocess(
        SCENARIO.name,
        "-p",
        "no:randomly",
        "--ct-vram-capacity",
        "24",
        "--ct-no-oom-retry",
        "--ct-snapshot",
        "on-failure",
        "--ct-report-json",
        "snapshots.json",
    )
    result.assert_outcomes(passed=2, failed=1)
    entries = {
        entry["nodeid"].split("::")[1]: entry
        for entry in json.loads((pytester.path / "snapshots.json").read_text())["snapshots"]
    }
    expected = {
        "test_attribution_runs_out_of_memory": "out of memory",
        "test_leaks_into_a_module_global": "leak",
        "test_goes_over_its_declared_need": "over its declared need",
    }
    assert set(entries) == set(expected)
    for name, why in expected.items():
        lines = sites[name]
        entry = entries[name]
        assert why in entry["why"]
        snapshot = pickle.loads(Path(entry["file"]).read_bytes())
        assert "segments" in snapshot and "device_traces" in snapshot
        named = [f"{SCENARIO.name}:{line} ({name})" for line in lines]
        site = next((s["user"] for s in entry["sites"] if s["user"] in named), None)
        assert site is not None, entry["sites"]
        result.stdout.fnmatch_lines([f"  *::{name} ({entry['why']}): *", f"      * at {site}*"])
    keep_artifacts(pytester.path / "snapshots.json")
    print(
        "\n".join(
            line
            for line in result.stdout.lines
            if "memory snapshot" in line or " block(s) " in line
        )
    )
