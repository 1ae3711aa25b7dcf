"""Shapes by name or path: the models and transcoder sets circuit-tracer 0.5.0 knows, their
short names and pairings, and a local ``config.json``.

The models' dimensions are the catalogue's one table (``bundled/catalogue.py`` ``PUBLISHED``,
sources in ``docs/registry-sources.md``), shaped here; the transcoder sets are listed here.
Nothing here downloads anything; :func:`model_from_config_json` reads a local file. A
ReplacementModel already in memory is read by :mod:`pytest_ctresources.estimator.loaded_model`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from pytest_ctresources.bundled import catalogue
from pytest_ctresources.estimator.estimate import (
    DEFAULT_ACTIVE_PER_LAYER_TOKEN,
    NORMALIZED_HOOK,
    RESID_MID_HOOK,
    ModelShape,
    TranscoderShape,
)
from pytest_ctresources.reading import Unreadable, read_regular
from pytest_ctresources.settings.config import shown
from pytest_ctresources.settings.sources import printable
from pytest_ctresources.units import MIB


class UnknownShape(LookupError):
    """A model or transcoder set the registry does not know; the message lists the known."""


class AmbiguousName(UnknownShape):
    """A short name that stands for more than one registry name; the message lists them."""


class MismatchedSet(UnknownShape):
    """A transcoder set made for other models than the one named with it."""


#: Gemma-3 4b and 12b are multimodal: circuit-tracer loads them with their SigLIP vision
#: tower (416,866,032 parameters) and a projector (1152 x d_model + 1152).
_SIGLIP_PARAMS: Final = 416_866_032
_MULTIMODAL: Final = frozenset(
    {
        "google/gemma-3-4b-pt",
        "google/gemma-3-4b-it",
        "google/gemma-3-12b-pt",
        "google/gemma-3-12b-it",
    }
)


def _vision_params(d_model: int) -> int:
    return _SIGLIP_PARAMS + 1152 * d_model + 1152


def shape_of_dims(name: str, dims: catalogue.ModelDims, *, vision: bool = False) -> ModelShape:
    """The estimator's shape of a model of ``dims`` (with its vision tower where ``vision``),
    named ``name``."""
    return ModelShape(
        name=name,
        family=dims.architecture,
        n_params=dims.n_model_params + (_vision_params(dims.d_model) if vision else 0),
        final_logit_softcap=catalogue.GEMMA_2_FINAL_SOFTCAP
        if dims.architecture == "gemma2"
        else None,
        **dims.dims(),
    )


#: The published models' shapes, from the catalogue's one table of their dimensions.
MODELS: Final[Mapping[str, ModelShape]] = MappingProxyType(
    {
        name: shape_of_dims(name, dims, vision=name in _MULTIMODAL)
        for name, dims in catalogue.PUBLISHED.items()
    }
)


@dataclass(frozen=True)
class TranscoderSetInfo:
    """A transcoder set as circuit-tracer loads it.

    Attributes:
        shape: width, cross-layer, skip connection (lazy flags not yet applied).
        models: the models it was trained on.
        lazy_capable: whether circuit-tracer can keep its matrices on disk (its own
            safetensors layout); GemmaScope npz and GemmaScope-2 files always load fully.
        l0: its active features per layer and token (average over layers), where published
            (sources in docs/registry-sources.md); None when not known.
    """

    shape: TranscoderShape
    models: tuple[str, ...]
    lazy_capable: bool
    l0: float | None = None

    @property
    def active_per_layer_token(self) -> float:
        """The active features per layer and token an estimate assumes for this set: its
        L0, else :data:`~pytest_ctresources.estimator.estimate.DEFAULT_ACTIVE_PER_LAYER_TOKEN`."""
        return DEFAULT_ACTIVE_PER_LAYER_TOKEN if self.l0 is None else self.l0

    @property
    def l0_source(self) -> str:
        """Where :attr:`active_per_layer_token` comes from, for reports."""
        if self.l0 is None:
            return "assumed: the set's L0 is not known"
        return f"{self.shape.name}'s L0"

    def loaded(self, *, lazy_encoder: bool = False, lazy_decoder: bool = True) -> TranscoderShape:
        """The shape with circuit-tracer's lazy-loading flags applied (its defaults here)."""
        from dataclasses import replace

        if not self.lazy_capable:
            return self.shape
        return replace(self.shape, lazy_encoder=lazy_encoder, lazy_decoder=lazy_decoder)


