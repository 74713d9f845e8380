"""Atom tracing on reconstructed volumes (``fasttomo-trace``).

  * :mod:`.core`      -- :func:`~fasttomo.trace.core.trace_volume`: peaks, batched Gaussian fits,
                         rejection, duplicate merging, species classes.
  * :mod:`.gauss`     -- Gaussian atoms on a voxel grid: patches, rendering, the batched LM fit.
  * :mod:`.neighbors` -- close pairs (grid hash), greedy suppression and matching.
  * :mod:`.score`     -- precision, recall, RMSD and species accuracy against true coordinates.
  * :mod:`.files`     -- atoms.csv, extended XYZ, the slab picture.
  * :mod:`.command`   -- the Hydra entry point ``fasttomo-trace``.
"""
