"""Volume writers/readers: exact round trips, voxel size, labels, IMOD XZY rotation, refusals."""

import json

import h5py

import mrcfile
import numpy as np
import pytest
import tifffile

from fasttomo.data.io import DataFileError, OutputExistsError
from fasttomo.data.io.volume import from_imod_xzy, read_volume, to_imod_xzy, write_volume

VOL = np.random.default_rng(3).standard_normal((6, 10, 14)).astype(np.float32)
ATTRS = {"config": {"data": {"source": "phantom"}, "seed": 0}, "metrics": {"pearson": 0.9}}


@pytest.mark.parametrize("fmt,suffix", [("mrc", "mrc"), ("h5", "h5"), ("tiff", "tif")])
@pytest.mark.parametrize("voxel", [2.17, 10.0, 0.1234567891])
def test_round_trip_exact(tmp_path, fmt, suffix, voxel):
    p = tmp_path / f"v.{suffix}"
    write_volume(p, VOL, voxel, label="run-1", attrs=ATTRS, fmt=fmt)
    vol, vx, attrs = read_volume(p)
    np.testing.assert_array_equal(vol, VOL)
    assert vx == voxel  # exactly, not just to float32
    if fmt != "mrc":
        assert attrs["config"] == ATTRS["config"]
    with pytest.raises(OutputExistsError, match=r"v\.\w+: file already exists.*output\.overwrite=true"):
        write_volume(p, VOL, voxel, label="run-1", attrs=ATTRS, fmt=fmt)
    write_volume(p, VOL * 2, voxel, label="run-1", attrs=ATTRS, fmt=fmt, overwrite=True)
    np.testing.assert_array_equal(read_volume(p)[0], VOL * 2)


def test_mrc_header_is_what_3dmod_expects(tmp_path):
    p = tmp_path / "v.mrc"
    write_volume(p, VOL, 2.5, label="my-run", attrs={}, fmt="mrc")
    with mrcfile.open(p) as m:
        assert m.header.mode == 2
        assert (int(m.header.nx), int(m.header.ny), int(m.header.nz)) == (14, 10, 6)  # X, Y, Z unchanged
        assert m.voxel_size.x == m.voxel_size.y == m.voxel_size.z == pytest.approx(2.5)
        assert tuple(m.header.origin.item()) == (0.0, 0.0, 0.0)
        labels = [bytes(x).decode() for x in m.header.label[: int(m.header.nlabl)]]
        assert any("fasttomo" in lab and "my-run" in lab for lab in labels)
        np.testing.assert_array_equal(m.data, VOL)


def test_mrc_label_names_the_run_once(tmp_path):
    """The run's label is "fasttomo <version> run <name>" (not "... run fasttomo run fasttomo")."""
    from fasttomo import __version__

    for label, expected in (("fasttomo", f"fasttomo {__version__} run fasttomo"),
                            ("fasttomo phantom ground truth", f"fasttomo {__version__} phantom ground truth")):
        p = tmp_path / f"{len(label)}.mrc"
        write_volume(p, VOL, 2.5, label=label, attrs={}, fmt="mrc")
        with mrcfile.open(p) as m:
            labels = [bytes(x).decode().strip() for x in m.header.label[: int(m.header.nlabl)]]
            assert expected in labels and not any("run fasttomo run" in lab for lab in labels), labels


def test_h5_attributes(tmp_path):
    p = tmp_path / "v.h5"
    write_volume(p, VOL, 2.5, label="r", attrs=ATTRS, fmt="h5")
    with h5py.File(p) as f:
        d = f["/volume"]
        assert d.attrs["voxel_size"] == 2.5 and d.attrs["units"] == "angstrom" and d.attrs["axis_order"] == "ZYX"
        assert json.loads(d.attrs["config"]) == ATTRS["config"]


def test_tiff_spacing_metadata(tmp_path):
    p = tmp_path / "v.tif"
    write_volume(p, VOL, 2.5, label="r", attrs={}, fmt="tiff")
    with tifffile.TiffFile(p) as t:
        assert t.imagej_metadata["spacing"] == 2.5 and t.imagej_metadata["unit"] == "angstrom"
        num, den = t.pages[0].tags["XResolution"].value
        assert den / num == pytest.approx(2.5)


def test_imod_xzy_is_a_rotation_not_a_mirror(tmp_path):
    f = to_imod_xzy(VOL)
    assert f.shape == (10, 6, 14)  # sections along Y, rows along Z
    np.testing.assert_array_equal(f, np.rot90(VOL, k=-1, axes=(0, 1)))
    z, y, x = 1, 7, 3
    assert f[y, VOL.shape[0] - 1 - z, x] == VOL[z, y, x]
    np.testing.assert_array_equal(from_imod_xzy(f), VOL)
    p = tmp_path / "xzy.mrc"
    write_volume(p, VOL, 3.0, label="r", attrs={}, fmt="mrc", imod_xzy=True)
    with mrcfile.open(p) as m:
        np.testing.assert_array_equal(m.data, f)
    vol, vx, attrs = read_volume(p)
    np.testing.assert_array_equal(vol, VOL)
    assert attrs["orientation"] == "XZY" and vx == 3.0
    with pytest.raises(DataFileError, match="imod_xzy"):
        write_volume(tmp_path / "x.h5", VOL, 3.0, label="r", attrs={}, fmt="h5", imod_xzy=True)


def test_read_volume_errors(tmp_path):
    with pytest.raises(DataFileError, match=r"v\.raw: unknown file suffix '\.raw'"):
        read_volume(tmp_path / "v.raw")
    p = tmp_path / "aniso.mrc"
    with mrcfile.new(p) as m:
        m.set_data(VOL)
        m.voxel_size = (1.0, 1.0, 2.0)
    with pytest.raises(DataFileError, match=r"aniso\.mrc: anisotropic voxel size \(x, y, z\) = \(1.0, 1.0, 2.0\)"):
        read_volume(p)
    q = tmp_path / "novox.mrc"
    with mrcfile.new(q) as m:
        m.set_data(VOL)
    vol, vx, attrs = read_volume(q)
    assert vx == 1.0 and attrs["voxel_size_assumed"]
    with pytest.raises(DataFileError, match="3-D"):
        write_volume(tmp_path / "bad.mrc", VOL[0], 1.0, label="r", attrs={}, fmt="mrc")
