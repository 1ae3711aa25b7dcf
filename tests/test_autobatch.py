"""--ct-batch-size auto and estimated needs, end to end through pytester (CPU).

Projects that run attributions run in-process (tests/conftest.py imports the stack they use
once, so no run imports it again). On CPU the model is not on a GPU, so auto fits the host's
memory; the choice on a GPU is tested with the CUDA branch's inputs stubbed here, and for real
in tests/gpu (the H200).
"""

from __future__ import annotations

import json
from typing import Any

import circuit_tracer  # imported before any in-process pytester run; see conftest
import pytest

from pytest_ctresources import testing
from pytest_ctresources.estimator import auto as autobatch
from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator import loaded_model, registry, timing
from pytest_ctresources.estimator.of_config import estimate_config
from pytest_ctresources.settings.config import CircuitTracerConfig
from pytest_ctresources.units import GIB
from tests.conftest import TINY_YAML

pytest_plugins = ["pytester"]

ATTRIBUTION_TEST = """
def test_attribution(ct_session):
    graph = ct_session.attribute("the capital of france is")
    assert graph.adjacency_matrix.shape[0] > 0
    (choice,) = ct_session.auto_choices
    print("CHOICE", choice.batch_size)
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makepyfile(test_auto=ATTRIBUTION_TEST)
    return pytester


def test_option_auto_on_cpu_fits_the_host_memory(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without CUDA the model runs on the CPU: auto fits the host's available memory (the
    tiny model's call fits it at the ceiling) and says so."""
    monkeypatch.setenv("COLUMNS", "500")  # the choice's line, unfolded
    result = project.runpytest(
        "--ct-config",
        "exp.yaml",
        "--ct-batch-size",
        "auto",
        "--ct-batch-size-max",
        "48",
        "-s",
        "-vv",  # the header's settings, and each auto choice in the summary
        "--ct-report-json",
        "report.json",
    )
    result.assert_outcomes(passed=1)
    # MAX_FEATURE_NODES is 40: 40 rows need one backward pass, as 48 would.
    result.stdout.fnmatch_lines(["*batch_size=auto (--ct-batch-size)*", "*CHOICE 40*"])
    result.stdout.fnmatch_lines(
        [
            "attributions: 1 in 1 test(s), batch size(s) 40",
            "  test_auto.py::test_attribution: auto batch size 40 (6 prompt tokens, * active "
            "features in all (* per layer and token), predicted * of host memory; the model is not on a CUDA GPU: it fits the host's "
            "available memory, * GiB (*) less 5% margin; the ceiling 48; 40 needs the same 1 "
            "backward batch(es) over 40 feature rows)",
        ]
    )
    report = json.loads((project.path / "report.json").read_text())
    (choice,) = report["auto_batch_sizes"]["test_auto.py::test_attribution"]
    assert choice.startswith("batch size 40 (6 prompt tokens, ")
    assert "it fits the host's available memory" in choice


