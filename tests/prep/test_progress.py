"""prep's progress: done/total, percent, img/s and ETA; one line redrawn with ``\\r`` on a
terminal (or where the launcher says its output ends on one), sparse whole lines elsewhere."""

from __future__ import annotations

import io
import re
import time

from prep._common import LOG_EVERY_S, Progress, _eta, _Serial
from theanompi.launch.output import TERMINAL_ENV

LINE = re.compile(r"^prep batch: (\d+)/1000 images \((\d+)%\), ([\d,]+) img/s, ETA (\S+) *$")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Rank1(_Serial):
    def Get_rank(self) -> int:  # noqa: N802 - mirrors mpi4py
        return 1


def _fields(draw: str) -> tuple[int, int, int, str]:
    """(images, percent, img/s, ETA) of one progress line."""
    m = LINE.match(draw)
    assert m, repr(draw)
    return int(m.group(1)), int(m.group(2)), int(m.group(3).replace(",", "")), m.group(4)


def _feed(bar: Progress, steps: int, n: int, pause: float = 0.0) -> None:
    for _ in range(steps):
        bar.update(n)
        time.sleep(pause)
    bar.close()


def test_eta_reads_like_a_clock() -> None:
    assert [_eta(s) for s in (0, 4.2, 59, 60, 63, 3599, 3600, 7500)] == [
        "0s", "5s", "59s", "1m00s", "1m03s", "59m59s", "1h00m", "2h05m"
    ]  # fmt: skip


def test_on_a_terminal_one_line_is_redrawn_with_rate_and_eta(monkeypatch) -> None:
    monkeypatch.delenv(TERMINAL_ENV, raising=False)
    out = _Terminal()
    _feed(Progress("prep batch", 1000, _Serial(), interval=0.0, stream=out), 10, 100, 0.01)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1, repr(text)
    draws = text.rstrip("\n").split("\r")[1:]
    assert len(draws) == 10 and text.startswith("\r"), repr(text)
    fields = [_fields(d) for d in draws]
    assert [f[0] for f in fields] == list(range(100, 1001, 100))
    assert [f[1] for f in fields][:3] == [10, 20, 30]
    assert all(f[2] > 0 for f in fields)
    assert fields[-1][3] == "0s" and re.fullmatch(r"\d+s|\d+m\d\ds", fields[0][3]), fields


def test_elsewhere_whole_lines_and_few_of_them(monkeypatch) -> None:
    monkeypatch.delenv(TERMINAL_ENV, raising=False)
    out = io.StringIO()
    bar = Progress("prep batch", 1000, _Serial(), interval=0.0, stream=out)
    assert bar.interval == LOG_EVERY_S
    _feed(bar, 10, 100)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [_fields(ln)[0] for ln in lines] == [100, 1000], lines  # the first and the last


def test_the_launcher_decides_where_the_ranks_output_ends(monkeypatch) -> None:
    """Under ``tmpi ... -n N`` rank 0's stderr is mpirun's pipe: the launcher says whether
    its own stderr is a terminal (THEANOMPI_TERMINAL), and that wins over the pipe."""
    monkeypatch.setenv(TERMINAL_ENV, "1")
    out = io.StringIO()
    _feed(Progress("prep batch", 1000, _Serial(), interval=0.0, stream=out), 2, 500)
    assert out.getvalue().count("\r") == 2
    monkeypatch.setenv(TERMINAL_ENV, "0")
    tty = _Terminal()
    _feed(Progress("prep batch", 1000, _Serial(), interval=0.0, stream=tty), 2, 500)
    assert "\r" not in tty.getvalue() and len(tty.getvalue().splitlines()) == 2


def test_only_rank_0_prints(monkeypatch) -> None:
    monkeypatch.setenv(TERMINAL_ENV, "1")
    out = io.StringIO()
    _feed(Progress("prep batch", 1000, _Rank1(), interval=0.0, stream=out), 10, 100)
    assert out.getvalue() == ""
