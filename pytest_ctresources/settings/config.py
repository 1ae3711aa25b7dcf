"""CircuitTracerConfig: the typed, frozen settings of one circuit-tracer experiment.

Every field is declared once in ``FIELDS`` with its default, its validation and its YAML
key; the layers (ini, YAML, marker, environment, option) only ever go through
:func:`validate_typed` / :func:`parse_text`, so a value is checked the same way wherever it
comes from. The config remembers the :class:`~pytest_ctresources.settings.sources.Source` of every
field, and converts to exactly the keyword arguments of ``circuit_tracer.attribute()`` and
``ReplacementModel.from_pretrained()``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from pytest_ctresources.settings.sources import Source

# Re-exported: the settings code and its callers quote values through config's names.
from pytest_ctresources.units import MAX_GIB as MAX_GIB
from pytest_ctresources.units import did_you_mean as did_you_mean
from pytest_ctresources.units import shown as shown

if TYPE_CHECKING:
    import torch

Backend = Literal["nnsight", "transformerlens"]
DType = Literal["float32", "bfloat16", "float16"]
Offload = Literal["cpu", "disk"]

BACKENDS: tuple[str, ...] = ("nnsight", "transformerlens")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
DTYPE_ALIASES: Mapping[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OFFLOADS: tuple[str, ...] = ("cpu", "disk")


class ConfigError(ValueError):
    """A value that does not fit a setting. The message is one line, ready for the user."""


#: The largest count a setting takes (batch sizes, feature nodes, tokens): a C ``int``,
#: what the tensor shapes these end up in are safe with, far beyond any real workload.
MAX_COUNT = 2**31 - 1

# --- value checks shared by every layer --------------------------------------------------


def _int_or_none(value: object) -> int | None:
    """``value`` if it is an int, else None. bool is an int subclass; ``BATCH_SIZE: true``
    must not mean batch size 1."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number_or_none(value: object) -> float | None:
    """``value`` if it is an int or a float (not a bool), else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def bound_text(most: float) -> str:
    """A bound as a message gives it: ``2147483647``, ``1024``, ``0.5``."""
    return str(int(most)) if float(most).is_integer() else f"{most:g}"


def _at_most(value: float, most: float, unit: str = "") -> None:
    # Compared before any float(): float(10**400) raises OverflowError, the comparison not.
    if value > most:
        raise ConfigError(f"must be at most {bound_text(most)}{unit}, got {shown(value)}")


def _positive_int(value: object) -> int:
    number = _int_or_none(value)
    if number is None or number <= 0:
        raise ConfigError(f"must be a positive integer, got {shown(value)}")
    _at_most(number, MAX_COUNT)
    return number


#: ``BATCH_SIZE: auto``: ct_session.attribute picks the batch size from the VRAM estimate.
AUTO = "auto"
#: ``ct_auto_margin``'s default: the share of the capacity auto leaves free beyond the
#: predicted peak (fragmentation, and what the estimator has not seen). Here, below both the
#: setting's declaration and the code that runs without pytest (``ct-resources``,
#: ``CtSession`` outside a run).
DEFAULT_AUTO_MARGIN = 0.05
#: The prompt length, in tokens, an estimate assumes where the prompt is not known yet
#: (``ct_estimate_prompt_tokens``'s default, and ``ct-resources estimate --prompt-tokens``').
DEFAULT_PROMPT_TOKENS = 32


def _batch_size(value: object) -> int | str:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    number = _int_or_none(value)
    if number is None or number <= 0:
        raise ConfigError(f"must be a positive integer or 'auto', got {shown(value)}")
    _at_most(number, MAX_COUNT)
    return number


def _number_text_hint(value: object) -> str:
    """For text that reads as a number (``5e-1`` in YAML, which YAML 1.1 takes as a string):
    how to write it so that it is one."""
    if not isinstance(value, str) or len(value) > 40:
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    return (
        " (text, not a number: YAML reads an exponent without a dot and a signed exponent "
        f"as text; write {number!r})"
    )


def gib_amount(value: object) -> float:
    """A positive, finite number of GiB, at most :data:`MAX_GIB`; else :class:`ConfigError`."""
    number = _number_or_none(value)
    if number is None or not number > 0 or number != number:
        raise ConfigError(
            f"must be a positive number of GiB, got {shown(value)}{_number_text_hint(value)}"
        )
    _at_most(number, MAX_GIB, " GiB")
    return float(number)


def _probability(value: object) -> float:
    number = _number_or_none(value)
    if number is None or not 0 < number <= 1:
        raise ConfigError(
            f"must be a number in (0, 1], got {shown(value)}{_number_text_hint(value)}"
        )
    return float(number)


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"must be a non-empty string, got {shown(value)}")
    if not value.isprintable():
        # A name with a newline or a NUL breaks every one-line message and header it is in.
        raise ConfigError(f"must be one line of printable text, got {shown(value)}")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, got {shown(value)}")
    return value


def _choice(
    choices: tuple[str, ...], aliases: Mapping[str, str] | None = None
) -> Callable[[object], str]:
    def check(value: object) -> str:
        if isinstance(value, str):
            value = (aliases or {}).get(value, value)
            if value in choices:
                return value
        raise ConfigError(f"must be one of {', '.join(choices)}; got {shown(value)}")

    return check


def _text_to_int(text: str) -> object:
    try:
        return int(text.strip())
    except ValueError:
        return text


def _text_to_number(text: str) -> object:
    try:
        return float(text.strip())
    except ValueError:
        return text


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _text_to_bool(text: str) -> object:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return text


def parse_bool(text: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0``; else :class:`ConfigError`."""
    return _bool(_text_to_bool(text))


