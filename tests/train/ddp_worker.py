"""torchrun target of tests/train/test_ddp_gloo.py: one rank of a REAL ``fasttomo.cli.reconstruct`` run.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/train/ddp_worker.py \
        DUMP_DIR hydra.run.dir=RUN_DIR key=value ...

Runs the console entry point unchanged (``fasttomo.cli.reconstruct.cli``) and records what this rank
did in ``DUMP_DIR/rank<r>.pt`` (outside the run folder): its logged losses, its final parameters,
the volume export gathered over ranks next to one single-process evaluation of the same model,
the sampler sizes, and every file or folder it created, wrote or renamed (seen by an audit hook,
which also catches writes made through ``os.open``, ``tempfile`` and renames).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    dump_dir = sys.argv.pop(1)
    writes: list[str] = []
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def audit(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(ch in mode for ch in "wax+")) or \
                (mode is None and isinstance(flags, int) and flags & write_flags)
            if writing:
                writes.append(os.path.abspath(os.fsdecode(path)))
        elif event in ("os.rename", "os.link", "os.symlink", "os.mkdir", "os.remove", "os.rmdir"):
            writes.append(os.path.abspath(os.fsdecode(args[1] if event in ("os.rename", "os.link") else args[0])))

    sys.addaudithook(audit)

    import torch

    from fasttomo.train import trainer as trainer_mod

    record: dict = {}
    export = trainer_mod.Trainer.export_volume

    def recording_export(self, shape_zyx=None):
        gathered = export(self, shape_zyx)
        c = self  # the Trainer holds its parts
        shape = tuple(shape_zyx) if shape_zyx is not None else c.projector.box.shape_zyx
        record.update(
            rank=c.rank, world_size=c.world_size, step=self.step,
            history=[list(h) for h in self.history], val_history=[list(h) for h in self.val_history],
            params={k: v.detach().clone() for k, v in c.projector.state_dict().items()},
            n_train=c.sampler.n_train, n_per_rank=c.sampler.n_per_rank,
            gathered=None if gathered is None else torch.from_numpy(gathered.copy()),
            single=(c.projector.volume(shape) * c.sampler.scale).cpu(),
            ddp=type(c.model).__name__,
        )
        return gathered

    trainer_mod.Trainer.export_volume = recording_export

    import atexit

    from fasttomo.cli.reconstruct import cli

    rank = int(os.environ["RANK"])

    def dump() -> None:
        record["writes"] = list(writes)
        os.makedirs(dump_dir, exist_ok=True)
        torch.save(record, os.path.join(dump_dir, f"rank{rank}.pt"))

    # the console entry point, as `torchrun -m fasttomo.cli.reconstruct` runs it: main(), the atexit
    # handlers (this dump among them), then os._exit without tearing torch's threads down (a
    # normal interpreter exit after a gloo run aborted now and then: "terminate called without an
    # active exception", exit -6, after every file was written)
    atexit.register(dump)
    cli()


if __name__ == "__main__":
    main()
