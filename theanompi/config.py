"""Load and validate the run config (configs/config.yaml) and a model config (configs/<model>.yaml).

Every key is declared once, as a field of a frozen section dataclass (``DataSection`` ...
``ModelSection``, in :mod:`theanompi.models.section`) with its type, default, and choices or range; so an unknown key, a wrong
type, a bad choice or a value out of range is reported at load time as one line naming the
file, the key and the fix. Choices that name a component (``sync_rule``, ``exch_strategy``,
``compression``, ``model.name``) are read from that component's registry when validating,
never listed here.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from theanompi.comm import is_power_of_two
from theanompi.errors import ConfigError
from theanompi.models.section import ModelSection
from theanompi.registry import Registry, is_reference
from theanompi.schema import (
    AT_LEAST_1,
    DIR,
    NON_NEGATIVE,
    PATH,
    POSITIVE,
    SEED,
    UNIT,
    Section,
    checked,
    fields_of,
    key,
    path_ok,
    show,
    suggest,
    to_plain,
)

__all__ = [
    "Config",
    "Section",
    "DataSection",
    "WeightExchangeSection",
    "RandomnessSection",
    "TrainingSection",
    "OutputSection",
    "ElasticSection",
    "ModelSection",
    "SCHEMA",
    "MODEL_SCHEMA",
    "choices",
    "fill_choices",
    "to_plain",
    "load_config",
    "print_config",
    "find_config",
    "configs_dir",
    "run_config",
    "RUN_CONFIG",
    "check_world_size",
    "parse_override",
]

LAYOUTS = ("c01b", "bc01")
DATA_VERIFY = ("first_read", "all", "off")  # data.verify: batch digests against the manifest
LR_SCALINGS = ("none", "linear")


# -- choices read from the registries (a name, or a reference they resolve) (imported only when a config is validated) ------------
def _rules() -> Registry[Any]:
    from theanompi.rules import RULES

    return RULES


def _strategies() -> Registry[Any]:
    from theanompi.exchange import STRATEGIES

    return STRATEGIES


def _when() -> tuple[str, ...]:
    from theanompi.exchange import WHEN

    return WHEN


def _sync_type_names() -> tuple[str, ...]:
    from theanompi.rules.bsp import SYNC_TYPES

    return tuple(SYNC_TYPES)


def _compressors() -> Registry[Any]:
    from theanompi.exchange.compression import COMPRESSORS

    return COMPRESSORS


def _backends() -> Registry[Any]:
    from theanompi.models import BACKENDS

    return BACKENDS


def _loggers() -> Registry[Any]:
    from theanompi.io.loggers import LOGGERS

    return LOGGERS


@dataclass(frozen=True)
class DataSection(Section):
    """``data``: where ``tmpi prep`` wrote the dataset and how it is stored."""

    dir: str = key("data/digits", check=DIR)  # output folder of `tmpi prep`
    file_batch_size: int = key(128, check=POSITIVE)  # B: images per hickle file
    image_size: int = key(32, check=POSITIVE)  # stored image side (prep --size)
    layout: str = key("c01b", choices=LAYOUTS)
    prefetch: bool = True  # load the next batch in a background thread
    # check each batch's SHA-256 against the manifest: when first read in a run, all at start, off
    verify: str = key("first_read", choices=DATA_VERIFY)


@dataclass(frozen=True)
class WeightExchangeSection(Section):
    """``weight_exchange``: how the workers' replicas are kept together."""

    sync_rule: str = key("BSP", choices=_rules)  # theanompi.rules.RULES
    exch_strategy: str = key("ar", choices=_strategies)  # theanompi.exchange.STRATEGIES
    sync_type: str = key("avg", choices=_sync_type_names)  # BSP: avg params; cdd: grads
    sync_start: bool = True  # EASGD: server and workers start in one mpirun
    avg_freq: int = key(2, check=AT_LEAST_1)  # EASGD: elastic exchange every avg_freq steps
    alpha: float = key(0.5, check=UNIT)  # EASGD: elastic moving rate
    # values on the wire (asa16 implies fp16): theanompi.exchange.compression.COMPRESSORS
    compression: str = key("none", choices=_compressors)
    gossip_p: float = key(0.5, check=UNIT)  # GOSGD: probability that a worker pushes after a step
    check_every: int = key(0, check=NON_NEGATIVE)  # debug: ranks bit-identical every K steps
    # BSP cdd: exchange gradient buckets while the backward pass still runs (never: after it;
    # auto: when the ranks span more than one node, where the exchange is worth hiding)
    overlap: str = key("auto", choices=_when)
    bucket_mb: float = key(25.0, check=POSITIVE)  # overlap: MB of gradients per bucket
    # reduce inside each node, exchange between one leader per node, broadcast inside the node
    # (auto: when some node holds more than one rank, unless the strategy is node-aware: ar)
    hierarchical: str = key("auto", choices=_when)
    # BSP cdd (ar, asa32, asa16): each rank keeps the optimiser state of 1/N of the parameters
    # and updates only those (ZeRO-1); the parameters, not the gradients, are all-gathered
    shard_optimizer: bool = False