def _set(
    name: str,
    width: int,
    models: tuple[str, ...],
    *,
    lazy: bool,
    clt: bool = False,
    skip: bool = False,
    hook: str = RESID_MID_HOOK,
    l0: float | None = None,
) -> TranscoderSetInfo:
    shape = TranscoderShape(
        name=name, width=width, cross_layer=clt, skip_connection=skip, feature_input_hook=hook
    )
    return TranscoderSetInfo(shape, models, lazy, l0)


#: GemmaScope's gemma-2-2b transcoders as circuit-tracer's ``gemma`` set lists them: the
#: ``average_l0_N`` of each layer's file (76, 65, 49, ..., 37, 41), 1020 over 26 layers.
_GEMMA_SCOPE_L0: Final = 1020 / 26


_GEMMA_2_2B = ("google/gemma-2-2b", "google/gemma-2-2b-it")
_LLAMA_1B = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct")
#: The Qwen3 models and the one transcoder set circuit-tracer's README lists for each (163840
#: features per layer, reading the MLP's input): the set made for it and its usual one.
_QWEN3_SETS: Final = {
    "Qwen/Qwen3-0.6B": "mwhanna/qwen3-0.6b-transcoders-lowl0",
    "Qwen/Qwen3-1.7B": "mwhanna/qwen3-1.7b-transcoders-lowl0",
    "Qwen/Qwen3-4B": "mwhanna/qwen3-4b-transcoders",
    "Qwen/Qwen3-8B": "mwhanna/qwen3-8b-transcoders",
    "Qwen/Qwen3-14B": "mwhanna/qwen3-14b-transcoders-lowl0",
}

TRANSCODER_SETS: Final[Mapping[str, TranscoderSetInfo]] = MappingProxyType(
    {
        info.shape.name: info
        for info in (
            _set(
                "mwhanna/gemma-scope-transcoders",
                16384,
                _GEMMA_2_2B,
                lazy=False,
                hook=NORMALIZED_HOOK,
                l0=_GEMMA_SCOPE_L0,
            ),
            _set("mntss/transcoder-Llama-3.2-1B", 131072, _LLAMA_1B, lazy=True, skip=True),
            _set("mntss/clt-gemma-2-2b-426k", 16384, _GEMMA_2_2B, lazy=True, clt=True),
            _set("mntss/clt-gemma-2-2b-2.5M", 98304, _GEMMA_2_2B, lazy=True, clt=True),
            _set("mntss/clt-llama-3.2-1b-524k", 32768, _LLAMA_1B, lazy=True, clt=True),
            *(
                _set(set_name, 163840, (model,), lazy=True, hook="mlp.hook_in")
                for model, set_name in _QWEN3_SETS.items()
            ),
        )
    }
)

#: circuit-tracer's short names (``hf_utils.py``).
ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {"gemma": "mwhanna/gemma-scope-transcoders", "llama": "mntss/transcoder-Llama-3.2-1B"}
)

