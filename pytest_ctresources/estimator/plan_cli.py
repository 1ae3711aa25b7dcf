"""``ct-resources plan``: the plan of a pytest run before it runs (``pytest --ct-plan``).

Collects the tests in this process (pytest's ``--collect-only`` with ``--ct-plan``; the
project's conftests and test modules are imported as collection imports them) and prints
which tests run on which GPU, which skip and why, and the predicted wall time from the
durations learned in earlier runs; ``--json`` for tools. Arguments after ``--`` go to pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import IO, Any

import pytest


def add_plan_parser(commands: Any) -> None:
    """The ``plan`` subcommand of ``ct-resources``."""
    plan = commands.add_parser(
        "plan", help="which tests would run on which GPU, which skip, the predicted wall time"
    )
    plan.add_argument(
        "--gpus",
        default="detected",
        metavar="GPUS",
        help="2x80,4x24, or names (H200, A100-80GB, RTX-4090); default the GPUs detected",
    )
    plan.add_argument("--workers-per-gpu", type=int, default=1, metavar="N", help="default 1")
    plan.add_argument("--json", action="store_true", help="one JSON object")
    plan.add_argument("pytest_args", nargs="*", help="pytest arguments (after --)")


class _Grab:
    """Takes the plan out of the run's stash before its config goes."""

    def __init__(self) -> None:
        self.plan: Any = None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from pytest_ctresources.xdist.plan_hooks import PLAN_KEY

        self.plan = session.config.stash.get(PLAN_KEY, None)


def run_plan(args: argparse.Namespace, out: IO[str]) -> int:
    from pytest_ctresources.xdist.plan import parse_gpus

    if args.workers_per_gpu < 1:
        raise ValueError("--workers-per-gpu must be at least 1")
    if args.gpus.strip().lower() != "detected":
        parse_gpus(args.gpus)  # a bad list is the command's error, not pytest's
    grab = _Grab()
    pytest_args = [
        *args.pytest_args,
        "--ct-plan",
        args.gpus,
        "--ct-plan-workers",
        str(args.workers_per_gpu),
        "-q",
        "-p",
        "no:xdist",
    ]
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        status = pytest.main(pytest_args, plugins=[grab])
    if grab.plan is None:
        sys.stderr.write(captured.getvalue())
        return int(status) or 1
    if args.json:
        json.dump(grab.plan.to_dict(), out, indent=2)
        out.write("\n")
    else:
        out.write("\n".join(grab.plan.lines()) + "\n")
    return 0
