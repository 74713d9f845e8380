"""Where a run's work happens: this process in the process group, the run folder, the start."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Place:
    """This process's rank, the world size and the local rank (its GPU); the run folder (None: a
    half set or a test, nothing written along the way); the run's start (``time.perf_counter``)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    out_dir: Path | None = None
    t0: float = 0.0

    @property
    def main(self) -> bool:
        return self.rank == 0
