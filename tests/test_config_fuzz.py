"""Config fuzz: hundreds of seeded bad configs (YAML values, ``--set`` strings, CLI flags) are each
refused with one ``ConfigError`` line naming the bad key; none raises anything else, none is
accepted. A sample goes through the real ``tmpi train`` in subprocesses (exit 2, one line, no
traceback), and random *valid* configs must still load (no false refusals)."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from theanompi.config import load_config, parse_override
from theanompi.errors import ConfigError
from theanompi.launch.testing import tmpi

MODEL = {"name": "mlp", "input_size": 28, "channels": 3, "n_classes": 10, "batch_size": 32}
LONG = "runs/" + "x" * 200_000  # a 200 kB path
NAN, INF = float("nan"), float("inf")

#: key -> values that must be refused (each alone, in an otherwise valid config)
BAD: dict[str, list[Any]] = {
    "data.dir": ["", LONG, "a\x00b", 5, ["d"], True, {"a": 1}],
    "data.file_batch_size": [0, -128, 1.5, "128", True, [128]],
    "data.image_size": [0, -32, "32", 3.5],
    "data.layout": ["cb01", "", 0, ["c01b"], "C01B"],
    "data.prefetch": ["yes", 2, 1.0, [True]],
    "data.verify": ["sometimes", True, 0, ""],
    "weight_exchange.sync_rule": ["bsp", "", 3, ["BSP"], "ALLREDUCE"],
    "weight_exchange.exch_strategy": ["nccl", "", 1, "AR"],
    "weight_exchange.sync_type": ["sum", "", True],
    "weight_exchange.compression": ["zip", "fp8", 16, ""],
    "weight_exchange.avg_freq": [0, -1, 1.5, "2"],
    "weight_exchange.alpha": [0, -0.5, 1.5, NAN, INF, "half"],
    "weight_exchange.gossip_p": [0, 2, -1, NAN, "p"],
    "weight_exchange.check_every": [-1, -100, 0.5, "1"],
    "weight_exchange.sync_start": ["no", 0.0, [False]],
    "randomness.seed": [-1, -(2**40), 2**64, 1.5, "1234", True, NAN],
    "randomness.shuffle": ["true", 1, None],
    "randomness.deterministic": ["on", 2],
    "training.print_freq": [0, -10, 2.5, "10", None],
    "training.max_steps": [-1, -5, 1.5, "all"],
    "training.lr_scaling": ["sqrt", "", 1],
    "training.lr_reference_batch": [0, -256, 1.5],
    "training.warmup_epochs": [-1, NAN, INF, "two"],
    "training.model": ["", LONG, "a\x00b", 7],
    "output.run_dir": [
        "",
        LONG,
        "runs/{modle}",
        "runs/{model.x}",
        "runs/{0}",
        "runs/{model!r}",
        "runs/{model:>9}",
        "runs/{",
        "runs/}{",
        "runs/{run_dir}",
        5,
        None,
    ],
    "output.checkpoint_dir": ["", "{run_dir}/{epoch}", "{run_dir.parent}", "{}", LONG],
    "output.record_dir": ["", "{run_dir}/{rank}", "{run_dir!s}", "x/{"],
    "output.snapshot_freq": [-1, 1.5, "1"],
    "output.timeline": [LONG, "t\x00.json", 3, ["t.json"]],
    "model.name": ["resnet", "", 5, None, ["mlp"]],
    "model.input_size": [0, -28, 1000, "28"],
    "model.channels": [0, -3, "3"],
    "model.n_classes": [0, -10, 2.5, "10"],
    "model.batch_size": [0, -32, 48, 256, 3, "32", 1.5],
    "model.n_epochs": [-1, 0, -100, 1.5, "ten", None],
    "model.learning_rate": [0, -0.1, NAN, INF, -INF, 1e18, "fast", "nan", True],
    "model.lr_policy": ["exp", "", 1],
    "model.lr_step": [["a"], [-1], [0], [2, -4], "4", 4, [1.5], [True], [[2]]],
    "model.lr_gamma": [0, -0.1, NAN, INF, "0.1x"],
    "model.momentum": [-0.1, 1.0, 1.5, NAN, INF, "0.9x"],
    "model.nesterov": ["yes", 1],
    "model.weight_decay": [-1e-4, 1.0, 5.0, NAN, INF, "wd"],
    "model.arch": [5, "big", [1, 2]],
}
#: valid alternatives mixed into every case (and the no-false-refusal check)
GOOD: dict[str, list[Any]] = {
    "model.batch_size": [16, 32, 64, 128],
    "model.learning_rate": [0.1, 1e-3, 1, "1e-3"],
    "model.lr_step": [[], [2, 4], [1]],
    "model.momentum": [0.0, 0.5, 0.99],
    "model.weight_decay": [0.0, 1e-4],
    "model.n_epochs": [1, 90],
    "training.print_freq": [1, 5, 100],
    "training.max_steps": [0, 10],
    "randomness.seed": [0, 7, 2**40],
    "weight_exchange.exch_strategy": ["ar", "asa32", "copper"],
    "weight_exchange.check_every": [0, 5],
    "output.run_dir": ["runs/{model}", "runs/a", "runs/{model}-{{x}}"],
    "output.snapshot_freq": [0, 2],
}
#: ``--set`` texts that are no section.key=value, or whose value is not YAML, or empty
BAD_SET_TEXTS = [
    "model.lr_step=[a",
    "model.lr_step=[1, 2",
    "model.arch={",
    "data.dir=",
    "data.dir=   ",
    "model.n_epochs=null",
    "model.n_epochs=~",
    "output.run_dir='unclosed",
    "model.learning_rate=: 1",
    "data.dir=a: b: c",
    "model.arch=!!python/object:os.system x",
    "noequals",
    "model=3",
    ".n_epochs=3",
    "model.=3",
    "=3",
]


#: wrong-type values by the key's type: every schema key gets them (a key added later too)
_WRONG_TYPE: dict[type, list[Any]] = {
    int: ["x", 1.5, True, [1]],
    float: ["x", NAN, INF, True, [0.5]],
    str: [5, ["s"], {"a": 1}],
    bool: ["yes", 2, 1.0],
    tuple: ["x", 5, {"a": 1}],
    Mapping: [5, "x", [1]],
}


def _bad_values() -> dict[str, list[Any]]:
    """:data:`BAD` plus the wrong-type values of every schema key."""
    from typing import get_origin, get_type_hints

    from theanompi.config import MODEL_SCHEMA, SCHEMA

    out = {k: list(v) for k, v in BAD.items()}
    for sec, cls in [*SCHEMA.items(), ("model", MODEL_SCHEMA)]:
        for name, hint in get_type_hints(cls).items():
            if name not in cls.defaults():
                continue
            kind = get_origin(hint) or hint
            for v in _WRONG_TYPE.get(kind, []):
                if all(repr(v) != repr(w) for w in out.setdefault(f"{sec}.{name}", [])):
                    out[f"{sec}.{name}"].append(v)
    return out


def _write(tmp: Path, run: dict[str, Any], model: dict[str, Any]) -> tuple[Path, Path]:
    run_path, model_path = tmp / "config.yaml", tmp / "m.yaml"
    run_path.write_text(yaml.safe_dump(run, allow_unicode=True))
    model_path.write_text(yaml.safe_dump(model, allow_unicode=True))
    return run_path, model_path


def _split(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    run: dict[str, Any] = {}
    model = dict(MODEL)
    for name, value in values.items():
        sec, short = name.split(".", 1)
        if sec == "model":
            model[short] = value
        else:
            run.setdefault(sec, {})[short] = value
    return run, model


def _set_text(name: str, value: Any) -> str:
    """``--set`` text for a value: YAML flow style (as a user would type it)."""
    if isinstance(value, str):
        return f"{name}={json.dumps(value)}"  # a JSON string is a YAML string
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name}={'.nan' if math.isnan(value) else ('-' if value < 0 else '') + '.inf'}"
    return f"{name}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def _cases(n: int, seed: int) -> list[tuple[str, str, Any, dict[str, Any]]]:
    """``n`` cases ``(channel, bad key, bad value, valid extras)``; channel ``yaml`` or ``set``."""
    rng = random.Random(seed)
    flat = [(k, v) for k, vs in _bad_values().items() for v in vs]
    rng.shuffle(flat)
    out = []
    for i in range(n):
        key, value = flat[i % len(flat)]
        extras = {}
        for g in rng.sample(sorted(GOOD), rng.randint(0, 3)):
            if g != key:
                extras[g] = rng.choice(GOOD[g])
        out.append((rng.choice(["yaml", "set"]), key, value, extras))
    return out


def _refusal(tmp: Path, channel: str, key: str, value: Any, extras: dict[str, Any]) -> str:
    """The one-line message refusing the case; fails on acceptance or any other exception."""
    if channel == "yaml":
        run, model = _split({**extras, key: value})
        run_path, model_path = _write(tmp, run, model)
        sets: dict[str, Any] = {}
    else:
        run, model = _split(extras)
        run_path, model_path = _write(tmp, run, model)
        sets = {}
    try:
        if channel == "set":
            name, parsed = parse_override(_set_text(key, value))
            sets[name] = parsed
        cfg = load_config(run_path, model_path, sets)
    except ConfigError as err:
        msg = str(err)
        assert "\n" not in msg, f"{key}={value!r}: not one line: {msg!r}"
        assert len(msg) < 600, f"{key}: message of {len(msg)} chars"
        return msg
    raise AssertionError(f"accepted bad {key}={str(value)[:50]!r} via {channel}: {cfg.to_dict()}")


def test_every_schema_key_is_fuzzed() -> None:
    """Keys added to the schema later get wrong-type values at least (see _bad_values)."""
    from theanompi.config import MODEL_SCHEMA, SCHEMA

    keys = {f"{s}.{k}" for s, cls in SCHEMA.items() for k in cls.defaults()}
    keys |= {f"model.{k}" for k in MODEL_SCHEMA.defaults()}
    bad = _bad_values()
    assert keys <= set(bad) and all(bad[k] for k in keys)


def test_fuzz_320_bad_configs_each_refused_in_one_line_naming_the_key(tmp_path: Path) -> None:
    cases = _cases(320, seed=20261203)
    assert len({(c[0], c[1], repr(c[2])) for c in cases}) >= 250
    for i, (channel, key, value, extras) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        msg = _refusal(d, channel, key, value, extras)
        short = key.split(".", 1)[1]
        named = key in msg or (short in msg and key.startswith("model."))
        if key == "training.model":  # a model name that is no config: the message names it
            named = named or "model config" in msg
        assert named, (
            f"case {i} {key}={str(value)[:40]!r} ({channel}): message misses the key: {msg}"
        )


@pytest.mark.parametrize("text", BAD_SET_TEXTS)
def test_unparseable_or_empty_set_values(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        name, value = parse_override(text)
        run_path, model_path = _write(tmp_path, {}, MODEL)
        load_config(run_path, model_path, {name: value})
    msg = str(info.value)
    assert "\n" not in msg and "--set" in msg or "unknown" in msg, msg


def test_empty_set_is_an_error_not_ignored() -> None:
    with pytest.raises(ConfigError, match=r"no value given for data\.dir"):
        parse_override("data.dir=")


def test_200kb_path_message_stays_short(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, "yaml", "output.run_dir", LONG, {})
    assert "output.run_dir" in msg and len(msg) < 300 and "chars)" in msg


def test_random_valid_configs_load(tmp_path: Path) -> None:
    """The other direction: 60 random combinations of valid values are all accepted."""
    rng = random.Random(7)
    for i in range(60):
        values = {k: rng.choice(v) for k, v in GOOD.items() if rng.random() < 0.6}
        run, model = _split(values)
        d = tmp_path / str(i)
        d.mkdir()
        cfg = load_config(*_write(d, run, model))
        if "model.learning_rate" in values:
            assert cfg.model.learning_rate == float(values["model.learning_rate"])
        if "randomness.seed" in values:
            assert cfg.randomness.seed == values["randomness.seed"]
        via_set = dict(parse_override(_set_text(k, v)) for k, v in values.items())
        cfg2 = load_config(*_write(d, {}, MODEL), via_set)
        assert cfg2.to_dict() == cfg.to_dict() | {"model": cfg2.model.to_dict()}


# -- through the real CLI -------------------------------------------------------------------
def _check_cli(proc: Any, key: str, code: int = 2) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("tmpi: error")]
    assert len(lines) == 1 and key in lines[0], err[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "args,key",
    [
        (["--epochs", "-1"], "model.n_epochs"),
        (["--lr", "nan"], "model.learning_rate"),
        (["--lr", "inf"], "model.learning_rate"),
        (["--lr", "0"], "model.learning_rate"),
        (["--lr", "1e18"], "model.learning_rate"),
        (["--seed", "-5"], "randomness.seed"),
        (["--max-steps", "-1"], "training.max_steps"),
        (["--set", "model.lr_step=[a"], "model.lr_step"),
        (["--set", "model.lr_step=[-1]"], "model.lr_step"),
        (["--set", "data.dir="], "data.dir"),
        (["--set", "model.weight_decay=.nan"], "model.weight_decay"),
        (["--set", "model.momentum=1.5"], "model.momentum"),
        (["--set", "training.print_freq=0"], "training.print_freq"),
        (["--set", "weight_exchange.check_every=-1"], "weight_exchange.check_every"),
        (["--set", "model.lr_gamma=0"], "model.lr_gamma"),
        (["--run-dir", "runs/{model.x}"], "output.run_dir"),
    ],
)
def test_cli_refuses_bad_flags(tmp_path: Path, args: list[str], key: str) -> None:
    _check_cli(tmpi("train", "--model", "mlp", *args, cwd=tmp_path, timeout=120), key)


def test_cli_refuses_a_200kb_path_in_yaml(tmp_path: Path) -> None:
    run_path, _ = _write(tmp_path, {"output": {"run_dir": LONG}}, MODEL)
    proc = tmpi("train", "--config", str(run_path), "--model", "mlp", cwd=tmp_path, timeout=120)
    assert len(_check_cli(proc, "output.run_dir")) < 400


@pytest.mark.mpi
@pytest.mark.parametrize(
    "run_dir,code,words",
    [
        ("/dev/null/run", 2, ("not a directory",)),  # a file in the way
        ("/sys/tmpi-run", 4, ("not permitted", "read-only", "permission denied")),  # refused
    ],
)
def test_cli_unwritable_run_dir_is_one_line(
    tmp_path: Path, run_dir: str, code: int, words: tuple[str, ...]
) -> None:
    proc = tmpi("train", "--model", "mlp", "--run-dir", run_dir, cwd=tmp_path, timeout=120)
    line = _check_cli(proc, "output.run_dir", code).lower()
    assert any(w in line for w in words), line


_BATCH = """
import sys, json
from theanompi import cli
out = []
for argv in json.loads(sys.stdin.read()):
    sys.argv = ["tmpi", "train", *argv]
    try:
        cli.main()
        out.append([0, ""])
    except SystemExit as e:
        out.append([e.code if isinstance(e.code, int) else 1, ""])
    print("\\x1e", file=sys.stderr, flush=True)
print(json.dumps(out))
"""


def test_cli_fuzz_sample_batched(tmp_path: Path) -> None:
    """40 fuzz cases through ``theanompi.cli.main`` (the ``tmpi`` entry point) in one
    subprocess: each exits 2 with exactly one ``tmpi: error`` line naming the key."""
    import subprocess

    from theanompi.launch.testing import REPO

    cases = [c for c in _cases(320, seed=99) if c[2] is not None][:40]
    argvs = []
    for i, (_, key, value, extras) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        run, model = _split({**extras, key: value})
        run_path, model_path = _write(d, run, model)
        argvs.append(["--config", str(run_path), "--model", str(model_path)])
    proc = subprocess.run(
        [sys.executable, "-c", _BATCH],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    chunks = proc.stderr.split("\x1e")
    for (_, key, value, _), (code, _), chunk in zip(cases, codes, chunks, strict=False):
        lines = [ln for ln in chunk.strip().splitlines() if ln]
        assert code == 2 and len(lines) == 1, (key, value, code, chunk)
        short = key.split(".", 1)[1]
        assert key in lines[0] or short in lines[0] or "model config" in lines[0], lines[0]
