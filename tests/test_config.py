"""The config loader: every bad-input case gives one ConfigError line naming the key and the fix."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import get_type_hints

import pytest
import yaml

from theanompi.config import (
    MODEL_SCHEMA,
    DataSection,
    WeightExchangeSection,
    check_world_size,
    choices,
    fill_choices,
    load_config,
    parse_override,
)
from theanompi.errors import ConfigError

MODEL_YAML = Path(__file__).parent / "model_mlp.yaml"
MODEL = {"name": "mlp", "input_size": 28, "channels": 3, "n_classes": 10, "batch_size": 32}


def write(tmp_path: Path, run: dict | str, model: dict | None = None) -> tuple[Path, Path]:
    run_path, model_path = tmp_path / "config.yaml", tmp_path / "m.yaml"
    run_path.write_text(run if isinstance(run, str) else yaml.safe_dump(run))
    model_path.write_text(yaml.safe_dump(model if model is not None else MODEL))
    return run_path, model_path


def error_of(tmp_path: Path, run: dict | str, model: dict | None = None, **kw: object) -> str:
    run_path, model_path = write(tmp_path, run, model)
    with pytest.raises(ConfigError) as info:
        load_config(run_path, model_path, **kw)
    msg = str(info.value)
    assert "\n" not in msg, "errors must be one line"
    return msg


def test_defaults_and_paths(tmp_path: Path) -> None:
    run_path, model_path = write(tmp_path, {"output": {"run_dir": "runs/x"}})
    cfg = load_config(run_path, model_path)
    assert cfg.data.file_batch_size == 128 and cfg.model.batch_size == 32
    assert cfg.weight_exchange.exch_strategy == "ar"
    assert cfg.output.checkpoint_dir == "runs/x/checkpoints"
    assert cfg.model.learning_rate == 0.01 and isinstance(cfg.model.learning_rate, float)


def test_repo_run_config_validates() -> None:
    cfg = load_config(None, MODEL_YAML)
    assert cfg.sources[0].endswith("configs/config.yaml")


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {"weight_exchange": {"exch_stratgy": "ar"}})
    assert "weight_exchange.exch_stratgy" in msg and "did you mean 'exch_strategy'" in msg


def test_unknown_section(tmp_path: Path) -> None:
    assert "unknown section 'trainig'" in error_of(tmp_path, {"trainig": {}})


def test_unknown_model_key(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {}, MODEL | {"learnig_rate": 0.1})
    assert "learnig_rate" in msg and "learning_rate" in msg


def test_wrong_type(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {}, MODEL | {"n_epochs": "ten"})
    assert "n_epochs must be int" in msg and "'ten'" in msg
    assert "must be bool" in error_of(tmp_path, {"randomness": {"mirror": "yes"}})


def test_bad_choice(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {"weight_exchange": {"exch_strategy": "nccl"}})
    assert "'nccl'" in msg and "'asa32'" in msg


def test_batch_size_must_divide_file_batch(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {}, MODEL | {"batch_size": 48})
    assert "batch_size=48 does not divide data.file_batch_size=128" in msg and "64" in msg


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    assert "not valid YAML" in error_of(tmp_path, "data:\n  dir: [unclosed\n")


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    run_path, _ = write(tmp_path, {})
    with pytest.raises(ConfigError, match="no model config 'nomodel'"):
        load_config(run_path, "nomodel")


def test_overrides_apply_and_validate(tmp_path: Path) -> None:
    run_path, model_path = write(tmp_path, {})
    cfg = load_config(
        run_path,
        model_path,
        {"model.batch_size": 64, "data.dir": "elsewhere", "randomness.seed": None},
    )
    assert (
        cfg.model.batch_size == 64 and cfg.data.dir == "elsewhere" and cfg.randomness.seed == 1234
    )
    with pytest.raises(ConfigError, match="batch_size=3"):
        load_config(run_path, model_path, {"model.batch_size": 3})
    assert parse_override("model.lr_step=[2, 4]") == ("model.lr_step", [2, 4])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("oops")


@pytest.mark.parametrize("strategy", ["asa32", "asa16", "copper"])
def test_power_of_two_for_asa_and_copper(tmp_path: Path, strategy: str) -> None:
    run_path, model_path = write(tmp_path, {"weight_exchange": {"exch_strategy": strategy}})
    cfg = load_config(run_path, model_path)
    for n in (1, 2, 4, 8):
        check_world_size(cfg, n)
    with pytest.raises(ConfigError, match=r"power-of-2 .* N=6; use -n 4 or -n 8"):
        check_world_size(cfg, 6)


def test_ar_any_n(tmp_path: Path) -> None:
    run_path, model_path = write(tmp_path, {})
    check_world_size(load_config(run_path, model_path), 3)


def test_deterministic_turns_randomness_off(tmp_path: Path) -> None:
    run_path, model_path = write(tmp_path, {"randomness": {"deterministic": True}})
    r = load_config(run_path, model_path).randomness
    assert not (r.shuffle or r.rand_crop or r.mirror)


def test_easgd_counts_its_server_rank(tmp_path: Path) -> None:
    run_path, model_path = write(tmp_path, {"weight_exchange": {"sync_rule": "EASGD"}})
    cfg = load_config(run_path, model_path)
    check_world_size(cfg, 2)
    with pytest.raises(ConfigError, match="EASGD needs a server") as info:
        check_world_size(cfg, 1)
    assert "\n" not in str(info.value)


# -- choices come from the registries -------------------------------------------------------
def test_choices_are_the_registries() -> None:
    from theanompi.exchange import STRATEGIES
    from theanompi.exchange.compression import COMPRESSORS
    from theanompi.models import MODELS
    from theanompi.rules import RULES

    assert choices("weight_exchange.sync_rule") == tuple(RULES)
    assert choices("weight_exchange.exch_strategy") == tuple(STRATEGIES)
    assert choices("weight_exchange.compression") == tuple(COMPRESSORS)
    assert choices("model.name") == tuple(MODELS)
    assert fill_choices("rule: {weight_exchange.sync_rule}.") == f"rule: {', '.join(RULES)}."


PLUGINS = """
from theanompi.models.mlp import MLP
from theanompi.rules.base import SyncRule


