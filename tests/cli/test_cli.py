"""The ``tmpi`` CLI, run for real in a subprocess: help, info, and one-line errors with exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

MODEL_YAML = str(Path(__file__).parents[1] / "model_mlp.yaml")


def test_top_level_help_lists_commands(cli) -> None:
    out = cli("--help")
    assert out.returncode == 0
    for name in ("prep", "train", "eval", "info", "plot", "bench"):
        assert name in out.stdout


@pytest.mark.parametrize("command", ["train", "eval", "info", "plot", "bench", "prep"])
def test_every_command_has_help(cli, command: str) -> None:
    out = cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout


@pytest.mark.parametrize(
    ("bench", "flag"),
    [
        ("prep", "--scan-tree"),
        ("exchange", "--strategies"),
        ("model", "--case"),
        ("layers", "--markdown"),
        ("train", "--ranks"),
    ],
)
def test_every_bench_help_lists_its_options(cli, bench: str, flag: str) -> None:
    """``tmpi bench X --help`` reaches the bench's own parser (typer's would list no options)."""
    out = cli("bench", bench, "--help")
    assert out.returncode == 0, out.stderr
    assert f"usage: tmpi bench {bench}" in out.stdout and flag in out.stdout


def test_train_help_lists_the_flags(cli) -> None:
    text = cli("train", "--help", env={"COLUMNS": "200"}).stdout
    for flag in (
        "--np",
        "--config",
        "--model",
        "--rule",
        "--strategy",
        "--sync-type",
        "--data",
        "--run-dir",
        "--epochs",
        "--batch-size",
        "--lr",
        "--resume",
        "--set",
        "--compression",
        "--timeline",
        "--lr-scaling",
        "--warmup-epochs",
        "--gossip-p",
    ):
        assert flag in text


def test_train_help_lists_the_registries(cli) -> None:
    from theanompi.exchange import STRATEGIES
    from theanompi.exchange.compression import COMPRESSORS
    from theanompi.models import MODELS
    from theanompi.rules import RULES

    text = cli("train", "--help", env={"COLUMNS": "250"}).stdout
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("│ --")}
    for flag, registry in (
        ("--rule", RULES),
        ("--strategy", STRATEGIES),
        ("--compression", COMPRESSORS),
        ("--model", MODELS),
    ):
        assert ", ".join(registry) in rows[flag], (flag, rows[flag])
    assert "{" not in text, "every {section.key} placeholder is filled"


def test_info_prints_mpi_pytensor_blas(cli) -> None:
    """... and says so where ``OPENBLAS_CORETYPE``, not OpenBLAS, chose the kernel."""
    out = cli("info", env={"OPENBLAS_CORETYPE": ""})  # empty: OpenBLAS picks
    assert out.returncode == 0, out.stderr
    assert "Open MPI" in out.stdout and "pytensor" in out.stdout
    assert "libscipy_openblas" in out.stdout, "PyTensor must link a real BLAS"
    assert "blas" not in out.stderr.lower(), f"BLAS warning: {out.stderr}"
    assert "OPENBLAS_CORETYPE" not in out.stdout
    assert "\x00" not in out.stdout, "Open MPI's version string ends in a NUL byte"
    forced = cli("info", env={"OPENBLAS_CORETYPE": "Haswell"})
    kernel = [ln for ln in forced.stdout.splitlines() if ln.startswith("blas kernel")]
    assert kernel and kernel[0].endswith("; set by OPENBLAS_CORETYPE)"), forced.stdout


def one_line_error(out) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tmpi: error: "), out.stderr
    return lines[0]


def test_bad_config_key_is_one_line(cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("weight_exchange:\n  exch_strategy: ar\n  avg_frq: 3\n")
    line = one_line_error(cli("train", "--config", str(bad), "--model", MODEL_YAML))
    assert "avg_frq" in line and "avg_freq" in line


def test_bad_batch_size_flag(cli) -> None:
    line = one_line_error(cli("train", "--model", MODEL_YAML, "--batch-size", "48"))
    assert "does not divide" in line


def test_bad_set_value(cli) -> None:
    line = one_line_error(cli("train", "--model", MODEL_YAML, "--set", "model.n_epochs=ten"))
    assert "n_epochs must be int" in line


def test_non_power_of_two_fails_before_mpirun(cli) -> None:
    line = one_line_error(cli("train", "-n", "3", "--strategy", "copper", "--model", MODEL_YAML))
    assert "power-of-2" in line and "N=3" in line


def test_unknown_strategy(cli) -> None:
    line = one_line_error(cli("train", "--model", MODEL_YAML, "--strategy", "nccl"))
    assert "'nccl'" in line


@pytest.mark.mpi
def test_info_under_mpirun_prints_once(mpirun) -> None:
    out = mpirun(2, ["-m", "theanompi.cli", "info"], timeout=120)
    assert out.stdout.count("mpi4py") == 1, "only rank 0 prints"
    assert any(line.split() == ["mpi", "ranks", "2"] for line in out.stdout.splitlines())


@pytest.mark.mpi
def test_config_error_under_mpirun_is_one_line_from_rank0(mpirun) -> None:
    """Every rank meets the bad flag before MPI starts; only rank 0 reports it, and in time."""
    for _ in range(3):  # the line used to be lost when rank 1 exited first
        proc = mpirun(
            2, ["-m", "theanompi.cli", "train", "--model", MODEL_YAML, "--strategy", "nccl"],
            timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 2
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tmpi: error")]
        assert len(errors) == 1 and "'nccl'" in errors[0], proc.stderr


def test_easgd_needs_two_ranks_before_mpirun(cli) -> None:
    line = one_line_error(cli("train", "-n", "1", "--rule", "EASGD", "--model", MODEL_YAML))
    assert "EASGD needs a server" in line


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--gossip-p", "1.5"], "weight_exchange.gossip_p must be in (0, 1], got 1.5"),
        (["--compression", "zip"], "compression is 'zip'; it must be one of 'none', 'fp16'"),
        (["--lr-scaling", "cubic"], "lr_scaling is 'cubic'"),
        (["--warmup-epochs", "-1"], "training.warmup_epochs must be >= 0"),
        (["--rule", "SSP"], "sync_rule is 'SSP'; it must be one of 'BSP', 'EASGD', 'GOSGD'"),
    ],
)
def test_new_flags_are_validated(cli, flags: list[str], message: str) -> None:
    assert message in one_line_error(cli("train", "--model", MODEL_YAML, *flags))


@pytest.mark.parametrize(
    "model",
    [
        ["--model", "vgg16", "--set", "data.image_size=256"],
        ["--model", "googlenet", "--set", "data.image_size=256"],
        ["--model", "mlp"],
        ["-m", "small_cnn"],
    ],
)
def test_model_names_are_accepted(cli, model: list[str]) -> None:
    """vgg16 and googlenet are configs/<name>.yaml; mlp and small_cnn (no config file of that
    name) take the schema defaults. The config validates, so the run stops at the next check:
    the rank count. tests/models/test_recipes.py checks every registered name."""
    line = one_line_error(cli("train", "-n", "3", "--strategy", "copper", *model))
    assert "power-of-2" in line and "N=3" in line


def test_unknown_model_is_one_line(cli) -> None:
    line = one_line_error(cli("train", "--model", "vggnet"))
    assert "no model config 'vggnet'" in line and "vgg16" in line and "googlenet" in line


def _panels(text: str) -> dict[str, str]:
    """``{title: its rows}`` of typer's rich help (the boxes ``╭─ Title ─...╮``)."""
    panels: dict[str, str] = {}
    title = None
    for line in text.splitlines():
        if line.startswith("╭─ "):
            title = line[3:].split(" ─")[0]
            panels[title] = ""
        elif line.startswith("╰"):
            title = None
        elif title is not None:
            panels[title] += line + "\n"
    return panels


