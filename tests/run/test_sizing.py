"""Sizes a run takes from its data (issue 26): plane resolutions, samples per ray, rays per step
and steps follow the image size and the view count; the embedded default's and the 128^3 cases'
choices are the ones they always were; the dry run prints each choice and why."""

from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import cli

from fasttomo.geometry.rays import Box
from fasttomo.run.build import auto_sizes, auto_steps

# (Z, Y, X) box, views over +-60 degrees -> resolutions, samples per ray, batch, steps
TABLE = [
    ((32, 64, 64), 61, [32, 64], 48, 1024, 1500),             # the embedded default phantom (unchanged)
    ((128, 128, 128), 61, [32, 64, 128], 134, 4096, 1500),    # the 128^3 bench_quality cases (unchanged)
    ((64, 128, 128), 61, [32, 64, 128], 96, 4096, 1500),
    ((128, 256, 256), 61, [64, 128, 256], 192, 8192, 1500),
    ((256, 512, 512), 61, [64, 128, 256], 384, 8192, 3500),   # provisional
    ((256, 1024, 1024), 61, [128, 256, 512], 384, 8192, 5500),  # camera1k (its measured recipe: 4000)
    ((512, 2048, 2048), 121, [256, 512, 1024], 768, 8192, 7500),  # the measured camera2k defaults
    ((256, 4096, 4096), 121, [512, 1024, 2048], 384, 8192, 9500),  # provisional
]


@pytest.mark.parametrize("box,n_views,res,spr,batch,steps", TABLE)
def test_sizes_follow_the_data(box, n_views, res, spr, batch, steps):
    sizes = auto_sizes(Box(box), box[1:], np.linspace(-60, 60, n_views))
    assert (sizes.resolutions, sizes.samples_per_ray, sizes.batch_size, sizes.steps) == (res, spr, batch, steps)
    assert set(sizes.why) == {"model.resolutions", "projector.samples_per_ray", "sampler.batch_size", "optim.steps"}


def test_steps_grow_with_the_largest_image_side_only():
    assert auto_steps((64, 64)) == auto_steps((256, 100)) == 1500
    assert auto_steps((1024, 512)) == auto_steps((512, 1024)) == 5500


def test_dry_run_prints_each_size_and_why(tmp_path):
    res = cli(["dry_run=true", "runtime=cpu", "data.width=24", "data.height=20", "data.n_tilts=15",
               "sampler.batch_size=256", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout + res.stderr
    assert "model.resolutions = [24] (automatic: one texel per voxel of the box's largest side 24" in text
    assert "sampler.batch_size = 256 (set)" in text
    assert "optim.steps = 1500 (automatic: the images' largest side 24 <= 256)" in text
    assert "projector.samples_per_ray = " in text and not (tmp_path / "run").exists()
