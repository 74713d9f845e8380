"""File input/output for tilt series and volumes.

Modules:
  * :mod:`.atomic`  -- :func:`atomic_write`, the one way every writer puts a file on disk.
  * :mod:`.mrc`     -- MRC/ST/ALI stacks and volumes (mrcfile), extended headers FEI1/FEI2,
                       legacy FEI and SerialEM (SERI).
  * :mod:`.imod`    -- IMOD text files (.rawtlt/.tlt) and SerialEM .mdoc.
  * :mod:`.hdf5`    -- fasttomo's own HDF5 tilt-series layout (documented there), user-named
                       datasets, and HDF5 volumes.
  * :mod:`.tiff`    -- multi-page TIFF stacks and volumes.
  * :mod:`.volume`  -- :func:`write_volume` / :func:`read_volume` (MRC, HDF5, TIFF).

Every error raised here is a :class:`DataFileError` (a
:class:`~fasttomo.data.tiltseries.TiltSeriesError`) whose message names the file, the problem and
the fix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fasttomo.data.io.common import (  # noqa: F401 - the package's public names
    STACK_SUFFIXES, DataFileError, OutputExistsError, _fmt, file_size, read_text_lines, source_from_suffix)

if TYPE_CHECKING:  # pragma: no cover
    from fasttomo.data.tiltseries import TiltSeries


def write_tiltseries(path: str | os.PathLike, ts: "TiltSeries", fmt: str | None = None,
                     overwrite: bool = False) -> list[str]:
    """Write ``ts`` as MRC (plus a sibling ``.rawtlt``), fasttomo HDF5 or TIFF (plus ``.rawtlt``).

    ``fmt`` is ``mrc``, ``h5`` or ``tiff``; None takes it from the suffix. Returns the written
    paths. MRC and TIFF keep neither the validity mask nor the ground truth (HDF5 keeps both; a
    warning says what was left out).
    """
    fmt = _fmt(path, fmt)
    if fmt == "h5":
        from fasttomo.data.io import hdf5

        return [hdf5.write_tiltseries_h5(path, ts, overwrite=overwrite)]
    from fasttomo.data.io import imod

    _warn_dropped(path, ts, fmt)
    if fmt == "mrc":
        from fasttomo.data.io import mrc

        written = mrc.write_mrc(path, ts.stack, ts.pixel_size, labels=[f"fasttomo tilt series from {ts.source}"],
                                overwrite=overwrite, image_stack=True)
    else:
        from fasttomo.data.io import tiff

        written = tiff.write_tiff(path, ts.stack, ts.pixel_size, attrs={"kind": "tiltseries"},
                                  overwrite=overwrite)
    tlt = os.path.splitext(str(path))[0] + ".rawtlt"
    return [written, imod.write_tilt_file(tlt, ts.angles, overwrite=overwrite)]


def _warn_dropped(path, ts, fmt) -> None:
    import logging

    lost = [name for name, v in (("valid mask", ts.valid), ("ground truth", ts.ground_truth)) if v is not None]
    if lost:
        logging.getLogger("fasttomo.data").warning(
            "%s: the %s format does not keep the %s; write .h5 to keep them.", path, fmt, " and ".join(lost))


def __getattr__(name: str):  # lazy re-exports keep the package import light and cycle-free
    if name in ("write_volume", "read_volume"):
        from fasttomo.data.io import volume

        return getattr(volume, name)
    if name == "atomic_write":
        from fasttomo.data.io.atomic import atomic_write

        return atomic_write
    raise AttributeError(name)


__all__ = ["DataFileError", "OutputExistsError", "source_from_suffix", "write_tiltseries",
           "write_volume", "read_volume", "atomic_write"]
