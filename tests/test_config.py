"""The config loader: every bad-input case gives one ConfigError line naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from theanompi.config import check_world_size, load_config, parse_override
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