def _text_to_optional(text: str) -> object:
    return None if text.strip().lower() in {"", "none", "null"} else text.strip()


@dataclass(frozen=True)
class FieldSpec:
    """How one config field is validated, and how its text form (CLI, env, ini) is read.

    Its default is :class:`CircuitTracerConfig`'s, and a field whose default is None may be
    null; what each field means is docs/configuration.md's table of YAML keys."""

    name: str
    check: Callable[[object], object]
    from_text: Callable[[str], object] = str.strip

    @property
    def yaml_key(self) -> str:
        return self.name.upper()

    @property
    def default(self) -> object:
        return getattr(CircuitTracerConfig, self.name)

    @property
    def nullable(self) -> bool:
        return self.default is None


FIELDS: Mapping[str, FieldSpec] = {
    spec.name: spec
    for spec in (
        FieldSpec("model_family", _text),
        FieldSpec("model_name", _text),
        FieldSpec("transcoder_set", _text),
        FieldSpec("backend", _choice(BACKENDS)),
        FieldSpec("dtype", _choice(DTYPES, DTYPE_ALIASES)),
        FieldSpec("batch_size", _batch_size, _text_to_int),
        FieldSpec("batch_size_max", _positive_int, _text_to_int),
        FieldSpec("max_feature_nodes", _positive_int, _text_to_int),
        FieldSpec("max_n_logits", _positive_int, _text_to_int),
        FieldSpec("desired_logit_prob", _probability, _text_to_number),
        FieldSpec("offload", _choice(OFFLOADS), _text_to_optional),
        FieldSpec("lazy_encoder", _bool, _text_to_bool),
        FieldSpec("lazy_decoder", _bool, _text_to_bool),
        FieldSpec("verbose", _bool, _text_to_bool),
        FieldSpec("vram_gib", gib_amount, _text_to_number),
    )
}

#: The YAML key that holds experiment parameters that are not ours (prompts, layer lists...).
PARAMS_KEY = "PARAMS"
#: The YAML key naming the notebook an experiment config runs (``pytest --nbmake``).
NOTEBOOK_KEY = "NOTEBOOK"


def validate_typed(name: str, value: object) -> object:
    """Check a typed value (from YAML or a marker) for field ``name``."""
    spec = FIELDS[name]
    if value is None and spec.nullable:
        return None
    return spec.check(value)


def checked_fields(values: Mapping[str, object]) -> dict[str, object]:
    """Check typed values by field name (a marker's, ``CtSession.from_yaml``'s keywords)."""
    checked: dict[str, object] = {}
    for name, value in values.items():
        if name not in FIELDS:
            raise ConfigError(
                f"unknown field {shown(name)}{did_you_mean(name, FIELDS)}; "
                f"fields: {', '.join(FIELDS)}"
            )
        try:
            checked[name] = validate_typed(name, value)
        except ConfigError as exc:
            raise ConfigError(f"{name} {exc}") from None
    return checked


def parse_text(name: str, text: str) -> object:
    """Read and check the text form of field ``name`` (from an option, env var or ini key)."""
    return validate_typed(name, FIELDS[name].from_text(text))


