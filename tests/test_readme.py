"""The docs quote the estimator (its guidance table and sample output) and list every setting:
both must be current. The README's walkthrough of a first project runs as printed."""

from __future__ import annotations

import html
import itertools
import json
import re
import shlex
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from pytest_ctresources.estimator.cli import main

# Projects run with --nbmake (tests/conftest.py turns nbmake off elsewhere).
pytestmark = pytest.mark.nbmake

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


def settings_rows(docs_prefix: str) -> list[str]:
    """The settings table's rows, from the declarations (``settings/options.py``); links to
    the docs start with ``docs_prefix`` (the README's ``docs/``, the docs pages' nothing)."""
    from pytest_ctresources.settings.options import SETTINGS

    rows = []
    for setting in SETTINGS:
        option = ""
        if setting.option:
            value = setting.metavar.replace("|", "\\|")
            if setting.const is not None:
                value = f"[{value}]"
            option = f"`{setting.option} {value}`" if value else f"`{setting.option}`"
        ini = f"`{setting.ini}`" if setting.ini else ""
        env = f"`{setting.env}`" if setting.env else ""
        meaning = setting.markdown().replace("](docs/", f"]({docs_prefix}")
        rows.append(f"| {option} | {ini} | {env} | {meaning} |")
    return rows


def test_the_settings_tables_are_the_declarations(pytester: pytest.Pytester) -> None:
    """The README's and the configuration page's settings tables are what the declarations
    render, row for row, and every option and ini key ``pytest --help`` lists is one."""
    for name, page in SETTINGS_PAGES.items():
        start = page.index("## Settings and where they come from")
        table = page[start : page.index("For one option the highest layer wins", start)]
        rows = [line for line in table.splitlines() if line.startswith("|")][2:]
        expected = settings_rows("docs/" if name == "README.md" else "")
        assert rows == expected, f"{name}: its table should read\n" + "\n".join(expected)
    helped = pytester.runpytest("--help").stdout.str()
    options = set(re.findall(r"^\s+(--ct-[a-z-]+)", helped, re.M))
    ini_keys = set(re.findall(r"^\s+(ct_[a-z_]+) \(", helped, re.M))
    assert len(options) > 10 and len(ini_keys) > 10
    table = "\n".join(settings_rows(""))
    assert {o for o in options if f"`{o}" not in table} == set()
    assert {k for k in ini_keys if f"`{k}`" not in table} == set()


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


#: The README's walkthrough of a first project: its files, its runs and what they print.
WALKTHROUGH = README[README.index("## Five minutes") : README.index("## Settings and where")]
#: A file the walkthrough prints: a paragraph that ends with its path (`` `path`: ``), then
#: the file in a fenced block.
PRINTED_FILE = re.compile(r"`([\w./-]+)`:\n\n```\w+\n(.*?)```", re.S)
#: The Jupyter kernel a notebook made in Jupyter names.
PYTHON3_KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def notebook_of_percent_script(script: str) -> nbformat.NotebookNode:
    """The notebook that a script in jupytext's percent format stands for: each ``# %%`` line
    starts a code cell, with the tags it gives (``# %% tags=["parameters"]``)."""
    nb = new_notebook(metadata={"kernelspec": PYTHON3_KERNEL})
    for cell in re.split(r"^(?=# %%)", script, flags=re.M)[1:]:
        marker, _, source = cell.partition("\n")
        tags = re.fullmatch(r"# %%(?: tags=(\[.*\]))?", marker)
        assert tags is not None, marker
        metadata = {"tags": json.loads(tags[1])} if tags[1] else {}
        nb.cells.append(new_code_cell(source.strip("\n"), metadata=metadata))
    return nb


def build_the_walkthrough_project(pytester: pytest.Pytester) -> None:
    """The files the walkthrough prints, as printed, in the pytester project; the notebook
    made from its cells."""
    files = dict(PRINTED_FILE.findall(WALKTHROUGH))
    assert sorted(files) == [
        "experiments/tiny.yaml",
        "notebooks/capital.ipynb",
        "pyproject.toml",
        "tests/test_circuits.py",
    ]
    for name, text in files.items():
        path = pytester.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".ipynb":
            nbformat.write(notebook_of_percent_script(text), path)
        else:
            path.write_text(text)


