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
import math
import re
import string
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
DATA_VERIFY = ("first_read", "all", "off")  # data.verify: batch digests against the manifest
LR_POLICIES = ("step", "fixed")
LR_SCALINGS = ("none", "linear")
MAX_LR = 100.0  # model.learning_rate above this is a typo (1e18), not a schedule


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


def _backends() -> tuple[str, ...]:
    from theanompi.models.ops import BACKENDS

    return tuple(BACKENDS)


# -- ranges: (predicate, what the message says the value must be) -----------------------------
Range = tuple[Callable[[Any], bool], str]
_POSITIVE: Range = (lambda v: v > 0, "positive")
_AT_LEAST_1: Range = (lambda v: v >= 1, ">= 1")
_NON_NEGATIVE: Range = (lambda v: v >= 0, ">= 0")
_UNIT: Range = (lambda v: 0.0 < v <= 1.0, "in (0, 1]")
_FRACTION: Range = (lambda v: 0.0 <= v < 1.0, "in [0, 1)")
_SEED: Range = (lambda v: 0 <= v < 2**63, "in [0, 2**63)")
_LR: Range = (lambda v: 0.0 < v <= MAX_LR, f"in (0, {MAX_LR:g}] (a larger lr diverges at once)")
_EPOCHS: Range = (lambda v: all(s >= 1 for s in v), "a list of epoch counts >= 1, e.g. [20, 40]")
_PATH_MAX, _NAME_MAX = 4096, 255  # Linux limits: whole path, one component (bytes)


def _path_ok(p: str, required: bool) -> bool:
    if not p:
        return not required
    return (
        "\x00" not in p
        and len(p.encode(errors="replace")) <= _PATH_MAX
        and all(len(part.encode(errors="replace")) <= _NAME_MAX for part in p.split("/"))
    )


_PATH: Range = (
    lambda v: _path_ok(v, False),
    f"a path of <= {_PATH_MAX} bytes, names <= {_NAME_MAX}",
)
_DIR: Range = (
    lambda v: _path_ok(v, True),
    f"a non-empty path of <= {_PATH_MAX} bytes, names <= {_NAME_MAX}",
)


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

    dir: str = key("data/digits", check=_DIR)  # output folder of `tmpi prep`
    file_batch_size: int = key(128, check=_POSITIVE)  # B: images per hickle file
    image_size: int = key(32, check=_POSITIVE)  # stored image side (prep --size)
    layout: str = key("c01b", choices=LAYOUTS)
    prefetch: bool = True  # load the next batch in a background thread
    # check each batch's SHA-256 against the manifest: when first read in a run, all at start, off
    verify: str = key("first_read", choices=DATA_VERIFY)


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
    check_every: int = key(0, check=_NON_NEGATIVE)  # debug: ranks bit-identical every K steps


@dataclass(frozen=True)
class RandomnessSection(Section):
    """``randomness``: data order and augmentation."""

    shuffle: bool = True  # shuffle file order each epoch
    rand_crop: bool = True
    mirror: bool = True
    seed: int = key(1234, check=_SEED)
    deterministic: bool = False  # turns shuffle, rand_crop and mirror off


@dataclass(frozen=True)
class TrainingSection(Section):
    """``training``: which model config, progress lines, and the learning-rate schedule."""

    model: str = key("digits", check=_DIR)  # configs/<model>.yaml, a path, or a model name
    print_freq: int = key(10, check=_AT_LEAST_1)  # progress line every print_freq steps
    max_steps: int = key(0, check=_NON_NEGATIVE)  # stop each epoch after this many (0: all)
    # linear: lr x global batch / lr_reference_batch
    lr_scaling: str = key("none", choices=LR_SCALINGS)
    lr_reference_batch: int = key(256, check=_AT_LEAST_1)  # the global batch lr is tuned for
    warmup_epochs: float = key(0.0, check=_NON_NEGATIVE)  # ramp lr linearly over these epochs
    backend: str = key("c", choices=_backends)  # compiler: c (C++/BLAS) | jax (XLA, GPU-ready)
    # end the job (exit 1) naming the rank(s) a collective waited for this long (0: off)
    stall_timeout: float = key(300.0, check=_NON_NEGATIVE)


