"""Load and validate the run config (configs/config.yaml) and a model config (configs/<model>.yaml).

Every key is declared once in ``SCHEMA`` / ``MODEL_SCHEMA`` with its type and
default, so an unknown key, a wrong type or a bad choice is reported at load
time as one line naming the file, the key and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from theanompi.comm import is_power_of_two
from theanompi.errors import ConfigError

__all__ = [
    "Config",
    "Section",
    "SCHEMA",
    "MODEL_SCHEMA",
    "RULES",
    "STRATEGIES",
    "SYNC_TYPES",
    "load_config",
    "find_config",
    "configs_dir",
    "check_world_size",
    "parse_override",
]

RULES = ("BSP", "EASGD")
STRATEGIES = ("ar", "asa32", "asa16", "copper")
SYNC_TYPES = ("avg", "cdd")
LAYOUTS = ("c01b", "bc01")
LR_POLICIES = ("step", "fixed")

# key: (type or tuple of choices, default). A tuple of str means "one of".
SCHEMA: dict[str, dict[str, tuple[Any, Any]]] = {
    "data": {
        "dir": (str, "data/digits"),  # output folder of `tmpi prep`
        "file_batch_size": (int, 128),  # B: images per hickle file
        "image_size": (int, 32),  # stored image side (prep --size)
        "layout": (LAYOUTS, "c01b"),
        "prefetch": (bool, True),  # load the next batch in a background thread
    },
    "weight_exchange": {
        "sync_rule": (RULES, "BSP"),
        "exch_strategy": (STRATEGIES, "ar"),
        "sync_type": (SYNC_TYPES, "avg"),  # avg: average params; cdd: average gradients
        "sync_start": (bool, True),  # EASGD: server and workers start in one mpirun
        "avg_freq": (int, 2),  # EASGD: elastic exchange every avg_freq steps
        "alpha": (float, 0.5),  # EASGD: elastic moving rate
        "check_every": (int, 0),  # debug: assert ranks bit-identical every K steps (0: off)
    },
    "randomness": {
        "shuffle": (bool, True),  # shuffle file order each epoch
        "rand_crop": (bool, True),
        "mirror": (bool, True),
        "seed": (int, 1234),
        "deterministic": (bool, False),  # turns shuffle, rand_crop and mirror off
    },
    "training": {
        "model": (str, "digits"),  # configs/<model>.yaml or a path
        "print_freq": (int, 10),  # progress line every print_freq steps
        "max_steps": (int, 0),  # stop each epoch after this many steps (0: whole epoch)
    },
    "output": {
        "run_dir": (str, "runs/{model}"),
        "checkpoint_dir": (str, "{run_dir}/checkpoints"),
        "record_dir": (str, "{run_dir}/record"),
        "snapshot_freq": (int, 1),  # checkpoint every snapshot_freq epochs
    },
}

MODEL_SCHEMA: dict[str, tuple[Any, Any]] = {
    "name": (str, None),  # key in theanompi.models registry
    "input_size": (int, 28),  # crop side fed to the network
    "channels": (int, 3),
    "n_classes": (int, 10),
    "batch_size": (int, 32),  # per-worker sub-batch; must divide data.file_batch_size
    "n_epochs": (int, 10),
    "learning_rate": (float, 0.01),
    "lr_policy": (LR_POLICIES, "step"),
    "lr_step": (list, []),  # epochs after which lr *= lr_gamma
    "lr_gamma": (float, 0.1),
    "momentum": (float, 0.9),
    "nesterov": (bool, False),
    "weight_decay": (float, 0.0005),
    "arch": (dict, {}),  # model-specific; validated by the model's constructor
}


class Section(dict):
    """A dict whose keys read as attributes: ``cfg.data.dir``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


@dataclass
class Config:
    """A validated run: the run config's sections plus the model section."""

    data: Section
    weight_exchange: Section
    randomness: Section
    training: Section
    output: Section
    model: Section
    sources: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: dict(getattr(self, k)) for k in (*SCHEMA, "model")}


def configs_dir() -> Path:
    """The repository's configs/ folder."""
    return Path(__file__).resolve().parents[1] / "configs"


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
    known = sorted(q.stem for q in configs_dir().glob("*.yaml") if q.stem != "config")
    choices = f"choose from {', '.join(known)} or " if known else ""
    raise ConfigError(
        f"no model config {str(name_or_path)!r} in configs/; {choices}give a .yaml path"
    )


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}valid keys: {', '.join(valid)}"