# GemmaScope-2 transcoders: one repo per Gemma-3 model, a subfolder per variant, e.g.
# mwhanna/gemma-scope-2-4b-it/transcoder_all/width_16k_l0_medium_affine. Width from the
# name; ``_affine`` adds a skip connection; always loaded fully.
#: The Gemma-3 models GemmaScope-2 covers: a size and pretrained or instruction-tuned.
_GEMMA_3_SIZE_KIND = r"(?P<size>1b|4b|12b)-(?P<kind>pt|it)"
#: The GemmaScope-2 sets :data:`_GEMMA_SCOPE_2` recognises, as listings and messages show them.
GEMMA_SCOPE_2_PATTERN: Final = (
    "mwhanna/gemma-scope-2-{1b,4b,12b}-{pt,it}/{transcoder_all,clt}/width_{16k,262k}_..."
)
_GEMMA_SCOPE_2 = re.compile(
    rf"gemma-scope-2-{_GEMMA_3_SIZE_KIND}"
    r"/(?P<layout>transcoder_all|clt)/width_(?P<width>\d+)k\w*?(?P<affine>_affine)?$"
)


def _gemma_scope_2(name: str) -> TranscoderSetInfo | None:
    match = _GEMMA_SCOPE_2.search(name)
    if match is None:
        return None
    model = f"google/gemma-3-{match['size']}-{match['kind']}"
    # "16k" is 2^14 features, "262k" 2^18: the nearest power of two.
    width = 1 << round(math.log2(int(match["width"]) * 1000))
    return _set(
        name,
        width,
        (model,),
        lazy=False,
        clt=match["layout"] == "clt",
        skip=match["affine"] is not None,
        hook="mlp.hook_in",
    )


def nearest(name: str, known: list[str], most: int = 5) -> str:
    """`` (nearest: a, b)``: the known names closest to a name the registry lacks."""
    import difflib

    close = difflib.get_close_matches(name, known, n=most, cutoff=0.4)
    if not close:  # a short name matches the end of a long one: "gemma-2-2b"
        lowered = name.lower()
        close = [k for k in known if lowered in k.lower()][:most]
    return f" (nearest: {', '.join(close)})" if close else ""


def known_models() -> list[str]:
    return sorted([*MODELS, *catalogue.BUNDLED_MODELS])


def known_transcoder_sets() -> list[str]:
    return sorted([*ALIASES, *TRANSCODER_SETS, GEMMA_SCOPE_2_PATTERN])


def model_shape(name: str) -> ModelShape:
    """The registry's (or a bundled random model's) shape of model ``name``."""
    if name in MODELS:
        return MODELS[name]
    if catalogue.is_bundled_model(name):
        return _bundled_model(name)
    if _is_config_json(name):
        return model_from_config_json(name)
    raise UnknownShape(
        f"unknown model {shown(name)}{nearest(name, known_models())}; "
        f"{len(known_models())} are known (docs/registry-sources.md), or give the path of a "
        "local config.json"
    )


def transcoder_info(name: str, model: str | None = None) -> TranscoderSetInfo:
    """The registry's entry for transcoder set ``name`` (an alias, repo or GemmaScope-2
    subfolder); ``model`` is needed for the bundled random set, which fits any model."""
    if name in catalogue.BUNDLED_TRANSCODER_SETS and model is not None:
        if catalogue.is_bundled_model(model):
            dims = catalogue.model_dims_of(model)
            return _set(
                name,
                dims.d_transcoder,
                (model,),
                lazy=False,
                clt=dims.cross_layer,
                skip=dims.skip_connection,
                hook=catalogue.default_hooks(dims)[0],
                l0=float(catalogue.DEFAULT_FEATURES_PER_TOKEN),
            )
    resolved = ALIASES.get(name, name)
    if resolved in TRANSCODER_SETS:
        return TRANSCODER_SETS[resolved]
    found = _gemma_scope_2(resolved)
    if found is not None:
        return found
    if name in catalogue.BUNDLED_TRANSCODER_SETS:
        raise UnknownShape(
            f"transcoder set {shown(name)} fits only the bundled models "
            f"({', '.join(sorted(catalogue.BUNDLED_MODELS))}), not {model!r}"
        )
    raise UnknownShape(
        f"unknown transcoder set {shown(name)}{nearest(name, known_transcoder_sets())}; "
        f"{len(known_transcoder_sets())} are known (docs/registry-sources.md)"
    )


