"""ct_session.graph_files and ct_session.prune: circuit-tracer's create_graph_files and
prune_graph after a real attribution on the tiny offline model, their arguments checked in one
line, and an out-of-memory error inside them explained as the pruning's."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from pytest_ctresources.bundled.builders import OWN_TOKENIZER_PREFIX, rewritten_own_tokenizer
from pytest_ctresources.session.progress import PruningTiming
from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]

GRAPH_FILES_TESTS = r"""
import json, os, shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from circuit_tracer.graph import prune_graph

class Listener:
    def __init__(self):
        self.lines, self.ends = [], 0
    def update(self, timing):
        self.lines.append(timing.descriptions()[0])
    def done(self):
        self.ends += 1

def test_files_of_the_attribution(ct_session, tmp_path):
    prompt = ct_session.cfg.params["PROMPT"]
    graph = ct_session.attribute(prompt)
    ct_session.progress = listener = Listener()
    out = tmp_path / "graphs" / "new"  # missing: created
    path = ct_session.graph_files(graph, "capital", out)
    assert path == out / "capital.json"
    written = json.loads(path.read_text())
    assert written["metadata"]["slug"] == "capital"
    assert written["metadata"]["prompt_tokens"] == ["<bos>", *prompt.split()]
    assert written["nodes"] and written["links"]
    listed = json.loads((out / "graph-metadata.json").read_text())["graphs"]
    assert [entry["slug"] for entry in listed] == ["capital"]
    nodes = graph.adjacency_matrix.shape[0]
    call = ct_session.prunings[-1]
    assert (call.timing.call, call.timing.nodes, call.timing.phase) == ("graph_files", nodes, "files")
    assert call.timing.total_s >= call.timing.prune_s > 0
    assert (call.node_threshold, call.edge_threshold, call.path) == (0.8, 0.98, path)
    assert listener.lines[0].startswith(f"pruning {nodes:,} nodes on cpu, ")
    assert listener.lines[-1].startswith("writing the graph files, ")
    assert listener.ends == 1

def test_files_of_a_saved_graph_whose_tokenizer_is_gone(ct_session):
    prompt = ct_session.cfg.params["PROMPT"]
    graph = ct_session.attribute(prompt)
    graph.to_pt("saved.pt")
    # What a graph read back after its model left the cache finds: the builder's
    # tokenizer directory removed with the model.
    shutil.rmtree(graph.cfg.tokenizer_name)
    path = ct_session.graph_files("saved.pt", "saved", "graphs")  # relative: the cwd's
    assert path == Path.cwd() / "graphs" / "saved.json"
    assert json.loads(path.read_text())["metadata"]["prompt_tokens"] == ["<bos>", *prompt.split()]

def test_prune_is_prune_graphs(ct_session):
    graph = ct_session.attribute(ct_session.cfg.params["PROMPT"])
    result = ct_session.prune(graph, 0.5, edge_threshold=0.9)
    expected = prune_graph(graph, 0.5, 0.9)
    assert type(result) is type(expected)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(result, expected))
    call = ct_session.prunings[-1]
    assert (call.timing.call, call.node_threshold, call.edge_threshold, call.path) == ("prune", 0.5, 0.9, None)
"""


USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"


def usage_section() -> str:
    page = USAGE.read_text()
    start = page.index("## After the attribution: graph files and pruning")
    return page[start : page.index("\n## ", start + 1)]


def test_graph_files_and_prune_after_a_real_attribution(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    example = re.search(r"```python\n(.*?)```", usage_section(), re.S)
    assert example is not None
    pytester.makepyfile(test_files=GRAPH_FILES_TESTS, test_usage_page=example.group(1))
    result = pytester.runpytest(
        "--ct-config", "exp.yaml", "--ct-batch-size", "16", "--ct-report-json", "r.json"
    )
    result.assert_outcomes(passed=4)
    # Each test's calls travel in its record to the JSON report.
    calls = json.loads((pytester.path / "r.json").read_text())["pruning_calls"]
    files = calls["test_files.py::test_files_of_the_attribution"]
    assert [(c["call"], c["node_threshold"], c["device"]) for c in files] == [
        ("graph_files", 0.8, "cpu")
    ]
    assert files[0]["path"].endswith("capital.json") and files[0]["total_s"] > 0
    (pruned,) = calls["test_files.py::test_prune_is_prune_graphs"]
    assert (pruned["call"], pruned["edge_threshold"], pruned["path"]) == ("prune", 0.9, None)


BAD_ARGUMENTS = r"""
import os

