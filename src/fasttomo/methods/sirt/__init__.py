"""Conventional reconstructions on fasttomo's geometry: the voxel projector pair and SIRT."""

from fasttomo.methods.sirt.projectors import back_project, forward_project, view_poses
from fasttomo.methods.sirt.solver import sirt, sirt_weights

__all__ = ["back_project", "forward_project", "sirt", "sirt_weights", "view_poses"]