class Local(SyncRule):
    name = "LOCAL"


class Served(SyncRule):
    name, min_ranks, uses_strategy = "SERVED", 2, True

    @classmethod
    def n_workers(cls, size):
        return size - 1


class Ring:
    requires_power_of_two = True


class AnyRing:
    requires_power_of_two = False


class Int8:
    pass


class Tiny(MLP):  # a user's model: it has the model protocol (here by deriving a shipped one)
    pass
"""


def plugins(tmp_path: Path) -> str:
    """A user's file of components, named by ``plugins.py:Class`` beside the configs."""
    (tmp_path / "plugins.py").write_text(PLUGINS)
    return str((tmp_path / "plugins.py").resolve())


def test_a_user_class_by_reference_is_a_choice(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {"weight_exchange": {"sync_rule": "LOCAL"}})
    assert "sync_rule is 'LOCAL'" in msg and "'GOSGD'" in msg
    assert "package.module:Class or path/to/file.py:Class" in msg
    path = plugins(tmp_path)
    run = {"weight_exchange": {"sync_rule": "plugins.py:Local", "exch_strategy": "plugins.py:Ring"}}
    run["weight_exchange"]["compression"] = "plugins.py:Int8"
    run_path, model_path = write(tmp_path, run, MODEL | {"name": "plugins.py:Tiny"})
    cfg = load_config(run_path, model_path)
    we = cfg.weight_exchange
    # relative to the config file, stored absolute: every rank and a --resume find the same file
    assert (we.sync_rule, we.exch_strategy, we.compression) == (
        f"{path}:Local",
        f"{path}:Ring",
        f"{path}:Int8",
    )
    assert cfg.model.name == f"{path}:Tiny"
    # a module on sys.path by its dotted name
    over = {"weight_exchange.compression": "theanompi.exchange.compression:FP16Compression"}
    cfg = load_config(run_path, model_path, over)
    assert cfg.weight_exchange.compression == over["weight_exchange.compression"]


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("nowhere.py:Local", "no file"),
        ("plugins.py:Nope", "has no 'Nope'"),
        ("no_such_pkg.mod:Local", "no module 'no_such_pkg.mod'"),
        ("broken.py:Local", "importing it failed: ZeroDivisionError"),
    ],
)
def test_a_bad_reference_is_one_line(tmp_path: Path, ref: str, why: str) -> None:
    plugins(tmp_path)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    msg = error_of(tmp_path, {"weight_exchange": {"sync_rule": ref}})
    assert "weight_exchange.sync_rule" in msg and why in msg and "\n" not in msg


