"""``@pytest.mark.ct_parametrize``: tests parametrized from an experiment config's ``PARAMS``:
ids from the values, the same items under xdist, bad references in one line naming the
config and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_ctresources.settings.parametrize import (
    MAX_ID,
    ParametrizeError,
    ParamsReference,
    parameter_sets,
    split_argnames,
    value_id,
)

pytest_plugins = ["pytester"]

EXPERIMENT = """\
MODEL_NAME: ctresources/tiny-gemma-2
PARAMS:
  PROMPT: the capital of france is
  PROMPTS:
    - the capital of france is
    - "the big red city was: a test"
  TEMPERATURES: [0.5, -1, 2]
  CASES:
    - {prompt: the capital of france is, target: paris}
    - [the capital of spain is, madrid]
"""

PER_PROMPT = """
import pytest

@pytest.mark.ct_parametrize("prompt", "PROMPTS")
def test_prompt(prompt, ct_config):
    assert prompt in ct_config.params["PROMPTS"]
"""


# --- the pure part ------------------------------------------------------------------------


def test_one_name_makes_a_test_per_element_with_ids_from_the_values() -> None:
    params = {"PROMPTS": ["the capital of france is", "x"], "TEMPERATURES": [0.5, -1, True]}
    sets = parameter_sets(ParamsReference(("prompt",), "PROMPTS"), "exp.yaml", params)
    assert sets.argvalues == ["the capital of france is", "x"]
    assert sets.ids == ["the-capital-of-france-is", "x"]
    numbers = parameter_sets(ParamsReference(("t",), "TEMPERATURES"), "exp.yaml", params)
    assert numbers.ids == ["0.5", "-1", "True"]


def test_several_names_take_lists_or_mappings() -> None:
    params = {"CASES": [{"prompt": "a b", "target": "c"}, ["d", "e"]]}
    sets = parameter_sets(ParamsReference(("prompt", "target"), "CASES"), "exp.yaml", params)
    assert sets.argvalues == [("a b", "c"), ("d", "e")]
    assert sets.ids == ["a-b-c", "d-e"]


def test_each_test_gets_its_own_copy_of_a_value() -> None:
    shared = {"ROWS": [{"layers": [1, 2]}]}
    sets = parameter_sets(ParamsReference(("row",), "ROWS"), "exp.yaml", shared)
    sets.argvalues[0]["layers"].append(3)
    assert shared["ROWS"][0]["layers"] == [1, 2]


def test_ids_are_short_safe_and_deterministic() -> None:
    long_a = "the quick brown fox jumps over the lazy dog and then " + "a" * 50
    long_b = "the quick brown fox jumps over the lazy dog and then " + "b" * 50
    first, second = value_id(long_a, "P0"), value_id(long_b, "P1")
    assert len(first) <= MAX_ID and len(second) <= MAX_ID and first != second
    assert first == value_id(long_a, "P0")  # a digest, not the salted hash()
    assert value_id("über/../$(rm -rf)", "P0") == "ber-..-rm-rf"
    assert value_id("???", "P3") == "P3" and value_id({"a": 1}, "P4") == "P4"
    assert value_id(10**5000, "P5") == "P5"  # str() of it would raise


@pytest.mark.parametrize(
    ("params", "key", "names", "message"),
    [
        (
            {"PROMPTS": []},
            "PROMPTZ",
            ("prompt",),
            "exp.yaml: PARAMS has no key 'PROMPTZ' (did you mean PROMPTS?); its keys: PROMPTS",
        ),
        ({}, "PROMPTS", ("prompt",), "exp.yaml: PARAMS has no key 'PROMPTS'; its keys: none"),
        (
            # Keys are data: quoted escaped and short, the first ten listed (they were raw:
            # a newline, an escape sequence and 5000 characters reached the terminal).
            {"PROMPT\nS": 1, "x\x1b[31m": 2, "k" * 5000: 3, **{f"K{i}": i for i in range(10)}},
            "PROMPTS",
            ("prompt",),
            "exp.yaml: PARAMS has no key 'PROMPTS' (did you mean 'PROMPT\\nS'?); its keys: "
            f"'PROMPT\\nS', 'x\\x1b[31m', '{'k' * 17}...{'k' * 18}' (5000 characters), K0, K1, "
            "K2, K3, K4, K5, K6 and 3 more",
        ),
        (
            {"PROMPT": "a"},
            "PROMPT",
            ("prompt",),
            "exp.yaml: PARAMS PROMPT must be a list (one test per element), got str 'a'",
        ),
        (
            {"CASES": [["a"]]},
            "CASES",
            ("prompt", "target"),
            "exp.yaml: PARAMS CASES[0] must be a list of 2 values or a mapping with keys "
            "prompt, target, got ['a']",
        ),
        (
            {"CASES": [{"prompt": "a"}]},
            "CASES",
            ("prompt", "target"),
            "exp.yaml: PARAMS CASES[0] has no 'target' (a mapping needs a key per name: "
            "prompt, target)",
        ),
    ],
)
def test_a_bad_reference_is_one_line_naming_the_config_and_the_key(
    params: dict[str, object], key: str, names: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ParametrizeError) as caught:
        parameter_sets(ParamsReference(names, key), "exp.yaml", params)
    assert str(caught.value) == message


def test_argnames_are_read_as_pytests_parametrize_reads_them() -> None:
    assert split_argnames("prompt") == ("prompt",)
    assert split_argnames(" prompt, target ") == ("prompt", "target")
    assert split_argnames(["prompt", "target"]) == ("prompt", "target")
    for bad in ("", "a b", ["a", "a"], 3):
        with pytest.raises(ValueError):
            split_argnames(bad)  # type: ignore[arg-type]


# --- through pytest -----------------------------------------------------------------------


def test_the_sessions_config_parametrizes_a_test_per_prompt(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=EXPERIMENT)
    pytester.makeini("[pytest]\nct_config = exp.yaml\n")
    pytester.makepyfile(test_prompts=PER_PROMPT)
    collected = pytester.runpytest("--collect-only", "-q", "-p", "no:randomly")
    assert {
        "test_prompts.py::test_prompt[the-capital-of-france-is]",
        "test_prompts.py::test_prompt[the-big-red-city-was-a-test]",
    } <= set(collected.stdout.lines)
    result = pytester.runpytest("-k", "big-red", "-p", "no:randomly")
    result.assert_outcomes(passed=1, deselected=1)
    assert "ct_parametrize" in pytester.runpytest("--markers").stdout.str()


def test_path_names_a_yaml_beside_the_test_and_the_plugin_acts_for_it(
    pytester: pytest.Pytester,
) -> None:
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "own.yaml").write_text(EXPERIMENT)
    pytester.makepyfile(
        **{
            "tests/test_cases": """
