"""Launching again: a launch whose mpirun never started, and a job restarted after a failure."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from theanompi.launch.banners import never_started
from theanompi.launch.elastic import ElasticHosts
from theanompi.launch.launcher_watch import EXIT_INTERRUPTED
from theanompi.launch.slurm import EXIT_REQUEUED
from theanompi.launch.supervise import Attempt, supervise

__all__ = ["NOT_RESTARTABLE", "RETRY_LOG_ENV", "START_TRIES", "run_started", "run_with_restarts"]

#: exit codes that a restart cannot mend: usage, data, resource (errors.py), Ctrl-C
NOT_RESTARTABLE = frozenset({0, 2, 3, 4, EXIT_INTERRUPTED, EXIT_REQUEUED})
#: launches of one attempt that may fail to start before the launcher gives up
START_TRIES = 3
#: a file that each such launch again appends a line to (the test suite counts them)
RETRY_LOG_ENV = "THEANOMPI_RETRY_LOG"


def _again(k: int, cmd: Sequence[str], why: str) -> None:
    """Say that launch ``k`` never started (``why``) and launch ``k + 1`` follows; note it in
    ``$THEANOMPI_RETRY_LOG`` where set."""
    print(
        f"tmpi: mpirun failed to start ({why}); launching again ({k + 1}/{START_TRIES})",
        file=sys.stderr,
        flush=True,
    )
    log = os.environ.get(RETRY_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{k + 1}/{START_TRIES} {' '.join(map(str, cmd))[:300]}\n")


def run_started(
    cmd: Sequence[str], *, timed_only: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` of an mpirun line,
    run again (up to :data:`START_TRIES` in all) while mpirun failed before starting any rank:
    the captured-output twin of the launcher's own retry, for benches and tests.

    Captured output cannot tell a daemon that never came up from a node lost mid-run; a job
    that is only timed (``timed_only``: a bench, which loses nothing by going again) takes
    both for a start that failed."""
    placed: dict[int, str] | None = {} if timed_only else None
    for k in range(1, START_TRIES + 1):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
        why = never_started(proc.stderr + proc.stdout, placed) if proc.returncode else ""
        if not why:
            break
        if k < START_TRIES:
            _again(k, cmd, why)
    return proc


def _launch(
    cmd: Sequence[str], env: Mapping[str, str], watch: Callable[[], str | None] | None = None
) -> Attempt:
    """:func:`supervise` ``cmd``, launched again (up to :data:`START_TRIES` in all) while
    mpirun fails before starting any rank: nothing ran, so nothing is lost or repeated."""
    for k in range(1, START_TRIES + 1):
        result = supervise(cmd, env, watch=watch)
        if not result.not_started or k == START_TRIES:
            return result
        _again(k, cmd, result.not_started)
        time.sleep(0.5 * k)
    raise AssertionError("unreachable")  # pragma: no cover


def _from_checkpoint(
    checkpoint_dir: str | os.PathLike[str] | None,
    record_dir: str | os.PathLike[str] | None,
    kind: str,
    line: tuple[str, str, str],
    **fields: Any,
) -> bool:
    """Before a relaunch: the ``line`` (its start, then ``{}``-with the latest checkpoint, or
    what to say without one) and, with a checkpoint, a ``kind`` record entry naming it beside
    ``fields``; whether the relaunch resumes."""
    from theanompi.io.checkpoint import latest_checkpoint
    from theanompi.io.record import append_entry

    ck = latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    start, found, none = line
    print(f"tmpi: {start}" + (found.format(ck) if ck else none), file=sys.stderr, flush=True)
    if record_dir is not None and ck is not None:
        append_entry(record_dir, kind, resume_from=str(ck), **fields)
    return ck is not None


def run_with_restarts(
    build_cmd: Callable[[bool], Sequence[str]],
    env: Mapping[str, str],
    *,
    max_restarts: int,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    record_dir: str | os.PathLike[str] | None = None,
    elastic: ElasticHosts | None = None,
) -> int:
    """Run the job; after a rank failure or stall relaunch it with ``--resume``, at most
    ``max_restarts`` times (as ``torchrun --max-restarts``); return the exit code.

    ``build_cmd(resume)`` gives the mpirun line. An exit in :data:`NOT_RESTARTABLE` (success,
    a usage, data or resource error, Ctrl-C) is final. Each restart is printed as one line and
    appended to the record as ``{"kind": "restart", "attempt", "max_restarts", "exit_code",
    "reason", "resume_from"}``; without a checkpoint yet, the run starts over.

    ``elastic`` (an elastic job's hosts, which ``build_cmd`` reads): after losing a host, or
    once the discovery script offers more slots (the ranks stopped at a step boundary), the job
    is relaunched at once on the hosts of now with ``--resume``, not counted as a restart, with
    a line and an ``elastic`` record entry; so is a job whose ranks fell below ``--min-np``,
    once the script offers enough slots again.
    """
    resume = False
    attempt = 0
    while True:
        try:
            result = _launch(build_cmd(resume), env, elastic.more if elastic else None)
        except KeyboardInterrupt:  # Ctrl-C between two attempts: no mpirun is running
            return EXIT_INTERRUPTED
        if result.failure:
            print(f"tmpi: error: {result.failure}", file=sys.stderr, flush=True)
        stopped = result.stopped or result.code in NOT_RESTARTABLE
        change, where = "", None
        if elastic is not None and result.lost_host:
            change = f"going on without {result.lost_host}"
            where = elastic.lose(result.lost_host, result.lost_ranks)
        elif elastic is not None and result.moved and result.code == EXIT_INTERRUPTED:
            change, where = "growing", elastic.grow()
        elif elastic is not None and not elastic.in_place and result.failure and not stopped:
            change, where = "going on with a rank fewer", elastic.fewer()  # a rank was lost
        elif elastic is not None and result.below_min_np:
            change, where = "going on with the hosts offered", elastic.refill()
        if where is not None:
            resume = _from_checkpoint(
                checkpoint_dir,
                record_dir,
                "elastic",
                (f"elastic: {change}: {where}, ", "from {}", "starting over (no checkpoint yet)"),
                change=change,
                hosts=where,
                seconds=round(result.seconds, 3),
            )
            continue
        if stopped or attempt >= max_restarts:
            if result.code not in NOT_RESTARTABLE and max_restarts:
                print(
                    f"tmpi: giving up after {attempt} restart(s) (--max-restarts {max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
            return result.code
        attempt += 1
        reason = result.failure or f"exit {result.code}"
        resume = _from_checkpoint(
            checkpoint_dir,
            record_dir,
            "restart",
            (
                f"restart {attempt}/{max_restarts} after {reason}: ",
                "resuming from {}",
                "no checkpoint yet, starting over",
            ),
            attempt=attempt,
            max_restarts=max_restarts,
            exit_code=result.code,
            reason=reason,
            seconds=round(result.seconds, 3),
        )
