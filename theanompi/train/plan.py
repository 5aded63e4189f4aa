"""What the training part of a run takes from its config, read once into typed sections: the config bag stops here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from theanompi.models.optim import LRPolicy, lr_policy
from theanompi.train.schedule import LRSchedule, lr_scale
from theanompi.train.trainer import LoopSettings

__all__ = [
    "FitPlan",
    "ElasticPlan",
    "SnapshotPlan",
    "RecordPlan",
    "SchedulePlan",
    "shrinks_in_place",
]


def shrinks_in_place(cfg: Any) -> bool:
    """An elastic run (``elastic.min_np``) whose ranks left after a lost one go on in the same
    job (BSP, serial exchange, no ZeRO-1); the launcher relaunches the others smaller."""
    from theanompi.rules import RULES

    we = cfg.weight_exchange
    return bool(cfg.elastic.min_np) and RULES.get(we.sync_rule).shrinks_in_place(we)


@dataclass(frozen=True)
class ElasticPlan:
    """An elastic run's rank-side settings (``elastic``): the fewest ranks it trains on, how
    often the state a shrink goes back to is kept, and whether a loss shrinks in place."""

    min_np: int
    commit_every_steps: int
    in_place: bool


@dataclass(frozen=True)
class SnapshotPlan:
    """Where and how often checkpoints are written (``output``)."""

    directory: str
    freq: int
    keep_last: int
    #: the file a user's model was loaded from (kept in every checkpoint's meta)
    model_source: str | None = None

    def meta(self, config: dict[str, Any], rule: str) -> dict[str, Any]:
        """What every checkpoint's meta names: the config, the rule and the model's file."""
        meta = {"config": config, "rule": rule}
        return {**meta, "model_source": self.model_source} if self.model_source else meta


@dataclass(frozen=True)
class RecordPlan:
    """The record's folder, the loggers fed from it (``output.loggers``) and their folder."""

    record_dir: str
    run_dir: str
    loggers: tuple[str, ...]


@dataclass(frozen=True)
class SchedulePlan:
    """The lr's run-level parts (``training.lr_scaling``, ``lr_reference_batch``,
    ``warmup_epochs``) over the model's lr policy (``model.lr_policy`` and its keys)."""

    scaling: str
    reference_batch: int
    warmup_epochs: float
    policy: LRPolicy

    def schedule(
        self, global_batch: int, steps_per_epoch: int, n_epochs: int
    ) -> tuple[LRSchedule, float, int]:
        """(schedule, lr scale, warm-up steps) for a run of ``global_batch`` images and
        ``steps_per_epoch`` optimiser steps per epoch."""
        scale = lr_scale(self.scaling, global_batch, self.reference_batch)
        warmup = round(float(self.warmup_epochs) * steps_per_epoch)
        total = n_epochs * steps_per_epoch
        return LRSchedule(scale, warmup, self.policy, total), scale, warmup


@dataclass(frozen=True)
class FitPlan:
    """The training part of a run, as typed sections (see :meth:`from_config`)."""

    model_name: str
    seed: int
    resume: bool
    loop: LoopSettings
    snapshot: SnapshotPlan
    record: RecordPlan
    schedule: SchedulePlan
    #: None unless ``elastic.min_np`` is set
    elastic: ElasticPlan | None = None
    #: the whole config as a plain dict: the record's ``start`` entry and checkpoints keep it
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, resume: bool, model_source: str | None = None) -> FitPlan:
        """The plan of validated config ``cfg`` (``resume``: continue its run dir's run);
        ``model_source``: the file a user's model was loaded from, kept in checkpoints."""
        out, tr, el = cfg.output, cfg.training, cfg.elastic
        elastic = ElasticPlan(int(el.min_np), int(el.commit_every_steps), shrinks_in_place(cfg))
        return cls(
            model_name=str(cfg.model.name),
            seed=int(cfg.randomness.seed),
            resume=resume,
            loop=LoopSettings(
                n_epochs=int(cfg.model.n_epochs),
                print_freq=int(tr.print_freq),
                check_every=int(cfg.weight_exchange.check_every),
                checkpoint_every_steps=int(out.checkpoint_every_steps),
                checkpoint_every_minutes=float(out.checkpoint_every_minutes),
                accumulate_steps=int(tr.accumulate_steps),
            ),
            snapshot=SnapshotPlan(
                str(out.checkpoint_dir), int(out.snapshot_freq), int(out.keep_last), model_source
            ),
            record=RecordPlan(str(out.record_dir), str(out.run_dir), tuple(out.loggers)),
            schedule=SchedulePlan(
                str(tr.lr_scaling),
                int(tr.lr_reference_batch),
                float(tr.warmup_epochs),
                lr_policy(cfg.model),
            ),
            elastic=elastic if el.min_np else None,
            config=cfg.to_dict(),
        )