@pytest.mark.parametrize(
    "spelling",
    [
        ("yaml", "BATCH_SIZE: auto\nBATCH_SIZE_MAX: 24\n"),
        ("ini", "[pytest]\nct_batch_size = auto\nct_batch_size_max = 24\n"),
        ("env", None),
    ],
    ids=lambda spelling: spelling[0],
)
def test_auto_from_yaml_ini_and_env(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, spelling: tuple[str, str | None]
) -> None:
    kind, text = spelling
    yaml = TINY_YAML.replace("BATCH_SIZE: 128\n", "")
    if kind == "yaml":
        yaml += text
    elif kind == "ini":
        project.makefile(".ini", pytest=text)
    else:
        monkeypatch.setenv("CT_BATCH_SIZE", "auto")
        monkeypatch.setenv("CT_BATCH_SIZE_MAX", "24")
    project.makefile(".yaml", exp=yaml)
    result = project.runpytest("--ct-config", "exp.yaml", "-s")
    result.assert_outcomes(passed=1)
    # The ceiling 24; 40 feature rows take two passes, as at 20.
    result.stdout.fnmatch_lines(["*CHOICE 20", "attributions: 1 in 1 test(s), batch size(s) 20"])


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (
            ["--ct-batch-size", "automatic"],
            None,
            "*argument --ct-batch-size: must be a positive integer or 'auto', got 'automatic'",
        ),
        (
            ["--ct-batch-size-max", "0"],
            None,
            "*argument --ct-batch-size-max: must be a positive integer, got 0",
        ),
        (
            [],
            "ct_auto_margin = 1.5",
            "ERROR: ini ct_auto_margin*: must be a number from 0 to below 1, got '1.5'",
        ),
        (
            [],
            "ct_estimate_prompt_tokens = none",
            "ERROR: ini ct_estimate_prompt_tokens*: must be a positive integer, got 'none'",
        ),
    ],
)
def test_bad_values_are_usage_errors(
    pytester: pytest.Pytester, args: list[str], ini: str | None, message: str
) -> None:
    if ini:
        pytester.makefile(".ini", pytest=f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# --- the choice on a GPU, with its inputs stubbed ---------------------------------------------


def tiny_model_seen_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The bundled tiny model on the CPU, which auto takes for a model on a CUDA GPU."""
    import torch

    model = testing.build_named_model(testing.TINY_GEMMA2, testing.RANDOM_TRANSCODERS, device="cpu")
    monkeypatch.setattr(autobatch, "_device_of", lambda model: torch.device("cuda"))
    return model


def auto_config(**fields: Any) -> CircuitTracerConfig:
    defaults = CircuitTracerConfig.defaults()
    return defaults.layered({"batch_size": "auto", **fields}, defaults.source_of("dtype"))


class FakeCuda:
    """The CUDA figures auto reads, set by the test: allocated, reserved, the device's free
    and total memory, and the peak."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, free_gib: float = 1000.0) -> None:
        import torch

        self.allocated = 1 << 30
        self.reserved = 1 << 30
        self.free = int(free_gib * GIB)
        self.total = 80 * GIB
        self.peak = self.allocated
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)