def test_gosgd_is_accepted(tmp_path: Path) -> None:
    run = {"weight_exchange": {"sync_rule": "GOSGD", "gossip_p": 0.25}}
    run_path, model_path = write(tmp_path, run)
    cfg = load_config(run_path, model_path)
    assert cfg.weight_exchange.sync_rule == "GOSGD" and cfg.weight_exchange.gossip_p == 0.25
    check_world_size(cfg, 3)  # every rank trains; no exchange strategy: any N >= 2
    with pytest.raises(ConfigError, match="GOSGD needs at least 2 ranks"):
        check_world_size(cfg, 1)


@pytest.mark.parametrize("pow2", [True, False])
def test_power_of_two_is_asked_of_the_strategy_class(tmp_path: Path, pow2: bool) -> None:
    plugins(tmp_path)
    ring = "plugins.py:Ring" if pow2 else "plugins.py:AnyRing"
    run_path, model_path = write(tmp_path, {"weight_exchange": {"exch_strategy": ring}})
    cfg = load_config(run_path, model_path)
    check_world_size(cfg, 4)
    if pow2:
        with pytest.raises(ConfigError, match=r"Ring' needs a power-of-2 .* N=6; use -n 4 or"):
            check_world_size(cfg, 6)
    else:
        check_world_size(cfg, 6)


def test_power_of_two_counts_the_rules_workers(tmp_path: Path) -> None:
    """A rule with a server rank and a strategy: N is the workers, -n the ranks."""
    plugins(tmp_path)
    run = {"weight_exchange": {"sync_rule": "plugins.py:Served", "exch_strategy": "copper"}}
    run_path, model_path = write(tmp_path, run)
    cfg = load_config(run_path, model_path)
    check_world_size(cfg, 5)  # 4 workers
    with pytest.raises(ConfigError, match=r"N=6; use -n 5 or -n 9, or --strategy ar"):
        check_world_size(cfg, 7)
    with pytest.raises(ConfigError, match="SERVED needs at least 2 ranks"):
        check_world_size(cfg, 1)


# -- typed, frozen sections -----------------------------------------------------------------
def test_sections_are_typed_and_frozen(tmp_path: Path) -> None:
    run_path, model_path = write(tmp_path, {}, MODEL | {"lr_step": [2, 4], "arch": {"hidden": [5]}})
    cfg = load_config(run_path, model_path)
    assert get_type_hints(DataSection)["file_batch_size"] is int
    assert get_type_hints(WeightExchangeSection)["gossip_p"] is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.dir = "elsewhere"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = cfg.model  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.data["dir"] = "elsewhere"  # type: ignore[index]
    with pytest.raises(TypeError):
        cfg.model.arch["hidden"] = [9]  # type: ignore[index]
    assert cfg.model.lr_step == (2, 4) and cfg.model.arch["hidden"] == (5,)
    # a section reads as a mapping too (models take it so)
    assert cfg.data["dir"] == cfg.data.dir and dict(cfg.model)["name"] == "mlp"
    assert cfg.model.get("nope", 1) == 1 and "batch_size" in cfg.model
    # to_dict keeps its shape: plain dicts and lists, JSON-able
    d = cfg.to_dict()
    assert list(d) == [
        "data",
        "weight_exchange",
        "randomness",
        "training",
        "output",
        "elastic",
        "model",
    ]
    assert d["model"]["lr_step"] == [2, 4] and d["model"]["arch"] == {"hidden": [5]}
    assert json.loads(json.dumps(d)) == d
    assert set(d["weight_exchange"]) == set(WeightExchangeSection.defaults())


def test_model_defaults_live_once() -> None:
    from theanompi.models import base

    assert base._COMMON_DEFAULTS == MODEL_SCHEMA.defaults()
    assert base._COMMON_DEFAULTS["lr_step"] == [] and base._COMMON_DEFAULTS["arch"] == {}


def test_a_frozen_model_section_builds_a_model(tmp_path: Path) -> None:
    from theanompi.models import create_model

    model = MODEL | {"input_size": 8, "arch": {"hidden": [5]}}
    run_path, model_path = write(tmp_path, {}, model)
    m = create_model(load_config(run_path, model_path).model)
    assert m.input_shape == (3, 8, 8) and m.config["arch"] == {"hidden": [5]}


