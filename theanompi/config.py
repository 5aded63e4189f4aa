"""Load and validate the run config (configs/config.yaml) and a model config (configs/<model>.yaml).

Every key is declared once, as a field of a frozen section dataclass (``DataSection`` ...
``ModelSection``) with its type, default, and choices or range; so an unknown key, a wrong
type, a bad choice or a value out of range is reported at load time as one line naming the
file, the key and the fix. Choices that name a component (``sync_rule``, ``exch_strategy``,
``compression``, ``model.name``) are read from that component's registry when validating,
never listed here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import yaml

from theanompi.comm import is_power_of_two
from theanompi.errors import ConfigError

__all__ = [
    "Config",
    "Section",
    "DataSection",
    "WeightExchangeSection",
    "RandomnessSection",
    "TrainingSection",
    "OutputSection",
    "ModelSection",
    "SCHEMA",
    "MODEL_SCHEMA",
    "choices",
    "fill_choices",
    "to_plain",
    "load_config",
    "find_config",
    "configs_dir",
    "check_world_size",
    "parse_override",
]

LAYOUTS = ("c01b", "bc01")
LR_POLICIES = ("step", "fixed")
LR_SCALINGS = ("none", "linear")


# -- choices read from the registries (imported only when a config is validated) ------------
def _rule_names() -> tuple[str, ...]:
    from theanompi.rules import RULES

    return tuple(RULES)


def _strategy_names() -> tuple[str, ...]:
    from theanompi.exchange import STRATEGIES

    return tuple(STRATEGIES)


def _sync_type_names() -> tuple[str, ...]:
    from theanompi.rules.bsp import SYNC_TYPES

    return tuple(SYNC_TYPES)


def _compressor_names() -> tuple[str, ...]:
    from theanompi.exchange.compression import COMPRESSORS

    return tuple(COMPRESSORS)


def _model_names() -> tuple[str, ...]:
    from theanompi.models import MODELS

    return tuple(MODELS)


# -- ranges: (predicate, what the message says the value must be) -----------------------------
Range = tuple[Callable[[Any], bool], str]
_POSITIVE: Range = (lambda v: v > 0, "positive")
_AT_LEAST_1: Range = (lambda v: v >= 1, ">= 1")
_NON_NEGATIVE: Range = (lambda v: v >= 0, ">= 0")
_UNIT: Range = (lambda v: 0.0 < v <= 1.0, "in (0, 1]")


def key(
    default: Any,
    *,
    choices: tuple[str, ...] | Callable[[], Iterable[str]] | None = None,
    check: Range | None = None,
) -> Any:
    """A config key with ``choices`` (a tuple, or a registry read when validating) or a range."""
    meta = {"choices": choices, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: _freeze(default), metadata=meta)
    return field(default=default, metadata=meta)


class _FrozenDict(Mapping[str, Any]):
    """A read-only dict (the model's ``arch``)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def to_plain(value: Any) -> Any:
    """A config value as YAML/JSON holds it: mappings become dicts, tuples lists (a copy).

    >>> to_plain({"arch": _freeze({"hidden": [5, 3]})})
    {'arch': {'hidden': [5, 3]}}
    """
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


@cache
def _fields(cls: type) -> dict[str, Field[Any]]:
    return {f.name: f for f in fields(cls)}


class Section(Mapping[str, Any]):
    """Base of the typed sections: frozen dataclasses that also read as read-only mappings,
    so ``cfg.data.dir``, ``cfg.data["dir"]`` and ``dict(cfg.model)`` all work."""

    def __getitem__(self, name: str) -> Any:
        if name not in _fields(type(self)):
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_fields(type(self)))

    def __len__(self) -> int:
        return len(_fields(type(self)))

    def to_dict(self) -> dict[str, Any]:
        """The section as plain YAML/JSON values."""
        return {name: to_plain(getattr(self, name)) for name in self}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every key's default as plain values."""
        out = {}
        for f in fields(cls):
            value = f.default if f.default_factory is MISSING else f.default_factory()
            out[f.name] = to_plain(value)
        return out


@dataclass(frozen=True)
class DataSection(Section):
    """``data``: where ``tmpi prep`` wrote the dataset and how it is stored."""

    dir: str = "data/digits"  # output folder of `tmpi prep`
    file_batch_size: int = key(128, check=_POSITIVE)  # B: images per hickle file
    image_size: int = 32  # stored image side (prep --size)
    layout: str = key("c01b", choices=LAYOUTS)
    prefetch: bool = True  # load the next batch in a background thread