import pytest

CALLS = {
    "node_threshold": lambda s: s.graph_files(None, "capital", "out", node_threshold=1.5),
    "edge_threshold": lambda s: s.graph_files(None, "capital", "out", edge_threshold="0.9"),
    "typo": lambda s: s.graph_files(None, "capital", "out", node_treshold=0.5),
    "slug": lambda s: s.graph_files(None, "../up", "out"),
    "output_path": lambda s: s.graph_files(None, "capital", "taken"),
    "graph": lambda s: s.graph_files({"nodes": []}, "capital", "out"),
    "saved_graph": lambda s: s.graph_files("missing.pt", "capital", "out"),
    "prune_threshold": lambda s: s.prune(None, float("nan")),
    "prune_device": lambda s: s.prune(None, device="gpu"),
    "huge_threshold": lambda s: s.graph_files(None, "capital", "out", node_threshold=10**400),
    "index_slug": lambda s: s.graph_files(None, "graph-metadata", "out"),
    "long_slug": lambda s: s.graph_files(None, "s" * 300, "out"),
    "nul_in_path": lambda s: s.graph_files(None, "capital", "out\0x"),
    "under_a_file": lambda s: s.graph_files(None, "capital", "taken/sub"),
    "broken_link": lambda s: s.graph_files(None, "capital", "dangling"),
    "link_at_the_file": lambda s: s.graph_files(None, "capital", "linked"),
    "not_an_index": lambda s: s.graph_files(None, "capital", "indexed"),
    "anyone_writes_the_graph": lambda s: s.prune("open.pt"),
}

@pytest.mark.parametrize("mistake", CALLS)
def test_mistake(ct_session, mistake):
    open("taken", "w").close()
    if not os.path.lexists("dangling"):
        os.symlink("nowhere", "dangling")
    os.makedirs("linked", exist_ok=True)
    if not os.path.lexists("linked/capital.json"):
        os.symlink("../victim", "linked/capital.json")
    os.makedirs("indexed", exist_ok=True)
    with open("indexed/graph-metadata.json", "w") as index:
        index.write("[]")
    open("open.pt", "w").close()
    os.chmod("open.pt", 0o666)
    CALLS[mistake](ct_session)
"""

#: The one line of each mistake, in the order of the tests.
MISTAKES = [
    "E   ValueError: graph_files(node_threshold=...): must be a number from 0 to 1, got 1.5",
    "E   TypeError: graph_files(edge_threshold=...): must be a number from 0 to 1, got '0.9'",
    "E   TypeError: graph_files() got unexpected keyword argument(s) node_treshold; accepted: edge_threshold, node_threshold, scan",
    "E   ValueError: graph_files(slug=...): must be a printable file name, not graph-metadata (the JSON file is <slug>.json in output_path, at most 255 bytes), got '../up'",
    "E   ValueError: graph_files(output_path=...): 'taken' exists and is not a directory",
    "E   TypeError: graph_files(graph=...): expected a circuit-tracer Graph (what attribute() returns) or the path of one saved with Graph.to_pt, got dict",
    "E   ValueError: graph_files(graph=...): no graph file 'missing.pt' (a path names a file written by Graph.to_pt)",
    "E   ValueError: prune(node_threshold=...): must be a number from 0 to 1, got nan",
    "E   ValueError: prune(device=...): not a torch device: 'gpu' (cpu, cuda, cuda:1)",
    # Each of these was a traceback from inside (OverflowError, the index overwritten and a
    # KeyError, OSError after the pruning ran, embedded null byte, NotADirectoryError,
    # FileExistsError, TypeError), a write through a link, or an unpickled file anyone wrote.
    "E   ValueError: graph_files(node_threshold=...): must be a number from 0 to 1, got an integer of about 401 digits",
    "E   ValueError: graph_files(slug=...): * got 'graph-metadata'",
    "E   ValueError: graph_files(slug=...): * got 'sss*' (300 characters)",
    "E   ValueError: graph_files(output_path=...): must name a directory, got 'out\\x00x'",
    "E   ValueError: graph_files(output_path=...): 'taken/sub' cannot be made: */taken is a file",
    "E   ValueError: graph_files(output_path=...): 'dangling' exists and is not a directory",
    "E   ValueError: graph_files(output_path=...): capital.json there is not a regular file (nothing is written through it)",
    "E   ValueError: graph_files(output_path=...): graph-metadata.json there is not circuit-tracer's index of graphs (an object whose 'graphs' is a list); move it, or name another directory",
    "E   ValueError: prune(graph=...): 'open.pt' can be written by anyone: not loaded (a graph file is a pickle, and loading one runs what it holds)",
]


def test_a_wrong_argument_is_one_line_naming_the_parameter(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mistakes=BAD_ARGUMENTS)
    result = pytester.runpytest()
    result.assert_outcomes(failed=len(MISTAKES))
    result.stdout.fnmatch_lines(MISTAKES)
    output = result.stdout.str()
    # The test's own frame, never the session's: one E line per failure.
    assert re.search(r"pytest_ctresources/\S+\.py:\d+", output) is None
    assert output.count("\nE   ") == len(MISTAKES)


OOM_TESTS = r"""
import pytest, torch
import circuit_tracer.graph

