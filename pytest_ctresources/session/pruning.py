"""Pruning after an attribution: ``ct_session.graph_files`` (circuit-tracer's
``create_graph_files``) and ``ct_session.prune`` (its ``prune_graph``).

``create_graph_files`` moves the dense graph (nodes x nodes, float32) to the GPU whenever there
is one and runs ``prune_graph`` there, whose sort of every edge score holds about
:data:`~pytest_ctresources.estimator.estimate.PRUNE_ADJACENCY_COPIES` adjacency-sized buffers
beside the model that is still loaded: the pipeline's second memory peak, where long prompts
run out of memory (circuit-tracer issue #92). Here a call's arguments are checked as
``attribute()``'s are (one line naming the parameter), the call is timed
(:class:`~pytest_ctresources.session.progress.PruningTiming`, told to the live progress
line), its peak measured (:class:`PruningCall`), and an out-of-memory error inside it is
described as the pruning's (:class:`PruningOom`), which the test's ``ctresources: CUDA out of
memory`` section shows in place of the attribution's advice.

Both calls work on a shallow copy of the graph: ``create_graph_files`` moves the graph it is
given to the GPU and back, and an error in between would leave the user's graph there,
holding the dense adjacency on the card for the rest of the test. The copy's tensors go with
the copy; the user's graph stays where it was. Usable without pytest; torch and circuit_tracer
are imported inside the functions.
"""

from __future__ import annotations

import copy
import inspect
import numbers
import os
import shlex
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pytest_ctresources.bundled.builders import rewritten_own_tokenizer
from pytest_ctresources.estimator.estimate import PRUNE_ADJACENCY_COPIES, prune_blocker
from pytest_ctresources.gpu import oom
from pytest_ctresources.session.progress import ProgressListener, PruningTiming
from pytest_ctresources.units import bytes_text, named, shown

if TYPE_CHECKING:
    import torch

    from pytest_ctresources.settings.config import CircuitTracerConfig

T = TypeVar("T")

#: ``create_graph_files``'s and ``prune_graph``'s defaults, which ct_session's keep.
NODE_THRESHOLD = 0.8
EDGE_THRESHOLD = 0.98
#: ``create_graph_files``'s parameters that ``graph_files`` names itself.
_NAMED = frozenset({"graph_or_path", "slug", "output_path", "node_threshold", "edge_threshold"})


@dataclass(frozen=True)
class PruningCall:
    """One successful ``graph_files()`` or ``prune()`` call: its thresholds, its timing (the
    call, the graph's nodes, the device, the phases' seconds) and its peak."""

    node_threshold: float
    edge_threshold: float
    timing: PruningTiming
    peak_allocated_bytes: int | None = None
    """The device's allocated peak during the call, when the call raised it (then it is the
    call's own, the model still loaded included); None on the CPU, or when an earlier peak
    of the test was higher."""
    path: Path | None = None
    """The JSON file ``graph_files`` wrote (None for ``prune``)."""

    def to_dict(self) -> dict[str, Any]:
        return self.timing.to_dict() | {
            "node_threshold": self.node_threshold,
            "edge_threshold": self.edge_threshold,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "path": None if self.path is None else str(self.path),
        }


@dataclass(frozen=True)
class PruningOom:
    """What a ``graph_files()`` or ``prune()`` call was pruning when it ran out of memory."""

    call: str
    nodes: int
    features: int
    layers: int
    tokens: int
    logits: int
    device: str
    allocated_bytes: int | None
    """Allocated on the device when the call started (the model and its transcoders, still
    loaded, and the test's own tensors); None off CUDA."""

    @property
    def adjacency_bytes(self) -> int:
        return self.nodes * self.nodes * 4

    def explanation(self) -> list[str]:
        """What was being pruned, where, and what that takes."""
        how = (
            "circuit-tracer's create_graph_files moves the dense graph there and runs prune_graph"
            if self.call == "graph_files"
            else "prune_graph on the dense graph moved there"
        )
        need = int(PRUNE_ADJACENCY_COPIES * self.adjacency_bytes)
        beside = (
            ""
            if self.allocated_bytes is None
            else f", beside the {bytes_text(self.allocated_bytes)} allocated when it started "
            "(the model and its transcoders stay loaded)"
        )
        return [
            f"out of memory while pruning the graph on {self.device}, in ct_session.{self.call}() "
            f"({how}), not in attribute(): the batch size does not change it",
            f"graph: {self.nodes:,} nodes ({self.features:,} feature, "
            f"{self.layers * self.tokens:,} error ({self.layers} layers x {self.tokens} "
            f"tokens), {self.tokens:,} token, {self.logits:,} logit); dense adjacency "
            f"{bytes_text(self.adjacency_bytes)} (nodes^2 x float32)",
            f"prune_graph's peak (the sort of every edge score) holds about "
            f"{PRUNE_ADJACENCY_COPIES:g} of them: {bytes_text(need)}{beside}",
        ]

    def next_step(self, cfg: CircuitTracerConfig | None) -> str:
        """What to do about it, and how to know beforehand."""
        where = (
            " (create_graph_files prunes on the GPU whenever there is one)"
            if self.call == "graph_files"
            else ""
        )
        return (
            "next step: a smaller graph (its nodes grow with max_feature_nodes and the prompt's "
            "tokens), or prune in host memory with "
            f'`ct_session.prune(graph, device="cpu")`{where}; '
            f"`{self.estimate_command(cfg)}` says beforehand what pruning needs "
            "(docs/estimator-cli.md)"
        )

    def estimate_command(self, cfg: CircuitTracerConfig | None) -> str:
        """``ct-resources estimate --pipeline`` for this graph's shape: the config's model,
        this graph's tokens and feature nodes."""
        parts = ["ct-resources", "estimate"]
        if cfg is not None and cfg.model_name:
            parts += ["--model", cfg.model_name]
            if cfg.transcoder_set:
                parts += ["--transcoders", cfg.transcoder_set]
            parts += ["--dtype", str(cfg.dtype)]
        parts += ["--prompt-tokens", str(max(1, self.tokens))]
        parts += ["--max-feature-nodes", str(max(1, self.features)), "--pipeline"]
        return shlex.join(parts)


