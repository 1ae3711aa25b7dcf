"""The ct-resources command: gpus and estimate, through main() and as an installed script."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from pytest_ctresources.estimator import auto as autobatch
from pytest_ctresources.estimator import estimate as est
from pytest_ctresources.estimator import registry, timing
from pytest_ctresources.estimator.cli import main
from pytest_ctresources.units import GIB

ROOT = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def fail(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_json_peak_is_the_estimators(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(
        capsys,
        "estimate",
        "--model",
        "google/gemma-2-2b",
        "--transcoders",
        "gemma",
        "--dtype",
        "bf16",
        "--batch-size",
        "64",
        "--prompt-tokens",
        "40",
        "--gpu-gib",
        "24",
        "--json",
    )
    payload = json.loads(out)
    model = registry.MODELS["google/gemma-2-2b"]
    info = registry.transcoder_info("gemma")
    transcoders = info.loaded()
    # Without --active-features: GemmaScope's L0, per layer and token.
    assert info.l0 is not None
    work = est.Workload("bfloat16", 64, 40, info.l0)
    expected = est.estimate(model, transcoders, work)
    assert payload["peak_gib"] == round(expected.peak_allocated_bytes / GIB, 3)
    assert payload["batch_size"] == 64
    assert payload["active_per_layer_token"] == round(info.l0, 3)
    assert payload["active_features"] == math.ceil(info.l0 * 26 * 39)
    assert payload["active_source"] == "mwhanna/gemma-scope-transcoders's L0"
    assert set(payload["breakdown_gib"]) == {
        "weights",
        "transcoders",
        "setup",
        "forward",
        "backward",
        "reserved margin",
        "CUDA context",
    }
    largest = est.largest_fitting_batch(model, transcoders, work, 24 * GIB, ceiling=512)
    assert largest is not None
    assert payload["largest_fitting_batch_size"] == largest[0]
    for row in payload["table"]:
        assert row["fits"] == (row["batch_size"] <= largest[0])


def test_text_output_has_the_breakdown_and_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(
        capsys,
        "estimate",
        "--config",
        str(ROOT / "example_configs" / "gemma-2-2b-it.yaml"),
        "--prompt-tokens",
        "60",
        "--gpu-gib",
        "24",
    )
    lines = out.splitlines()
    assert lines[0].startswith("model        google/gemma-2-2b-it: 2.6B parameters, 26 layers")
    assert "transcoders  mwhanna/gemma-scope-transcoders: per-layer, 16384" in lines[1]
    assert "bfloat16, batch size " in lines[2] and "(auto), 60 prompt tokens" in lines[2]
    features = math.ceil(1020 / 26 * 26 * 59)
    assert lines[3] == (
        "features     39.23 active per layer and token (mwhanna/gemma-scope-transcoders's "
        f"L0): {features} in all over 26 layers x 59 positions after BOS"
    )
    for name in ("weights", "transcoders", "setup", "forward", "backward", "CUDA context"):
        assert any(line.startswith(f"  {name} ") for line in lines), name
    # The config's batch size is auto: "fits" is auto's rule, said once, used throughout.
    assert lines[5] == (
        "fits         allocated peak and CUDA context within auto's budget 22.8 GiB = 24.0 GiB "
        "(--gpu-gib 24) less 5% margin (the caching allocator frees its unused cache before it "
        "runs out, so the reserved peak need not fit)"
    )
    assert "batch size   peak GiB   peak + context GiB   fits 22.8 GiB" in lines
    assert any("yes  <- this run" in line for line in lines)
    assert lines[-2].startswith("largest batch size that fits (up to 512): ")
    assert lines[-1].startswith("auto: batch size ")
    assert lines[-1].endswith("budget 22.8 GiB = 24.0 GiB (--gpu-gib 24) less 5% margin)")
    fixed = run(capsys, "estimate", "--model", "gemma-2-2b", "--dtype", "bf16", "--gpu-gib", "24")
    assert (
        "fits         total on the card (reserved peak and CUDA context) within the card's 24.0 GiB"
    ) in fixed.splitlines()
    assert "batch size   peak GiB   total GiB   fits 24.0 GiB" in fixed.splitlines()


def test_pipeline_prints_a_line_per_phase_and_the_json_a_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["estimate", "--model", "meta-llama/Llama-3.2-1B", "--batch-size", "16"]
    flags += ["--prompt-tokens", "2000", "--max-feature-nodes", "2048", "--gpu-gib", "80"]
    flags += ["--active-features", "16", "--pipeline"]
    lines = run(capsys, *flags).splitlines()
    start = lines.index("phase        peak GiB  total GiB  host GiB")
    attribute, prune = lines[start + 1 :]
    assert attribute.startswith("attribute ") and "peak in the " in attribute
    assert prune.startswith("prune ") and "36058 nodes, dense adjacency 4.84 GiB" in prune
    payload = json.loads(run(capsys, *flags, "--json"))["pipeline"]
    assert set(payload) == {"attribute", "prune", "peak_phase"}
    assert payload["prune"]["host_gib"] == round(5 * 36058**2 / GIB, 3)
    peak = max(("attribute", "prune"), key=lambda name: payload[name]["total_gib"])
    assert (
        payload["peak_phase"] == peak
        and "<- the run's peak" in lines[start + 1 + (peak == "prune")]
    )
    assert "pipeline" not in json.loads(run(capsys, *flags[:-1], "--json"))


def test_longest_prompt_is_the_longest_whose_every_phase_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At a fixed batch size the attribution stops it; at auto's (smaller batches as the
    prompt grows) pruning does, which no batch size changes."""
    flags = ["estimate", "--model", "meta-llama/Llama-3.2-1B", "--gpu-gib", "80"]
    flags += ["--max-feature-nodes", "2048", "--active-features", "16", "--longest-prompt"]
    fixed = json.loads(run(capsys, *flags, "--batch-size", "16", "--json"))
    auto = json.loads(run(capsys, *flags, "--batch-size", "auto", "--json"))
    assert fixed["stopped_by_phase"] == "attribute" and auto["stopped_by_phase"] == "prune"
    assert fixed["batch_size"] == 16 and auto["auto"] and auto["batch_size"] < 16
    model = registry.MODELS["meta-llama/Llama-3.2-1B"]
    transcoders = registry.transcoder_info("llama").loaded()

    def phases(tokens: int) -> est.Pipeline:
        work = est.Workload("float32", 16, tokens, 16, max_feature_nodes=2048)  # the default
        return est.pipeline(est.estimate(model, transcoders, work))

    # What must fit for a call to run: the allocated peak and the CUDA context.
    context = est.CALIBRATION.context_bytes
    tokens = fixed["longest_prompt_tokens"]
    assert all(p.peak_allocated_bytes + context <= 80 * GIB for p in phases(tokens).phases)
    assert phases(tokens + 1).phases[0].peak_allocated_bytes + context > 80 * GIB
    text = run(capsys, *flags, "--batch-size", "16")
    assert text == (
        f"longest prompt whose whole pipeline fits --gpu-gib 80: {tokens} tokens (batch size "
        "16); one more token and the attribute phase does not fit\n"
    )