@pytest.fixture
def card_too_small(monkeypatch):
    def prune_graph(graph, node_threshold=0.8, edge_threshold=0.98):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB")
    monkeypatch.setattr(circuit_tracer.graph, "prune_graph", prune_graph)

def test_graph_files(ct_session, card_too_small, tmp_path):
    graph = ct_session.attribute(ct_session.cfg.params["PROMPT"])
    ct_session.graph_files(graph, "capital", tmp_path)

def test_prune(ct_session, card_too_small):
    graph = ct_session.attribute(ct_session.cfg.params["PROMPT"])
    ct_session.prune(graph)

def test_an_oom_of_its_own_after_one_caught(ct_session, card_too_small, tmp_path):
    graph = ct_session.attribute(ct_session.cfg.params["PROMPT"])
    with pytest.raises(torch.cuda.OutOfMemoryError):
        ct_session.graph_files(graph, "capital", tmp_path)
    assert ct_session.pruning_oom is not None
    raise torch.cuda.OutOfMemoryError("CUDA out of memory in the test's own code")
"""

PRUNING_LINES = [
    "graph: * nodes (40 feature, * error (* layers x 6 tokens), 6 token, * logit); dense adjacency 0 MiB (nodes^2 x float32)",
    "prune_graph's peak (the sort of every edge score) holds about 11 of them: 0 MiB",
    "config in effect:",
    "  model_name = 'ctresources/tiny-gemma-2' (MODEL_NAME in exp.yaml)",
]
ESTIMATE = (
    "`ct-resources estimate --model ctresources/tiny-gemma-2 --transcoders "
    "ctresources/random-jumprelu --dtype float32 --prompt-tokens 6 --max-feature-nodes 40 "
    "--pipeline` says beforehand what pruning needs (docs/estimator-cli.md)"
)


def failures(output: str) -> dict[str, str]:
    """Each failed test's block of pytest's FAILURES section, by test name."""
    blocks = re.split(r"^_{3,} (\S+) _{3,}$", output, flags=re.MULTILINE)
    return dict(zip(blocks[1::2], blocks[2::2], strict=True))


def test_an_oom_while_pruning_is_explained_as_the_prunings(pytester: pytest.Pytester) -> None:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_oom=OOM_TESTS)
    result = pytester.runpytest("--ct-config", "exp.yaml")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        [
            "*ctresources: CUDA out of memory*",
            "out of memory while pruning the graph on cpu, in ct_session.graph_files() "
            "(circuit-tracer's create_graph_files moves the dense graph there and runs "
            "prune_graph), not in attribute(): the batch size does not change it",
            *PRUNING_LINES,
            "next step: a smaller graph (its nodes grow with max_feature_nodes and the prompt's "
            'tokens), or prune in host memory with `ct_session.prune(graph, device="cpu")` '
            "(create_graph_files prunes on the GPU whenever there is one); " + ESTIMATE,
            "*ctresources: CUDA out of memory*",
            "out of memory while pruning the graph on cpu, in ct_session.prune() (prune_graph on "
            "the dense graph moved there), not in attribute(): the batch size does not change it",
            *PRUNING_LINES,
            "next step: a smaller graph (*`; " + ESTIMATE,
        ]
    )
    # The usage page's excerpt is this output, as printed (less the config it elides).
    excerpt = re.search(r"```text\n(.*?)```", usage_section(), re.S)
    assert excerpt is not None
    shown = [line.strip() for line in excerpt.group(1).splitlines()]
    assert shown.count("...") == 1
    lines = [line.strip() for line in result.stdout.lines]
    assert all(line in lines for line in shown if line != "..."), shown
    blocks = failures(result.stdout.str())
    assert "out of memory while pruning" in blocks["test_graph_files"]
    assert "--ct-batch-size" not in blocks["test_graph_files"]
    # The test caught the pruning's error; the one that failed it is its own.
    own = blocks["test_an_oom_of_its_own_after_one_caught"]
    assert "out of memory while pruning" not in own
    assert "next step: try `BATCH_SIZE: 64` in exp.yaml" in own


def test_a_builders_tokenizer_that_is_gone_is_written_again(tmp_path: Path) -> None:
    gone = tmp_path / f"{OWN_TOKENIZER_PREFIX}abc123"
    with rewritten_own_tokenizer(str(gone), 512) as name:
        assert name is not None and os.path.isdir(name) and name != str(gone)
        tokenizer = AutoTokenizer.from_pretrained(name)
        assert len(tokenizer) == 512
        assert tokenizer.decode(tokenizer("the capital")["input_ids"]) == "<bos> the capital"
    assert not os.path.exists(name)
    # Nothing to write: a directory that is there, a name a builder did not make.
    gone.mkdir()
    for present in (str(gone), "google/gemma-2-2b", str(tmp_path / "mine")):
        with rewritten_own_tokenizer(present, 512) as name:
            assert name is None


def test_pruning_timing_describes_its_phase() -> None:
    timing = PruningTiming("graph_files", 12345, "cuda:0", started=0.0)
    assert re.fullmatch(r"pruning 12,345 nodes on cuda:0, [\d.]+ s", timing.descriptions()[0])
    timing.prune_s, timing.phase = 3.25, "files"
    long, short, terse = timing.descriptions()
    assert re.fullmatch(r"writing the graph files, [\d.]+ s \(pruning 3.2\)", long)
    assert long.startswith(short) and terse.startswith("files ")


def test_a_graph_past_cudas_sort_limit_is_refused_before_it_moves() -> None:
    """prune_graph sorts nodes^2 edge scores in one torch.sort, which on CUDA takes at most
    INT_MAX elements: past 46,340 nodes a GPU cannot prune at any memory (measured on the
    H200, docs/estimator.md), and the call says so before the dense graph moves there."""
    import torch

    from pytest_ctresources.session import pruning

    def graph(nodes: int) -> SimpleNamespace:
        return SimpleNamespace(adjacency_matrix=SimpleNamespace(shape=(nodes, nodes)))

    with pytest.raises(ValueError) as refused:
        pruning.PruningRun("graph_files", graph(46_341), torch.device("cuda", 0), 0.8, 0.98)
    assert str(refused.value) == (
        "graph_files(): a graph of 46,341 nodes cannot be pruned on cuda:0: prune_graph sorts "
        "its 2,147,488,281 edge scores (nodes^2) in one torch.sort, which on CUDA takes at "
        "most 2,147,483,647: at most 46,340 nodes on a GPU; create_graph_files prunes on the "
        "GPU whenever there is one; prune in host memory with ct_session.prune(graph, "
        'device="cpu"), or make the graph smaller (max_feature_nodes, a shorter prompt)'
    )
    with pytest.raises(ValueError, match=r"^prune\(\): a graph of 46,341 nodes .* GPU; prune in"):
        pruning.PruningRun("prune", graph(46_341), torch.device("cuda", 0), 0.8, 0.98)
    pruning.PruningRun("prune", graph(46_340), torch.device("cuda", 0), 0.8, 0.98)
    pruning.PruningRun("prune", graph(46_341), torch.device("cpu"), 0.8, 0.98)  # CPU sorts it
