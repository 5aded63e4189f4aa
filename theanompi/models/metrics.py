"""Top-1 / top-5 error and loss: the one implementation used by the model graph, validation and eval.

Three places report these numbers (the training step's error, in-training validation,
``tmpi eval``); they share the rules below so that two reports of one checkpoint can never
differ.

Tie rule
    A class ``c`` ranks above the true class ``y`` when its score is strictly greater, or
    equal with a lower class index (``c < y``): exactly the order of a stable argsort by
    descending score, and ``argmax`` (first maximum) agrees with it. Top-k is a hit iff
    fewer than ``k`` classes rank above ``y``. Without a rule for ties, a true class tied
    with others (e.g. several probabilities that underflowed to 0) would count as a hit by
    one report and a miss by another.
Loss floor
    The loss of an image is ``-log(max(p_y, LOSS_FLOOR))`` in float64 on the predicted
    probabilities (see :data:`LOSS_FLOOR`).
Exact reduction
    Hit and image counts are integers (summed exactly); each sub-batch's loss is summed in
    float64 and these sums are added in global sub-batch order, so the result has the same
    bits for any number of ranks.

The symbolic version (:func:`symbolic_metrics`) imports PyTensor when called, so importing
this module does not.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = [
    "TOP_K",
    "LOSS_FLOOR",
    "true_rank",
    "batch_metrics",
    "evaluate",
    "indexed_batches",
    "validate",
    "symbolic_true_rank",
    "symbolic_metrics",
]

#: The "k" of top-k error.
TOP_K = 5

#: Smallest probability the loss uses: 2**-149, the smallest positive float32.
#: Models predict float32 probabilities, so every non-zero one is >= this value and is
#: scored exactly (the floor changes nothing but exact zeros). A stored 0 means the true
#: probability underflowed below it, so ``-log(LOSS_FLOOR) = 149 ln 2 ~ 103.28`` is the
#: least loss consistent with the prediction (a larger floor such as 1e-12 would hide
#: confident mistakes; a 0 would give an infinite mean). Exact in float64.
LOSS_FLOOR = 2.0**-149


def true_rank(scores: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Number of classes ranking above the true class of each row (0 = top-1 hit).

    Parameters
    ----------
    scores
        (b, K) probabilities or logits; only their order matters.
    y
        (b,) labels in ``[0, K)`` (drop padding first).

    Returns
    -------
    numpy.ndarray
        (b,) int64: classes with a strictly greater score, plus classes with an equal
        score and a lower index (the tie rule of this module).

    >>> import numpy as np
    >>> true_rank(np.array([[0.2, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]]), np.array([2, 3])).tolist()
    [1, 3]
    """
    s = np.asarray(scores)
    yv = np.asarray(y, dtype=np.int64)
    sy = s[np.arange(len(yv)), yv][:, None]
    lower = np.arange(s.shape[1])[None, :] < yv[:, None]
    return ((s > sy) | ((s == sy) & lower)).sum(axis=1).astype(np.int64)


def batch_metrics(probs: np.ndarray, y: np.ndarray, k: int = TOP_K) -> dict[str, Any]:
    """Metrics of one sub-batch; slots with ``y < 0`` (padding) are left out.

    Parameters
    ----------
    probs
        (b, K) class probabilities (float32 or float64).
    y
        (b,) int labels, ``-1`` for padding.
    k
        Top-k size; with ``k >= K`` every image is a top-k hit.

    Returns
    -------
    dict
        ``n`` (valid images), ``top1``/``topk`` (hit counts), ``loss`` (float64 sum of
        ``-log(max(p_y, LOSS_FLOOR))``), ``labels``, ``hit1`` (bool per valid image),
        ``topk_idx`` ((n, min(k, K)) int32, best first, in the order of the tie rule).

    >>> import numpy as np
    >>> m = batch_metrics(np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]), np.array([1, -1]), k=2)
    >>> m["n"], m["top1"], m["topk"], m["topk_idx"].tolist()
    (1, 0, 1, [[0, 1]])
    """
    probs = np.asarray(probs)
    y = np.asarray(y)
    valid = y >= 0
    p, yv = probs[valid], y[valid].astype(np.int64)
    rank = true_rank(p, yv)
    hit1 = rank < 1
    order = np.argsort(-p, axis=1, kind="stable")[:, : min(k, p.shape[1])].astype(np.int32)
    pt = np.maximum(p[np.arange(len(yv)), yv].astype(np.float64), LOSS_FLOOR)
    return {
        "n": int(len(yv)),
        "top1": int(hit1.sum()),
        "topk": int((rank < k).sum()),
        "loss": float(np.sum(-np.log(pt))),
        "labels": yv,
        "hit1": hit1,
        "topk_idx": order,
    }