def test_past_cudas_sort_limit_the_pruning_cannot_run_at_any_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On a card with room to spare, the longest prompt is where the graph passes 46,340
    nodes: prune_graph's one torch.sort of nodes^2 scores is past INT_MAX there."""
    flags = ["estimate", "--model", "meta-llama/Llama-3.2-1B", "--gpu-gib", "1000"]
    flags += ["--max-feature-nodes", "2048", "--active-features", "4", "--batch-size", "1"]
    longest = json.loads(run(capsys, *flags, "--longest-prompt", "--json"))
    tokens = longest["longest_prompt_tokens"]
    # 2048 feature nodes + 17 nodes per token (16 layers' errors and the token) + 10 logits.
    assert 2048 + 17 * tokens + 10 <= 46_340 < 2048 + 17 * (tokens + 1) + 10
    assert longest["stopped_by_phase"] == "prune"
    assert longest["stopped_because"].startswith("prune_graph sorts its ")
    text = run(capsys, *flags, "--longest-prompt")
    assert f"{tokens} tokens (batch size 1); one more token and the prune phase cannot run" in text
    longer = [*flags, "--prompt-tokens", str(tokens + 1), "--pipeline"]
    over = json.loads(run(capsys, *longer, "--json"))
    assert over["pipeline"]["prune"]["cannot_run_on_a_gpu"].endswith("46,340 nodes on a GPU")
    table = run(capsys, *longer)
    assert "cannot run on a GPU: prune_graph sorts" in table