def test_choice_on_a_gpu_uses_measured_memory_and_real_active_features(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    cuda = FakeCuda(monkeypatch)
    budget = autobatch.Budget(4.0, "fake", 0.1)
    active = int(model.setup_attribution(model.ensure_tokenized(prompt)).activation_matrix._nnz())
    assert 10 < active < 4096

    roomy = autobatch.choose(model, prompt, cfg, budget)
    assert roomy.active_features == active
    assert roomy.prompt_tokens == 6
    # Everything fits: one backward pass over all the active features is the fastest (a
    # larger batch only adds forward work).
    assert roomy.batch_size == active
    assert f"the ceiling 4096; {active} is predicted fastest (" in roomy.reason

    # Less room: leave space for about 60 batch rows, so several passes are needed.
    shape, transcoders = loaded_model.shapes_of_loaded(model)
    work = est.Workload("float32", 1, 6, 0.0, 4096, counted_features=active)
    one, two = (est.estimate(shape, transcoders, est.with_batch(work, b)) for b in (1, 2))
    # auto fits the allocated peak plus the CUDA context (autobatch.counted_for_fit).
    fit_one, fit_two = (autobatch.counted_for_fit(e, budget) for e in (one, two))
    per_row = fit_two - fit_one
    cuda.allocated = budget.budget_bytes - (fit_one - one.resident_bytes) - 60 * per_row
    tight = autobatch.choose(model, prompt, cfg, budget)
    assert 1 < tight.batch_size < active
    largest = int(tight.reason.split(" is the largest")[0])
    chosen, _ = timing.fastest_batch(shape, transcoders, work, largest)
    assert tight.batch_size == chosen.batch_size <= largest
    assert tight.predicted_gib is not None and tight.predicted_gib <= 3.6
    assert tight.reason.endswith("budget 3.6 GiB = 4.0 GiB (fake) less 10% margin")

    cuda.allocated = int(3.3 * GIB)  # with the context, already over the budget: refused
    with pytest.raises(autobatch.WillNotFit, match=r"the attribute phase \(attribute\(\)\)"):
        autobatch.choose(model, prompt, cfg, budget)
    # Under an emulated capacity (a cap on PyTorch's allocator) the context does not count.
    capped = autobatch.choose(model, prompt, cfg, autobatch.Budget(4.0, "cap", 0.1, emulated=True))
    assert capped.batch_size > 1


def test_auto_fits_what_is_free_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds most of the card: mem_get_info's free memory (plus what this
    process's allocator holds unused) bounds auto below the card's budget, and the reason
    says so."""
    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    cuda = FakeCuda(monkeypatch)
    budget = autobatch.Budget(80.0, "an 80 GiB card", 0.05)
    alone = autobatch.choose(model, prompt, cfg, budget)
    assert "room" not in alone.reason
    # Leave free what the call takes at batch 20 with what is allocated, less the 0.5 GiB
    # this process's cache holds unused, and the 5% margin of that room.
    call_20 = _call_bytes(model, prompt, 20)
    cuda.reserved = cuda.allocated + (512 << 20)
    cuda.free = int((cuda.allocated + call_20) / 0.95) - cuda.reserved
    crowded = autobatch.choose(model, prompt, cfg, budget)
    assert 10 < crowded.batch_size <= 20 < alone.batch_size
    assert crowded.predicted_gib is not None
    assert "GiB free on the device (mem_get_info: other processes' memory counts) + " in (
        crowded.reason
    )
    assert crowded.reason.endswith("GiB this process reserves, less 5% margin")
    cuda.free = 0
    cuda.reserved = cuda.allocated
    full = autobatch.choose(model, prompt, cfg, budget)
    assert full.batch_size == 1
    assert "not even batch size 1 is predicted to fit the room" in full.reason


def test_auto_on_the_cpu_fits_the_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "the capital of france is"
    model = testing.build_named_model(testing.TINY_GEMMA2, testing.RANDOM_TRANSCODERS, device="cpu")
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    budget = autobatch.Budget(None, "no CUDA GPU detected", 0.05)
    shape, transcoders = loaded_model.shapes_of_loaded(model)
    active = int(model.setup_attribution(model.ensure_tokenized(prompt)).activation_matrix._nnz())
    work = est.Workload("float32", 60, 6, 0.0, 4096, counted_features=active)
    sixty = est.estimate(shape, transcoders, work).call_bytes
    monkeypatch.setattr(autobatch, "host_available", lambda: (int(sixty / 0.95), "fake"))
    choice, context = autobatch.choose_with_setup(model, prompt, cfg, budget)
    assert context is not None  # handed to attribute(), as on a GPU
    assert 1 < choice.batch_size <= 60
    assert choice.reason.startswith(
        "the model is not on a CUDA GPU: it fits the host's available memory, "
    )
    assert "GiB (fake) less 5% margin; " in choice.reason
    monkeypatch.setattr(autobatch, "host_available", lambda: None)
    unknown = autobatch.choose(model, prompt, cfg, budget)
    assert unknown.batch_size == 4096
    assert unknown.reason == (
        "the model is not on a CUDA GPU, and the host's available memory is unknown: the "
        "ceiling 4096"
    )


def test_host_memory_is_read_from_proc_meminfo() -> None:
    found = autobatch.host_available()
    assert found is not None
    available, source = found
    assert available > 0
    assert source in ("psutil", "/proc/meminfo MemAvailable") or source.startswith("cgroup v")


def test_a_first_call_keeps_the_family_s_validation_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ct_auto_margin 0, a first call on a model still leaves its family's worst
    validation under-prediction free; once a call measured, the user's margin holds."""
    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    FakeCuda(monkeypatch)
    first = autobatch.choose(model, prompt, cfg, autobatch.Budget(2.0, "fake", 0.0))
    margin = est.WORST_UNDER_PREDICTION["gemma2"]
    assert first.reason.endswith(f"(fake) less {100 * margin:g}% margin")


def _call_bytes(model: Any, prompt: str, batch: int) -> int:
    """What the estimator says an attribution of ``prompt`` at ``batch`` adds."""
    shape, transcoders = loaded_model.shapes_of_loaded(model)
    active = int(model.setup_attribution(model.ensure_tokenized(prompt)).activation_matrix._nnz())
    tokens = int(model.ensure_tokenized(prompt).numel())
    work = est.Workload("float32", batch, tokens, 0.0, 4096, counted_features=active)
    return est.estimate(shape, transcoders, work).call_bytes


def test_the_measured_peak_corrects_later_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that took 0.3 GiB more than predicted: the next choice on the same model and
    prompt length predicts that much more (more above the measured batch), chooses a smaller
    batch and says why; the measured peak is in the first choice's description."""
    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    cuda = FakeCuda(monkeypatch)
    budget = autobatch.Budget(4.0, "fake", 0.05, emulated=True)
    cuda.allocated = budget.budget_bytes - _call_bytes(model, prompt, 100)
    first = autobatch.choose(model, prompt, cfg, budget)
    assert 50 < first.batch_size <= 100
    assert first.predicted_gib is not None and first.measured_gib is None
    assert "corrected" not in first.reason
    excess = _call_bytes(model, prompt, 50)
    measured = cuda.allocated + first._predicted_call_bytes + excess
    with autobatch.observed(model, first, first.batch_size) as seen:
        cuda.peak = measured  # the call raised the device's peak: an exact measurement
    assert seen.choice is not None
    assert seen.choice.measured_gib == pytest.approx(measured / GIB)
    assert f"measured {measured / GIB:.2f} GiB" in seen.choice.describe()
    # Active features mean one thing everywhere: the count in all, and per layer and token.
    active = int(model.setup_attribution(model.ensure_tokenized(prompt)).activation_matrix._nnz())
    tokens = int(model.ensure_tokenized(prompt).numel())
    layers = loaded_model.shapes_of_loaded(model)[0].n_layers
    per = active / (layers * (tokens - 1))
    assert first.active_features == active
    assert f"{active} active features in all ({per:.1f} per layer and token)" in first.describe()

    second = autobatch.choose(model, prompt, cfg, budget)
    assert second.batch_size < first.batch_size
    assert second.reason.startswith(
        f"corrected +{excess / GIB:.2f} GiB at batch {first.batch_size} from the peak measured "
        "there on this model and prompt length; "
    )
    assert second.predicted_gib is not None and second.predicted_gib <= 3.8
    correction = autobatch.correction_for(model, first._key)
    assert correction is not None
    assert correction.at(first.batch_size) == excess
    assert correction.at(2 * first.batch_size) == 2 * excess
    assert correction.at(first.batch_size // 2) == excess
    # Another prompt length has nothing measured: no correction.
    other = autobatch.choose(model, "a different prompt of other length", cfg, budget)
    assert "corrected" not in other.reason


def test_a_call_below_the_earlier_peak_only_bounds_the_correction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call that did not raise the device's peak measured only an upper bound: kept when
    it shows the prediction was high, ignored otherwise; no measured figure is claimed."""
    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    cuda = FakeCuda(monkeypatch)
    budget = autobatch.Budget(2.0, "fake", 0.05)
    choice = autobatch.choose(model, prompt, cfg, budget)
    cuda.peak = 100 * GIB  # an earlier, larger peak in the same test
    with autobatch.observed(model, choice, choice.batch_size) as seen:
        pass
    assert seen.choice is None
    assert autobatch.correction_for(model, choice._key) is None
    cuda.peak = cuda.allocated + choice._predicted_call_bytes // 2
    with autobatch.observed(model, choice, choice.batch_size + 1) as seen:
        cuda.peak -= 1  # an OOM retry's smaller batch: not auto's choice, nothing learnt
    assert autobatch.correction_for(model, choice._key) is None
    with autobatch.observed(model, choice, choice.batch_size) as seen:
        pass  # peak unchanged: at most half the prediction
    correction = autobatch.correction_for(model, choice._key)
    assert correction is not None and correction.excess_bytes < 0


def test_an_out_of_memory_error_corrects_the_next_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(batch_size_max=4096, max_feature_nodes=4096)
    cuda = FakeCuda(monkeypatch)
    budget = autobatch.Budget(80.0, "card", 0.05)
    # The device has room for about 100 batch rows beyond the margin.
    cuda.free = int((cuda.allocated + _call_bytes(model, prompt, 100)) / 0.95) - cuda.reserved
    first = autobatch.choose(model, prompt, cfg, budget)
    assert 50 < first.batch_size <= 100
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with autobatch.observed(model, first, first.batch_size):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    second = autobatch.choose(model, prompt, cfg, budget)
    assert second.batch_size < first.batch_size
    assert "from an out-of-memory error there" in second.reason


def test_ct_session_reports_the_measured_peak_and_the_correction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through CtSession (what the summary and the JSON report show): the first choice's
    description carries its measured peak, the second its correction."""
    from pytest_ctresources.session.session import CtSession

    prompt = "the capital of france is"
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cuda = FakeCuda(monkeypatch)

    def attribute(prompt: Any, model: Any, **kwargs: Any) -> Any:
        cuda.peak = cuda.allocated + int(0.25 * GIB) + kwargs["batch_size"] * 1000
        return "graph"

    monkeypatch.setattr(circuit_tracer, "attribute", attribute)
    session = CtSession(
        auto_config(max_feature_nodes=64),
        oom_retry=False,
        auto_budget=autobatch.Budget(8.0, "fake", 0.05),
    )
    assert session.attribute(prompt, model) == "graph"
    assert session.attribute(prompt, model) == "graph"
    first, second = (choice.describe() for choice in session.auto_choices)
    assert ", measured " in first and "corrected" not in first
    assert "from the peak measured there on this model and prompt length" in second


def test_balanced_batch() -> None:
    assert est.balanced_batch(306, 4096) == 293  # 14 passes either way
    assert est.balanced_batch(256, 4096) == 256
    assert est.balanced_batch(512, 100) == 100
    assert est.balanced_batch(7, 0) == 7


# --- estimated needs in skip decisions --------------------------------------------------------

ESTIMATED = """
import pytest

@pytest.mark.ct_config(model_name="google/gemma-2-2b", transcoder_set="gemma", dtype="bfloat16")
def test_gemma(ct_session):
    pass

@pytest.mark.vram(gib=1)
@pytest.mark.ct_config(model_name="google/gemma-2-2b", transcoder_set="gemma", dtype="bfloat16")
def test_declared_wins(ct_session):
    pass

@pytest.mark.ct_config(model_name="someone/unknown-model", transcoder_set="gemma")
def test_unknown_model_has_no_estimate(ct_session):
    pass

@pytest.mark.ct_config(model_name="google/gemma-2-2b", transcoder_set="gemma", dtype="bfloat16")
def test_no_ct_session():
    pass
"""


def _estimated_gib(prompt_tokens: int, batch_size: int = 1) -> float:
    cfg = CircuitTracerConfig.defaults().layered(
        {"model_name": "google/gemma-2-2b", "transcoder_set": "gemma", "dtype": "bfloat16"},
        CircuitTracerConfig.defaults().source_of("dtype"),
    )
    prediction = estimate_config(cfg, prompt_tokens, batch_size=batch_size)
    assert prediction is not None
    return round(prediction.total_gib, 2)


def test_estimated_need_skips_on_a_small_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The skip decision takes the least the test may need: with the OOM retry on (the
    default), the estimate at the retry's floor (batch 1)."""
    monkeypatch.setenv("CT_FAKE_GPUS", "Small GPU=8")
    pytester.makepyfile(test_est=ESTIMATED)
    result = pytester.runpytest("-rs", "-p", "no:randomly")
    result.assert_outcomes(passed=3, skipped=1)
    gib = _estimated_gib(32)
    assert gib > 8
    # The most it may take is said as estimated, not as capped at the card.
    most = _estimated_gib(32, batch_size=256)
    assert most > gib
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED ?1? test_est.py:*: needs {gib:.1f} GiB VRAM (estimated for "
            f"google/gemma-2-2b, bfloat16, batch 1 (the OOM retry's floor), {most:.1f} GiB at "
            "batch 256, 32 prompt tokens); GPU 0 (Small GPU) has 8.0 GiB",
        ]
    )


def test_without_the_oom_retry_the_configured_batch_decides(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Small GPU=16")
    pytester.makepyfile(test_est=ESTIMATED)
    # With the retry, batch 1 fits 16 GiB: the test runs (and would halve after an OOM).
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=4)
    result = pytester.runpytest("-rs", "-p", "no:randomly", "--ct-no-oom-retry")
    result.assert_outcomes(passed=3, skipped=1)
    gib = _estimated_gib(32, batch_size=256)
    assert gib > 16
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED * needs {gib:.1f} GiB VRAM (estimated for google/gemma-2-2b, bfloat16, "
            "batch 256, 32 prompt tokens); GPU 0 (Small GPU) has 16.0 GiB"
        ]
    )