import pytest

pytestmark = pytest.mark.ct_parametrize("temperature", "TEMPERATURES", path="own.yaml")

@pytest.mark.ct_parametrize("prompt, target", "CASES", path="own.yaml")
def test_case(prompt, target, temperature):
    assert (prompt, target) in [("the capital of france is", "paris"),
                                ("the capital of spain is", "madrid")]
    assert temperature in (0.5, -1, 2)
"""
        }
    )
    result = pytester.runpytest("-v", "-p", "no:randomly")
    result.assert_outcomes(passed=6)
    passed = {line.split(" PASSED")[0] for line in result.stdout.lines if " PASSED" in line}
    assert {
        "tests/test_cases.py::test_case[the-capital-of-france-is-paris-0.5]",
        "tests/test_cases.py::test_case[the-capital-of-spain-is-madrid--1]",
    } <= passed
    # Nothing else in the project asks for the plugin: these tests do.
    assert "ctresources: inactive" in result.stdout.str()
    assert "ct_parametrize marker" in result.stdout.str()


def test_every_xdist_worker_collects_the_same_items(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=EXPERIMENT)
    pytester.makeini("[pytest]\nct_config = exp.yaml\n")
    long_prompts = "\n".join(f"    - prompt number {i} {'x' * 40}" for i in range(8))
    pytester.makefile(".yaml", many=f"PARAMS:\n  PROMPTS:\n{long_prompts}\n")
    pytester.makepyfile(
        test_prompts=PER_PROMPT
        + """