def test_a_gpu_name_is_its_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``--gpu-gib H200`` is the card's GiB as ``--ct-plan`` knows it, named in the output;
    a name it does not know is one line listing those it does."""
    from pytest_ctresources.xdist.plan import GPU_NAMES

    flags = ["estimate", "--model", "meta-llama/Llama-3.2-1B", "--longest-prompt", "--json"]
    by_name = json.loads(run(capsys, *flags, "--gpu-gib", "h200"))
    by_size = json.loads(run(capsys, *flags, "--gpu-gib", str(GPU_NAMES["H200"])))
    assert by_name["longest_prompt_tokens"] == by_size["longest_prompt_tokens"]
    assert by_name["gpu"] == "--gpu-gib H200 (139.8 GiB)"
    error = fail(capsys, "estimate", "--model", "gemma-2-2b", "--gpu-gib", "B300")
    assert (
        error.strip()
        .splitlines()[-1]
        .endswith(
            "argument --gpu-gib: must be a positive number of GiB or a GPU name (H200, H100, "
            "H100-80GB, A100-80GB, A100-40GB, L40S, L4, A10G, RTX-4090, RTX-3090, T4), got 'B300'"
        )
    )


def test_auto_batch_size_is_the_plugins_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's auto is ct_session's: the 5% margin, the ceiling, the time model."""
    common = ["estimate", "--model", "meta-llama/Llama-3.2-1B", "--transcoders", "llama"]
    common += ["--dtype", "bfloat16", "--gpu-gib", "16"]
    auto = json.loads(run(capsys, *common, "--batch-size", "auto", "--json"))
    model = registry.MODELS["meta-llama/Llama-3.2-1B"]
    transcoders = registry.transcoder_info("llama").loaded()
    # The llama set's L0 is not known: the documented default, per layer and token.
    work = est.Workload("bfloat16", 1, 32, est.DEFAULT_ACTIVE_PER_LAYER_TOKEN)
    budget = autobatch.Budget(16.0, "--gpu-gib 16", autobatch.DEFAULT_AUTO_MARGIN)
    fitted = autobatch.fit_batch(model, transcoders, work, budget, 512)
    assert fitted is not None
    # The predicted fastest: fewer than the largest that fits.
    assert auto["batch_size"] == fitted.batch < fitted.largest == auto["largest_fitting_batch_size"]
    chosen, _ = timing.fastest_batch(model, transcoders, work, fitted.largest)
    assert fitted.batch == chosen.batch_size
    assert auto["auto_reason"] == f"{fitted.why}; {budget.describe()}"
    assert f"; {fitted.batch} is predicted within 5% of the fastest on fewer backward" in fitted.why
    assert auto["active_source"] == "assumed: the set's L0 is not known"
    capped = json.loads(run(capsys, *common, "--batch-size", "auto", "--ceiling", "8", "--json"))
    assert capped["batch_size"] == 8
    assert capped["auto_reason"].startswith("the ceiling 8, and predicted fastest; budget 15.2 GiB")


