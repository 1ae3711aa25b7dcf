"""What the plugin's per-test work costs, side by side with the plugin off, in one run.

Three workloads, the ones users run:

- ``small-cuda``: 200 tests that each allocate one small CUDA tensor, in a process that
  imported torch, transformers and circuit_tracer (a realistic heap for a garbage collection);
  the plugin against ``-p no:ctresources``.
- ``attribution``: 60 ``ct_session.attribute()`` calls on the bundled tiny model on the GPU;
  the default cleanup against ``ct_cleanup = never`` (``ct_session`` needs the plugin).
- ``small-cpu``: 200 small CPU tests in a process that imported the same libraries, under
  ``ct_cleanup = always`` against ``-p no:ctresources``.

Each variant first runs once unmeasured (its learned needs then make the plugin take a VRAM
lease per test, as in a user's second run). Each run is a fresh pytest process forked from
this script after it imported torch,
transformers and circuit_tracer (never initialising CUDA), so a run costs what pytest and the
tests cost, not seconds of imports: the heap each run's garbage collections walk is the one a
user's process has, while twenty runs fit where five would. Variants alternate, each run
``--repeats`` times; the table gives medians of each run's wall time (fork to exit: pytest's
start-up, collection, the tests, the summary; the imports a user's process also pays come on
top, so the ratios here are the stricter ones) and of the session time pytest reports, with
each ratio to the workload's baseline. Other
cleanup policies (``CleanupPolicy`` in pytest_ctresources/gpu/cleanup_between_tests.py) are
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

CONFTEST = """
import gc, json, os, sys

import torch
import transformers  # noqa: F401  (the heap users' suites have; imported by the bench already)
import circuit_tracer  # noqa: F401

_policy = os.environ.get("BENCH_CLEANUP_POLICY")
if _policy:
    import pytest_ctresources.gpu.cleanup_between_tests as _between
    _between.POLICY = _between.CleanupPolicy(**json.loads(_policy))

FULL = [0]

def _count(phase, info):
    if phase == "start" and info["generation"] == 2:
        FULL[0] += 1

def pytest_sessionstart(session):
    gc.callbacks.append(_count)

def pytest_sessionfinish(session):
    print(f"\\nBENCH full_collections={FULL[0]}")
"""

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
    before = "every test, no freeze (before)"
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
                *[Variant(before, [], policy=POLICIES[before]) for _ in (1,) if before in POLICIES],
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
                *[
                    Variant(
                        "always, no freeze (before)", [], "ct_cleanup = always", {"freeze": False}
                    )
                    for _ in (1,)
                    if before in POLICIES
                ],
            ],
        ),
    ]


SESSION_TIME = re.compile(r" in ([0-9.]+)s")


def run_variant(project: Path, variant: Variant, report: Path) -> None:
    """One pytest run of ``variant``, forked from this process (see the module docstring)."""
    (project / "pytest.ini").write_text(f"[pytest]\n{variant.ini}\n")
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if variant.policy is not None:
        env["BENCH_CLEANUP_POLICY"] = json.dumps(variant.policy)
    # pytest's cache stays on: the needs it learns make later runs take a VRAM lease per test,
    # a per-test cost of the plugin too (every variant gets one unmeasured run first).
    args = ["-q", "-p", "no:randomly", *variant.args]
    if "no:ctresources" not in variant.args:
        args += ["--ct-report-json", str(report)]
    log = project / "run.log"
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: a pytest process like any other, but with the imports done
        code = 1
        try:
            os.chdir(project)
            os.environ.pop("BENCH_CLEANUP_POLICY", None)
            os.environ.update(env)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            code = int(pytest.main(args))
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    wall = time.perf_counter() - began
    out = log.read_text()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{variant.name}: pytest exited {status}\n{out[-3000:]}")
    variant.walls.append(wall)
    found = SESSION_TIME.findall(out.strip().splitlines()[-1])
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
    for variant in everyone:  # warm-up: learned needs in the cache, files in the page cache
        run_variant(project, variant, project / "report.json")
        variant.walls.clear(), variant.sessions.clear(), variant.collections.clear()
        variant.leaked.clear()
    for _ in range(repeats):
        for variant in everyone:  # alternating, so that drifts hit every variant alike
            run_variant(project, variant, project / "report.json")


def table(workload: Workload, imports_s: float) -> list[str]:
    """``imports_s``: what importing torch, transformers and circuit_tracer took here, which
    a user's process pays on top of a forked run's wall time."""
    base_wall = statistics.median(workload.baseline.walls)
    base_session = statistics.median(workload.baseline.sessions)
    lines = [
        f"### {workload.name}: {workload.count} tests",
        "",
        "| variant | run wall s, median (all) | ratio | with the imports' "
        f"{imports_s:.1f} s: ratio | session s (median) | ratio | full collections "
        "| max leaked bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in [workload.baseline, *workload.variants]:
        wall = statistics.median(variant.walls)
        session = statistics.median(variant.sessions)
        leaked = max(variant.leaked) if variant.leaked else "-"
        lines.append(
            f"| {variant.name} | {wall:.2f} ({', '.join(f'{w:.2f}' for w in variant.walls)}) "
            f"| {wall / base_wall:.3f} | {(wall + imports_s) / (base_wall + imports_s):.3f} "
            f"| {session:.2f} | {session / base_session:.3f} "
            f"| {statistics.median(variant.collections):g} | {leaked} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="small-cuda,attribution,small-cpu")
    parser.add_argument(
        "--policies",
        default="all",
        help="'all', 'none', or the alternative policies to measure, comma-separated",
    )
    parser.add_argument("--out", type=Path, help="also write the Markdown tables here")
    args = parser.parse_args()
    if args.policies != "all":
        keep = set() if args.policies == "none" else set(args.policies.split(","))
        for name in list(POLICIES):
            if name not in keep:
                del POLICIES[name]
    # The heap of a user's process, imported once here and shared by every forked run.
    # CUDA is detected through NVML: initialising it here would break it in the children.
    began = time.perf_counter()
    import circuit_tracer  # noqa: F401
    import torch
    import transformers  # noqa: F401

    imports_s = time.perf_counter() - began

    from pytest_ctresources.gpu.detect import detect_gpus

    gpu = detect_gpus(torch_fallback=False).gpu(0)
    cuda = gpu is not None
    wanted = set(args.workloads.split(","))
    lines = [
        f"cleanup cost: {gpu.name if gpu else 'no CUDA GPU'}, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.repeats} repeats; "
        f"command: python bench/cleanup_cost.py {' '.join(sys.argv[1:])}",
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
            lines += [*table(workload, imports_s), ""]
            print("\n".join(table(workload, imports_s)), flush=True)
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