def raised_while_pruning(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a :class:`PruningRun` (its traceback passes through one):
    an error the test caught from ``graph_files`` and a later one of its own are told apart."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _RUN_CODE:
            return True
        tb = tb.tb_next
    return False


def threshold(call: str, name: str, value: object) -> float:
    """``value`` as a fraction of the total influence, from 0 to 1."""
    __tracebackhide__ = True
    message = f"{call}({name}=...): must be a number from 0 to 1, got {shown(value)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(message)
    # Compared before float(): float() of an int (or a Fraction) over a float's range raises.
    if not 0 <= cast(float, value) <= 1:  # NaN too
        raise ValueError(message)
    return float(value)


def graph_of(call: str, graph: object) -> Any:
    """``graph`` if it is a circuit-tracer ``Graph``; the one saved there if it is a path."""
    __tracebackhide__ = True
    from circuit_tracer.graph import Graph

    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, (str, os.PathLike)):
        path = os.fsdecode(graph)
        if "\0" in path or not os.path.isfile(path):
            raise ValueError(
                f"{call}(graph=...): no graph file {shown(path)} (a path names a file "
                "written by Graph.to_pt)"
            )
        problem = _not_loadable(path)
        if problem is not None:
            raise ValueError(
                f"{call}(graph=...): {shown(path)} {problem}: not loaded (a graph file is a "
                "pickle, and loading one runs what it holds)"
            )
        return Graph.from_pt(path)
    raise TypeError(
        f"{call}(graph=...): expected a circuit-tracer Graph (what attribute() returns) or the "
        f"path of one saved with Graph.to_pt, got {type(graph).__name__}"
    )


def _not_loadable(path: str) -> str | None:
    """Why the graph file at ``path`` is not one to unpickle: another user's, one anyone may
    write, or reached through a link another user planted in a shared directory."""
    from pytest_ctresources.settings.report_paths import planted_link

    info = os.stat(path)
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to you"
    if info.st_mode & stat.S_IWOTH:
        return "can be written by anyone"
    return planted_link(Path(os.path.abspath(path)))


#: The viewer's index, which every ``graph_files`` call into a directory updates.
METADATA_FILE = "graph-metadata.json"
#: The longest file name, in bytes, of the usual file systems.
MAX_NAME_BYTES = 255


def slug_of(slug: object) -> str:
    """The graph's name, and its file's (``<slug>.json`` in the output directory)."""
    __tracebackhide__ = True
    if not isinstance(slug, str):
        raise TypeError(f"graph_files(slug=...): must be a string, got {type(slug).__name__}")
    separators = {"/", os.sep, os.altsep or "/"}
    name = f"{slug}.json"
    if (
        not slug
        or not slug.isprintable()  # NUL, a newline, a lone surrogate
        or any(separator in slug for separator in separators)
        or name == METADATA_FILE
        or len(os.fsencode(name)) > MAX_NAME_BYTES
    ):
        raise ValueError(
            "graph_files(slug=...): must be a printable file name, not graph-metadata (the "
            f"JSON file is <slug>.json in output_path, at most {MAX_NAME_BYTES} bytes), got "
            f"{shown(slug)}"
        )
    return slug


