"""VRAM placement under pytest-xdist, end to end with fake GPUs (CT_FAKE_GPUS): a test goes
to a worker whose GPU holds it, and skips only where no GPU of the run does."""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import pytest_ctresources

pytest.importorskip("xdist")

SIZES_TEST = """
import json, os, time, pytest

@pytest.mark.parametrize("gib", [
    pytest.param(gib, marks=pytest.mark.vram(gib=gib), id=f"{gib}GiB")
    for gib in (10, 20, 30, 60, 90)
])
def test_size(gib):
    with open(f"ran-{gib}.json", "w") as handle:
        json.dump({"worker": os.environ["PYTEST_XDIST_WORKER"],
                   "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "fake": os.environ["CT_FAKE_GPUS"], "start": time.monotonic()}, handle)
    # Holding the lease a moment, so that tests on one card overlap often enough for the
    # check below to see an over-commit; no one waits for it, and no check needs an overlap.
    time.sleep(0.05)
    with open(f"ran-{gib}.json") as handle:
        data = json.load(handle)
    data["end"] = time.monotonic()
    with open(f"ran-{gib}.json", "w") as handle:
        json.dump(data, handle)

def test_no_need():
    pass
"""

#: Fake GPU UUIDs by capacity (CT_FAKE_GPUS "Small=24;Big=80").
CARD = {"GPU-fake-0": 24, "GPU-fake-1": 80}


def placed(*roots: Path) -> dict[int, dict[str, Any]]:
    return {
        int(path.stem.removeprefix("ran-")): json.loads(path.read_text())
        for root in roots
        for path in root.rglob("ran-*.json")
    }


def card_of(where: dict[str, Any]) -> tuple[str, int]:
    """The card a test ran on: (its host's fake list, the card's GiB)."""
    if ";" not in where["fake"]:  # a host with one card
        return where["fake"], int(where["fake"].partition("=")[2])
    return where["visible"], CARD[where["visible"]]


def check_sizes(pytester: pytest.Pytester, result: pytest.RunResult, *hosts: Path) -> None:
    result.assert_outcomes(passed=5, skipped=1)
    ran = placed(pytester.path, *hosts)
    assert sorted(ran) == [10, 20, 30, 60]
    for gib, where in ran.items():
        assert gib <= card_of(where)[1], (gib, where)  # nothing ran where it did not fit
        # The tests running at its start, on its card, lease no more than the card holds.
        beside = [
            other
            for other, span in ran.items()
            if card_of(span) == card_of(where) and span["start"] <= where["start"] < span["end"]
        ]
        assert sum(beside) <= card_of(where)[1], (gib, beside)
    assert card_of(ran[30])[1] == 80 and card_of(ran[60])[1] == 80
    result.stdout.fnmatch_lines(
        ["*SKIPPED*needs 90.0 GiB VRAM; GPU 0 (Big) has 80.0 GiB, the largest GPU in this run"]
    )
    report = json.loads((pytester.path / "r.json").read_text())
    why = {
        p["nodeid"].split("[")[-1].rstrip("]"): p["placed_because"] for p in report["placements"]
    }
    # The Big card is GPU 1 of a host with both, GPU 0 of a host of its own.
    assert re.match(r"needs 30\.0 GiB: only GPU [01] \(Big\) hold\(s\) it", why["30GiB"])
    assert why["10GiB"].startswith("fits every GPU")
    assert why["90GiB"] == "too big for every GPU: sent to the largest, which skips it"
    result.stdout.fnmatch_lines(
        [
            "  placed by VRAM: 2 test(s) on the only GPUs that hold them, 3 that fit every GPU, "
            "1 too big for every GPU (skipped on the largest); * packed beside other workers' tests"
        ]
    )