@pytest.mark.ct_parametrize("prompt", "PROMPTS", path="many.yaml")
def test_many(prompt):
    assert prompt.startswith("prompt number")
"""
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=10)


@pytest.mark.parametrize(
    ("marker", "ini", "line"),
    [
        (
            '"prompt", "PROMPTZ"',
            "ct_config = exp.yaml",
            "exp.yaml: PARAMS has no key 'PROMPTZ' (did you mean PROMPT?); its keys: PROMPT, "
            "PROMPTS, TEMPERATURES, CASES "
            "(@pytest.mark.ct_parametrize on test_bad.py::test_bad)",
        ),
        (
            '"prompt", "PROMPT"',
            "ct_config = exp.yaml",
            "exp.yaml: PARAMS PROMPT must be a list (one test per element), got str "
            "'the capital of france is' (@pytest.mark.ct_parametrize on test_bad.py::test_bad)",
        ),
        (
            '"prompt", "PROMPTS", path="missing.yaml"',
            "ct_cleanup = auto",
            "missing.yaml: cannot read experiment config: No such file or directory "
            "(@pytest.mark.ct_parametrize on test_bad.py::test_bad)",
        ),
        (
            '"prompt", "PROMPTS"',
            "ct_cleanup = auto",
            "no experiment config to read PARAMS PROMPTS from: give the marker "
            "path='...yaml', or the session one (--ct-config, ini ct_config, CT_CONFIG) "
            "(@pytest.mark.ct_parametrize on test_bad.py::test_bad)",
        ),
        (
            '"a prompt", "PROMPTS"',
            "ct_config = exp.yaml",
            "invalid @pytest.mark.ct_parametrize on test_bad.py::test_bad: argnames must name "
            "arguments ('prompt' or 'prompt, target'), got 'a prompt'; usage: "
            "@pytest.mark.ct_parametrize(argnames: str | collections.abc.Sequence[str], "
            "key: str, path: str | None = None)",
        ),
    ],
    ids=["missing-key", "not-a-list", "bad-path", "no-config", "bad-argnames"],
)
def test_a_bad_reference_fails_collection_in_one_line(
    pytester: pytest.Pytester, marker: str, ini: str, line: str
) -> None:
    pytester.makefile(".yaml", exp=EXPERIMENT)
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile(
        test_bad=f"""
import pytest

@pytest.mark.ct_parametrize({marker})
def test_bad(prompt):
    pass

def test_fine():
    pass
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    # The session's config is named as resolved (an absolute path), the marker's as given.
    assert [shown for shown in out.splitlines() if shown.endswith(line)], out
    assert "Traceback" not in out and "parametrize_tests.py" not in out


def test_the_usage_pages_example_collects_as_shown(pytester: pytest.Pytester) -> None:
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "usage.md").read_text()
    section = page[page.index("## Experiments as parametrized tests") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    shown = re.search(
        r"```text\n\$ pytest (--ct-config \S+) --collect-only -q\n(.*?)\$", section, re.S
    )
    assert code is not None and shown is not None
    pytester.makepyfile(test_prompts=code.group(1))
    flag, path = shown.group(1).split()
    result = pytester.runpytest(flag, str(root / path), "--collect-only", "-q", "-p", "no:randomly")
    assert result.stdout.lines[: len(shown.group(2).splitlines())] == shown.group(2).splitlines()
