"""Every kernel test starts and ends with the door at backend auto and an empty spy."""

from __future__ import annotations

import pytest

from fasttomo.kernels import dispatch


@pytest.fixture(autouse=True)
def _door_at_auto():
    dispatch.configure("auto")
    dispatch.reset_counters()
    yield
    dispatch.configure("auto")
    dispatch.reset_counters()