def _sum_ints(comm: Any, a: np.ndarray) -> np.ndarray:
    if comm is None:
        return a
    from mpi4py import MPI

    out = np.zeros_like(a)
    comm.Allreduce(a, out, op=MPI.SUM)
    return out


def evaluate(
    model: Any,
    batches: Iterable[tuple[int, np.ndarray, np.ndarray]],
    comm: Any = None,
    n_classes: int | None = None,
    keep_predictions: bool = False,
) -> dict[str, Any]:
    """Evaluate ``model.predict`` on this rank's sub-batches and reduce over ``comm``.

    Parameters
    ----------
    model
        Anything with ``predict(x) -> (b, K) probabilities`` and ``n_classes``.
    batches
        This rank's ``(g, x, y)``: ``g`` the global sub-batch index (it fixes the loss
        summation order, see :func:`indexed_batches`), ``x`` float32 (b, C, H, W),
        ``y`` int (b,), ``-1`` = padding.
    comm
        Communicator over which the sub-batches are split; ``None``: this process alone.
        Collective: every rank of ``comm`` must call it.
    n_classes
        Class count for the per-class counts (default ``model.n_classes``).
    keep_predictions
        Gather the top-5 indices of every image to rank 0 (in sub-batch order).

    Returns
    -------
    dict
        The same on every rank: ``images``, ``top1_hits``, ``top5_hits`` (ints),
        ``top1_error``, ``top5_error``, ``loss`` (mean, NaN when no image), ``seconds``
        (slowest rank), ``images_per_s``, ``class_images`` / ``class_top1`` (int arrays);
        ``predictions`` ((n, 5) int32) on rank 0 only, when asked.
    """
    K = int(n_classes if n_classes is not None else model.n_classes)
    counts = np.zeros(3, dtype=np.int64)  # images, top-1 hits, top-5 hits
    per_class = np.zeros((2, K), dtype=np.int64)  # images, top-1 hits
    losses: list[tuple[int, float]] = []
    preds: list[tuple[int, np.ndarray]] = []
    if comm is not None:
        from mpi4py import MPI

        comm.Barrier()
        clock = MPI.Wtime
    else:
        clock = time.perf_counter
    t0 = clock()
    for g, x, y in batches:
        m = batch_metrics(model.predict(x), y)
        counts += (m["n"], m["top1"], m["topk"])
        np.add.at(per_class[0], m["labels"], 1)
        np.add.at(per_class[1], m["labels"][m["hit1"]], 1)
        losses.append((int(g), m["loss"]))
        if keep_predictions:
            preds.append((int(g), m["topk_idx"]))
    seconds = clock() - t0
    if comm is not None:
        from mpi4py import MPI

        # a buffer Allreduce, not mpi4py's pickled allreduce: the first of those on a
        # communicator makes mpi4py's private duplicate of it, a collective wait that holds
        # the GIL, which would starve the stall watchdog's thread while a rank is missing
        t = np.array([seconds], dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        seconds = float(t[0])
        losses = [gl for part in comm.allgather(losses) for gl in part]
        parts = comm.gather(preds, root=0) if keep_predictions else None
        preds = [gp for part in parts for gp in part] if parts is not None else []
    n, h1, h5 = (int(v) for v in _sum_ints(comm, counts))
    per_class = _sum_ints(comm, per_class)
    loss_sum = 0.0
    for _, s in sorted(losses, key=lambda t: t[0]):  # global order: the same bits for any N
        loss_sum += s
    out: dict[str, Any] = {
        "images": n,
        "top1_hits": h1,
        "top5_hits": h5,
        "top1_error": 1.0 - h1 / n if n else float("nan"),
        "top5_error": 1.0 - h5 / n if n else float("nan"),
        "loss": loss_sum / n if n else float("nan"),
        "seconds": seconds,
        "images_per_s": n / seconds if seconds > 0 else float("nan"),
        "class_images": per_class[0],
        "class_top1": per_class[1],
    }
    if keep_predictions and (comm is None or comm.Get_rank() == 0):
        preds.sort(key=lambda t: t[0])
        out["predictions"] = (
            np.concatenate([p for _, p in preds])
            if preds
            else np.zeros((0, min(TOP_K, K)), np.int32)
        )
    return out


def indexed_batches(loader: Any) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(g, x, y)`` of a :class:`~theanompi.data.ValLoader` with the global sub-batch index.

    Rank ``r`` of ``N`` gets sub-batches ``r, r + N, ...``, so its ``i``-th is ``r + i * N``.
    """
    with loader.batches() as it:
        for i, (x, y) in enumerate(it):
            yield loader.rank + i * loader.size, x, y


def validate(model: Any, loader: Any, comm: Any = None) -> dict[str, Any]:
    """Val loss, top-1 / top-5 error of ``model`` over the whole val split (training loop).

    The same code and reduction as ``tmpi eval`` (:func:`evaluate`), so the record's
    validation of an epoch equals ``tmpi eval`` of that epoch's checkpoint exactly.

    Parameters
    ----------
    model
        Anything with ``predict(x) -> (b, K) probabilities`` and ``n_classes``.
    loader
        This rank's :class:`~theanompi.data.ValLoader` (rank ``r`` of ``N``).
    comm
        Communicator of the ``N`` ranks sharing the val split (collective); ``None``: one
        process with ``ValLoader(cfg, 0, 1)``.

    Returns
    -------
    dict
        The same on every rank: ``val_loss``, ``val_top1_err``, ``val_top5_err`` (floats),
        ``val_n`` (images), ``val_seconds`` (slowest rank).
    """
    size = 1 if comm is None else comm.Get_size()
    if loader.size != size:
        raise ValueError(
            f"loader splits the val set over {loader.size} rank(s) but comm has {size}; "
            "build ValLoader(cfg, comm.Get_rank(), comm.Get_size())"
        )
    r = evaluate(model, indexed_batches(loader), comm)
    return {
        "val_loss": r["loss"],
        "val_top1_err": r["top1_error"],
        "val_top5_err": r["top5_error"],
        "val_n": r["images"],
        "val_seconds": r["seconds"],
    }


def symbolic_true_rank(scores: Any, y: Any) -> Any:
    """PyTensor version of :func:`true_rank` (same tie rule): (b,) int64 for (b, K) ``scores``."""
    import pytensor.tensor as pt

    rows = pt.arange(y.shape[0])
    sy = scores[rows, y].dimshuffle(0, "x")
    lower = pt.lt(pt.arange(scores.shape[1]).dimshuffle("x", 0), y.dimshuffle(0, "x"))
    above = pt.or_(pt.gt(scores, sy), pt.and_(pt.eq(scores, sy), lower))
    return pt.sum(above, axis=-1, dtype="int64")


def symbolic_metrics(
    logits: Any, y: Any, k: int = TOP_K, label_smoothing: float = 0.0
) -> tuple[Any, Any, Any]:
    """Graph of (mean loss, top-1 error, top-k error) of ``logits`` (b, K) for labels ``y`` (b,).

    The loss is the exact mean ``log_softmax`` cross-entropy (the training objective, no
    floor: its gradient must not vanish); the errors follow the tie rule on ``logits``.
    Labels must be real (no ``-1`` padding). Reported validation numbers come from
    :func:`batch_metrics` on ``predict``'s probabilities, not from this graph.

    With ``label_smoothing = s`` > 0 (the training objective only) the loss is
    ``(1 - s) * -log p_y + s * mean_k(-log p_k)``, the cross-entropy against the target
    ``(1 - s) * onehot(y) + s / K``: ``torch.nn.CrossEntropyLoss(label_smoothing=s)``.

    Returns
    -------
    tuple
        Three ``floatX`` scalars.
    """
    import pytensor
    import pytensor.tensor as pt
    from pytensor.tensor.special import log_softmax

    fx = pytensor.config.floatX
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be in [0, 1), e.g. 0.1")
    rows = pt.arange(y.shape[0])
    logp = log_softmax(logits, axis=-1)
    loss = -logp[rows, y].mean()
    if label_smoothing:
        s = np.asarray(label_smoothing, dtype=logits.dtype)
        loss = (np.asarray(1, logits.dtype) - s) * loss - s * logp.mean(axis=-1).mean()
    rank = symbolic_true_rank(logits, y)
    top1 = pt.ge(rank, 1).astype(fx).mean()
    topk = pt.ge(rank, k).astype(fx).mean()
    return loss.astype(fx), top1, topk
