"""The one registry type: a name, ``package.module:Class`` and ``path/file.py:Class`` resolve alike."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

import theanompi.registry
from theanompi.errors import ConfigError
from theanompi.exchange import STRATEGIES
from theanompi.exchange.compression import COMPRESSORS
from theanompi.models import MODELS
from theanompi.registry import Registry
from theanompi.rules import RULES


def test_doctests() -> None:
    assert doctest.testmod(theanompi.registry).failed == 0


def test_every_choice_is_a_registry() -> None:
    from theanompi.models import BACKENDS

    for reg in (MODELS, RULES, STRATEGIES, COMPRESSORS, BACKENDS):
        assert isinstance(reg, Registry) and len(reg) == len(reg.names()) >= 2


def test_a_name_a_module_path_and_a_file_path_resolve_to_the_same_class(tmp_path: Path) -> None:
    from theanompi.exchange.asa import Asa32Exchanger

    assert STRATEGIES.get("asa32") is Asa32Exchanger
    assert STRATEGIES.get("theanompi.exchange.asa:Asa32Exchanger") is Asa32Exchanger
    (tmp_path / "mine.py").write_text("from theanompi.exchange.asa import Asa32Exchanger as A\n")
    assert STRATEGIES.get("mine.py:A", tmp_path) is Asa32Exchanger
    assert STRATEGIES.get(f"{tmp_path}/mine.py:A") is Asa32Exchanger


def test_a_file_is_loaded_once_and_a_relative_reference_is_stored_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "count.py").write_text(
        "import itertools\nN = next(itertools.count())\nclass C: pass\n"
    )
    reg = Registry("thing")
    first = reg.get("count.py:C", tmp_path)
    monkeypatch.chdir(tmp_path)  # relative to the working directory when no base is given
    assert reg.get("count.py:C") is first
    assert reg.check("count.py:C") == f"{(tmp_path / 'count.py').resolve()}:C"
    assert reg.check("theanompi.errors:ConfigError") == "theanompi.errors:ConfigError"


def test_register_and_decorate_without_replacing() -> None:
    reg = Registry("widget", {"a": "theanompi.errors:UserError"})

    @reg.register("b")
    class B:
        pass

    reg.register("c", "theanompi.errors:DataError")
    assert reg.names() == ("a", "b", "c") and reg.get("b") is B
    with pytest.raises(ValueError, match="registered already"):
        reg.register("a", B)
    with pytest.raises(ValueError, match="no ':'"):
        reg.register("x:y", B)


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("rign", "unknown widget 'rign' (did you mean 'ring'?); choose from 'ring', or give"),
        ("gone.py:C", "no file"),
        ("theanompi.errors:Nope", "'theanompi.errors' has no 'Nope'"),
        ("theanompi.nope:C", "no module 'theanompi.nope'"),
        (":C", "give package.module:Class or path/to/file.py:Class"),
    ],
)
def test_what_cannot_be_resolved_is_one_line(tmp_path: Path, ref: str, why: str) -> None:
    reg = Registry("widget", {"ring": "theanompi.errors:UserError"})
    with pytest.raises(ConfigError) as info:
        reg.get(ref, tmp_path)
    assert why in str(info.value) and "\n" not in str(info.value)


def test_a_directory_named_like_a_choice_does_not_shadow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "asa32").mkdir()
    monkeypatch.chdir(tmp_path)
    from theanompi.exchange.asa import Asa32Exchanger

    assert STRATEGIES.get("asa32") is Asa32Exchanger