def test_estimate_uses_the_ini_prompt_length(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Small GPU=8")
    pytester.makefile(".ini", pytest="[pytest]\nct_estimate_prompt_tokens = 8\n")
    pytester.makepyfile(test_est=ESTIMATED)
    result = pytester.runpytest("-rs", "-p", "no:randomly")
    gib = _estimated_gib(8)
    assert gib > 8
    result.stdout.fnmatch_lines(
        [f"SKIPPED * needs {gib:.1f} GiB VRAM (estimated for * 8 prompt tokens)*"]
    )


def test_estimated_need_runs_on_a_big_gpu_and_without_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_est=ESTIMATED)
    monkeypatch.setenv("CT_FAKE_GPUS", "Big GPU=139.8")
    pytester.runpytest().assert_outcomes(passed=4)
    # No GPU: ct_session runs the model on the CPU, so an estimate never skips (a declared
    # need still does).
    monkeypatch.setenv("CT_FAKE_GPUS", "")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * needs 1.0 GiB VRAM; no CUDA GPU detected"])


# --- what auto may fill -------------------------------------------------------------------------

BUDGETS = """
import pytest

GEMMA = dict(model_name="google/gemma-2-2b", transcoder_set="gemma", dtype="bfloat16")

@pytest.mark.vram(gib=20)
@pytest.mark.ct_config(batch_size="auto", **GEMMA)
def test_declared(ct_session):
    print("BUDGET", ct_session.auto_budget.describe())

@pytest.mark.ct_config(batch_size="auto", **GEMMA)
def test_estimated(ct_session):
    print("BUDGET", ct_session.auto_budget.describe())
"""