@dataclass(frozen=True)
class WeightExchangeSection(Section):
    """``weight_exchange``: how the workers' replicas are kept together."""

    sync_rule: str = key("BSP", choices=_rule_names)  # theanompi.rules.RULES
    exch_strategy: str = key("ar", choices=_strategy_names)  # theanompi.exchange.STRATEGIES
    sync_type: str = key("avg", choices=_sync_type_names)  # BSP: avg params; cdd: grads
    sync_start: bool = True  # EASGD: server and workers start in one mpirun
    avg_freq: int = key(2, check=_AT_LEAST_1)  # EASGD: elastic exchange every avg_freq steps
    alpha: float = key(0.5, check=_UNIT)  # EASGD: elastic moving rate
    # values on the wire (asa16 implies fp16): theanompi.exchange.compression.COMPRESSORS
    compression: str = key("none", choices=_compressor_names)
    gossip_p: float = key(0.5, check=_UNIT)  # GOSGD: probability that a worker pushes after a step
    check_every: int = 0  # debug: assert ranks bit-identical every K steps (0: off)


@dataclass(frozen=True)
class RandomnessSection(Section):
    """``randomness``: data order and augmentation."""

    shuffle: bool = True  # shuffle file order each epoch
    rand_crop: bool = True
    mirror: bool = True
    seed: int = 1234
    deterministic: bool = False  # turns shuffle, rand_crop and mirror off


@dataclass(frozen=True)
class TrainingSection(Section):
    """``training``: which model config, progress lines, and the learning-rate schedule."""

    model: str = "digits"  # configs/<model>.yaml, a path, or a registered model name
    print_freq: int = 10  # progress line every print_freq steps
    max_steps: int = 0  # stop each epoch after this many steps (0: whole epoch)
    # linear: lr x global batch / lr_reference_batch
    lr_scaling: str = key("none", choices=LR_SCALINGS)
    lr_reference_batch: int = key(256, check=_AT_LEAST_1)  # the global batch lr is tuned for
    warmup_epochs: float = key(0.0, check=_NON_NEGATIVE)  # ramp lr linearly over these epochs


@dataclass(frozen=True)
class OutputSection(Section):
    """``output``: run folder, checkpoints, record and timeline ({model}, {run_dir} expanded)."""

    run_dir: str = "runs/{model}"
    checkpoint_dir: str = "{run_dir}/checkpoints"
    record_dir: str = "{run_dir}/record"
    snapshot_freq: int = 1  # checkpoint every snapshot_freq epochs
    timeline: str = ""  # Chrome trace of every rank's spans (empty: none)


@dataclass(frozen=True)
class ModelSection(Section):
    """A model config (configs/<model>.yaml), given to ``create_model`` as a mapping."""

    name: str = key("", choices=_model_names)  # required: theanompi.models.MODELS
    input_size: int = 28  # crop side fed to the network
    channels: int = 3
    n_classes: int = 10
    batch_size: int = 32  # per-worker sub-batch; must divide data.file_batch_size
    n_epochs: int = 10
    learning_rate: float = 0.01
    lr_policy: str = key("step", choices=LR_POLICIES)
    lr_step: tuple[int, ...] = ()  # epochs after which lr *= lr_gamma
    lr_gamma: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0005
    arch: Mapping[str, Any] = key({})  # model-specific; validated by the model's constructor


#: the run config's sections, in file order
SCHEMA: dict[str, type[Section]] = {
    "data": DataSection,
    "weight_exchange": WeightExchangeSection,
    "randomness": RandomnessSection,
    "training": TrainingSection,
    "output": OutputSection,
}
#: the model config's keys
MODEL_SCHEMA: type[ModelSection] = ModelSection


@dataclass(frozen=True)
class Config:
    """A validated run: the run config's sections plus the model section."""

    data: DataSection
    weight_exchange: WeightExchangeSection
    randomness: RandomnessSection
    training: TrainingSection
    output: OutputSection
    model: ModelSection
    sources: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain values (what checkpoints and records store)."""
        return {name: getattr(self, name).to_dict() for name in (*SCHEMA, "model")}


def choices(name: str) -> tuple[str, ...]:
    """The valid values of a choice key, e.g. ``choices("weight_exchange.sync_rule")``,
    read from its registry now (names added at run time count)."""
    sec, _, short = name.partition(".")
    cls = MODEL_SCHEMA if sec == "model" else SCHEMA[sec]
    found = _fields(cls)[short].metadata["choices"]
    if found is None:
        raise KeyError(f"{name} is not a choice key")
    return tuple(found() if callable(found) else found)


def configs_dir() -> Path:
    """The repository's configs/ folder."""
    return Path(__file__).resolve().parents[1] / "configs"