@dataclass(frozen=True)
class OutputSection(Section):
    """``output``: run folder, checkpoints, record and timeline ({model}, {run_dir} expanded)."""

    run_dir: str = key("runs/{model}", check=_DIR)
    checkpoint_dir: str = key("{run_dir}/checkpoints", check=_DIR)
    record_dir: str = key("{run_dir}/record", check=_DIR)
    snapshot_freq: int = key(1, check=_NON_NEGATIVE)  # checkpoint every snapshot_freq epochs
    checkpoint_every_steps: int = key(0, check=_NON_NEGATIVE)  # + mid-epoch, every K steps (0: off)
    checkpoint_every_minutes: float = key(0.0, check=_NON_NEGATIVE)  # + every M minutes (0: off)
    keep_last: int = key(0, check=_NON_NEGATIVE)  # keep the last K checkpoints (0: all)
    timeline: str = key("", check=_PATH)  # Chrome trace of every rank's spans (empty: none)


@dataclass(frozen=True)
class ModelSection(Section):
    """A model config (configs/<model>.yaml), given to ``create_model`` as a mapping."""

    name: str = key("", choices=_model_names)  # required: theanompi.models.MODELS
    input_size: int = key(28, check=_POSITIVE)  # crop side fed to the network
    channels: int = key(3, check=_POSITIVE)
    n_classes: int = key(10, check=_AT_LEAST_1)
    batch_size: int = key(32, check=_POSITIVE)  # per-worker sub-batch; divides file_batch_size
    n_epochs: int = key(10, check=_AT_LEAST_1)
    learning_rate: float = key(0.01, check=_LR)
    lr_policy: str = key("step", choices=LR_POLICIES)
    lr_step: tuple[int, ...] = key((), check=_EPOCHS)  # epochs after which lr *= lr_gamma
    lr_gamma: float = key(0.1, check=_POSITIVE)
    momentum: float = key(0.9, check=_FRACTION)
    nesterov: bool = False
    weight_decay: float = key(0.0005, check=_FRACTION)
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
    """The model and run configs: ``theanompi/configs`` (in a checkout, a link to the
    repository's configs/; in an installed wheel, the shipped copies)."""
    return Path(__file__).resolve().parent / "configs"


def _known_configs() -> list[str]:
    return sorted(q.stem for q in configs_dir().glob("*.yaml") if q.stem != "config")


def _exists(p: Path) -> bool:
    """``p.exists()``, False where the OS refuses the name itself (too long, a NUL byte)."""
    try:
        return p.exists()
    except (OSError, ValueError):
        return False


def find_config(name_or_path: str | Path) -> Path:
    """``digits`` → configs/digits.yaml; an existing path is returned as is."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or _exists(p):
        if not _exists(p):
            raise ConfigError(f"config file {_show(str(p))} not found; check the path")
        return p
    for cand in (Path("configs") / f"{p}.yaml", configs_dir() / f"{p}.yaml"):
        if _exists(cand):
            return cand
    known = _known_configs()
    choices_ = f"choose from {', '.join(known)} or " if known else ""
    raise ConfigError(
        f"no model config {_show(str(name_or_path))} in configs/; {choices_}give a .yaml path"
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


def _show(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened for a one-line message (a 200 kB path stays readable)."""
    text = repr(value)
    return (
        text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text)} chars)"
    )


