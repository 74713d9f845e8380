"""Angles in radians are refused (issue 10, case 8): a tilt series whose largest |angle| is below
2 degrees is almost certainly given in radians; the error names the override."""

from __future__ import annotations

import numpy as np
import pytest
from io_helpers import ANGLES5, data_cfg, make_stack, write_raw_mrc, write_tlt

from fasttomo.data.load import load_tiltseries
from fasttomo.data.tiltseries import TiltSeriesError


def test_radians_are_refused_with_the_override_named(tmp_path):
    p = write_raw_mrc(tmp_path / "s.mrc", make_stack())
    t = write_tlt(tmp_path / "s.rawtlt", np.radians(ANGLES5))  # +-40 degrees written in radians: +-0.70
    with pytest.raises(TiltSeriesError, match=r"s\.rawtlt.*look like radians.*data\.check_angle_units=false"):
        load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
    ts = load_tiltseries(data_cfg(source="mrc", path=p, angles=t, check_angle_units=False))  # a real tiny range
    assert np.allclose(ts.angles, np.radians(ANGLES5))


def test_per_line_radians_are_refused_and_degrees_pass(tmp_path):
    p = write_raw_mrc(tmp_path / "s.mrc", make_stack())
    per_line = np.radians(ANGLES5)[:, None] + np.linspace(-0.01, 0.01, 12)[None, :]
    t = write_tlt(tmp_path / "pl.tlt", per_line.ravel(), per_line=12)
    with pytest.raises(TiltSeriesError, match="radians"):
        load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
    t2 = write_tlt(tmp_path / "d.rawtlt", [-3.0, -1.5, 0.0, 1.5, 3.0])  # small, but clearly degrees (>= 2)
    assert load_tiltseries(data_cfg(source="mrc", path=p, angles=t2)).n_tilts == 5


def test_a_series_of_fewer_than_five_views_is_warned(tmp_path, caplog):
    p = write_raw_mrc(tmp_path / "s.mrc", make_stack())
    t = write_tlt(tmp_path / "s.rawtlt", ANGLES5)
    few = "views; a tomogram from so few is mostly streaks"
    assert load_tiltseries(data_cfg(source="mrc", path=p, angles=t)).n_tilts == 5 and few not in caplog.text
    ts = load_tiltseries(data_cfg(source="mrc", path=p, angles=t, exclude_views=[2, 3, 4]))  # 2 views left
    assert ts.n_tilts == 2 and "only 2 views; a tomogram from so few is mostly streaks" in caplog.text