def _known_configs() -> list[str]:
    return sorted(q.stem for q in configs_dir().glob("*.yaml") if q.stem != "config")


def find_config(name_or_path: str | Path) -> Path:
    """``digits`` → configs/digits.yaml; an existing path is returned as is."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} not found; check the path")
        return p
    for cand in (Path("configs") / f"{p}.yaml", configs_dir() / f"{p}.yaml"):
        if cand.exists():
            return cand
    known = _known_configs()
    choices_ = f"choose from {', '.join(known)} or " if known else ""
    raise ConfigError(
        f"no model config {str(name_or_path)!r} in configs/; {choices_}give a .yaml path"
    )


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}valid keys: {', '.join(valid)}"


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _yaml_type(hint: Any) -> type:
    """The YAML type a field is written as: ``tuple[...]`` is a list, ``Mapping`` a dict."""
    origin = get_origin(hint) or hint
    return {tuple: list, Mapping: dict}.get(origin, origin)


def _check_value(where: str, name: str, f: Field[Any], hint: Any, value: Any) -> Any:
    valid = f.metadata.get("choices")
    if valid is not None:
        valid = tuple(valid() if callable(valid) else valid)
        if value not in valid:
            raise ConfigError(
                f"{where}: {name} is {value!r}; it must be one of {', '.join(map(repr, valid))}"
            )
        return value
    kind = _yaml_type(hint)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(
            f"{where}: {name} must be {kind.__name__}, got {value!r} ({type(value).__name__})"
        )
    check = f.metadata.get("check")
    if check is not None and not check[0](value):
        raise ConfigError(f"{name} must be {check[1]}, got {value!r}")
    return _freeze(value)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(
            f"{path}{line}: not valid YAML ({getattr(err, 'problem', err)})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def _checked(where: str, cls: type[Section], given: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``given`` validated against ``cls``'s fields, defaults filled in (the section's kwargs)."""
    known = _fields(cls)
    unknown = [k for k in given if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {prefix + unknown[0]!r}; {_suggest(unknown[0], list(known))}"
        )
    hints = _hints(cls)
    return {
        name: _check_value(where, prefix + name, known[name], hints[name], value)
        for name, value in given.items()
    }


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.batch_size=64"`` → ``("model.batch_size", 64)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. model.batch_size=64")
    name, raw = text.split("=", 1)
    return name.strip(), yaml.safe_load(raw)


def _model_source(name_or_path: str) -> tuple[dict[str, Any], str, str]:
    """(raw model keys, where they came from, run-dir stem) for ``training.model``: a config
    file, or else a registered model name, built from the schema defaults."""
    try:
        path = find_config(name_or_path)
    except ConfigError:
        if Path(name_or_path).suffix in (".yaml", ".yml"):
            raise
        models = _model_names()
        if name_or_path not in models:
            known = _known_configs()
            bare = ", ".join(m for m in models if m not in known)
            raise ConfigError(
                f"no model config {name_or_path!r} in configs/; choose from {', '.join(known)}, "
                f"a model without one ({bare}: schema defaults), or give a .yaml path"
            ) from None
        return {"name": name_or_path}, f"model {name_or_path} (schema defaults)", name_or_path
    return _read_yaml(path), str(path), path.stem


def _expand(name: str, template: str, **values: str) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError):
        fields_ = ", ".join("{" + k + "}" for k in values)
        raise ConfigError(
            f"output.{name} is {template!r}; its only placeholders can be {fields_}"
        ) from None