# --- names as people type them ------------------------------------------------------------
# ct-resources takes short names (``gemma-2-2b``, ``qwen3-4b``, ``width_16k_l0_small``) and
# resolves them here to the registry's full names. Experiment YAML does not: MODEL_NAME and
# TRANSCODER_SET go to circuit-tracer and Hugging Face as written, where a short name is a
# different hub id or a local folder (docs/estimator-cli.md).

#: What separates the parts of a name: a short name matches whole parts only, so ``gemma``
#: matches ``google/gemma-2-2b`` but ``mma`` does not.
_SEPARATORS: Final = frozenset("/-_.")


def _matches_whole_parts(short: str, name: str) -> bool:
    """Whether ``short`` occurs in ``name`` (case-insensitively) between separators or the
    ends of ``name``."""
    needle, text = short.lower(), name.lower()
    start = text.find(needle)
    while start != -1 and needle:
        end = start + len(needle)
        if (start == 0 or text[start - 1] in _SEPARATORS) and (
            end == len(text) or text[end] in _SEPARATORS
        ):
            return True
        start = text.find(needle, start + 1)
    return False


def short_name_matches(short: str, known: list[str]) -> list[str]:
    """The names in ``known`` that ``short`` may stand for, most specific rule first: the name
    itself in any case; else the names whose last part (after the owner's ``/``) it is; else
    the names it is a run of whole parts of (``llama``, ``Llama-3.2``)."""
    lowered = short.lower()
    for rule in (
        lambda name: name.lower() == lowered,
        lambda name: name.rsplit("/", 1)[-1].lower() == lowered,
        lambda name: _matches_whole_parts(short, name),
    ):
        found = [name for name in known if rule(name)]
        if found:
            return found
    return []


def _is_config_json(name: str) -> bool:
    """Whether ``name`` is a ``config.json`` path or a folder holding one. A name no file can
    have (too long, a NUL byte) is none: the caller's lookup then names it as unknown."""
    path = Path(name)
    try:
        return path.name == "config.json" or (path.is_dir() and (path / "config.json").is_file())
    except (OSError, ValueError):
        return False


def short_name_note(name: str, resolved: str) -> str:
    """Why a short name in an experiment config does not load: what ``ct-resources
    estimate`` and a model that failed to load both say of it."""
    return (
        f"{shown(name)} is short for {resolved}; experiment configs take the full name, which "
        "circuit-tracer loads (short names work on the command line)"
    )


def resolve_model_name(name: str) -> str:
    """The registry's full name for model ``name`` as a person types it: a full name (any
    case) or a short one that stands for one model only (``gemma-2-2b``, ``qwen3-4b``). A
    local ``config.json`` (or a folder holding one) is taken as it is, before any short name;
    a name nothing matches comes back unchanged, for :func:`model_shape` to refuse with the
    nearest names.

    Raises:
        AmbiguousName: the short name stands for several models (the message lists them).
    """
    known = known_models()
    if name in known or _is_config_json(name):
        return name
    # The registry's models before the bundled random ones: those are what people mean.
    found = sorted(short_name_matches(name, known), key=catalogue.is_bundled_model)
    if len(found) > 1:
        raise AmbiguousName(
            f"ambiguous model name {shown(name)}: it could be {', '.join(found)}; "
            "give one of them in full"
        )
    return found[0] if found else name


#: A GemmaScope-2 variant without its repository (``width_16k_l0_small``, as the batch-size
#: table prints it, or ``clt/width_262k_l0_medium_affine``): the model says which repository.
_GEMMA_SCOPE_2_VARIANT = re.compile(
    r"(?:(?P<layout>transcoder_all|clt)/)?(?P<variant>width_\d+k\w*)"
)
_GEMMA_3_MODEL = re.compile(rf"google/gemma-3-{_GEMMA_3_SIZE_KIND}")