@dataclass(frozen=True)
class RandomnessSection(Section):
    """``randomness``: data order and augmentation."""

    shuffle: bool = True  # shuffle file order each epoch
    rand_crop: bool = True
    mirror: bool = True
    seed: int = key(1234, check=SEED)
    deterministic: bool = False  # turns shuffle, rand_crop and mirror off


@dataclass(frozen=True)
class TrainingSection(Section):
    """``training``: which model config, progress lines, and the learning-rate schedule."""

    model: str = key("digits", check=DIR)  # configs/<model>.yaml, a path, or a model name
    print_freq: int = key(10, check=AT_LEAST_1)  # progress line every print_freq steps
    max_steps: int = key(0, check=NON_NEGATIVE)  # stop each epoch after this many (0: all)
    # linear: lr x global batch / lr_reference_batch
    lr_scaling: str = key("none", choices=LR_SCALINGS)
    lr_reference_batch: int = key(256, check=AT_LEAST_1)  # the global batch lr is tuned for
    warmup_epochs: float = key(0.0, check=NON_NEGATIVE)  # ramp lr linearly over these epochs
    # gradient accumulation: each optimiser step takes the mean gradient of K sub-batches
    accumulate_steps: int = key(1, check=AT_LEAST_1)
    backend: str = key("c", choices=_backends)  # compiler: c (C++/BLAS) | jax (XLA, GPU-ready)
    # end the job (exit 1) naming the rank(s) a collective waited for this long (0: off)
    stall_timeout: float = key(300.0, check=NON_NEGATIVE)


@dataclass(frozen=True)
class OutputSection(Section):
    """``output``: run folder, checkpoints, record and timeline ({model}, {run_dir} expanded)."""

    run_dir: str = key("runs/{model}", check=DIR)
    checkpoint_dir: str = key("{run_dir}/checkpoints", check=DIR)
    record_dir: str = key("{run_dir}/record", check=DIR)
    snapshot_freq: int = key(1, check=NON_NEGATIVE)  # checkpoint every snapshot_freq epochs
    checkpoint_every_steps: int = key(0, check=NON_NEGATIVE)  # + mid-epoch, every K steps (0: off)
    checkpoint_every_minutes: float = key(0.0, check=NON_NEGATIVE)  # + every M minutes (0: off)
    keep_last: int = key(0, check=NON_NEGATIVE)  # keep the last K checkpoints (0: all)
    timeline: str = key("", check=PATH)  # Chrome trace of every rank's spans (empty: none)
    # fed the record's step and epoch entries on rank 0: theanompi.io.loggers.LOGGERS
    loggers: tuple[str, ...] = key((), choices=_loggers)


@dataclass(frozen=True)
class ElasticSection(Section):
    """``elastic``: a lost rank leaves the job and the others go on (BSP; mpirun with ULFM)."""

    # go on while at least this many ranks are left (0: not elastic, a lost rank ends the job)
    min_np: int = key(0, check=NON_NEGATIVE)
    # copy parameters and optimiser state in memory every K steps: a loss redoes at most K
    commit_every_steps: int = key(1, check=AT_LEAST_1)
    max_np: int = key(0, check=NON_NEGATIVE)  # grow to at most this many ranks (0: -n)
    # prints the hosts available now, one host:slots a line; the job grows to new ones
    host_discovery_script: str = key("", check=PATH)
    timeout: float = key(600.0, check=NON_NEGATIVE)  # wait this long for min_np slots to come