def load_config(
    path: str | Path | None = None,
    model: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Read the run config and its model config, apply ``overrides`` (``"section.key": value``,
    ``None`` values ignored), validate everything and return a frozen :class:`Config`.

    ``model`` (or ``training.model``) names configs/<model>.yaml, a YAML path, or a model
    registered in :data:`theanompi.models.MODELS` without a config file: then the model
    section is the schema defaults with ``name`` set.
    """
    run_path = Path(path) if path is not None else configs_dir() / "config.yaml"
    if not run_path.exists():
        raise ConfigError(f"config file {str(run_path)!r} not found; pass --config PATH")
    raw = _read_yaml(run_path)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    where = str(run_path)
    for sec in raw:
        if sec not in SCHEMA:
            raise ConfigError(f"{where}: unknown section {sec!r}; {_suggest(sec, list(SCHEMA))}")
        if not isinstance(raw[sec], dict):
            raise ConfigError(f"{where}: section {sec!r} must be a mapping of keys")
    model_over = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("model.")}
    run_over = {k: v for k, v in overrides.items() if not k.startswith("model.")}
    for name, value in run_over.items():
        sec, _, short = name.partition(".")
        if sec not in SCHEMA or not short:
            raise ConfigError(
                f"override {name!r}: unknown section; {_suggest(sec, [*SCHEMA, 'model'])}"
            )
        raw.setdefault(sec, {})[short] = value
    given = {sec: _checked(where, cls, raw.get(sec, {}), f"{sec}.") for sec, cls in SCHEMA.items()}
    if model is not None:
        given["training"]["model"] = str(model)

    mraw, model_where, stem = _model_source(given["training"].get("model", TrainingSection.model))
    mraw.update(model_over)
    mgiven = _checked(model_where, ModelSection, mraw, "")
    if not mgiven.get("name"):
        raise ConfigError(
            f"{model_where}: key 'name' is required (the model to build, e.g. small_cnn)"
        )

    if given["randomness"].get("deterministic"):
        given["randomness"].update(shuffle=False, rand_crop=False, mirror=False)
    out = OutputSection(**given["output"])
    run_dir = _expand("run_dir", out.run_dir, model=stem)
    given["output"].update(
        run_dir=run_dir,
        checkpoint_dir=_expand("checkpoint_dir", out.checkpoint_dir, run_dir=run_dir, model=stem),
        record_dir=_expand("record_dir", out.record_dir, run_dir=run_dir, model=stem),
    )
    sections = {sec: cls(**given[sec]) for sec, cls in SCHEMA.items()}
    cfg = Config(
        **sections,  # type: ignore[arg-type]
        model=ModelSection(**mgiven),
        sources=(str(run_path), model_where),
    )
    _cross_check(cfg)
    return cfg


def _cross_check(cfg: Config) -> None:
    """Checks across keys (one key's range is checked with the key)."""
    B, b = cfg.data.file_batch_size, cfg.model.batch_size
    if b <= 0 or B % b:
        divisors = [d for d in range(1, B + 1) if B % d == 0]
        raise ConfigError(
            f"model.batch_size={b} does not divide data.file_batch_size={B}; use one of {divisors}"
        )
    if cfg.model.input_size > cfg.data.image_size:
        raise ConfigError(
            f"model.input_size={cfg.model.input_size} exceeds data.image_size={cfg.data.image_size}; "
            "crop must fit inside the stored images"
        )


def check_world_size(cfg: Config, size: int) -> None:
    """Checks that need the total rank count ``size`` (servers included).

    The rule's own (``rule_class(rule).check_world(size)``, e.g. a server plus a worker);
    then, for rules that exchange with ``exch_strategy``, the strategy's
    ``requires_power_of_two`` on the rule's worker count.
    """
    from theanompi.exchange import STRATEGIES, strategy_class
    from theanompi.rules import rule_class

    rule = rule_class(cfg.weight_exchange.sync_rule)
    rule.check_world(size)
    if not rule.uses_strategy:
        return
    strategy = cfg.weight_exchange.exch_strategy
    n = rule.n_workers(size)
    if strategy_class(strategy).requires_power_of_two and not is_power_of_two(n):
        lower, extra = 1 << (max(n, 1).bit_length() - 1), size - n
        any_n = [
            s
            for s in STRATEGIES
            if not (strategy_class(s).requires_power_of_two or strategy_class(s).baseline)
        ]
        other = f", or --strategy {any_n[0]} (any N)" if any_n else ""
        raise ConfigError(
            f"exch_strategy {strategy!r} needs a power-of-2 worker count, got N={n}; "
            f"use -n {lower + extra} or -n {2 * lower + extra}{other}"
        )


_PLACEHOLDER = re.compile(r"\{([a-z_]+\.[a-z_]+)\}")


def fill_choices(text: str) -> str:
    """``"Rule: {weight_exchange.sync_rule}."`` → ``"Rule: BSP, EASGD, GOSGD."`` (CLI help)."""
    return _PLACEHOLDER.sub(lambda m: ", ".join(choices(m[1])), text)