def test_a_declared_need_bounds_auto(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Big GPU=80")
    pytester.makepyfile(test_budget=BUDGETS)
    result = pytester.runpytest("-s", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*BUDGET budget 19.0 GiB = 20.0 GiB (@pytest.mark.vram on test_budget.py::"
            "test_declared) less 5% margin",
            "*BUDGET budget 76.0 GiB = 80.0 GiB (GPU 0 (Big GPU)) less 5% margin",
        ]
    )


def test_under_xdist_auto_fills_its_lease_only(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers share one GPU: an auto test leases the most its estimate allows (capped
    at the card) and may fill that lease, not the card."""
    monkeypatch.setenv("CT_FAKE_GPUS", "Shared GPU=60")
    pytester.makepyfile(test_budget=BUDGETS)
    result = pytester.runpytest("-n", "2", "-p", "no:randomly", "--junitxml=j.xml", "-rA")
    result.assert_outcomes(passed=2)
    text = result.stdout.str()
    assert "(its VRAM lease) less 5% margin" in text
    import xml.etree.ElementTree as ET

    leases = {
        case.get("name"): float(prop.get("value"))
        for case in ET.parse(pytester.path / "j.xml").iter("testcase")
        for prop in case.iter("property")
        if prop.get("name") == "ct_lease_gib"
    }
    assert leases["test_declared"] == 20.0
    cfg = CircuitTracerConfig.defaults().layered(
        {"model_name": "google/gemma-2-2b", "transcoder_set": "gemma", "dtype": "bfloat16"},
        CircuitTracerConfig.defaults().source_of("dtype"),
    )
    most = estimate_config(cfg, 32, batch_size=512)
    assert most is not None
    assert leases["test_estimated"] == min(60.0, round(most.total_gib, 2))


def test_auto_needs_are_never_learned() -> None:
    from pytest_ctresources.core.learned import memory_key, nodeid_of

    cfg = CircuitTracerConfig.defaults()
    auto = cfg.layered({"batch_size": "auto"}, cfg.source_of("dtype"))
    assert nodeid_of(memory_key("t.py::x", cfg)) == "t.py::x"
    assert memory_key("t.py::x", auto) == ""
    # A passed test of such a config, with its peak, teaches the summary nothing either (its
    # record's empty key is not the node id, a key of its own).
    from pytest_ctresources.core.record import TestRecord
    from pytest_ctresources.report.results import TestResult
    from pytest_ctresources.report.run_summary import RunSummary

    record = TestRecord(memory_key="", peak_allocated_bytes=1 << 30, peak_reserved_bytes=1 << 30)
    summary = RunSummary(results={"t.py::x": TestResult("t.py::x", record)})
    assert summary.learned() == {}


def test_estimate_low_compares_with_the_most_the_estimate_allows() -> None:
    from pytest_ctresources.core.record import TestRecord
    from pytest_ctresources.report.results import TestResult

    def result(peak_gib: float) -> TestResult:
        record = TestRecord(
            device=0,
            gpu="G",
            date="2026-11-30",
            memory_key="",
            baseline_bytes=0,
            peak_allocated_bytes=int(peak_gib * 2**30),
            peak_reserved_bytes=int(peak_gib * 2**30),
            after_bytes=0,
            leaked_bytes=0,
            need_gib=5.0,
            need_source="estimated for m, bfloat16, batch 1 (auto's least), 32 prompt tokens",
            need_kind="estimate",
            need_most_gib=20.0,
        )
        return TestResult("t.py::x", record)

    assert result(12.0).flags(leak_threshold=1 << 30) == []
    (flag,) = result(25.0).flags(leak_threshold=1 << 30)
    assert flag.kind == "ESTIMATE LOW"
    assert str(flag).startswith(
        "ESTIMATE LOW: peak 25.00 GiB reserved > 20.0 GiB, the most it may take (estimated"
    )


def test_auto_runs_the_setup_pass_once_and_attributes_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch
    from circuit_tracer import attribute

    from pytest_ctresources.session.session import CtSession

    prompt = "the capital of france is"
    # A GPU as auto sees it, so the choice runs its setup pass.
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    cfg = auto_config(max_feature_nodes=64)
    FakeCuda(monkeypatch)
    setups = []
    original = type(model).setup_attribution

    def counting(self: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        setups.append(input_ids.numel())
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "setup_attribution", counting)
    session = CtSession(cfg, oom_retry=False, auto_budget=autobatch.Budget(8.0, "fake", 0.05))
    graph = session.attribute(prompt, model)
    assert setups == [6]  # the choice's pass, handed to attribute()
    assert "setup_attribution" not in vars(model)  # the hand-over is gone with the call
    batch = session.auto_choices[-1].batch_size
    plain = attribute(prompt, model, batch_size=batch, max_feature_nodes=64, verbose=False)
    assert len(setups) == 2  # a plain call runs its own
    assert torch.equal(graph.adjacency_matrix, plain.adjacency_matrix)

    # A context nobody used does not outlive the block, and other prompts run their own.
    context = model.setup_attribution(model.ensure_tokenized(prompt))
    with autobatch.reused_setup(model, prompt, context):
        attribute("a different prompt", model, batch_size=8, max_feature_nodes=16, verbose=False)
    assert len(setups) == 4
    assert "setup_attribution" not in vars(model)


def test_an_unused_setup_is_freed_and_a_patch_of_the_callers_restored() -> None:
    import weakref

    from circuit_tracer import attribute

    prompt = "the capital of france is"
    model = testing.build_named_model(testing.TINY_GEMMA2, testing.RANDOM_TRANSCODERS, device="cpu")
    context = model.setup_attribution(model.ensure_tokenized(prompt))
    alive = weakref.ref(context)
    calls: list[int] = []
    original = model.setup_attribution

    def callers_wrapper(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(input_ids.numel()))
        return original(input_ids, *args, **kwargs)

    model.setup_attribution = callers_wrapper
    with autobatch.reused_setup(model, prompt, context):
        del context
        # Another prompt: the handed-over context is dropped at once, the caller's runs.
        attribute("a different prompt", model, batch_size=8, max_feature_nodes=16, verbose=False)
        assert alive() is None
    assert calls == [4]
    assert vars(model)["setup_attribution"] is callers_wrapper


def test_a_share_of_a_card_fits_the_reserved_peak() -> None:
    shape = registry.model_shape("google/gemma-2-2b")
    transcoders = registry.transcoder_info("gemma").loaded()
    work = est.Workload("bfloat16", 1, 32, 40.0, 8192)
    card = autobatch.Budget(24.0, "card", 0.05)
    share = autobatch.Budget(24.0, "a vram marker", 0.05, shared=True)
    on_card = autobatch.fit_batch(shape, transcoders, work, card, 512)
    in_share = autobatch.fit_batch(shape, transcoders, work, share, 512)
    assert on_card is not None and in_share is not None
    assert in_share[1] < on_card[1]  # the reserved envelope is above the allocated peak
    assert autobatch.counted_for_fit(in_share[2], share) == autobatch.counted(in_share[2], share)
    assert autobatch.counted_for_fit(on_card[2], card) < autobatch.counted(on_card[2], card)


def test_the_batch_size_before_an_auto_call_fits_the_host_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_ctresources.estimator import auto as autobatch
    from pytest_ctresources.session.session import CtSession
    from pytest_ctresources.settings.config import CircuitTracerConfig
    from pytest_ctresources.settings.sources import Source

    monkeypatch.setattr(autobatch, "host_available", lambda: (20 << 30, "test"))
    cfg = CircuitTracerConfig.defaults().layered(
        {"model_name": "google/gemma-2-2b", "transcoder_set": "gemma", "batch_size": "auto"},
        Source.default(),
    )
    before = CtSession(cfg, auto_budget=autobatch.Budget(None, "no CUDA GPU", 0.05)).batch_size
    # gemma-2-2b in float32 at 512 would take about 60 GiB: not the ceiling on a 20 GiB host.
    assert 1 <= before < 512
    more = autobatch.Budget(None, "no CUDA GPU", 0.05)
    monkeypatch.setattr(autobatch, "host_available", lambda: (200 << 30, "test"))
    assert CtSession(cfg, auto_budget=more).batch_size > before


#: 500 tokens of the tiny model with 8192 feature nodes: its attribution fits a 4 GiB card at
#: batch size 1, the pruning after it (nearly 10k nodes, 11 dense adjacencies) alone does not.
LONG_PROMPT = [2, *(3 + index % 500 for index in range(499))]


def test_auto_refuses_a_prompt_no_batch_size_fits_before_the_attribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model_seen_on_a_gpu(monkeypatch)
    FakeCuda(monkeypatch)
    cfg = auto_config(batch_size_max=64, max_feature_nodes=8192)
    ran: list[object] = []
    monkeypatch.setattr(model, "run_forward_pass", lambda *args, **kwargs: ran.append(args))
    with pytest.raises(autobatch.WillNotFit) as refused:
        autobatch.choose(model, LONG_PROMPT, cfg, autobatch.Budget(4.0, "a 4 GiB card", 0.05))
    message = str(refused.value)
    assert "\n" not in message and not ran
    assert message.startswith(
        "--ct-batch-size auto: 500 prompt tokens cannot fit at any batch size: the prune phase "
        "alone (prune_graph, 9702 nodes, dense adjacency 0.35 GiB) is predicted to need "
    )
    assert message.endswith(
        "at batch size 1, over the budget 3.8 GiB = 4.0 GiB (a 4 GiB card) less 5% margin"
    )
    # The attribution itself, where the card is smaller than what is resident.
    with pytest.raises(autobatch.WillNotFit, match=r"the attribute phase \(attribute\(\)\)"):
        autobatch.choose(model, LONG_PROMPT, cfg, autobatch.Budget(2.0, "a small card", 0.05))
    # A card that holds both: a choice, as before.
    assert autobatch.choose(model, LONG_PROMPT, cfg, autobatch.Budget(8.0, "big", 0.05))


REFUSED_TEST = """
import pytest
import torch

from pytest_ctresources.estimator import auto

LONG_PROMPT = [2, *(3 + index % 500 for index in range(499))]
_patch = pytest.MonkeyPatch()


def pytest_configure(config):
    # The tiny model stays on the CPU; auto takes it for a model on the fake GPU.
    _patch.setattr(auto, "_device_of", lambda model: torch.device("cuda"))
    for name, value in {
        "memory_allocated": lambda device=None: 1 << 28,
        "memory_reserved": lambda device=None: 1 << 28,
        "mem_get_info": lambda device=None: (1 << 32, 1 << 32),
    }.items():
        _patch.setattr(torch.cuda, name, value)


def pytest_unconfigure(config):
    _patch.undo()  # an in-process run shares torch with the suite that runs it
"""


def test_a_refused_prompt_fails_its_test_in_one_line_naming_the_phase_and_the_card(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "Small GPU=4")
    pytester.makefile(".yaml", exp=TINY_YAML)
    pytester.makeconftest(REFUSED_TEST)
    pytester.makepyfile(
        """
        from conftest import LONG_PROMPT

        def test_long(ct_session):
            ct_session.attribute(LONG_PROMPT, max_feature_nodes=8192)
        """
    )
    result = pytester.runpytest(
        "--ct-config", "exp.yaml", "--ct-batch-size", "auto", "-p", "no:randomly"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*--ct-batch-size auto: 500 prompt tokens cannot fit at any batch size: the prune "
            "phase alone (prune_graph, * nodes, dense adjacency * GiB) is predicted to need * GiB at "
            "batch size 1, over the budget 3.8 GiB = 4.0 GiB (GPU 0 (Small GPU*) less 5% margin"
        ]
    )
    assert "Traceback" not in result.stdout.str() and "WillNotFit" not in result.stdout.str()