def _type_name(t: Any) -> str:
    if isinstance(t, tuple):
        return "one of " + ", ".join(map(repr, t))
    return t.__name__


def _check_value(where: str, key: str, kind: Any, value: Any) -> Any:
    if isinstance(kind, tuple):
        if value not in kind:
            raise ConfigError(f"{where}: {key} is {value!r}; it must be {_type_name(kind)}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(
            f"{where}: {key} must be {kind.__name__}, got {value!r} ({type(value).__name__})"
        )
    return value


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


def _fill(
    where: str, schema: dict[str, tuple[Any, Any]], given: dict[str, Any], prefix: str
) -> Section:
    unknown = [k for k in given if k not in schema]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {prefix + unknown[0]!r}; {_suggest(unknown[0], list(schema))}"
        )
    out = Section()
    for key, (kind, default) in schema.items():
        if key in given:
            out[key] = _check_value(where, prefix + key, kind, given[key])
        else:
            out[key] = default if not isinstance(default, (list, dict)) else type(default)(default)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.batch_size=64"`` → ``("model.batch_size", 64)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. model.batch_size=64")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def load_config(
    path: str | Path | None = None,
    model: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Read the run config and its model config, apply ``overrides`` (``"section.key": value``,
    ``None`` values ignored), validate everything and return a :class:`Config`."""
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
    for key, value in run_over.items():
        sec, _, name = key.partition(".")
        if sec not in SCHEMA or not name:
            raise ConfigError(
                f"override {key!r}: unknown section; {_suggest(sec, [*SCHEMA, 'model'])}"
            )
        raw.setdefault(sec, {})[name] = value
    sections = {
        sec: _fill(where, schema, raw.get(sec, {}), f"{sec}.") for sec, schema in SCHEMA.items()
    }
    if model is not None:
        sections["training"]["model"] = str(model)

    model_path = find_config(sections["training"]["model"])
    mraw = _read_yaml(model_path)
    mraw.update(model_over)
    msec = _fill(str(model_path), MODEL_SCHEMA, mraw, "")
    if not msec.name:
        raise ConfigError(
            f"{model_path}: key 'name' is required (the model to build, e.g. small_cnn)"
        )
    cfg = Config(**sections, model=msec, sources=[str(run_path), str(model_path)])
    _cross_check(cfg)
    _expand_paths(cfg, model_path.stem)
    return cfg


def _cross_check(cfg: Config) -> None:
    B, b = cfg.data.file_batch_size, cfg.model.batch_size
    if B <= 0:
        raise ConfigError(f"data.file_batch_size must be positive, got {B}")
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
    if cfg.weight_exchange.avg_freq < 1:
        raise ConfigError(
            f"weight_exchange.avg_freq must be >= 1, got {cfg.weight_exchange.avg_freq}"
        )
    if not 0.0 < cfg.weight_exchange.alpha <= 1.0:
        raise ConfigError(
            f"weight_exchange.alpha must be in (0, 1], got {cfg.weight_exchange.alpha}"
        )
    if cfg.randomness.deterministic:
        cfg.randomness.update(shuffle=False, rand_crop=False, mirror=False)


def _expand_paths(cfg: Config, model_stem: str) -> None:
    out = cfg.output
    out["run_dir"] = out.run_dir.format(model=model_stem)
    out["checkpoint_dir"] = out.checkpoint_dir.format(run_dir=out.run_dir, model=model_stem)
    out["record_dir"] = out.record_dir.format(run_dir=out.run_dir, model=model_stem)


def check_world_size(cfg: Config, n_workers: int) -> None:
    """Checks that need the worker count: asa*/copper need a power of 2."""
    strategy = cfg.weight_exchange.exch_strategy
    if cfg.weight_exchange.sync_rule == "BSP" and strategy in ("asa32", "asa16", "copper"):
        if not is_power_of_two(n_workers):
            lower = 1 << (n_workers.bit_length() - 1)
            raise ConfigError(
                f"exch_strategy {strategy!r} needs a power-of-2 worker count, got N={n_workers}; "
                f"use -n {lower} or -n {lower * 2}, or --strategy ar (any N)"
            )
