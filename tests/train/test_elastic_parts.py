"""The parts of an elastic shrink that need no lost rank: the epoch's sub-batches dealt over a
world of another size from where the old one left off, and the commit a shrink goes back to
(``restore`` on MPI's real ``COMM_SELF``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _train_data import tiny_config, write_dataset  # noqa: E402

from theanompi.data import TrainLoader  # noqa: E402
from theanompi.train.elastic import Commit, Point  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("elastic") / "data", n_train=6, n_val=1)


def _ids(loader: TrainLoader, epoch: int, start: int, dealt: int | None) -> list[int]:
    """The sub-batches (their labels' digest) this loader hands out of ``epoch``."""
    with loader.epoch(epoch, start, dealt) as batches:
        return [hash(y.tobytes()) ^ hash(x[:, 0, 0, 0].tobytes()) for x, y in batches]


@pytest.mark.parametrize(("before", "after", "done"), [(4, 3, 3), (4, 2, 1), (2, 3, 5), (3, 1, 2)])
def test_the_rest_of_an_epoch_is_dealt_once_over_the_new_world(
    data: Path, tmp_path: Path, before: int, after: int, done: int
) -> None:
    cfg = tiny_config(data, tmp_path / "r", **{"randomness.deterministic": False})
    old = [TrainLoader(cfg, r, before) for r in range(before)]
    dealt = done * before  # the old world trained `done` steps, then lost a rank
    trained = [x for ld in old for x in _ids(ld, 1, 0, None)[:done]]
    new = [TrainLoader(cfg, r, after) for r in range(after)]
    n, left = new[0].steps_per_epoch, new[0].steps_left(dealt)
    rest = [x for ld in new for x in _ids(ld, 1, n - left, dealt)]
    assert all(len(_ids(ld, 1, n - left, dealt)) == left for ld in new)  # the same steps each
    both = trained + rest
    assert len(both) == len(set(both)), "a sub-batch was trained twice"
    total = new[0].n_sub
    assert total - after < len(both) <= total  # all but fewer than one round of the new world
    # the default (no dealt) is the old deal: start * size
    assert _ids(old[0], 1, done, None) == _ids(old[0], 1, done, done * before)


def test_a_commit_goes_back_to_the_newest_that_every_rank_holds() -> None:
    from mpi4py import MPI

    class Model:  # what Commit reads: shared variables
        def __init__(self) -> None:
            import pytensor

            self.params = [pytensor.shared(np.zeros(3, np.float32))]
            self.opt_state = [pytensor.shared(np.zeros(2, np.float32))]
            self.buffers: list[object] = []

    m = Model()
    commit = Commit(m, every=2)
    for step in range(1, 6):
        m.params[0].set_value(np.full(3, step, np.float32))
        commit.keep(Point(0, step, step * 4))
    # steps 2 and 4 were kept (every 2); the model moved on to 5
    assert commit.seq == 2
    point = commit.restore(MPI.COMM_SELF)
    assert point == Point(0, 4, 16)
    np.testing.assert_array_equal(m.params[0].get_value(), np.full(3, 4, np.float32))
    m.params[0].get_value(borrow=True)[:] = 9  # the model's values are a copy, not the commit's
    assert commit.restore(MPI.COMM_SELF).step == 4
    np.testing.assert_array_equal(m.params[0].get_value(), np.full(3, 4, np.float32))
    commit.keep(Point(1, 7, 0), always=True)  # an epoch's start: kept whatever the step
    assert commit.restore(MPI.COMM_SELF) == Point(1, 7, 0)