def _as_float(value: Any) -> Any:
    """``1e-3`` is a str to YAML 1.1 (no dot): read such a str as the float it spells."""
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _check_value(where: str, name: str, f: Field[Any], hint: Any, value: Any) -> Any:
    valid = f.metadata.get("choices")
    if valid is not None:
        valid = tuple(valid() if callable(valid) else valid)
        if not isinstance(value, str) or value not in valid:
            raise ConfigError(
                f"{where}: {name} is {_show(value)}; it must be one of {', '.join(map(repr, valid))}"
            )
        return value
    kind = _yaml_type(hint)
    if kind is float:
        value = _as_float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise ConfigError(
            f"{where}: {name} must be {kind.__name__}, got {_show(value)} ({type(value).__name__})"
        )
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{where}: {name} must be a finite number, got {value!r}")
    if kind is list:  # tuple[int, ...]: every item of that type
        item = (getattr(hint, "__args__", None) or (Any,))[0]
        bad = [
            v for v in value if item is not Any and (isinstance(v, bool) or not isinstance(v, item))
        ]
        if bad:
            raise ConfigError(
                f"{where}: {name} must be a list of {item.__name__}, got {_show(value)} "
                f"({_show(bad[0])} is {type(bad[0]).__name__})"
            )
    check = f.metadata.get("check")
    if check is not None and not check[0](value):
        raise ConfigError(f"{where}: {name} must be {check[1]}, got {_show(value)}")
    return _freeze(value)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or type(err).__name__
        raise ConfigError(f"{_show(str(path))}: cannot read ({reason}); check the path") from None
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
    unknown = [str(k) for k in given if k not in known]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {_show(prefix + unknown[0])}; {_suggest(unknown[0], list(known))}"
        )
    hints = _hints(cls)
    return {
        name: _check_value(where, prefix + name, known[name], hints[name], value)
        for name, value in given.items()
    }


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.batch_size=64"`` → ``("model.batch_size", 64)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(
            f"--set {_show(text)}: expected section.key=value, e.g. model.batch_size=64"
        )
    name, raw = text.split("=", 1)
    name = name.strip()
    if "." not in name or not all(name.split(".", 1)):
        raise ConfigError(
            f"--set {_show(text)}: {_show(name)} is not section.key, e.g. model.batch_size=64"
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        why = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            f"--set {_show(text)}: the value is not valid YAML ({why}); quote a string, "
            f"e.g. {name}='text', or write a list as [1, 2]"
        ) from None
    if value is None:
        raise ConfigError(
            f"--set {_show(text)}: no value given for {name}; write {name}=VALUE"
            " (an empty value is not 'unset': drop the --set to keep the config's value)"
        )
    return name, value


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
                f"no model config {_show(name_or_path)} in configs/; choose from {', '.join(known)}, "
                f"a model without one ({bare}: schema defaults), or give a .yaml path"
            ) from None
        return {"name": name_or_path}, f"model {name_or_path} (schema defaults)", name_or_path
    return _read_yaml(path), str(path), path.stem


def _expand(name: str, template: str, **values: str) -> str:
    """``template`` with its ``{name}`` placeholders filled in; only plain names of ``values``
    (no ``{model.x}``, ``{0}``, ``{model!r}`` or format specs), ``{{``/``}}`` for braces."""
    fields_ = ", ".join("{" + k + "}" for k in values)
    bad = ConfigError(
        f"output.{name} is {_show(template)}; its only placeholders can be {fields_} "
        "(write {{ and }} for a literal brace)"
    )
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        raise bad from None
    out = []
    for literal, field_name, spec, conversion in parts:
        out.append(literal)
        if field_name is None:
            continue
        if field_name not in values or spec or conversion:
            raise bad
        out.append(values[field_name])
    text = "".join(out)
    if not _path_ok(text, True):
        raise ConfigError(f"output.{name} expands to {_show(text)}; it must be {_DIR[1]}")
    return text


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
    if not _exists(run_path):
        raise ConfigError(f"config file {_show(str(run_path))} not found; pass --config PATH")
    raw = _read_yaml(run_path)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    where = str(run_path)
    for sec in raw:
        if sec not in SCHEMA:
            raise ConfigError(
                f"{where}: unknown section {_show(sec)}; {_suggest(str(sec), list(SCHEMA))}"
            )
        if not isinstance(raw[sec], dict):
            raise ConfigError(f"{where}: section {sec!r} must be a mapping of keys")
    model_over = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("model.")}
    run_over = {k: v for k, v in overrides.items() if not k.startswith("model.")}
    for name, value in run_over.items():
        sec, _, short = name.partition(".")
        if sec not in SCHEMA or not short:
            raise ConfigError(
                f"override {_show(name)}: unknown section; {_suggest(sec, [*SCHEMA, 'model'])}"
            )
        _checked("command line", SCHEMA[sec], {short: value}, f"{sec}.")  # name the flag's value
        raw.setdefault(sec, {})[short] = value
    _checked("command line", ModelSection, model_over, "model.")
    given = {sec: _checked(where, cls, raw.get(sec, {}), f"{sec}.") for sec, cls in SCHEMA.items()}
    if model is not None:
        given["training"].update(
            _checked("--model", TrainingSection, {"model": str(model)}, "training.")
        )

    mraw, model_where, stem = _model_source(given["training"].get("model", TrainingSection.model))
    mraw.update(model_over)
    mgiven = _checked(model_where, ModelSection, mraw, "model.")
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
