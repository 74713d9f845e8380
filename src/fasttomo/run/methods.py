"""``model.kind`` -> the reconstruction method a run fits (the table that picks it):
SIRT (``model=sirt``, fasttomo.methods.sirt.method.SirtMethod), otherwise a neural field
(fasttomo.run.field.FieldMethod). The dry run picks its estimate the same way
(fasttomo.run.preflight.dry_run)."""

from __future__ import annotations

from fasttomo.config import Config
from fasttomo.run.place import Place


def make_method(cfg: Config, ts, hold, place: Place, stop=None):
    """The method of ``cfg.model.kind`` on ``ts`` (``hold``: the held-out views; ``stop``: the
    run's StopRequests, None for a half set). Settings the method cannot honour raise here."""
    return _MAKERS.get(cfg.model.kind, _field)(cfg, ts, hold, place, stop)


def _field(cfg: Config, ts, hold, place: Place, stop):
    from fasttomo.run.field import FieldMethod

    return FieldMethod(cfg, ts, hold, place, stop)


def _sirt(cfg: Config, ts, hold, place: Place, stop):
    """SIRT polls no stop requests: a signal ends it at once (StopRequests' setup phase)."""
    from fasttomo.methods.sirt.method import SirtMethod
    from fasttomo.run.build import reconstruction_box, resolve_device

    return SirtMethod(cfg, ts, reconstruction_box(cfg, ts), resolve_device(cfg.runtime.device, place.local_rank),
                      hold, main=place.main)


_MAKERS = {"sirt": _sirt}