def _gemma_scope_2_of(variant: re.Match[str], model: str | None) -> str:
    """The GemmaScope-2 set of ``variant`` made for ``model``."""
    layout = variant["layout"] or "transcoder_all"
    example = f"mwhanna/gemma-scope-2-4b-it/{layout}/{variant['variant']}"
    gemma_3 = None if model is None else _GEMMA_3_MODEL.fullmatch(model)
    if gemma_3 is None:
        error = UnknownShape if model is None else MismatchedSet
        raise error(
            f"transcoder set {shown(variant.string)} is a GemmaScope-2 variant, made for "
            "google/gemma-3-{1b,4b,12b}-{pt,it} (one repository each), "
            + ("and no model is named" if model is None else f"not for {model}")
            + f": name a Gemma-3 model with it, or the set in full ({example})"
        )
    repo = f"mwhanna/gemma-scope-2-{gemma_3['size']}-{gemma_3['kind']}"
    return f"{repo}/{layout}/{variant['variant']}"


def _models_of(set_name: str) -> tuple[str, ...]:
    info = TRANSCODER_SETS.get(ALIASES.get(set_name, set_name)) or _gemma_scope_2(set_name)
    return () if info is None else info.models


def resolve_transcoder_set(name: str, model: str | None = None) -> str:
    """The registry's name for transcoder set ``name`` as a person types it, given the model
    it goes with (a full name, or None): circuit-tracer's aliases (``gemma``, ``llama``) and
    full names stay as they are; a GemmaScope-2 variant (``width_16k_l0_small``) becomes the
    one of ``model``'s repository; a short name stands for the sets it matches
    (:func:`short_name_matches`), and where several do, for those made for ``model``. A name
    nothing matches comes back unchanged, for :func:`transcoder_info` to refuse.

    Raises:
        AmbiguousName: the short name stands for several sets (the message lists them).
        MismatchedSet: a GemmaScope-2 variant with a model that is not a Gemma-3 one.
    """
    bundled = sorted(catalogue.BUNDLED_TRANSCODER_SETS)
    if name in ALIASES or name in TRANSCODER_SETS or name in bundled or _gemma_scope_2(name):
        return name
    variant = _GEMMA_SCOPE_2_VARIANT.fullmatch(name)
    if variant is not None:
        return _gemma_scope_2_of(variant, model)
    alias = [key for key in ALIASES if key == name.lower()]
    if alias:
        return alias[0]
    found = short_name_matches(name, [*TRANSCODER_SETS, *bundled])
    made_for_model = [set_name for set_name in found if model in _models_of(set_name)]
    if len(found) > 1 and made_for_model:
        found = made_for_model
    if len(found) > 1:
        scope = f"for {model} " if made_for_model else ""
        raise AmbiguousName(
            f"ambiguous transcoder set {shown(name)}: {scope}it could be {', '.join(found)}; "
            "give one of them in full"
        )
    return found[0] if found else name


#: The transcoder set ``ct-resources estimate --model NAME`` uses when none is named: among
#: the sets made for the model, the one circuit-tracer's own examples use with it (0.5.0's
#: README, its demos and tests). gemma-2-2b: ``gemma`` (the README's first example, the
#: attribution demo); gemma-2-2b-it: ``gemma`` too (gemma_it_demo: base-model transcoders on
#: the instruct model); Llama-3.2-1B: ``llama`` (the README's CLI example, the attribution
#: demo's "Llama-3.2-1B, with llama transcoders"), and for -Instruct the same, as the
#: registry lists it for both; each Qwen3 model: the one set the README lists for its size.
#: Gemma-3 has none: the README's only example names a set that does not exist ("gemma-3")
#: and the tests use different GemmaScope-2 variants (16k and 262k features, whose estimates
#: differ tenfold), so a Gemma-3 model needs its set named.
USUAL_TRANSCODER_SETS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "google/gemma-2-2b": "gemma",
        "google/gemma-2-2b-it": "gemma",
        "meta-llama/Llama-3.2-1B": "llama",
        "meta-llama/Llama-3.2-1B-Instruct": "llama",
        **_QWEN3_SETS,
    }
)