def test_config_sets_the_ceiling_and_logits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "x.yaml"
    config.write_text(
        "MODEL_NAME: google/gemma-2-2b\nTRANSCODER_SET: gemma\nDTYPE: bfloat16\n"
        "BATCH_SIZE: auto\nBATCH_SIZE_MAX: 64\n"
    )
    payload = json.loads(
        run(capsys, "estimate", "--config", str(config), "--gpu-gib", "80", "--json")
    )
    assert payload["batch_size"] == 64
    assert max(row["batch_size"] for row in payload["table"]) == 64


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "google/gemma-7", "--transcoders", "gemma"],
            "argument --model: unknown model 'google/gemma-7' (nearest: google/gemma-2-27b, ",
        ),
        (
            ["--model", "gemma-7"],  # a short name the registry lacks: the nearest too
            "argument --model: unknown model 'gemma-7' (nearest: google/gemma-2-27b, ",
        ),
        (
            ["--model", "google/gemma-2-2b", "--transcoders", "nope"],
            "argument --transcoders: unknown transcoder set 'nope'",
        ),
        (
            ["--model", "llama"],
            "argument --model: ambiguous model name 'llama': it could be "
            "meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.2-1B, ",
        ),
        (
            ["--model", "gemma-2-2b", "--transcoders", "clt"],
            "argument --transcoders: ambiguous transcoder set 'clt': for google/gemma-2-2b it "
            "could be mntss/clt-gemma-2-2b-426k, mntss/clt-gemma-2-2b-2.5M; give one of them",
        ),
        (
            ["--model", "Llama-3.2-1B", "--transcoders", "gemma"],
            "argument --transcoders: transcoder set gemma (mwhanna/gemma-scope-transcoders) was "
            "made for google/gemma-2-2b, google/gemma-2-2b-it, not for meta-llama/Llama-3.2-1B; "
            "meta-llama/Llama-3.2-1B's usual set is llama",
        ),
        (
            ["--model", "gemma-2-2b", "--transcoders", "width_16k_l0_small"],
            "argument --transcoders: transcoder set 'width_16k_l0_small' is a GemmaScope-2 "
            "variant, made for google/gemma-3-{1b,4b,12b}-{pt,it} (one repository each), not for "
            "google/gemma-2-2b",
        ),
        (
            ["--model", "gemma-3-4b-it"],
            "no usual transcoder set for google/gemma-3-4b-it: GemmaScope-2 has several",
        ),
        (
            ["--model", "gemma-2-9b"],
            "no usual transcoder set for google/gemma-2-9b: the registry knows none; name one "
            "with --transcoders SET",
        ),
        (["--transcoders", "gemma"], "name a model: --model NAME, or MODEL_NAME in the --config"),
        (  # no file can have this name: unknown, not an OSError from looking for config.json
            ["--model", "a" * 5000],
            "argument --model: unknown model 'aaaaaaaaaaaaaaaaa...aaaaaaaaaaaaaaaaaa' (5000 "
            "characters); ",
        ),
        (["--config", "missing.yaml"], "missing.yaml: cannot read experiment config"),
        (
            ["--model", "google/gemma-2-2b", "--transcoders", "gemma", "--batch-size", "auto"],
            "--batch-size auto needs a GPU size",
        ),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "")  # no GPU, whatever the machine has
    err = fail(capsys, "estimate", *argv)
    assert err.startswith(f"ct-resources: error: {message}")
    assert err.count("\n") == 1


def test_bad_flag_values_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    err = fail(capsys, "estimate", "--model", "x", "--transcoders", "y", "--dtype", "fp8")
    assert "argument --dtype: must be one of float32, bfloat16, float16; got 'fp8'" in err
    err = fail(capsys, "estimate", "--prompt-tokens", "0")
    assert "argument --prompt-tokens: must be a positive integer, got '0'" in err


