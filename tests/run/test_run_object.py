"""The run as an object (fasttomo.run.run.Run), checked on real runs: a quality number that cannot
be computed is null in metrics.json and "n/a" in the log and the summary, never a crash at the end
of a run; every refused input (config, data read and validation, resume checks) is refused before
the run folder is made, so nothing is left behind; SIRT and the field run behind one interface."""

from __future__ import annotations

import mrcfile
import numpy as np
import pytest
from cli_helpers import TINY, TINY_RUN, cli, strict_json

from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.run.pipeline import user_errors

SIRT = [*(a for a in TINY if not a.startswith(("model.", "projector.", "sampler."))), "model=sirt"]


def _stack(tmp_path, values: np.ndarray, n_angles: int | None = None):
    """An MRC stack of ``values`` and a .rawtlt of ``n_angles`` (default: one per view) angles."""
    path, angles = tmp_path / "stack.mrc", tmp_path / "stack.rawtlt"
    with mrcfile.new(path, overwrite=True) as m:
        m.set_data(values.astype(np.float32))
        m.voxel_size = 10.0
    n = values.shape[0] if n_angles is None else n_angles
    angles.write_text("\n".join(f"{a:.2f}" for a in np.linspace(-60, 60, n)))
    return path, angles


def test_uncomputable_pearsons_are_null_in_metrics_and_n_a_in_the_log(tmp_path):
    """Learning rates that blow the field up (the guard off) leave nothing to correlate: the run
    used to end in a TypeError (exit 1, traceback, no metrics.json) formatting a None Pearson; it
    ends as a divergence (exit 3, one line) with metrics.json written, the Pearsons null."""
    out = tmp_path / "run"
    res = cli([*TINY, "optim.steps=30", "guard=off", "optim.lr_grids=1e6", "optim.lr_decoder=1e3",
               f"hydra.run.dir={out}"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 3 and "Traceback" not in text, text
    metrics = strict_json(out / "metrics.json")
    vr = metrics["view_residuals"]
    assert vr["pearson_mean"] is None and set(vr["pearson"]) == {None}
    assert metrics["status"] == "diverged"
    assert "Pearson n/a on average" in (out / "reconstruct.log").read_text()


@pytest.mark.parametrize("case", ["missing data.path", "angles do not match the stack", "non-finite pixels",
                                  "resume past optim.steps"])
def test_refused_input_leaves_no_run_folder(tmp_path, case):
    """Every input check happens before the run folder is made: a refused run leaves nothing."""
    values = np.random.default_rng(0).random((15, 20, 24))
    if case == "non-finite pixels":
        values[3, 4, 5] = np.nan  # data.nonfinite=reject
    path, angles = _stack(tmp_path, values, 14 if "angles" in case else None)
    args = [*TINY_RUN, "data=mrc", f"data.path={path}", f"data.angles={angles}", "optim.steps=4"]
    if case == "missing data.path":
        args[-3] = f"data.path={tmp_path / 'nothing.mrc'}"
    elif case == "non-finite pixels":
        args.append(f"data.exclude_views={list(range(1, 16))}".replace(" ", ""))
    elif case == "resume past optim.steps":
        run(compose_config([*args, f"output.dir={tmp_path / 'first'}"]))
        args = [f"resume={tmp_path / 'first'}", "optim.steps=2"]
    out = tmp_path / "refused"
    with pytest.raises(user_errors()):
        run(compose_config([*args, f"output.dir={out}"]))
    assert not out.exists()


def test_sirt_runs_behind_the_method_interface_with_half_sets(tmp_path):
    out = tmp_path / "sirt"
    metrics = run(compose_config([*SIRT, "model.iterations=5", "evaluation.half_sets=true",
                                  f"output.dir={out}"]))
    assert metrics["model"] == "sirt" and metrics["steps"] == 5 and metrics["status"] == "finished"
    assert metrics["half_sets"]["fsc"] and not list(out.glob("volume_*"))  # scored, not written
    assert not (out / "checkpoints").exists()
    assert strict_json(out / "manifest.json")["status"] == "finished"
    tl = strict_json(out / "metrics.json")["timeline"]  # the process's own peak (VmHWM), as the field's
    assert tl["peak_host_bytes"] > 50e6 and tl["peak_gpu_bytes"] is None
    phases = tl["peak_bytes_by_phase"]  # where the peak is: the main run, each half, their FSC
    assert list(phases) == ["main run", "even half: fit", "even half: volume", "odd half: fit", "odd half: volume",
                            "half-set FSC"]
    assert all(p["gpu"] is None for p in phases.values())
    hosts = [p["host"] for p in phases.values() if p["host"] is not None]
    assert hosts and max(hosts) <= tl["peak_host_bytes"]


def test_the_main_fit_is_let_go_before_the_half_sets(tmp_path, monkeypatch):
    """The main fit's trainer (its data, snapshots and buffers on the device) is freed before the
    halves are fitted, and the run still ends with its step count, checkpoint and half-set FSC."""
    import gc
    import weakref

    from fasttomo.run import results
    from fasttomo.run.run import Run

    main_trainer: list = []
    alive: list[bool] = []

    class Watched(Run):
        def score(self):
            main_trainer.append(weakref.ref(self.method.trainer))
            super().score()

    make_method = results.make_method

    def make_half(*args, **kwargs):  # the real method; notes whether the main trainer still lives
        gc.collect()
        alive.append(main_trainer[0]() is not None)
        return make_method(*args, **kwargs)

    monkeypatch.setattr(results, "make_method", make_half)
    out = tmp_path / "halves"
    metrics = Watched(compose_config([*TINY, "optim.steps=6", "evaluation.half_sets=true", f"output.dir={out}"])).execute()
    assert alive == [False, False]  # both halves were made with the main trainer gone
    assert metrics["half_sets"]["fsc"] and metrics["steps"] == 6
    assert strict_json(out / "manifest.json")["step"] == 6 and (out / "checkpoints" / "last.pt").exists()


def test_sirt_refuses_a_volume_shape_before_the_folder_is_made(tmp_path):
    out = tmp_path / "sirt"
    with pytest.raises(user_errors(), match="output.volume_shape"):
        run(compose_config([*SIRT, "model.iterations=2", "output.volume_shape=[4,4,4]",
                            f"output.dir={out}"]))
    assert not out.exists()


@pytest.mark.parametrize("writable", [True, False], ids=["own-stack", "read-only-stack"])
def test_the_half_sets_read_their_views_in_place_or_copy_them(tmp_path, monkeypatch, writable):
    """Each half gets its views (even, odd in tilt order). From a stack the run may write, the
    halves read rows of it, no copy (at 4096^2 x 121 a copy is 8 GB beside it), and the run's
    stack is in its own order again afterwards; from a read-only one each half gets a copy and the
    run lets its stack go before the first half is fitted. The run ends as before either way."""
    from fasttomo.run import results
    from fasttomo.run.run import Run

    seen: list = []

    class Watched(Run):
        def score(self):
            self.ts.valid = np.random.default_rng(0).random(self.ts.stack.shape) > 0.1  # a mask goes with its views
            self.ts.stack.flags.writeable = writable
            seen.append((self.ts.stack.copy(), self.ts.valid.copy()))  # the run's own views, before the halves
            super().score()

    make_method = results.make_method

    def make_half(cfg, ts, hold, place, *rest):
        seen.append((ts.stack.copy(), ts.valid.copy(), np.shares_memory(ts.stack, watched.ts.stack), watched.ts.stack))
        return make_method(cfg, ts, hold, place, *rest)

    monkeypatch.setattr(results, "make_method", make_half)
    watched = Watched(compose_config([*TINY, "optim.steps=6", "evaluation.half_sets=true",
                                      f"output.dir={tmp_path / 'halves'}"]))
    metrics = watched.execute()
    (whole, mask), (even, even_mask, even_shared, run_stack), (odd, odd_mask, odd_shared, _) = seen
    np.testing.assert_array_equal(even, whole[0::2])
    np.testing.assert_array_equal(odd, whole[1::2])
    np.testing.assert_array_equal(even_mask, mask[0::2])
    np.testing.assert_array_equal(odd_mask, mask[1::2])
    assert even_shared is odd_shared is writable
    if writable:  # back in tilt order, the mask too
        np.testing.assert_array_equal(watched.ts.stack, whole)
        np.testing.assert_array_equal(watched.ts.valid, mask)
    else:
        assert run_stack.shape == whole.shape and run_stack.strides == (0, 0, 0)  # no memory behind it
        assert np.isnan(run_stack).all() and not run_stack.flags.writeable  # never read as data
    assert metrics["status"] == "finished" and metrics["half_sets"]["fsc"]