def test_tests_go_to_a_gpu_that_holds_them_and_skip_only_where_none_does(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # -n 4 over a 24 and an 80 GiB card: two workers each (round-robin binding).
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=24;Big=80")
    pytester.makepyfile(SIZES_TEST)
    # -v: the placement block is a detail where no test waited, and waits depend on timing.
    result = pytester.runpytest_subprocess("-n", "4", "-rs", "-v", "--ct-report-json", "r.json")
    check_sizes(pytester, result)


def test_workers_with_their_own_environment_report_their_own_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each --tx group sees one card (CUDA_VISIBLE_DEVICES in its own environment).
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=24;Big=80")
    pytester.makepyfile(SIZES_TEST)
    result = pytester.runpytest_subprocess(
        "--tx",
        "2*popen//env:CUDA_VISIBLE_DEVICES=0",
        "--tx",
        "2*popen//env:CUDA_VISIBLE_DEVICES=1",
        "--dist",
        "load",
        "-rs",
        "-v",  # the placement block is a detail where no test waited (timing decides)
        "--ct-report-json",
        "r.json",
    )
    check_sizes(pytester, result)


# execnet's socket server prints this once it listens (on the free port the OS gave it).
READY = re.compile(r"Entering Accept loop \('127\.0\.0\.1', (\d+)\)")


def socket_server(host: Path, fake_gpus: str, request: pytest.FixtureRequest) -> int:
    """Start execnet's socket server as a host of its own: in ``host``, seeing ``fake_gpus``,
    its ledger in ``host`` (TMPDIR: the hosts share no lease budget); killed at the test's
    end. Returns its port, read from its readiness line within a deadline."""
    checkout = str(Path(pytest_ctresources.__file__).parent.parent)
    env = {
        **os.environ,
        "CT_FAKE_GPUS": fake_gpus,
        "TMPDIR": str(host),
        "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")]),
    }
    server = subprocess.Popen(
        # As a module: run as a script, its directory would come first on sys.path and its
        # name shadow the standard library's socketserver (logging.config imports it).
        [sys.executable, "-u", "-m", "execnet.script.socketserver", "127.0.0.1:0"],
        cwd=host,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    request.addfinalizer(lambda: (server.kill(), server.wait()))
    assert server.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 60
    with selectors.DefaultSelector() as selector:
        selector.register(server.stdout, selectors.EVENT_READ)
        while not (match := READY.search(seen[-1] if seen else "")):
            left = deadline - time.monotonic()
            assert left > 0 and selector.select(left), f"no readiness line: {seen}"
            line = server.stdout.readline()
            assert line, f"the socket server ended: {seen}"
            seen.append(line)
    # Keep reading what the worker running inside it prints, so that no pipe fills.
    threading.Thread(target=server.stdout.read, daemon=True).start()
    return int(match.group(1))


def test_socket_workers_on_hosts_of_their_own_report_their_own_gpu(
    pytester: pytest.Pytester,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> None:
    # Two "hosts" (a 24 and an 80 GiB card), two socket= workers each. A socket worker runs in
    # the server's process, with the server's environment and directory, not the controller's:
    # xdist rsyncs the project (--rsyncdir) into the host's pyexecnetcache/ and runs it there.
    # Subprocess: the controller must not see the workers' fake GPUs.
    pytester.makepyfile(SIZES_TEST)
    hosts = [tmp_path_factory.mktemp(name) for name in ("small", "big")]
    tx = [
        f"socket=127.0.0.1:{socket_server(host, fake, request)}"
        for host, fake in zip(hosts, ("Small=24", "Big=80"), strict=True)
        for _worker in range(2)
    ]
    result = pytester.runpytest_subprocess(
        *[arg for spec in tx for arg in ("--tx", spec)],
        "--dist",
        "load",
        "--rsyncdir",
        str(pytester.path),
        "-rs",
        "-v",  # the placement block is a detail where no test waited (docs/vram-report.md)
        "--ct-report-json",
        "r.json",
        *[str(path) for path in pytester.path.glob("test_*.py")],  # xdist: relative to --rsyncdir
    )
    check_sizes(pytester, result, *hosts)


def test_other_dist_modes_keep_xdists_own_scheduler(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Small=24;Big=80")
    pytester.makepyfile(SIZES_TEST)
    result = pytester.runpytest_subprocess(
        "-n", "4", "--dist", "loadfile", "-rs", "--ct-report-json", "r.json"
    )
    assert "the largest GPU in this run" not in result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    assert all(p["placed_because"] is None for p in report["placements"])