def test_gpus_lists_what_the_plugin_detects(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "NVIDIA A100=39.4;NVIDIA H200=139.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    out = run(capsys, "gpus")
    assert out.splitlines()[:3] == [
        "source: CT_FAKE_GPUS",
        "CUDA_VISIBLE_DEVICES: 1,0",
        "index  name                          total GiB   free GiB   physical  uuid",
    ]
    # Fake GPUs are free but for what CT_FAKE_GPUS_USED says (by physical position).
    assert out.splitlines()[3].split() == [
        "0",
        "NVIDIA",
        "H200",
        "139.8",
        "139.8",
        "1",
        "GPU-fake-1",
    ]
    assert out.splitlines()[4].split() == ["1", "NVIDIA", "A100", "39.4", "39.4", "0", "GPU-fake-0"]
    monkeypatch.setenv("CT_FAKE_GPUS_USED", "6;0.5")
    payload = json.loads(run(capsys, "gpus", "--json"))
    assert payload["source"] == "fake"
    assert payload["free_gib"] == [139.3, 33.4]
    assert [gpu["name"] for gpu in payload["gpus"]] == ["NVIDIA H200", "NVIDIA A100"]


def test_gpus_without_a_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CT_FAKE_GPUS", "")
    assert run(capsys, "gpus").startswith("no CUDA GPU detected (")


def test_the_console_script_is_installed() -> None:
    (entry,) = metadata.entry_points(group="console_scripts", name="ct-resources")
    assert entry.value == "pytest_ctresources.estimator.cli:main"
    script = Path(sys.executable).parent / "ct-resources"
    result = subprocess.run(
        [
            str(script),
            "estimate",
            "--model",
            "Qwen/Qwen3-0.6B",
            "--transcoders",
            "mwhanna/qwen3-0.6b-transcoders-lowl0",
            "--gpu-gib",
            "24",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "Qwen/Qwen3-0.6B"


def test_table_is_the_largest_fitting_batch_per_card(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "table", "--cards", "24,80", "--prompt-tokens", "32", "--dtypes", "bf16")
    lines = out.splitlines()
    assert lines[0] == (
        "| model | transcoders | active per layer and token | dtype | prompt tokens | 24 GiB "
        "| 80 GiB |"
    )
    row = next(line for line in lines if line.startswith("| google/gemma-2-2b | gemma |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == "39.2 (L0)"
    assert any("| 64 (assumed) |" in line for line in lines)
    model = registry.MODELS["google/gemma-2-2b"]
    transcoders = registry.transcoder_info("gemma").loaded()
    work = est.Workload("bfloat16", 1, 32, 1020 / 26)
    for cell, card in zip(cells[5:], (24, 80), strict=True):
        found = est.largest_fitting_batch(model, transcoders, work, card * GIB, ceiling=512)
        assert found is not None
        assert cell == str(found[0])
    assert any("does not fit" in line for line in lines)
    assert fail(capsys, "table", "--cards", "24,big").startswith(
        "ct-resources: error: bad list '24,big'"
    )


def test_active_features_given_are_per_layer_and_token(capsys: pytest.CaptureFixture[str]) -> None:
    """--active-features K: K per layer and token, times the layers and the positions after
    BOS, and the output says where the figure came from."""
    common = ["estimate", "--model", "Qwen/Qwen3-0.6B", "--transcoders"]
    common += ["mwhanna/qwen3-0.6b-transcoders-lowl0", "--prompt-tokens", "21", "--gpu-gib", "80"]
    payload = json.loads(run(capsys, *common, "--active-features", "10", "--json"))
    assert payload["active_per_layer_token"] == 10
    assert payload["active_features"] == 10 * 28 * 20
    assert payload["active_source"] == "--active-features"
    text = run(capsys, *common, "--active-features", "10")
    assert (
        "features     10 active per layer and token (--active-features): 5600 in all over 28 "
        "layers x 20 positions after BOS"
    ) in text


def test_short_names_and_the_usual_set_estimate_what_the_full_names_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["--dtype", "bf16", "--gpu-gib", "24", "--json"]
    full = json.loads(
        run(capsys, "estimate", "--model", "google/gemma-2-2b", "--transcoders", "gemma", *common)
    )
    short = json.loads(run(capsys, "estimate", "--model", "GEMMA-2-2B", *common))
    assert full["transcoders_source"] == "--transcoders"
    assert short["transcoders_source"] == "google/gemma-2-2b's usual set"
    assert short["model_source"] == full["model_source"] == "--model"
    sources = {"transcoders_source"}
    assert {k: v for k, v in short.items() if k not in sources} == {
        k: v for k, v in full.items() if k not in sources
    }
    text = run(capsys, "estimate", "--model", "gemma-2-2b", "--gpu-gib", "24")
    assert text.splitlines()[1] == (
        "transcoders  mwhanna/gemma-scope-transcoders: per-layer, 16384 features per layer "
        "(google/gemma-2-2b's usual set; --transcoders to choose another)"
    )
    named = run(capsys, "estimate", "--model", "gemma-2-2b", "--transcoders", "426k")
    assert named.splitlines()[1].startswith("transcoders  mntss/clt-gemma-2-2b-426k: cross-layer")
    assert "usual set" not in named


@pytest.mark.parametrize("model", sorted(registry.USUAL_TRANSCODER_SETS))
def test_model_alone_takes_its_usual_set(capsys: pytest.CaptureFixture[str], model: str) -> None:
    short = model.split("/")[1].lower()  # what a person types
    payload = json.loads(run(capsys, "estimate", "--model", short, "--gpu-gib", "80", "--json"))
    assert payload["model"] == model
    usual = registry.USUAL_TRANSCODER_SETS[model]
    assert payload["transcoders"] == registry.transcoder_info(usual).shape.name
    assert payload["transcoders_source"] == f"{model}'s usual set"


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        (
            "MODEL_NAME: gemma-2-2b\nTRANSCODER_SET: gemma\n",
            "MODEL_NAME in {path}: 'gemma-2-2b' is short for google/gemma-2-2b; experiment "
            "configs take the full name, which circuit-tracer loads (short names work on the "
            "command line)",
        ),
        (
            "MODEL_NAME: google/gemma-2-2b\nTRANSCODER_SET: 426k\n",
            "TRANSCODER_SET in {path}: '426k' is short for mntss/clt-gemma-2-2b-426k; ",
        ),
        (
            "MODEL_NAME: google/gemma-2-2b\nTRANSCODER_SET: llama\n",
            "TRANSCODER_SET in {path}: transcoder set llama (mntss/transcoder-Llama-3.2-1B) was "
            "made for meta-llama/Llama-3.2-1B, meta-llama/Llama-3.2-1B-Instruct, not for "
            "google/gemma-2-2b; google/gemma-2-2b's usual set is gemma",
        ),
        (
            "MODEL_NAME: google/gemma-7\nTRANSCODER_SET: gemma\n",
            "MODEL_NAME in {path}: unknown model 'google/gemma-7' (nearest: ",
        ),
    ],
)
def test_experiment_yaml_names_are_not_resolved(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, yaml: str, message: str
) -> None:
    """The plugin hands MODEL_NAME and TRANSCODER_SET to circuit-tracer as written: a short
    name there is refused with the full one, and a wrong pair names both, as for the flags."""
    config = tmp_path / "x.yaml"
    config.write_text(yaml)
    err = fail(capsys, "estimate", "--config", str(config), "--gpu-gib", "24")
    assert err.startswith("ct-resources: error: " + message.format(path=config))
    assert err.count("\n") == 1


def test_flags_resolve_over_a_config_and_its_set_must_fit_the_new_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "x.yaml"
    config.write_text("MODEL_NAME: google/gemma-2-2b\nTRANSCODER_SET: gemma\nDTYPE: bf16\n")
    flagged = ["estimate", "--config", str(config), "--gpu-gib", "24", "--json"]
    payload = json.loads(run(capsys, *flagged, "--model", "gemma-2-2b-it"))
    assert (payload["model"], payload["model_source"]) == ("google/gemma-2-2b-it", "--model")
    assert payload["transcoders_source"] == f"TRANSCODER_SET in {config}"
    err = fail(capsys, *flagged, "--model", "qwen3-4b")
    assert err.startswith(
        f"ct-resources: error: TRANSCODER_SET in {config}: transcoder set gemma "
        "(mwhanna/gemma-scope-transcoders) was made for google/gemma-2-2b, google/gemma-2-2b-it, "
        "not for Qwen/Qwen3-4B; Qwen/Qwen3-4B's usual set is mwhanna/qwen3-4b-transcoders"
    )
    # A set named on the command line resolves for the model the config names.
    payload = json.loads(run(capsys, *flagged, "--transcoders", "clt-gemma-2-2b-426k"))
    assert payload["transcoders"] == "mntss/clt-gemma-2-2b-426k"


def _table_rows(text: str) -> list[tuple[int, float, bool, str]]:
    """The batch-size table of an estimate: (batch size, figure compared, fits, mark)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("batch size   peak GiB"))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        fields, _, mark = line.partition("<-")
        batch, _peak, figure, fits = fields.split()
        rows.append((int(batch), float(figure), fits == "yes", mark.strip()))
    return rows


@pytest.mark.parametrize("tokens", ["20", "24", "30", "40", "128"])
@pytest.mark.parametrize("batch", ["auto", "128"])
def test_one_output_states_one_largest_batch_size(
    capsys: pytest.CaptureFixture[str], tokens: str, batch: str
) -> None:
    """The table, the "largest batch size that fits" line and auto's reason give one figure
    (the config's gemma-2-2b-it at 30 tokens once printed 301 in one place and 313 in
    another): every row fits exactly when it is no larger, its row is marked, and auto's
    reason names the same."""
    argv = ["estimate", "--config", str(ROOT / "example_configs" / "gemma-2-2b-it.yaml")]
    argv += ["--prompt-tokens", tokens, "--gpu-gib", "24", "--batch-size", batch]
    text = run(capsys, *argv)
    (stated,) = [line for line in text.splitlines() if line.startswith("largest batch size")]
    largest = int(stated.rsplit(": ", 1)[1])
    rows = _table_rows(text)
    assert all(fits == (size <= largest) for size, _, fits, _ in rows)
    assert [size for size, _, _, mark in rows if "the largest that fits" in mark] == [largest]
    (this_run,) = [(size, fits) for size, _, fits, mark in rows if "this run" in mark]
    payload = json.loads(run(capsys, *argv, "--json"))
    assert payload["largest_fitting_batch_size"] == largest
    assert [row["fits"] for row in payload["table"]] == [fits for _, _, fits, _ in rows]
    if batch == "auto":
        assert this_run[1]  # auto's choice fits by the rule the output states
        reason = text.splitlines()[-1]
        assert f"{largest} is the largest that fits" in reason or f"the ceiling {largest}" in reason
        assert payload["fit_rule"] == {
            "counts": "allocated peak and CUDA context",
            "budget_gib": 22.8,
        }
        budget = autobatch.Budget(24.0, "--gpu-gib 24", autobatch.DEFAULT_AUTO_MARGIN)
        for row in payload["table"]:
            work = est.Workload("bfloat16", row["batch_size"], int(tokens), 1020 / 26)
            prediction = est.estimate(registry.MODELS["google/gemma-2-2b-it"], GEMMA_SET, work)
            counted = autobatch.counted_for_fit(prediction, budget)
            assert row["counted_gib"] == round(counted / GIB, 3)
    else:
        assert this_run[0] == 128
        assert payload["fit_rule"]["counts"] == "total on the card (reserved peak and CUDA context)"
        assert all(row["counted_gib"] == row["total_gib"] for row in payload["table"])


GEMMA_SET = registry.transcoder_info("gemma").loaded()


def test_the_readme_table_s_names_are_accepted_and_its_figures_are_the_estimate_s(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every row of `ct-resources table` (docs/estimator-cli.md's table), its short transcoder names
    as printed, through `ct-resources estimate`: the same largest batch size on each card."""
    lines = run(capsys, "table").splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    cards = [float(cell.removesuffix(" GiB")) for cell in header[5:]]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert {row[1] for row in rows} >= {"gemma", "llama", "width_16k_l0_small"}
    for model, transcoders, _active, dtype, tokens, *cells in rows:
        argv = ["estimate", "--model", model, "--transcoders", transcoders, "--dtype", dtype]
        argv += ["--prompt-tokens", tokens, "--json"]
        for card, cell in zip(cards, cells, strict=True):
            payload = json.loads(run(capsys, *argv, "--gpu-gib", f"{card:g}"))
            largest = payload["largest_fitting_batch_size"]
            assert cell == ("does not fit" if largest is None else str(largest)), (argv, card)
