"""Conventional reconstructions on fasttomo's geometry: the voxel projector pair and SIRT."""

from fasttomo.conventional.projectors import back_project, forward_project, view_poses
from fasttomo.conventional.sirt import sirt, sirt_weights

__all__ = ["back_project", "forward_project", "sirt", "sirt_weights", "view_poses"]