def test_train_help_shows_the_settings_groups_as_panels(cli) -> None:
    """One panel per TrainSettings group, in its order, and each flag in its group's panel."""
    import typer

    from theanompi.cli import app
    from theanompi.cli.train import TrainSettings

    text = cli("train", "--help", env={"COLUMNS": "200"}).stdout
    panels = _panels(text)
    groups = TrainSettings.panels()
    assert list(panels) == ["Options", *groups], list(panels)
    assert list(groups) == ["Launch", "Exchange", "Data", "Schedule", "Output", "Reliability"]
    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    for param in command.params:
        group = next((g for g, names in groups.items() if param.name in names), "Options")
        assert (param.rich_help_panel or "Options") == group, (param.name, group)
        assert param.opts[0] in panels[group], (param.opts[0], group)
    for flag in ("--np", "--hostfile", "--host", "-H", "--mpi-args", "--backend"):
        assert flag in panels["Launch"], flag
    assert "--print-config" in panels["Options"]


@pytest.mark.parametrize(
    "command",
    [["eval"], ["prep", "all"], ["prep", "scan"], ["prep", "batch"], ["prep", "mean"],
     ["prep", "verify"]],
)  # fmt: skip
def test_every_command_with_n_lists_the_placement_flags(cli, command: list[str]) -> None:
    panels = _panels(cli(*command, "--help", env={"COLUMNS": "200"}).stdout)
    for flag in ("--np", "--hostfile", "--host", "-H", "--mpi-args", "THEANOMPI_HOSTFILE"):
        assert flag in panels["Launch"], (command, flag)
    general = ["--config", "--model", "--set", "--help"] if command == ["eval"] else ["--help"]
    rows = [row.split()[1] for row in panels["Options"].splitlines() if row.startswith("│ -")]
    assert rows == general, rows


def test_print_config_round_trips_through_load_config(cli, tmp_path: Path) -> None:
    """``--print-config`` prints every key (flags and --set applied) and starts nothing, even
    with -n; ``load_config`` of the text gives the same config, and printing that again gives
    the same keys."""
    from theanompi.config import load_config

    flags = ["--model", MODEL_YAML, "--strategy", "asa16", "--set", "model.n_epochs=7"]
    out = cli("train", "-n", "2", *flags, "--print-config")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    printed = tmp_path / "printed.yaml"
    printed.write_text(out.stdout)
    want = load_config(
        None, MODEL_YAML, {"weight_exchange.exch_strategy": "asa16"} | {"model.n_epochs": 7}
    )
    assert load_config(printed).to_dict() == want.to_dict()
    again = cli("train", "--config", str(printed), "--print-config")
    assert again.returncode == 0, again.stderr
    body = [ln for ln in again.stdout.splitlines() if not ln.startswith("#")]
    assert body == [ln for ln in out.stdout.splitlines() if not ln.startswith("#")]