def usual_transcoder_set(model: str) -> str:
    """The set :data:`USUAL_TRANSCODER_SETS` names for ``model`` (the bundled random set for
    a bundled model).

    Raises:
        UnknownShape: the registry has no usual set for ``model``; the message says what to
            name instead.
    """
    if catalogue.is_bundled_model(model):
        return catalogue.RANDOM_TRANSCODERS
    if model in USUAL_TRANSCODER_SETS:
        return USUAL_TRANSCODER_SETS[model]
    gemma_3 = _GEMMA_3_MODEL.fullmatch(model)
    if gemma_3 is not None:
        repo = f"mwhanna/gemma-scope-2-{gemma_3['size']}-{gemma_3['kind']}"
        raise UnknownShape(
            f"no usual transcoder set for {model}: GemmaScope-2 has several for it and "
            "circuit-tracer's examples settle on none (e.g. width_16k_l0_small, short for "
            f"{repo}/transcoder_all/width_16k_l0_small)"
        )
    made_for = [name for name, info in TRANSCODER_SETS.items() if model in info.models]
    sets = (
        f" (the registry knows {', '.join(made_for)})" if made_for else ": the registry knows none"
    )
    raise UnknownShape(f"no usual transcoder set for {model}{sets}")


def check_pair(model: str, set_name: str) -> None:
    """Refuse a transcoder set made for other models than ``model``. Only models the
    registry names are checked: a local ``config.json`` says nothing of its transcoders.

    Raises:
        MismatchedSet: the message names the set, the models it was made for, ``model`` and
            the set usually used with ``model``.
        UnknownShape: ``set_name`` is not known.
    """
    if model not in MODELS and not catalogue.is_bundled_model(model):
        return
    info = transcoder_info(set_name, model)
    if model in info.models:
        return
    # Both names are known by now (the registry's own), so they are quoted whole.
    full = "" if info.shape.name == set_name else f" ({info.shape.name})"
    try:
        usual = f"; {model}'s usual set is {usual_transcoder_set(model)}"
    except UnknownShape:
        usual = ""
    raise MismatchedSet(
        f"transcoder set {set_name}{full} was made for {', '.join(info.models)}, "
        f"not for {model}{usual}"
    )


def _bundled_model(name: str) -> ModelShape:
    return shape_of_dims(name, catalogue.model_dims_of(name))


_FAMILIES: Final = {
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "llama": "llama",
    "qwen3": "qwen3",
}


#: The largest ``config.json`` read (a real one is a few KiB; Gemma-3's, with its vision
#: tower, under 10 KiB).
MAX_CONFIG_JSON_BYTES: Final = MIB
#: The largest dimension a ``config.json`` may give (real vocabularies are under 2**19).
MAX_DIMENSION: Final = 1 << 24

_CONFIG_KEYS: Final = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "d_mlp": "intermediate_size",
    "vocab_size": "vocab_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}


