"""One reconstruction, start to finish, from a typed Config (no Hydra here).

Order (the phases of :class:`fasttomo.run.run.Run`): join the process group (torchrun) -> every
input check before anything is written: (resume) read and verify the checkpoint, refuse changes a
continuation cannot make; read/simulate and validate the tilt series (evaluation.truth attached,
evaluation.holdout_views set aside); (a field) refuse a run too big for the memory; make the
method of model.kind (run/methods.py) and load the checkpoint into it -> open the run folder
(rank 0: lock, decide whether the folder can be used, remove an earlier run's files when allowed,
manifest; see folder.py) -> log file (with what the checks logged) -> check the free disk space ->
fit (SIGINT/SIGTERM stop after the current step, see stop.py) -> export the volume (the
best-validation field with optim.keep_best; sharded over ranks, gathered on rank 0) -> volume
files -> checkpoint -> (pose=refine: poses.xf/.tlt/.aln) -> (evaluation.half_sets or
output.half_volumes: the even and the odd views fitted apart, their volumes and FSC) ->
slices.png, loss.png, fsc_*.png -> metrics.json, last (rank 0 only; the other ranks write
nothing). model=sirt fits SIRT (methods/sirt/method.py) behind the same method interface, without
a checkpoint. Every file is written atomically. A failure to write one result keeps the others and
the error says what was saved where (outputs.py). An error after the run folder was opened goes
into reconstruct.log and manifest.json (status failed, diverged or interrupted) before it
propagates; refused input leaves no folder behind.

Resume (``resume=<checkpoint or run folder>``) continues the saved run exactly (same batches, RNG
streams, schedules and optimizer state), into a new run folder, or in place when the checkpoint
lies in the output folder of an unfinished (interrupted, killed, failed) run. The new folder
holds the whole run: its metrics, loss curves and checkpoints include the steps before the
resume, and metrics.json names the checkpoint it resumed from. ``optim.steps`` is the TOTAL step
count, so resuming a run stopped at step N of optim.steps=T trains T-N more steps; raising
optim.steps extends a finished run (not bit-identical to a longer run from the start, since the
learning-rate schedule of the first part was laid out for the smaller total). The entry point
takes the settings from the checkpoint (resume.py); here, settings that differ from the
checkpoint's config are logged as a warning, and the process count, data, sampler and model must
match (refused otherwise).
"""

from __future__ import annotations

from fasttomo.config import Config
from fasttomo.run.folder import OutputExistsError, OutputFolderError  # noqa: F401 - public here
from fasttomo.run.results import planned_outputs, slices_png, user_errors  # noqa: F401 - public here


def run_reconstruction(cfg: Config) -> dict:
    """Run one reconstruction described by ``cfg`` (cfg.output.dir must be set); returns metrics."""
    from fasttomo.run.run import Run

    return Run(cfg).execute()