def output_directory(output_path: object, slug: str) -> str:
    """Where the files go, absolute; created by ``create_graph_files`` if missing. Refuses,
    before any pruning, what the files would be written through or over: a link another
    user planted on the way, an entry at ``<slug>.json`` or the index that is not a regular
    file of this user's, an index that is not circuit-tracer's."""
    __tracebackhide__ = True
    from pytest_ctresources.settings.report_paths import existing_ancestor, planted_link

    if not isinstance(output_path, (str, os.PathLike)):
        raise TypeError(
            f"graph_files(output_path=...): must be a directory path, got "
            f"{type(output_path).__name__}"
        )
    given = os.fsdecode(output_path)
    if not given or "\0" in given:
        raise ValueError(f"graph_files(output_path=...): must name a directory, got {shown(given)}")
    # Absolute: create_graph_files's metadata writer asserts that the path's parent exists,
    # which a bare relative name ("graphs": its dirname is "") has not.
    directory = os.path.abspath(given)

    def refuse(problem: str) -> ValueError:
        return ValueError(f"graph_files(output_path=...): {problem}")

    if (problem := planted_link(Path(directory, METADATA_FILE))) is not None:
        raise refuse(problem)
    if os.path.lexists(directory) and not os.path.isdir(directory):  # a broken link too
        raise refuse(f"{shown(given)} exists and is not a directory")
    if not os.path.isdir(directory):
        existing = existing_ancestor(Path(directory))
        if not existing.is_dir():
            raise refuse(f"{shown(given)} cannot be made: {named(str(existing))} is a file")
        return directory
    for name in (f"{slug}.json", METADATA_FILE):
        try:
            info = os.lstat(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise refuse(f"{name} there is not a regular file (nothing is written through it)")
        if info.st_uid != os.geteuid():
            raise refuse(f"{name} there belongs to uid {info.st_uid}, not to you")
    _check_index(os.path.join(directory, METADATA_FILE), refuse)
    return directory


def _check_index(path: str, refuse: Callable[[str], ValueError]) -> None:
    """The viewer's index, if there is one, is what ``create_graph_files`` adds to: an object
    whose ``graphs`` is a list (anything else was a TypeError or KeyError from inside it)."""
    __tracebackhide__ = True
    import json

    from pytest_ctresources.reading import Unreadable, read_regular

    if not os.path.lexists(path):
        return
    try:
        index = json.loads(read_regular(path, _MAX_INDEX_BYTES, follow_links=False))
    except (Unreadable, ValueError, RecursionError):
        index = None
    if not isinstance(index, dict) or not isinstance(index.get("graphs"), list):
        raise refuse(
            f"{METADATA_FILE} there is not circuit-tracer's index of graphs (an object whose "
            "'graphs' is a list); move it, or name another directory"
        )


#: The largest viewer index read (a few hundred bytes per graph).
_MAX_INDEX_BYTES = 64 << 20


def graph_files_extras(call: str, extras: Mapping[str, Any]) -> dict[str, Any]:
    """``create_graph_files``'s other keyword arguments (``scan``), checked by name."""
    __tracebackhide__ = True
    from circuit_tracer.utils.create_graph_files import create_graph_files

    accepted = set(inspect.signature(create_graph_files).parameters) - _NAMED
    unknown = set(extras) - accepted
    if unknown:
        raise TypeError(
            f"{call}() got unexpected keyword argument(s) {', '.join(sorted(unknown))}; "
            f"accepted: {', '.join(sorted(accepted | {'node_threshold', 'edge_threshold'}))}"
        )
    return dict(extras)


def device_of(call: str, device: object) -> torch.device:
    """Where to prune: ``device``, or where ``create_graph_files`` prunes (the current CUDA
    device when there is one, else the CPU)."""
    __tracebackhide__ = True
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        resolved = device
    elif isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError:
            raise ValueError(
                f"{call}(device=...): not a torch device: {shown(device)} (cpu, cuda, cuda:1)"
            ) from None
    else:
        raise TypeError(
            f"{call}(device=...): must be a device name or a torch.device, got "
            f"{type(device).__name__}"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{call}(device=...): {shown(device)}, but CUDA is not available")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class PruningRun:
    """One ``graph_files()`` or ``prune()`` call on a working copy of ``graph`` pruned on
    ``device``: timed (``timing``, told to ``listener``), its peak measured, and, when it runs
    out of memory, what it was pruning (``oom``)."""

    def __init__(
        self,
        call: str,
        graph: Any,
        device: torch.device,
        node_threshold: float,
        edge_threshold: float,
        listener: ProgressListener | None = None,
    ) -> None:
        self.graph = graph
        self.device = device
        self.node_threshold = node_threshold
        self.edge_threshold = edge_threshold
        self.listener = listener
        nodes = int(graph.adjacency_matrix.shape[0])
        blocker = prune_blocker(nodes) if device.type == "cuda" else ""
        if blocker:
            # Before the dense graph moves to the card: circuit-tracer would fail in the sort,
            # after the copy and most of the pruning's memory.
            instead = (
                "create_graph_files prunes on the GPU whenever there is one; "
                if call == "graph_files"
                else ""
            )
            raise ValueError(
                f"{call}(): a graph of {nodes:,} nodes cannot be pruned on {device}: {blocker}; "
                f'{instead}prune in host memory with ct_session.prune(graph, device="cpu"), or '
                "make the graph smaller (max_feature_nodes, a shorter prompt)"
            )
        self.timing = PruningTiming(call, nodes, str(device))
        self.peak_allocated_bytes: int | None = None
        self.oom: PruningOom | None = None

    def graph_files(self, slug: str, directory: str, extras: Mapping[str, Any]) -> Path:
        """``create_graph_files`` on the working copy; the JSON file it wrote."""
        __tracebackhide__ = True
        from circuit_tracer.utils.create_graph_files import create_graph_files

        cfg = self.graph.cfg
        # create_graph_files loads the tokenizer by graph.cfg.tokenizer_name. A bundled model's
        # is a temporary directory gone with the model; the working copy gets a config naming
        # the same tokenizer written again, offline (bundled/builders.py). Changing the copy's
        # config, not circuit-tracer's AutoTokenizer, leaves every other caller as it was.
        with rewritten_own_tokenizer(cfg.tokenizer_name, int(self.graph.vocab_size)) as name:
            work = self._working_copy()
            if name is not None:
                work.cfg = copy.copy(cfg)
                work.cfg.tokenizer_name = name
            self._run(
                lambda: create_graph_files(
                    work,
                    slug,
                    directory,
                    node_threshold=self.node_threshold,
                    edge_threshold=self.edge_threshold,
                    **extras,
                ),
                work,
            )
        return Path(directory, f"{slug}.json")

    def prune(self) -> Any:
        """``prune_graph`` on the working copy moved to the device; its ``PruneResult`` with
        the tensors on the CPU (as create_graph_files takes them)."""
        __tracebackhide__ = True
        from circuit_tracer.graph import prune_graph

        work = self._working_copy()

        def pruned() -> Any:
            work.to(self.device)
            result = prune_graph(work, self.node_threshold, self.edge_threshold)
            return type(result)(*(tensor.cpu() for tensor in result))

        return self._run(pruned, work)

    def record(self, path: Path | None = None) -> PruningCall:
        return PruningCall(
            self.node_threshold, self.edge_threshold, self.timing, self.peak_allocated_bytes, path
        )

    def _working_copy(self) -> Any:
        """A shallow copy of the graph whose second move (create_graph_files's back to the CPU,
        after prune_graph) starts the files phase. Its ``to`` is its own attribute, removed
        after the call (``_run``), so the copy holds no cycle through it."""
        work = copy.copy(self.graph)
        move = type(work).to
        moves = 0

        def to(device: Any) -> None:
            nonlocal moves
            move(work, device)
            moves += 1
            if moves == 2 and self.timing.phase == "prune":
                self.timing.files_started()
                self._tell()

        work.to = to
        return work

    def _run(self, action: Callable[[], T], working_copy: Any) -> T:
        """``action`` (circuit-tracer's call on ``working_copy``), timed and measured; an OOM
        inside it leaves its facts in ``oom`` (:func:`raised_while_pruning` finds this frame)."""
        __tracebackhide__ = True
        cuda = sys.modules["torch"].cuda if self.device.type == "cuda" else None
        allocated = int(cuda.memory_allocated(self.device)) if cuda is not None else None
        peak_before = int(cuda.max_memory_allocated(self.device)) if cuda is not None else None
        self._tell()
        try:
            result = action()
        except Exception as exc:
            if oom.is_oom(exc):
                self.oom = self._oom(allocated)
            raise
        finally:
            vars(working_copy).pop("to", None)
            self.timing.finished()
            if self.listener is not None:
                self.listener.done()
        if cuda is not None and peak_before is not None:
            peak = int(cuda.max_memory_allocated(self.device))
            self.peak_allocated_bytes = peak if peak > peak_before else None
        return result

    def _tell(self) -> None:
        if self.listener is not None:
            self.listener.update(self.timing)

    def _oom(self, allocated: int | None) -> PruningOom:
        graph = self.graph
        return PruningOom(
            self.timing.call,
            self.timing.nodes,
            len(graph.selected_features),
            int(graph.cfg.n_layers),
            int(graph.n_pos),
            len(graph.logit_targets),
            self.timing.device,
            allocated,
        )


_RUN_CODE = PruningRun._run.__code__
