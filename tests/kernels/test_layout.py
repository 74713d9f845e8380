"""PlaneLayout is the one source of plane offsets: its iterators agree with its offsets, and the
flat form the custom ops carry turns back into the same layout. Tuning is a frozen argument."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from fasttomo.kernels.layout import PlaneLayout


def test_scales_groups_and_flat_form_agree_with_offsets():
    lay = PlaneLayout(3, 5, ((4, 6, 5), (7, 3, 9)))
    assert PlaneLayout.from_flat(3, 5, lay.flat_resolutions) == lay
    assert lay.flat_resolutions == [4, 6, 5, 7, 3, 9]
    assert [s[4:] for s in lay.scales()] == list(lay.offsets)
    assert [s[1:4] for s in lay.scales()] == list(lay.resolutions)
    groups = list(lay.groups())
    assert [g[0] for g in groups] == [o for row in lay.offsets for o in row]
    # groups tile the buffer exactly, in order
    assert all(a[0] + a[3] == b[0] for a, b in zip(groups, groups[1:]))
    assert groups[-1][0] + groups[-1][3] == lay.numel
    with pytest.raises(ValueError, match="3 per scale"):
        PlaneLayout.from_flat(3, 5, [4, 6])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_tuning_is_a_frozen_argument():
    from fasttomo.kernels.triton import kplanes as kp

    with pytest.raises(dataclasses.FrozenInstanceError):
        kp.DEFAULT_TUNING.backward = "pairs"  # type: ignore[misc]
    with pytest.raises(ValueError, match="backward"):
        kp.KPlanesTuning(backward="scan")
    with pytest.raises(ValueError, match="power of two"):
        kp.KPlanesTuning(run_rows=6)
    with pytest.raises(ValueError, match="few_channel_rows must be a power of two"):
        kp.KPlanesTuning(few_channel_rows=12)
    # rows per scale: 16 for few channels and planes up to 512 a side, run_rows elsewhere; 0 turns it off
    tu = kp.KPlanesTuning()
    assert [tu.rows(c, side) for c, side in ((8, 256), (8, 512), (8, 1024), (48, 200), (16, 512))] == [16, 16, 8, 8, 16]
    assert kp.KPlanesTuning(few_channel_rows=0).rows(8, 256) == 8
    # register caps: 128 where a channel chunk is at most 2 elements a thread (they fit it), run_maxnreg elsewhere
    assert [tu.maxnreg(c, r) for c, r in ((8, 8), (4, 16), (8, 16), (12, 8), (16, 8), (48, 8))] == [
        128, 128, 168, 168, 168, 168]
    assert kp.KPlanesTuning(small_tile_maxnreg=None).maxnreg(8, 8) == 168


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_scale_takes_more_rows_only_where_programs_stay_plenty(monkeypatch):
    """16 rows a program halve the programs: a scale takes them only where the launch keeps
    min_programs_per_sm programs an SM (a 132-SM device stands in here), so a problem just large
    enough for texel runs at 8 rows keeps 8 rows."""
    import types

    import torch

    from fasttomo.kernels.triton import kplanes as kp

    from fasttomo.kernels.triton.launch import sm_count

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(multi_processor_count=132))
    sm_count.cache_clear()
    cuda = torch.device("cuda")
    camera = 8192 * 768  # the camera2k step's points, T = 2, C = 8
    assert [kp.scale_rows(camera, 2, 8, side, cuda) for side in (256, 512, 1024)] == [16, 16, 8]
    assert kp.scale_rows(camera, 2, 48, 256, cuda) == 8  # many channels: 8 rows
    edge = 16 * 132 * 128 // 2  # 16 programs an SM at 8 rows of 16 points, T = 2
    assert kp.backward_strategy(edge, 2, cuda) == "runs" and kp.scale_rows(edge, 2, 8, 256, cuda) == 8
    assert kp.backward_strategy(edge - 128, 2, cuda) == "pairs"
    assert kp.scale_rows(100, 2, 8, 256, torch.device("cpu")) == 16  # no device to fill: the interpreter
    sm_count.cache_clear()  # no stand-in count left for later tests
    # no module-level knobs left to setattr
    assert not [n for n in vars(kp) if n.isupper() and not n.startswith("_") and n != "BACKWARDS"
                and n != "DEFAULT_TUNING"]
