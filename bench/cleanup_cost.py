"""What the plugin's per-test work costs, side by side with the plugin off, in one run.

Three workloads, the ones users run (issue 12 of the project set them):

- ``small-cuda``: 200 tests that each allocate one small CUDA tensor, in a process that
  imported torch, transformers and circuit_tracer (a realistic heap for a garbage collection);
  the plugin against ``-p no:ctresources``.
- ``attribution``: 60 ``ct_session.attribute()`` calls on the bundled tiny model on the GPU;
  the default cleanup against ``ct_cleanup = never`` (``ct_session`` needs the plugin).
- ``small-cpu``: 200 small CPU tests in a process that imported the same libraries, under
  ``ct_cleanup = always`` against ``-p no:ctresources``.

Each variant is a fresh pytest process (``python -m pytest``); variants alternate, and each is
run ``--repeats`` times; the table gives medians of the whole process's wall time and of the
session time pytest itself reports, and the ratio of each to the workload's baseline. Other
cleanup policies (``CleanupPolicy`` in pytest_ctresources/cleanup_between_tests.py) are
measured the same way, installed from the project's conftest, so that the choice of levers
(collect only when CUDA memory is above the test's baseline, freeze long-lived objects,
return the cache only when it holds enough) rests on figures; ``collections`` counts the full
garbage collections per test that the policy ran.

    python bench/cleanup_cost.py --out $OUT/cleanup_cost.md            # on a GPU machine
    python bench/cleanup_cost.py --workloads small-cpu --repeats 5     # anywhere

A workload that needs CUDA is skipped without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Policies measured besides the default, as CleanupPolicy keyword arguments.
POLICIES: dict[str, dict[str, object]] = {
    "every test, no freeze (before)": {
        "conditional": False,
        "freeze": False,
        "empty_cache_min_bytes": 0,
    },
    "above baseline, no freeze": {"freeze": False},
    "every test, freeze": {"conditional": False},
    "above baseline, freeze, cache always": {"empty_cache_min_bytes": 0},
}

CONFTEST = '''
import gc, json, os, sys

import torch
import transformers  # noqa: F401  (the heap users' suites have)
import circuit_tracer  # noqa: F401

_policy = os.environ.get("BENCH_CLEANUP_POLICY")
if _policy:
    import pytest_ctresources.cleanup_between_tests as _between
    _between.POLICY = _between.CleanupPolicy(**json.loads(_policy))

FULL = [0]

def _count(phase, info):
    if phase == "start" and info["generation"] == 2:
        FULL[0] += 1

def pytest_sessionstart(session):
    gc.callbacks.append(_count)

def pytest_sessionfinish(session):
    print(f"\\nBENCH full_collections={FULL[0]}")
'''

SMALL_CUDA = """
import pytest, torch

@pytest.mark.parametrize("i", range(200))
def test_small(i):
    x = torch.ones(1024, device="cuda")
    assert x.sum().item() == 1024
"""

SMALL_CPU = """
import pytest, torch

@pytest.mark.parametrize("i", range(200))
def test_small(i):
    x = torch.ones(1024)
    assert x.sum().item() == 1024
"""

ATTRIBUTION = """
import pytest

@pytest.mark.parametrize("i", range(60))
def test_attribution(ct_session, i):
    graph = ct_session.attribute("the capital of france is")
    assert len(graph.selected_features) > 0