def _words(text: str) -> str:
    """``text`` with each run of white space one space: lines folded at any width compare."""
    return " ".join(text.split())


def test_the_five_minute_example_runs_as_shown(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walkthrough's project, its files as printed, under ``pytest -v`` on a machine
    without a GPU: two tests pass, the one that needs 20 GiB is skipped, and the output
    shown is what it prints, in order (``...``: lines left out; the project's path for
    ``/tmp/myproj``)."""
    build_the_walkthrough_project(pytester)
    monkeypatch.setenv("CT_FAKE_GPUS", "")  # no GPU, whatever the machine has
    monkeypatch.setenv("COLUMNS", "80")  # as shown: pytest's own lines are cut to the width
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2, skipped=1)
    shown = re.search(r"```text\n(.*?)```", WALKTHROUGH, re.S)
    assert shown is not None
    printed = _words(result.stdout.str())
    position = 0
    for part in re.split(r"^\.\.\.$", shown[1], flags=re.M):
        expected = _words(part.replace("/tmp/myproj", str(pytester.path)))
        found = printed.find(expected, position)
        assert found >= 0, f"not printed (after what came before it): {expected}"
        position = found + len(expected)


#: The keys of the plugin's four columns in pytest-html's results table (report/html.py).
VRAM_COLUMNS = ("ctPeakAllocated", "ctPeakReserved", "ctDeclaredNeed", "ctLeaked")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_walkthroughs_ci_command_runs_it_all_and_writes_the_reports(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walkthrough's CI command, as printed (its environment assignment set here), in a
    subprocess, since ``-n 2`` starts workers, on a machine without a GPU: the two tests and
    the notebook pass with the config's values, the big test is skipped, and each report
    file is what the README says it is."""
    notebook = "notebooks/capital.ipynb::capital.ipynb"
    assert f"`{notebook}`" in WALKTHROUGH  # the README names the notebook's item
    tests = [
        f"tests/test_circuits.py::{name}" for name in ("test_capital_circuit", "test_smaller_graph")
    ]
    big = "tests/test_circuits.py::test_needs_a_big_gpu"
    build_the_walkthrough_project(pytester)
    notebook_file = (pytester.path / "notebooks" / "capital.ipynb").read_bytes()
    (command,) = re.findall(r"```bash\n(.*?)\n```", WALKTHROUGH, re.S)
    argv = shlex.split(command)
    while re.fullmatch(r"[A-Z_]+=.*", argv[0]):
        name, _, value = argv.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    assert argv[0] == "pytest" and {"--nbmake", "-n"} <= set(argv), argv
    # No GPU, whatever the machine has: the plugin sees none, and nor do torch in the
    # workers and the notebook's kernel (this process's torch is left alone).
    monkeypatch.setenv("CT_FAKE_GPUS", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # The report files the command names, each described in the README's list of them.
    json_path, plot_path, html_path = (
        argv[argv.index(option) + 1]
        for option in ("--ct-report-json", "--ct-report-plot", "--html")
    )
    for path in (json_path, plot_path, html_path):
        assert f"- `{path}`: " in WALKTHROUGH, path
    result = pytester.runpytest_subprocess(*argv[1:], timeout=300)
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "2 workers [[]4 items[]]",
            f"wrote the JSON report: {json_path}",
            f"wrote the VRAM plot: {plot_path}",
        ]
    )
    # The values were injected in memory: the notebook on disk is as it was written.
    assert (pytester.path / "notebooks" / "capital.ipynb").read_bytes() == notebook_file

    report = json.loads((pytester.path / json_path).read_text())
    assert report["schema"] == "pytest-ctresources-report" and report["exitstatus"] == 0
    assert report["settings"]["config"]["batch_size"] == {
        "value": 32,
        "source": f"BATCH_SIZE in {pytester.path / 'experiments' / 'tiny.yaml'}",
    }
    assert report["tests"] == []  # the VRAM figures: no test used CUDA
    assert sorted(report["attributions"]) == sorted(tests)
    assert sorted(report["attribution_timings"]) == sorted(tests)
    assert report["vram_skips"] == {big: "needs 20.0 GiB VRAM; no CUDA GPU detected"}
    injected = {value["name"]: value for value in report["notebook_values"][notebook]}
    assert {name: value["value"] for name, value in injected.items()} == {
        "MODEL_NAME": "'ctresources/tiny-gemma-2'",
        "TRANSCODER_SET": "'ctresources/random-jumprelu'",
        "BATCH_SIZE": "32",
        "MAX_FEATURE_NODES": "48",
        "PROMPT": "'the capital of france is'",
    }
    assert {value["injected"] for value in injected.values()} == {"after_parameters"}

    assert (pytester.path / plot_path).read_bytes().startswith(PNG_SIGNATURE)

    page = (pytester.path / html_path).read_text()
    blob = re.search(r'data-jsonblob="([^"]*)"', page)
    assert blob is not None
    rows = {test_id: row for test_id, (row,) in json.loads(html.unescape(blob[1]))["tests"].items()}
    assert {test_id: row["result"] for test_id, row in rows.items()} == {
        **dict.fromkeys([*tests, notebook], "Passed"),
        big: "Skipped",
    }
    assert all(row[key] == "" for row in rows.values() for key in VRAM_COLUMNS)  # no CUDA
    headings = re.findall(r'<th class="sortable" data-column-type="(ct\w+)">VRAM ', page)
    assert headings == list(VRAM_COLUMNS)
    # The plot, in the report's summary, above the results table.
    plot = page.index('<details class="ctresources-vram" open>')
    assert 'src="data:image/png;base64,' in page[plot:]
    assert plot < page.index('<table id="results-table">')


