"""End-to-end handedness (issue 3): a chiral phantom simulated, written as an IMOD-style MRC +
.rawtlt by another tool (mrcfile + plain text), read back and reconstructed, correlates with the
phantom far better than with its mirror images; the same data with the tilt axis rotated by 90
degrees plus data.tilt_axis_angle=90 reconstructs the same volume."""

import numpy as np
import pytest
from io_helpers import write_raw_mrc, write_tlt

try:
    from fasttomo.cli.reconstruct import compose_config, run
except ImportError as exc:  # the trainer lands separately
    pytest.skip(f"fasttomo.cli.reconstruct is not importable yet ({exc}); the e2e handedness tests need the trainer.",
                allow_module_level=True)

from fasttomo.data.io.volume import read_volume
from fasttomo.data.phantom import default_phantom, default_thickness, project, voxelize

W = H = 32
T = default_thickness(W)
ANGLES = np.linspace(-60.0, 60.0, 41)


def _corr(a, b):
    a, b = a.ravel() - a.mean(), b.ravel() - b.mean()
    return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def _reconstruct(tmp_path, name, stack, extra=()):
    p = write_raw_mrc(tmp_path / f"{name}.mrc", stack, voxel=10.0)
    t = write_tlt(tmp_path / f"{name}.rawtlt", ANGLES)
    out = tmp_path / f"run_{name}"
    cfg = compose_config(["data=mrc", f"data.path={p}", f"data.angles={t}", f"data.thickness={T}",
                          "++data.normalize=none", "experiment=quick", "optim.steps=300", "runtime.device=cpu",
                          "logging.tensorboard=false", "logging.progress=false", f"output.dir={out}", *extra])
    run(cfg)
    vol, vx, _ = read_volume(out / "volume.mrc")
    assert vx == 10.0
    return vol


@pytest.fixture(scope="module")
def phantom_and_stack():
    ph = default_phantom(W, H, T)
    return ph, project(ph, ANGLES, H, W)


@pytest.mark.slow
def test_chiral_phantom_reconstructs_with_imod_handedness(tmp_path, phantom_and_stack):
    ph, stack = phantom_and_stack
    vol = _reconstruct(tmp_path, "chiral", stack)
    truth = voxelize(ph)
    assert vol.shape == truth.shape == (T, H, W)
    mirror_x = voxelize(ph.mirror())             # x -> -x
    mirror_z = truth[::-1]                        # z -> -z (what a flipped tilt-angle sign gives)
    c = _corr(vol, truth)
    assert c > 0.6, f"reconstruction correlates only {c:.3f} with the phantom"
    # Most of the slab is nearly mirror-symmetric, so compare where the phantom and its mirror image
    # differ: there the right hand correlates strongly with the phantom and not with the mirror
    # (a mirrored reconstruction gives the opposite: measured 0.92 / -0.07 vs -0.09 / 0.92).
    for name, mirror in (("x", mirror_x), ("z", mirror_z)):
        m = np.abs(truth - mirror) > 0.05
        good, bad = _corr(vol[m], truth[m]), _corr(vol[m], mirror[m])
        assert good > 0.6 and good > bad + 0.4, f"mirror {name}: phantom {good:.3f} vs mirror image {bad:.3f}"


@pytest.mark.slow
def test_tilt_axis_rotated_by_90_reconstructs_the_same_volume(tmp_path, phantom_and_stack):
    ph, stack = phantom_and_stack
    ref = _reconstruct(tmp_path, "axis0", stack)
    # raw images whose tilt axis lies at +90 degrees (counter-clockwise from +Y): a rotation of the
    # image content (np.rot90 is a rotation, never a mirror)
    rotated = np.ascontiguousarray(np.rot90(stack, k=-1, axes=(1, 2)))
    vol = _reconstruct(tmp_path, "axis90", rotated, ["++data.tilt_axis_angle=90"])
    assert _corr(vol, ref) > 0.98
    truth = voxelize(ph)
    assert abs(_corr(vol, truth) - _corr(ref, truth)) < 0.02