# -- the new keys' ranges -------------------------------------------------------------------
@pytest.mark.parametrize(
    "section,name,value,message",
    [
        ("weight_exchange", "gossip_p", 0, "weight_exchange.gossip_p must be in (0, 1], got 0.0"),
        ("weight_exchange", "gossip_p", 1.5, "weight_exchange.gossip_p must be in (0, 1], got 1.5"),
        ("weight_exchange", "alpha", 0, "weight_exchange.alpha must be in (0, 1], got 0.0"),
        ("weight_exchange", "avg_freq", 0, "weight_exchange.avg_freq must be >= 1, got 0"),
        ("weight_exchange", "compression", "zip", "compression is 'zip'; it must be one of"),
        ("training", "lr_reference_batch", 0, "training.lr_reference_batch must be >= 1, got 0"),
        ("training", "warmup_epochs", -1, "training.warmup_epochs must be >= 0, got -1.0"),
        ("training", "lr_scaling", "cubic", "lr_scaling is 'cubic'; it must be one of 'none'"),
        ("output", "timeline", 3, "output.timeline must be str, got 3"),
        ("data", "file_batch_size", 0, "data.file_batch_size must be positive, got 0"),
    ],
)
def test_range_checks(tmp_path: Path, section: str, name: str, value: object, message: str) -> None:
    assert message in error_of(tmp_path, {section: {name: value}})


def test_new_keys_load(tmp_path: Path) -> None:
    run = {
        "weight_exchange": {"compression": "fp16", "gossip_p": 1},
        "training": {"lr_scaling": "linear", "lr_reference_batch": 64, "warmup_epochs": 2},
        "output": {"timeline": "t.json"},
    }
    run_path, model_path = write(tmp_path, run)
    cfg = load_config(run_path, model_path)
    assert cfg.weight_exchange.compression == "fp16" and cfg.weight_exchange.gossip_p == 1.0
    assert cfg.training.warmup_epochs == 2.0 and isinstance(cfg.training.warmup_epochs, float)
    assert cfg.training.lr_scaling == "linear" and cfg.output.timeline == "t.json"


# -- model names ----------------------------------------------------------------------------
def test_model_name_must_be_registered(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {}, MODEL | {"name": "resnet"})
    assert "name is 'resnet'; it must be one of" in msg and "'small_cnn'" in msg
    assert "key 'name' is required" in error_of(tmp_path, {}, {"input_size": 28})


def test_model_vgg16_is_its_config(tmp_path: Path) -> None:
    run_path, _ = write(tmp_path, {"data": {"image_size": 256}})
    cfg = load_config(run_path, "vgg16")
    assert cfg.model.name == "vgg16" and cfg.sources[1].endswith("configs/vgg16.yaml")
    assert cfg.model.input_size == 224


@pytest.mark.parametrize("name", ["mlp", "small_cnn"])
def test_registered_model_without_config_uses_schema_defaults(tmp_path: Path, name: str) -> None:
    run_path, _ = write(tmp_path, {})
    cfg = load_config(run_path, name, {"model.n_epochs": 3})
    expected = MODEL_SCHEMA.defaults() | {"name": name, "n_epochs": 3}
    assert cfg.model.to_dict() == expected
    assert cfg.output.run_dir == f"runs/{name}"


def test_unknown_model_lists_configs_and_models(tmp_path: Path) -> None:
    run_path, _ = write(tmp_path, {})
    with pytest.raises(ConfigError) as info:
        load_config(run_path, "resnet")
    msg = str(info.value)
    assert msg.startswith("no model config 'resnet'") and "vgg16" in msg and "small_cnn" in msg


def test_bad_path_placeholder_is_one_line(tmp_path: Path) -> None:
    msg = error_of(tmp_path, {"output": {"run_dir": "runs/{modle}"}})
    assert "output.run_dir is 'runs/{modle}'" in msg and "{model}" in msg


# -- output.loggers: a list of names from one registry -----------------------------------------
def test_loggers_are_a_list_of_registry_names(tmp_path: Path) -> None:
    from theanompi.io.loggers import LOGGERS

    assert choices("output.loggers") == tuple(LOGGERS) == ("csv", "tensorboard")
    run_path, model_path = write(tmp_path, {"output": {"loggers": ["tensorboard", "csv"]}})
    assert load_config(run_path, model_path).output.loggers == ("tensorboard", "csv")
    assert load_config(run_path, model_path, {"output.loggers": []}).output.loggers == ()
    assert load_config(None, MODEL_YAML).output.loggers == ()  # the default: none
    # a user's class beside the config file, stored absolute (every rank finds the same file)
    (tmp_path / "mine.py").write_text("class Spy:\n    pass\n")
    run_path, model_path = write(tmp_path, {"output": {"loggers": ["csv", "mine.py:Spy"]}})
    got = load_config(run_path, model_path).output.loggers
    assert got == ("csv", f"{(tmp_path / 'mine.py').resolve()}:Spy")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["tensorbord"], "output.loggers is 'tensorbord'; it must be one of 'csv', 'tensorboard'"),
        ("csv", "output.loggers must be a list, got 'csv' (str); write e.g. [csv, tensorboard]"),
        (["csv", "csv"], "output.loggers lists 'csv' twice"),
        ([3], "output.loggers is 3; it must be one of"),
        (["nowhere.py:Spy"], "output.loggers: 'nowhere.py:Spy': no file"),
    ],
)
def test_a_bad_logger_list_is_one_line(tmp_path: Path, value: object, message: str) -> None:
    assert message in error_of(tmp_path, {"output": {"loggers": value}})
    run_path, model_path = write(tmp_path, {})
    with pytest.raises(ConfigError) as info:  # the same from the command line (--set)
        load_config(run_path, model_path, {"output.loggers": value})
    assert message in str(info.value) and "\n" not in str(info.value)