#: the run config's sections, in file order
SCHEMA: dict[str, type[Section]] = {
    "data": DataSection,
    "weight_exchange": WeightExchangeSection,
    "randomness": RandomnessSection,
    "training": TrainingSection,
    "output": OutputSection,
    "elastic": ElasticSection,
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
    elastic: ElasticSection
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
    found = fields_of(cls)[short].metadata["choices"]
    if found is None:
        raise KeyError(f"{name} is not a choice key")
    return tuple(found() if callable(found) else found)


#: the resolved config a run keeps in its run dir (written by rank 0 at start)
RUN_CONFIG = "config.yaml"


def run_config(run_dir: str | Path | None) -> Path | None:
    """``<run_dir>/config.yaml`` where the run keeps one: what ``tmpi eval --run-dir R`` and
    ``tmpi train --resume --run-dir R`` rebuild the run from when given no --config or --model
    (its model too, a user's file included, so it need not be named again)."""
    path = Path(run_dir) / RUN_CONFIG if run_dir is not None else None
    return path if path is not None and _is_file(path) else None


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


def _is_file(p: Path) -> bool:
    """``p.is_file()``, False where the OS refuses the name itself (too long, a NUL byte)."""
    try:
        return p.is_file()
    except (OSError, ValueError):
        return False


def find_config(name_or_path: str | Path) -> Path:
    """``digits`` → configs/digits.yaml; a .yaml path or an existing file is returned as is
    (a folder named like a config, ``digits/`` in the working directory, never shadows it)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or _is_file(p):
        if not _is_file(p):
            raise ConfigError(f"config file {show(str(p))} not found; check the path")
        return p
    for cand in (Path("configs") / f"{p}.yaml", configs_dir() / f"{p}.yaml"):
        if _exists(cand):
            return cand
    known = _known_configs()
    choices_ = f"choose from {', '.join(known)} or " if known else ""
    raise ConfigError(
        f"no model config {show(str(name_or_path))} in configs/; {choices_}give a .yaml path"
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or type(err).__name__
        raise ConfigError(f"{show(str(path))}: cannot read ({reason}); check the path") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(
            f"{path}{line}: not valid YAML ({getattr(err, 'problem', err)})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.batch_size=64"`` → ``("model.batch_size", 64)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(
            f"--set {show(text)}: expected section.key=value, e.g. model.batch_size=64"
        )
    name, raw = text.split("=", 1)
    name = name.strip()
    if "." not in name or not all(name.split(".", 1)):
        raise ConfigError(
            f"--set {show(text)}: {show(name)} is not section.key, e.g. model.batch_size=64"
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        why = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            f"--set {show(text)}: the value is not valid YAML ({why}); quote a string, "
            f"e.g. {name}='text', or write a list as [1, 2]"
        ) from None
    if value is None:
        raise ConfigError(
            f"--set {show(text)}: no value given for {name}; write {name}=VALUE"
            " (an empty value is not 'unset': drop the --set to keep the config's value)"
        )
    return name, value


def _model_source(name_or_path: str) -> tuple[dict[str, Any], str, str]:
    """(raw model keys, where they came from, run-dir stem) for ``training.model``: a config
    file, or else a registered model name or a ``package.module:Class`` /
    ``path/to/file.py:Class`` reference, built from the schema defaults."""
    if is_reference(name_or_path):  # the class itself: its run dir is named after it
        stem = name_or_path.rpartition(":")[2]
        return {"name": name_or_path}, f"model {name_or_path} (schema defaults)", stem
    try:
        path = find_config(name_or_path)
    except ConfigError:
        if Path(name_or_path).suffix in (".yaml", ".yml"):
            raise
        models = choices("model.name")
        if name_or_path not in models:
            known = _known_configs()
            bare = ", ".join(m for m in models if m not in known)
            raise ConfigError(
                f"no model config {show(name_or_path)} in configs/; choose from {', '.join(known)}, "
                f"a model without one ({bare}: schema defaults), or give a .yaml path"
            ) from None
        return {"name": name_or_path}, f"model {name_or_path} (schema defaults)", name_or_path
    return _read_yaml(path), str(path), path.stem


def _folder_of(where: str) -> Path | None:
    """The folder of a config file that ``where`` names (None: not a file)."""
    return Path(where).parent if _is_file(Path(where)) else None


def _expand(name: str, template: str, **values: str) -> str:
    """``template`` with its ``{name}`` placeholders filled in; only plain names of ``values``
    (no ``{model.x}``, ``{0}``, ``{model!r}`` or format specs), ``{{``/``}}`` for braces."""
    fields_ = ", ".join("{" + k + "}" for k in values)
    bad = ConfigError(
        f"output.{name} is {show(template)}; its only placeholders can be {fields_} "
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
    if not path_ok(text, True):
        raise ConfigError(f"output.{name} expands to {show(text)}; it must be {DIR[1]}")
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
    section is the schema defaults with ``name`` set. A ``model:`` section in the run config
    holds the model's keys itself (what :func:`print_config` writes, e.g. a run dir's
    ``config.yaml``); ``model`` or a ``training.model`` override still name another one.
    """
    run_path = Path(path) if path is not None else configs_dir() / "config.yaml"
    if not _exists(run_path):
        raise ConfigError(f"config file {show(str(run_path))} not found; pass --config PATH")
    raw = _read_yaml(run_path)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    where = str(run_path)
    for sec in raw:
        if sec not in SCHEMA and sec != "model":
            raise ConfigError(
                f"{where}: unknown section {show(sec)}; {suggest(str(sec), [*SCHEMA, 'model'])}"
            )
        if not isinstance(raw[sec], dict):
            raise ConfigError(f"{where}: section {sec!r} must be a mapping of keys")
    embedded = raw.pop("model", None)  # the model's keys themselves (a run dir's config.yaml)
    model_over = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("model.")}
    run_over = {k: v for k, v in overrides.items() if not k.startswith("model.")}
    for name, value in run_over.items():
        sec, _, short = name.partition(".")
        if sec not in SCHEMA or not short:
            raise ConfigError(
                f"override {show(name)}: unknown section; {suggest(sec, [*SCHEMA, 'model'])}"
            )
        value = checked("command line", SCHEMA[sec], {short: value}, f"{sec}.")[short]
        raw.setdefault(sec, {})[short] = value  # as checked: a file reference made absolute
    model_over = checked("command line", ModelSection, model_over, "model.")
    given = {
        sec: checked(where, cls, raw.get(sec, {}), f"{sec}.", run_path.parent)
        for sec, cls in SCHEMA.items()
    }
    if model is not None:
        given["training"].update(
            checked("--model", TrainingSection, {"model": str(model)}, "training.")
        )

    named = model is not None or "training.model" in run_over  # a flag beats the file's section
    if embedded is not None and not named:
        model_where = f"{where} (model section)"
        stem = Path(given["training"].get("model", TrainingSection.model)).stem
        mgiven = checked(model_where, ModelSection, embedded, "model.", run_path.parent)
    else:
        mraw, model_where, stem = _model_source(
            given["training"].get("model", TrainingSection.model)
        )
        mgiven = checked(model_where, ModelSection, mraw, "model.", _folder_of(model_where))
    mgiven.update(model_over)
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


