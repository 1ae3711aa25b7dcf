"""The docs quote the estimator (its guidance table and sample output) and list every setting:
both must be current."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest

from pytest_ctresources.estimator.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: The page that quotes `ct-resources`: its table, sample estimates and errors.
ESTIMATOR_PAGE = (ROOT / "docs" / "estimator-cli.md").read_text()
#: The pages with the settings table.
SETTINGS_PAGES = {
    "README.md": README,
    "docs/configuration.md": (ROOT / "docs" / "configuration.md").read_text(),
}


def output_of(capsys: pytest.CaptureFixture[str], command: str) -> str:
    argv = shlex.split(command)
    assert argv[0] == "ct-resources"
    assert main(argv[1:]) == 0
    return capsys.readouterr().out


def test_guidance_table_is_what_ct_resources_table_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = output_of(capsys, "ct-resources table")
    assert table.strip() in ESTIMATOR_PAGE, "regenerate the table with `ct-resources table`"


def test_sample_estimates_are_current(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every text block that is one ``$ ct-resources estimate ...`` and its output."""
    monkeypatch.chdir(ROOT)  # the commands name example_configs/ relative to the repo
    marker = "```text\n$ ct-resources estimate "
    starts = [found.start() for found in re.finditer(re.escape(marker), ESTIMATOR_PAGE)]
    assert len(starts) >= 2
    for start in starts:
        block = ESTIMATOR_PAGE[
            start + len("```text\n") : ESTIMATOR_PAGE.index("```", start + len(marker))
        ]
        command, _, shown = block.partition("\n")
        assert output_of(capsys, command.removeprefix("$ ")).strip() == shown.strip(), command


def test_sample_errors_are_current(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ``$ ct-resources ...`` line the page follows with an error is answered so."""
    monkeypatch.setenv("CT_FAKE_GPUS", "")  # no GPU, whatever the machine has
    lines = [line.strip() for line in ESTIMATOR_PAGE.splitlines()]
    samples = [
        (command.removeprefix("$ "), answer)
        for command, answer in itertools.pairwise(lines)
        if command.startswith("$ ct-resources ") and answer.startswith("ct-resources: error: ")
    ]
    assert len(samples) >= 3
    for command, answer in samples:
        with pytest.raises(SystemExit):
            main(shlex.split(command)[1:])
        assert capsys.readouterr().err.strip() == answer, command


pytest_plugins = ["pytester"]


def test_every_option_and_ini_key_is_in_the_settings_table(pytester: pytest.Pytester) -> None:
    """What ``pytest --help`` lists of the plugin's is in the settings table of the README
    and of the configuration page."""
    helped = pytester.runpytest("--help").stdout.str()
    options = set(re.findall(r"^\s+(--ct-[a-z-]+)", helped, re.M))
    ini_keys = set(re.findall(r"^\s+(ct_[a-z_]+) \(", helped, re.M))
    assert len(options) > 10 and len(ini_keys) > 10
    for name, page in SETTINGS_PAGES.items():
        start = page.index("## Settings and where they come from")
        table = page[start : page.index("For one option the highest layer wins", start)]
        rows = [line for line in table.splitlines() if line.startswith("|")]
        missing_options = {opt for opt in options if not any(f"`{opt}" in row for row in rows)}
        missing_ini = {key for key in ini_keys if not any(f"`{key}`" in row for row in rows)}
        assert (missing_options, missing_ini) == (set(), set()), name


def test_the_set_up_commands_are_what_ci_runs() -> None:
    """The README's two set-up commands: its pytest runs are lines of .ci/run, and its pip
    installs install what .ci/run's do (the same pins and extras)."""
    section = README[README.index("## Developing the plugin") :]
    start = section.index("```bash\n") + len("```bash\n")
    lines = section[start : section.index("```", start)].splitlines()
    commands = [
        part.strip()
        for line in lines
        if line and not line.startswith("#")
        for part in line.split(" && ")
    ]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    runs = [command for command in commands if "python -m pytest" in command]
    assert len(runs) == 2 and all(command in ci for command in runs), runs
    installs = [c.split("pip install ", 1)[1] for c in commands if "pip install " in c]
    ci_installs = [line.split("pip install -q ", 1)[1] for line in ci if "install -q -c " in line]
    assert installs == ci_installs


def test_the_five_minute_example_runs_as_shown(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's first experiment suite, its files as printed: two tests pass, the one
    that needs 20 GiB is skipped with the reason shown, on a machine without a GPU."""
    section = README[README.index("## Five minutes") : README.index("## Settings and where")]
    blocks = dict(re.findall(r"```(yaml|python|toml)\n(.*?)```", section, re.S))
    pytester.makefile(".yaml", **{"experiments/tiny": blocks["yaml"]})
    pytester.makefile(".py", **{"tests/test_circuits": blocks["python"]})
    pytester.makepyprojecttoml(blocks["toml"])
    monkeypatch.setenv("CT_FAKE_GPUS", "")  # no GPU, whatever the machine has
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "skipped for VRAM: 1 test(s)",
            "  tests/test_circuits.py::test_needs_a_big_gpu: needs 20.0 GiB VRAM; no CUDA GPU*",
            "attributions: 2 in 2 test(s), batch size(s) 32",
        ]
    )


def _section(result: pytest.RunResult, title: str) -> list[str]:
    """The lines of the terminal section ``title`` (up to the next ``===`` line)."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if f" {title} " in line and "===" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("==="))
    return lines[start + 1 : end]


def test_the_readme_example_run_prints_a_short_summary_and_v_keeps_the_details(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first set-up command's pytest run (the example suite on the bundled tiny model),
    as the README writes it: by default a summary of at most 15 lines; its -v keeps the
    values each notebook item ran with and the slowest attributions."""
    section = README[README.index("## Developing the plugin") :]
    command = next(line for line in section.splitlines() if "python -m pytest --nbmake" in line)
    args = shlex.split(command.split("python -m pytest", 1)[1].split("&&")[0])
    assert "-v" in args
    monkeypatch.chdir(ROOT)  # the repository's own ini, examples and configs
    quiet = [arg for arg in args if arg != "-v"]
    # In-process; no cache: nothing is written into the repository.
    default = pytester.runpytest(*quiet, "-p", "no:cacheprovider", "-p", "no:randomly")
    assert default.ret == pytest.ExitCode.OK
    summary = _section(default, "ctresources summary")
    assert 1 <= len(summary) <= 15, summary
    verbose = pytester.runpytest(*args, "-p", "no:cacheprovider", "-p", "no:randomly")
    assert verbose.ret == pytest.ExitCode.OK
    details = "\n".join(_section(verbose, "ctresources summary"))
    assert "notebook items ran with" in details and "slowest attributions" in details
    assert len(details.splitlines()) > len(summary)