# -- print_config: the resolved config as one YAML file that loads back -------------------------
def _round_trip(tmp_path: Path, cfg: object) -> object:
    from theanompi.config import print_config

    saved = tmp_path / "saved" / "config.yaml"
    saved.parent.mkdir(exist_ok=True)
    saved.write_text(print_config(cfg))
    return load_config(saved)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"output.run_dir": "runs/{model}/a{{b}}c", "randomness.deterministic": True},
        {"output.loggers": ["csv", "tensorboard"], "model.arch": {"hidden": [5, 3], "x": {}}},
        {"model.learning_rate": 1e-5, "training.warmup_epochs": 0.5, "output.timeline": "t.json"},
    ],
)
def test_print_config_loads_back_unchanged(tmp_path: Path, over: dict) -> None:
    cfg = load_config(None, MODEL_YAML, over)
    back = _round_trip(tmp_path, cfg)
    assert back.to_dict() == cfg.to_dict()
    assert back.sources[1].endswith("config.yaml (model section)")


def test_print_config_keeps_user_references_and_registered_models(tmp_path: Path) -> None:
    path = plugins(tmp_path)
    run = {"weight_exchange": {"sync_rule": "plugins.py:Local"}}
    run_path, model_path = write(tmp_path, run, MODEL | {"name": "plugins.py:Tiny"})
    cfg = load_config(run_path, model_path)
    assert cfg.model.name == f"{path}:Tiny"
    assert _round_trip(tmp_path, cfg).to_dict() == cfg.to_dict()
    cfg = load_config(run_path, "small_cnn")  # no model file: the schema defaults
    assert _round_trip(tmp_path, cfg).to_dict() == cfg.to_dict()


def test_a_model_section_in_the_run_config(tmp_path: Path) -> None:
    run = {"training": {"model": "mine"}, "model": MODEL | {"n_epochs": 3}}
    run_path, model_path = write(tmp_path, run)
    cfg = load_config(run_path)
    assert cfg.model.n_epochs == 3 and cfg.output.run_dir == "runs/mine"
    assert load_config(run_path, None, {"model.n_epochs": 4}).model.n_epochs == 4
    # a model named by flag or override still wins over the file's section
    assert load_config(run_path, model_path).model.n_epochs == 10
    over = {"training.model": str(model_path)}
    assert load_config(run_path, None, over).model.n_epochs == 10
    run_path.write_text(yaml.safe_dump({"model": MODEL | {"bach_size": 4}}))
    with pytest.raises(ConfigError, match=r"\(model section\): unknown key 'model.bach_size'"):
        load_config(run_path)


def test_a_folder_named_like_a_config_does_not_shadow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "digits").mkdir()  # e.g. a data folder in the working directory
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, "digits")
    assert cfg.model.name == "small_cnn" and cfg.sources[1].endswith("configs/digits.yaml")


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"sync_type": "cdd", "exch_strategy": "copper"}, "(ar, asa32, asa16), not 'copper'; set"),
        ({"sync_type": "avg"}, "sync_type 'avg' updates each replica apart: set sync_type: cdd"),
        ({"sync_rule": "EASGD"}, "EASGD updates each worker's own replica"),
        ({"sync_rule": "GOSGD"}, "GOSGD updates each worker's own replica"),
    ],
)
def test_shard_optimizer_is_refused_where_there_is_no_one_update_to_divide(
    tmp_path: Path, keys: dict[str, str], says: str
) -> None:
    run_path, model_path = write(tmp_path, {"weight_exchange": {"shard_optimizer": True, **keys}})
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(run_path, model_path)
    ok = {"sync_type": "cdd", "exch_strategy": "asa16", "shard_optimizer": True}
    run_path, _ = write(tmp_path, {"weight_exchange": ok})
    assert load_config(run_path, model_path).weight_exchange.shard_optimizer