class _Dumper(yaml.SafeDumper):
    """safe_dump, with a list of scalars on one line (``loggers: [csv, tensorboard]``)."""


def _flow_list(dumper: yaml.SafeDumper, data: list[Any]) -> Any:
    flow = not any(isinstance(v, (list, dict)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _flow_list)

#: the output keys whose ``{...}`` placeholders load_config expands (braces escaped when written)
_EXPANDED = ("run_dir", "checkpoint_dir", "record_dir")


def print_config(cfg: Config) -> str:
    """``cfg`` as run-config YAML, every key, with the model's keys in a ``model:`` section,
    so that ``load_config(file)`` of the text gives ``cfg`` back (equal ``to_dict()``); a
    header comment names the files it came from. ``tmpi train`` writes it as
    ``<run_dir>/config.yaml``.

    >>> text = print_config(load_config(None, "digits"))
    >>> print(text[text.index("data:") : text.index("weight_exchange:")].strip())
    data:
      dir: data/digits
      file_batch_size: 128
      image_size: 32
      layout: c01b
      prefetch: true
      verify: first_read
    """
    data = cfg.to_dict()
    for k in _EXPANDED:  # already expanded: a literal brace must stay one when loaded again
        data["output"][k] = data["output"][k].replace("{", "{{").replace("}", "}}")
    lines = ["# theanompi run config, resolved: every key; load_config(this file) gives it back"]
    named = zip(("run config", "model"), cfg.sources, strict=False)  # sources may be ()
    lines += [f"# {what}: {src!r}" for what, src in named]
    parts = ["\n".join(lines) + "\n"]
    for sec, keys in data.items():
        parts.append(yaml.dump({sec: keys}, Dumper=_Dumper, sort_keys=False, width=10**9))
    return "\n".join(parts)


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
    rule = _rules().get(cfg.weight_exchange.sync_rule)
    # the rule refuses its own keys now (EASGD's sync_start: false), not inside the job
    rule.from_config(cfg.weight_exchange, seed=cfg.randomness.seed)
    if cfg.training.accumulate_steps > 1:  # the rule says whether it can step on K sub-batches
        rule.check_accumulate(cfg.training.accumulate_steps)
    if cfg.weight_exchange.shard_optimizer:
        rule.check_sharding(cfg.weight_exchange)
    el = cfg.elastic
    if (el.max_np or el.host_discovery_script) and not el.min_np:
        raise ConfigError(
            "elastic.max_np and elastic.host_discovery_script make a job elastic: give "
            "elastic.min_np (--min-np) too, the fewest ranks to go on with"
        )
    if el.max_np and el.max_np < el.min_np:
        raise ConfigError(
            f"elastic.max_np={el.max_np} is below elastic.min_np={el.min_np}; raise --max-np"
        )
    if el.min_np:
        if cfg.output.timeline:
            raise ConfigError(
                "elastic.min_np: the timeline gathers every rank's spans at the end, and a "
                "lost rank's are gone; set output.timeline: '' (or elastic.min_np: 0)"
            )


def check_world_size(cfg: Config, size: int) -> None:
    """Checks that need the total rank count ``size`` (servers included).

    The rule's own (``RULES.get(rule).check_world(size)``, e.g. a server plus a worker);
    then, for rules that exchange with ``exch_strategy``, the strategy's
    ``requires_power_of_two`` on the rule's worker count (not for an elastic job: on any N it
    goes on with a strategy that takes it).
    """
    from theanompi.exchange import STRATEGIES, any_n_strategies
    from theanompi.rules import RULES

    rule = RULES.get(cfg.weight_exchange.sync_rule)
    rule.check_world(size)
    if cfg.elastic.min_np > size:
        raise ConfigError(
            f"elastic.min_np={cfg.elastic.min_np} exceeds the {size} rank(s) started; "
            f"use --min-np {size} or less, or -n {cfg.elastic.min_np}"
        )
    if not rule.uses_strategy or cfg.elastic.min_np:  # elastic: any N (train.run.create_rule)
        return
    strategy = cfg.weight_exchange.exch_strategy
    n = rule.n_workers(size)
    if STRATEGIES.get(strategy).requires_power_of_two and not is_power_of_two(n):
        lower, extra = 1 << (max(n, 1).bit_length() - 1), size - n
        any_n = any_n_strategies()
        other = f", or --strategy {any_n[0]} (any N)" if any_n else ""
        raise ConfigError(
            f"exch_strategy {strategy!r} needs a power-of-2 worker count, got N={n}; "
            f"use -n {lower + extra} or -n {2 * lower + extra}{other}"
        )


_PLACEHOLDER = re.compile(r"\{([a-z_]+\.[a-z_]+)\}")


def fill_choices(text: str) -> str:
    """``"Rule: {weight_exchange.sync_rule}."`` → ``"Rule: BSP, EASGD, GOSGD."`` (CLI help)."""
    return _PLACEHOLDER.sub(lambda m: ", ".join(choices(m[1])), text)