@dataclass(frozen=True)
class CircuitTracerConfig:
    """The resolved settings of one circuit-tracer experiment, with the source of each.

    Build one with :meth:`defaults` and :meth:`layered`; read a field's provenance with
    :meth:`source_of`. ``params`` holds the experiment's own parameters (the YAML ``PARAMS``
    mapping), passed through untouched.
    """

    model_family: str | None = None
    model_name: str | None = None
    transcoder_set: str | None = None
    backend: Backend = "nnsight"
    dtype: DType = "float32"
    batch_size: int | Literal["auto"] = 256
    batch_size_max: int = 512
    max_feature_nodes: int = 8192
    max_n_logits: int = 10
    desired_logit_prob: float = 0.95
    offload: Offload | None = None
    lazy_encoder: bool = False
    lazy_decoder: bool = True
    verbose: bool = False
    vram_gib: float | None = None
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    sources: Mapping[str, Source] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def defaults(cls) -> CircuitTracerConfig:
        """The built-in defaults, every field sourced ``default``."""
        return cls(sources=MappingProxyType({name: Source.default() for name in FIELDS}))

    def layered(
        self,
        values: Mapping[str, Any],
        source: Source | Callable[[str], Source],
        params: Mapping[str, Any] | None = None,
    ) -> CircuitTracerConfig:
        """A copy with ``values`` (already validated) laid over this config.

        ``source`` is the source of every value, or a function giving each field's source.
        """
        unknown = set(values) - set(FIELDS)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        source_of = source if callable(source) else (lambda _name: source)
        sources = dict(self.sources)
        sources.update({name: source_of(name) for name in values})
        merged_params = dict(self.params)
        merged_params.update(params or {})
        return dataclasses.replace(
            self,
            **values,
            params=MappingProxyType(merged_params),
            sources=MappingProxyType(sources),
        )

    def source_of(self, name: str) -> Source:
        """Where field ``name`` got its value."""
        if name not in FIELDS:
            raise KeyError(
                f"{name!r} is not a CircuitTracerConfig field{did_you_mean(name, FIELDS)}"
            )
        return self.sources.get(name, Source.default())

    def attribute_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``circuit_tracer.attribute(prompt, model, **kwargs)``."""
        return {
            "max_n_logits": self.max_n_logits,
            "desired_logit_prob": self.desired_logit_prob,
            "batch_size": self.batch_size,
            "max_feature_nodes": self.max_feature_nodes,
            "offload": self.offload,
            "verbose": self.verbose,
        }

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``circuit_tracer.ReplacementModel.from_pretrained(**kwargs)``.

        Raises :class:`ConfigError` when the model or transcoder set is not configured.
        """
        missing = [n.upper() for n in ("model_name", "transcoder_set") if getattr(self, n) is None]
        if missing:
            raise ConfigError(
                f"{' and '.join(missing)} not set: name them in the experiment YAML "
                "(--ct-config) or with @pytest.mark.ct_config(model_name=..., transcoder_set=...)"
            )
        return {
            "model_name": self.model_name,
            "transcoder_set": self.transcoder_set,
            "backend": self.backend,
            "dtype": self.torch_dtype(),
            "lazy_encoder": self.lazy_encoder,
            "lazy_decoder": self.lazy_decoder,
        }

    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by ``dtype`` (imports torch)."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def model_key(self) -> tuple[str | None, str | None, str, str]:
        """What identifies a loaded model: tests with equal keys share one ReplacementModel."""
        return (self.model_name, self.transcoder_set, self.backend, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Every field with its value and source, JSON-ready."""
        out: dict[str, Any] = {
            name: {"value": getattr(self, name), "source": str(self.source_of(name))}
            for name in FIELDS
        }
        out["params"] = _json_keys(self.params)
        return out

    def describe(self) -> list[str]:
        """``name = value (source)`` lines, one per field."""
        return [f"{name} = {getattr(self, name)!r} ({self.source_of(name)})" for name in FIELDS]


def _json_keys(value: Any) -> Any:
    """``value`` with every mapping key one JSON can hold (a YAML key may be a date, bytes
    or a tuple: ``json.dumps`` refuses those, and the whole JSON report was lost), as text."""
    if isinstance(value, Mapping):
        return {
            key if isinstance(key, str | int | float | bool) or key is None else str(key): (
                _json_keys(item)
            )
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_json_keys(item) for item in value]
    return value