"""

TINY_CONFIG = """\
MODEL_NAME: ctresources/tiny-gemma-2
TRANSCODER_SET: ctresources/random-jumprelu
BATCH_SIZE: 64
MAX_FEATURE_NODES: 64
"""


@dataclass
class Variant:
    name: str
    args: list[str]
    ini: str = ""
    policy: dict[str, object] | None = None
    walls: list[float] = field(default_factory=list)
    sessions: list[float] = field(default_factory=list)
    collections: list[int] = field(default_factory=list)
    leaked: list[int] = field(default_factory=list)


@dataclass
class Workload:
    name: str
    tests: str
    count: int
    needs_cuda: bool
    baseline: Variant
    variants: list[Variant]


def workloads() -> list[Workload]:
    off = ["-p", "no:ctresources"]
    policy_variants = [Variant(name, [], policy=kwargs) for name, kwargs in POLICIES.items()]
    return [
        Workload(
            "small-cuda",
            SMALL_CUDA,
            200,
            True,
            Variant("plugin off", off),
            [Variant("plugin, default cleanup", []), *policy_variants],
        ),
        Workload(
            "attribution",
            ATTRIBUTION,
            60,
            True,
            Variant("ct_cleanup = never", [], ini="ct_cleanup = never"),
            [
                Variant("default cleanup", []),
                Variant(
                    "every test, no freeze (before)",
                    [],
                    policy=POLICIES["every test, no freeze (before)"],
                ),
            ],
        ),
        Workload(
            "small-cpu",
            SMALL_CPU,
            200,
            False,
            Variant("plugin off", off),
            [
                Variant("ct_cleanup = always", [], ini="ct_cleanup = always"),
                Variant(
                    "always, no freeze (before)",
                    [],
                    ini="ct_cleanup = always",
                    policy={"freeze": False},
                ),
            ],
        ),
    ]


SESSION_TIME = re.compile(r" in ([0-9.]+)s")


def run_variant(project: Path, variant: Variant, report: Path) -> None:
    (project / "pytest.ini").write_text(f"[pytest]\n{variant.ini}\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop("BENCH_CLEANUP_POLICY", None)
    if variant.policy is not None:
        env["BENCH_CLEANUP_POLICY"] = json.dumps(variant.policy)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    if "no:ctresources" not in variant.args:
        args += ["--ct-report-json", str(report)]
    began = time.perf_counter()
    done = subprocess.run(
        [*args, *variant.args], cwd=project, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - began
    out = done.stdout
    if done.returncode != 0:
        raise SystemExit(f"{variant.name}: pytest exited {done.returncode}\n{out[-3000:]}")
    variant.walls.append(wall)
    found = SESSION_TIME.findall(out.splitlines()[-1])
    variant.sessions.append(float(found[-1]) if found else float("nan"))
    collections = re.search(r"BENCH full_collections=(\d+)", out)
    variant.collections.append(int(collections.group(1)) if collections else -1)
    if report.exists():
        tests = json.loads(report.read_text())["tests"]
        variant.leaked.append(max((t["leaked_bytes"] for t in tests), default=0))
        report.unlink()


def measure(workload: Workload, repeats: int, root: Path) -> None:
    project = root / workload.name
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST)
    (project / f"test_{workload.name.replace('-', '_')}.py").write_text(workload.tests)
    # ct_session builds the tiny model on the default device: the GPU where there is one.
    (project / "tiny.yaml").write_text(TINY_CONFIG)
    everyone = [workload.baseline, *workload.variants]
    for variant in everyone:
        if workload.name == "attribution":
            variant.args = [*variant.args, "--ct-config", "tiny.yaml"]
    for _ in range(repeats):
        for variant in everyone:  # alternating, so that drifts hit every variant alike
            run_variant(project, variant, project / "report.json")


def table(workload: Workload) -> list[str]:
    base_wall = statistics.median(workload.baseline.walls)
    base_session = statistics.median(workload.baseline.sessions)
    lines = [
        f"### {workload.name}: {workload.count} tests",
        "",
        "| variant | wall s (median) | ratio | session s (median) | ratio | full collections "
        "| max leaked bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in [workload.baseline, *workload.variants]:
        wall = statistics.median(variant.walls)
        session = statistics.median(variant.sessions)
        leaked = max(variant.leaked) if variant.leaked else "-"
        lines.append(
            f"| {variant.name} | {wall:.2f} ({', '.join(f'{w:.2f}' for w in variant.walls)}) "
            f"| {wall / base_wall:.3f} | {session:.2f} | {session / base_session:.3f} "
            f"| {statistics.median(variant.collections):g} | {leaked} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="small-cuda,attribution,small-cpu")
    parser.add_argument("--out", type=Path, help="also write the Markdown tables here")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    wanted = set(args.workloads.split(","))
    lines = [
        f"cleanup cost: {torch.cuda.get_device_name(0) if cuda else 'no CUDA'}, "
        f"torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, {args.repeats} repeats",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="ct-cleanup-bench-") as tmp:
        for workload in workloads():
            if workload.name not in wanted:
                continue
            if workload.needs_cuda and not cuda:
                lines += [f"### {workload.name}: skipped, no CUDA", ""]
                continue
            measure(workload, args.repeats, Path(tmp))
            lines += [*table(workload), ""]
            print("\n".join(table(workload)), flush=True)
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
