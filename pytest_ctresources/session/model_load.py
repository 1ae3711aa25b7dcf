"""Why a model failed to load, in one line a researcher can act on.

``ReplacementModel.from_pretrained`` fails deep inside huggingface_hub and transformers, with
chained exceptions hundreds of traceback lines long, and every test that asks for the model
tries again (each retry waits on the hub when offline is not declared). :class:`ModelCache`
remembers the first failure per model and raises :class:`ModelLoadError` with the message
built here; later tests of the same model fail at once, pointing at the first.
"""

from __future__ import annotations

import difflib

from pytest_ctresources.gpu.cleanup import exception_chain
from pytest_ctresources.settings.config import CircuitTracerConfig, shown


class ModelLoadError(RuntimeError):
    """A configured model could not be loaded; the message is one line for the user."""


def _known_names() -> list[str]:
    from pytest_ctresources.estimator.registry import known_models

    return known_models()


def did_you_mean_model(name: str) -> str:
    """`` (did you mean ctresources/tiny-gemma-2?)`` against the bundled and registry names;
    for a short name (``gemma-2-2b``), what ``ct-resources estimate`` says of it."""
    from pytest_ctresources.estimator.registry import (
        UnknownShape,
        resolve_model_name,
        short_name_note,
    )

    known = _known_names()
    if name in known:
        return ""
    try:
        resolved = resolve_model_name(name)
    except UnknownShape as exc:  # a short name for several models: the message lists them
        return f"; {exc}"
    if resolved != name:
        return f"; {short_name_note(name, resolved)}"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


#: Exceptions (by class name, anywhere in the chain) that say the model cannot be loaded by
#: trying again in this run: the files are not reachable or not there.
_PERMANENT = frozenset(
    {
        "OfflineModeIsEnabled",
        "GatedRepoError",
        "RepositoryNotFoundError",
        "RevisionNotFoundError",
        "EntryNotFoundError",
        "LocalEntryNotFoundError",
        "ConfigError",
    }
)


def is_permanent(exc: BaseException) -> bool:
    """Whether a load failure will fail again for the next test of the same model (offline,
    not found, gated, not configured); an out-of-memory error, or anything else, may not."""
    names = {type(link).__name__ for link in exception_chain(exc)}
    if "OutOfMemoryError" in names:
        return False
    return bool(names & _PERMANENT) or isinstance(exc, ValueError)


def cause_of(exc: BaseException) -> str:
    """What went wrong, from the exception chain: offline, not found, gated, or the error."""
    names = {type(link).__name__ for link in exception_chain(exc)}
    if "OfflineModeIsEnabled" in names:
        return (
            "offline (HF_HUB_OFFLINE is set) and its files are not in the local Hugging Face cache"
        )
    if "GatedRepoError" in names:
        return (
            "a gated repository: accept its licence on huggingface.co, then log in "
            "(huggingface-cli login, or HF_TOKEN)"
        )
    if "RepositoryNotFoundError" in names:
        return "not found on the Hugging Face hub (a typo, or a private repository)"
    if "LocalEntryNotFoundError" in names:
        return "not in the local Hugging Face cache, and the hub could not be reached"
    innermost = list(exception_chain(exc))[-1]
    text = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {text[0] if text else '(no message)'}"


def load_failure_message(cfg: CircuitTracerConfig, exc: BaseException) -> str:
    """The first failure's one line: the model, where it was configured, and why."""
    name = cfg.model_name or "(no MODEL_NAME)"
    return (
        f"cannot load model {shown(name)} with transcoders {shown(cfg.transcoder_set)} "
        f"({cfg.source_of('model_name')}): {cause_of(exc)}{did_you_mean_model(name)}"
    )


def repeated_failure_message(first_message: str, first_test: str | None) -> str:
    """Later tests of the same model: one line pointing at the first failure."""
    where = f" in {first_test}" if first_test else ""
    return f"not retried: the same model failed to load earlier{where}: {first_message}"