def _section(result: pytest.RunResult, title: str) -> list[str]:
    """The lines of the terminal section ``title`` (up to the next ``===`` line)."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if f" {title} " in line and "===" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("==="))
    return lines[start + 1 : end]


class DefaultVerbositySummary:
    """In the same run, the plugin's summary once more as a run without ``-v`` prints it: its
    reporter renders it again from the same results at verbosity 0, into these lines (one
    run of the example suite instead of two, each a kernel per notebook)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stats: dict[str, list[object]] = {}
        self.config: pytest.Config | None = None

    def section(self, title: str) -> None:
        self.lines.append(f"=== {title} ===")

    def write_line(self, line: str) -> None:
        self.lines.append(line)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(
        self, terminalreporter: pytest.TerminalReporter, config: pytest.Config
    ) -> None:
        reporter = config.pluginmanager.get_plugin("ctresources-summary")
        self.stats, self.config = terminalreporter.stats, config
        verbose = config.option.verbose
        config.option.verbose = 0
        try:
            reporter.pytest_terminal_summary(self)
        finally:
            config.option.verbose = verbose


def test_the_readme_example_run_prints_a_short_summary_and_v_keeps_the_details(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first set-up command's pytest run (the example suite on the bundled tiny model),
    as the README writes it: its -v keeps the values each notebook item ran with and the
    slowest attributions; the same run without -v prints a summary of at most 15 lines."""
    section = README[README.index("## Developing the plugin") :]
    command = next(line for line in section.splitlines() if "python -m pytest --nbmake" in line)
    args = shlex.split(command.split("python -m pytest", 1)[1].split("&&")[0])
    assert "-v" in args
    monkeypatch.chdir(ROOT)  # the repository's own ini, examples and configs
    default = DefaultVerbositySummary()
    # In-process; no cache: nothing is written into the repository.
    verbose = pytester.runpytest(
        *args, "-p", "no:cacheprovider", "-p", "no:randomly", plugins=[default]
    )
    assert verbose.ret == pytest.ExitCode.OK
    details = _section(verbose, "ctresources summary")
    assert "notebook items ran with" in "\n".join(details)
    assert "slowest attributions" in "\n".join(details)
    assert default.lines[0] == "=== ctresources summary ==="
    summary = default.lines[1:]
    assert 1 <= len(summary) <= 15, summary
    assert len(details) > len(summary)
    assert not any("slowest attributions" in line for line in summary)


def test_the_readme_is_a_front_page() -> None:
    """What it does, install, a first suite, the settings table, links: the rest is the
    documentation site's. Past 250 lines, move details to a page of docs/ and link it."""
    assert len(README.splitlines()) <= 250