def _read_config_json(file: Path, where: str) -> object:
    """The JSON in ``file``, read as the input it is: a regular file (opening a FIFO for
    reading waits for a writer forever, ``/dev/zero`` never ends), at most
    :data:`MAX_CONFIG_JSON_BYTES`; nesting is bounded by json's decoder (a RecursionError)."""
    try:
        data = read_regular(file, MAX_CONFIG_JSON_BYTES)
    except Unreadable as exc:
        limit = " (the limit for a config.json)" if exc.too_large else ""
        raise UnknownShape(f"cannot read model config {where}: {exc}{limit}") from None
    try:
        return json.loads(data, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise UnknownShape(f"cannot read model config {where}: not UTF-8 text") from None
    except RecursionError:  # json's decoder stops at Python's recursion limit
        raise UnknownShape(f"cannot read model config {where}: nested too deep") from None
    except ValueError as exc:
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "integer string conversion" in problem:  # sys.get_int_max_str_digits()
            raise UnknownShape(
                f"cannot read model config {where}: an integer of over 4300 digits, more than "
                "Python reads"
            ) from None
        raise UnknownShape(f"cannot read model config {where}: {shown(problem)}") from None


def _no_constant(name: str) -> object:
    """JSON has no NaN or Infinity (Python's json reads them unless told not to)."""
    raise ValueError(f"{name} is not a JSON number")


def _dimension(text: Mapping[str, Any], name: str, key: str, where: str) -> int:
    """Dimension ``name`` of the model, from ``text[key]``: a JSON integer from 1 to
    :data:`MAX_DIMENSION` (``1e400`` is a float of infinity, 400 digits no model has)."""
    value = text[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise UnknownShape(f"{where}: {key} must be a whole number, got {shown(value)}")
    if value <= 0:
        raise UnknownShape(f"{where}: {name} must be positive, got {value}")
    if value > MAX_DIMENSION:
        raise UnknownShape(f"{where}: {key} must be at most {MAX_DIMENSION}, got {shown(value)}")
    return value


def model_from_config_json(path: str | Path) -> ModelShape:
    """A model's shape from its Hugging Face ``config.json`` (or the folder holding it).

    Multimodal Gemma-3 configs keep the language model in ``text_config``; its vision tower
    is counted as circuit-tracer loads it.

    Raises:
        UnknownShape: the file is missing, not a regular file of at most
            :data:`MAX_CONFIG_JSON_BYTES`, not JSON, or lacks a needed key; a dimension is
            not a whole number from 1 to :data:`MAX_DIMENSION`. One line naming the file
            and the field.
    """
    file = Path(path)
    try:
        if file.is_dir():
            file = file / "config.json"
    except (OSError, ValueError):
        pass  # reading it says what is wrong
    where = printable(str(file))
    config = _read_config_json(file, where)
    if not isinstance(config, dict) or not isinstance(config.get("text_config", {}), dict):
        raise UnknownShape(f"{where}: not a model config (a JSON object of the model's settings)")
    vision = "vision_config" in config and "text_config" in config
    text = config.get("text_config", config)
    model_type = text.get("model_type", config.get("model_type", ""))
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnknownShape(
            f"{where}: model_type {shown(model_type)} is not one of {', '.join(sorted(_FAMILIES))}"
        )
    try:
        if text.get("num_key_value_heads") is None:
            text = {**text, "num_key_value_heads": text["num_attention_heads"]}
        dims = {
            name: _dimension(text, name, key, where)
            for name, key in _CONFIG_KEYS.items()
            if key != "head_dim" or text.get("head_dim")
        }
    except KeyError as exc:
        raise UnknownShape(f"{where}: missing or invalid key {exc}") from None
    if "head_dim" not in dims:
        dims["head_dim"] = dims["d_model"] // dims["n_heads"]
    if dims["head_dim"] <= 0:  # d_model smaller than n_heads
        raise UnknownShape(f"{where}: head_dim must be positive, got {dims['head_dim']}")
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    params = catalogue.count_params(family, dims, tied=tied)
    if vision:
        params += _vision_params(dims["d_model"])
    softcap = text.get("final_logit_softcapping")
    if family == "gemma2" and "final_logit_softcapping" not in text:
        softcap = catalogue.GEMMA_2_FINAL_SOFTCAP  # Gemma2Config's default
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, int | float)
        or not math.isfinite(softcap)
        or not 0 <= softcap <= 1e6
    ):
        raise UnknownShape(
            f"{where}: final_logit_softcapping must be a number from 0 to 1e6 or null, got "
            f"{shown(softcap)}"
        )
    name = config.get("_name_or_path")
    return ModelShape(
        name=printable(name)[:200] if isinstance(name, str) and name else file.parent.name,
        family=family,
        n_params=params,
        final_logit_softcap=float(softcap) if softcap else None,
        **dims,
    )
