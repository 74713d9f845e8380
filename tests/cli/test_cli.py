"""The command line explains itself: --help, one error style for everything a user types, the
closing summary, report.png (also in TensorBoard), logging that fits a redirected output, and
fasttomo-simulate consistent with its messages. Every command runs as a real process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import pytest
from PIL import Image

from cli_helpers import TINY, TINY_RUN, _env, cli

from fasttomo.cli.help import config_groups, schema_keys
from fasttomo.config import Config
from fasttomo.cli.reconstruct import config_dir

REPO = Path(__file__).resolve().parents[2]


def _run(module: str, args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------------------- --help
def test_help_names_every_group_and_option(tmp_path):
    res = cli(["--help"], tmp_path)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert text.startswith("fasttomo-reconstruct: reconstruct a 3-D volume")
    groups = config_groups(config_dir())
    assert {"data", "model", "optim", "pose", "experiment"} <= set(groups)
    for group, options in groups.items():
        assert f"\n  {group}\n" in text, group
        for option, comment in options.items():
            assert option in text, f"{group}={option}"
            assert comment, f"configs/{group}/{option}.yaml has no first comment to describe it"
    assert "optim.steps: int or null, default null" in text              # null: sized from the data
    assert "data.exclude_views: list, default []" in text
    assert "Hydra" in text and "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir())                                   # help writes nothing


def test_every_key_is_documented():
    undocumented = [k for k, info in schema_keys(Config).items() if not info.doc]
    assert not undocumented, f"keys without an attribute docstring in config.py: {undocumented}"


def test_help_of_one_key_and_one_group(tmp_path):
    key = cli(["--help", "optim.steps"], tmp_path)
    assert key.returncode == 0, key.stderr
    assert key.stdout.startswith("optim.steps: int or null, default null\n")  # the schema's default: no YAML restates it
    assert "optimizer steps" in key.stdout.lower()
    group = cli(["--help", "data"], tmp_path)
    assert group.returncode == 0, group.stderr
    for option in ("phantom (default)", "mrc", "hdf5", "tiff", "data.exclude_views: list, default []",
                   "data.path: str or null"):
        assert option in group.stdout, option
    assert "IMOD-style stack" in group.stdout                               # an option's comment, in full
    assert "Keys and defaults" not in group.stdout                          # the YAML's key list is not prose
    optim = cli(["--help", "optim"], tmp_path)                              # ... even where it starts mid-line
    assert optim.returncode == 0 and "Keys and defaults" not in optim.stdout
    assert "Adam with one learning rate per parameter group.\n" in optim.stdout
    section = cli(["--help=output"], tmp_path)                              # a section without options
    assert section.returncode == 0 and "output.overwrite: bool, default false" in section.stdout
    bad = cli(["--help", "optim.stepz"], tmp_path)
    assert bad.returncode == 2 and "did you mean optim.steps?" in bad.stderr and "Traceback" not in bad.stderr


def test_simulate_and_evaluate_have_their_own_help(tmp_path):
    sim = _run("fasttomo.cli.simulate", ["--help"], tmp_path)
    assert sim.returncode == 0, sim.stderr
    assert sim.stdout.startswith("fasttomo-simulate: write the built-in synthetic tilt series")
    assert "overwrite: bool, default false" in sim.stdout and "data.noise" in sim.stdout
    assert "kplanes_tilted" not in sim.stdout and "\n  optim\n" not in sim.stdout   # not reconstruct's groups
    ev = _run("fasttomo.cli.evaluate", ["--help", "tilt_range"], tmp_path)
    assert ev.returncode == 0 and ev.stdout.startswith("tilt_range: list or null, default null")


# --------------------------------------------------------------------------------------- one error style
@pytest.mark.parametrize("arg, expected", [
    ("data=mrcc", "data=mrcc: no option 'mrcc' in group data; the options are hdf5, mrc, phantom, phantom_small, tiff. "
                  "Did you mean data=mrc?"),
    ("optim.stpes=10", "optim.stpes: no such key. Did you mean optim.steps"),
    ("+optim.stpes=10", "optim.stpes: no such key. Did you mean optim.steps"),
    ("optim.steps=1e3", "optim.steps: expected an integer, got 1e3 (Hydra reads it as the float 1000); write it as "
                        "a whole number, e.g. optim.steps=1000."),
    ("optim.steps=abc", "optim.steps: expected an integer, got 'abc'; e.g. optim.steps=4."),  # null default: generic
    ("data.exclude_views=5", "data.exclude_views: expected a list, got 5; write data.exclude_views=[5]"),
    # a list of a fixed form (its documentation opens with it) is not "a list of one"
    ("data.crop=16", "data.crop: expected a list of 4 values, got 16; write data.crop=[y0,y1,x0,x1] with your values."),
    ("optim.betas=0.9", "optim.betas: expected a list of 2 values, got 0.9; write optim.betas=[beta1,beta2] with your "
                        "values."),
    ("dry_run=maybe", "dry_run: expected true or false, got 'maybe'"),
    ("loss.plane_tv=[1,2]", "loss.plane_tv: expected a number, got a list ([1,2])"),
    ("optim=adamw", "optim=adamw: no option 'adamw' in group optim; the options are adam."),
    ("foo=1", "foo: no such key."),
    ("data.path=${nope}", "data.path: Interpolation key 'nope' not found"),
    # a list without brackets is a Hydra sweep: every value is kept in the advice, IMOD ranges spelled out
    ("data.exclude_views=3,7,12", "data.exclude_views: expected a list, got 3,7,12 (without brackets, Hydra reads "
                                  "values separated by commas as a sweep); write data.exclude_views=[3,7,12]."),
    ("data.crop=0,16,0,16", "write data.crop=[0,16,0,16]."),
    # a comma in a file name: Hydra's hint to quote it (on lines after its first) is kept
    ("data.path=TS,01.mrc", "data.path=TS,01.mrc: the comma makes this several values; to keep it one value (a file "
                            "name with a comma), quote it: \"data.path='TS,01.mrc'\""),
    ("output.formats=mrc,h5", "write output.formats=[mrc,h5]."),
    ("data.exclude_views=1-5", "data.exclude_views: expected a list, got 1-5; write data.exclude_views=[1,2,3,4,5] "
                               "(the range spelled out)."),
    ("data.exclude_views=1-5,9", "write data.exclude_views=[1,2,3,4,5,9]."),
    ("data.exclude_views=[1-5]", "data.exclude_views: expected view numbers, got [1-5] (fasttomo takes no ranges); "
                                 "write data.exclude_views=[1,2,3,4,5]."),
    # GNU-style options and a space for the '=': Hydra's argparse printed its usage
    ("--dry-run", "--dry-run: fasttomo takes key=value settings, not --options; write dry_run=true."),
    ("--data.path=x.mrc", "--data.path: fasttomo takes key=value settings, not --options; write data.path=x.mrc."),
    (("--steps", "20"), "--steps: fasttomo takes key=value settings, not --options; write optim.steps=20."),
    ("--verbose", "--verbose: fasttomo takes key=value settings, not --options; write them as key=value "
                  "(fasttomo-reconstruct --help lists the keys)."),
    (("data.path", "phantom32.mrc"), "data.path: write data.path=phantom32.mrc (key=value, no spaces around =)."),
    (("data.path", "=", "phantom32.mrc"), "data.path: write data.path=phantom32.mrc (key=value, no spaces around =)."),
])
def test_mistyped_input_gets_one_line_and_exit_2(tmp_path, arg, expected):
    args = list(arg) if isinstance(arg, tuple) else [arg]
    res = cli([*TINY, *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    errors = [ln for ln in text.splitlines() if "[ERROR]" in ln]
    assert len(errors) == 1, text
    assert expected in errors[0], errors[0]
    for internal in ("Traceback", "HYDRA_FULL_ERROR", "search path", "full_key", "object_type", "Error executing job"):
        assert internal not in text, internal
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


def test_a_sweep_checks_every_value(tmp_path):
    res = cli(["-m", *TINY, "optim.steps=3,x4", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert res.returncode == 2 and "optim.steps: expected an integer, got 'x4'" in res.stderr


def test_a_sweep_into_an_earlier_sweeps_folder_is_refused_before_hydra_writes(tmp_path):
    """A second sweep into the same hydra.sweep.dir is refused at once: Hydra would first rewrite
    the earlier sweep's multirun.yaml, then every job would refuse its folder."""
    sweep = tmp_path / "sweep"
    first = cli(["-m", *TINY, "optim.steps=3,4", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert first.returncode == 0, first.stderr
    record = (sweep / "multirun.yaml").read_bytes()
    again = cli(["-m", *TINY, "optim.steps=5,6", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert (f"hydra.sweep.dir={sweep} holds the runs of an earlier sweep (jobs 0, 1); choose another "
            "hydra.sweep.dir, or add output.overwrite=true") in again.stderr
    assert (sweep / "multirun.yaml").read_bytes() == record


def test_simulate_and_evaluate_use_the_same_error_style(tmp_path):
    sim = _run("fasttomo.cli.simulate", ["formt=h5"], tmp_path)
    assert sim.returncode == 2 and "formt: no such key. Did you mean format?" in sim.stderr
    ev = _run("fasttomo.cli.evaluate", ["held_out_views=5"], tmp_path)
    assert ev.returncode == 2 and "held_out_views: expected a list, got 5; write held_out_views=[5]" in ev.stderr
    assert "Traceback" not in sim.stderr + ev.stderr and not list(tmp_path.iterdir())


def test_a_list_without_brackets_keeps_every_value_in_simulate_and_evaluate(tmp_path):
    """tilt_range=-60,60 was advised as tilt_range=[-60] (a list of one), dropping 60."""
    ev = _run("fasttomo.cli.evaluate", ["volume=v.mrc", "tilt_range=-60,60"], tmp_path)
    assert ev.returncode == 2 and "write tilt_range=[-60,60]." in ev.stderr, ev.stderr
    sim = _run("fasttomo.cli.simulate", ["--out", "ph"], tmp_path)
    assert sim.returncode == 2 and "--out: fasttomo takes key=value settings, not --options; write out=ph." in sim.stderr
    assert "Traceback" not in ev.stderr + sim.stderr and "usage:" not in sim.stderr and not list(tmp_path.iterdir())


def test_hydra_flags_pass_the_option_check_and_others_are_refused(tmp_path):
    """Hydra's own flags (--cfg, -c, --info, -m) still work; an option Hydra does not know gets
    one line naming the key=value to write, not Hydra's usage and "unrecognized arguments"."""
    for flags in (["--cfg", "job"], ["-c", "job"], ["--cfg=job", "--resolve"]):
        res = cli([*flags, *TINY], tmp_path)
        assert res.returncode == 0 and "\noptim:\n" in res.stdout, (flags, res.stderr)
    info = cli(["--info", "config", *TINY], tmp_path)
    assert info.returncode == 0 and "Config search path" in info.stdout, info.stderr
    res = cli(["-m", *TINY, "--dry-run"], tmp_path)
    assert res.returncode == 2 and "write dry_run=true." in res.stderr and "usage:" not in res.stderr, res.stderr
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------- a run, redirected
@pytest.fixture(scope="module")
def redirected_run(tmp_path_factory):
    """A tiny run with TensorBoard and periodic checkpoints, its output redirected to a file."""
    base = tmp_path_factory.mktemp("cli")
    out = base / "run"
    log_path = base / "console.txt"
    with open(log_path, "w") as fh:
        res = subprocess.run([sys.executable, "-m", "fasttomo.cli.reconstruct", *TINY, "optim.steps=40",
                              "logging.tensorboard=true", "logging.progress=true", "logging.log_every=5",
                              "logging.checkpoint_every=20", f"hydra.run.dir={out}"], cwd=base, env=_env(),
                             stdout=fh, stderr=subprocess.STDOUT, text=True, timeout=300)
    text = log_path.read_text()
    assert res.returncode == 0, text
    return out, text


def test_redirected_output_has_no_carriage_returns_and_progress_lines(redirected_run):
    out, text = redirected_run
    assert "\r" not in text
    progress = [ln for ln in text.splitlines() if "[fasttomo.progress]" in ln]
    assert len(progress) >= 5 and "step 40/40 (100 %)" in progress[-1] and "steps/s" in progress[0]
    log = (out / "reconstruct.log").read_text()
    assert "\r" not in log and log.count("[fasttomo.progress]") == len(progress)
    # checkpoints are named as the README says, and writing one is logged
    assert (out / "checkpoints" / "step0000020.pt").is_file()
    assert f"wrote checkpoint {out / 'checkpoints' / 'step0000020.pt'} at step 20" in log
    assert f"wrote checkpoint {out / 'checkpoints' / 'last.pt'} at step 40" in log


def test_closing_summary_names_folder_files_speed_quality_and_tensorboard(redirected_run):
    out, text = redirected_run
    tail = text[text.index("finished."):]
    assert f"run folder: {out}\n" in tail
    for name in ("volume.mrc", "report.png", "metrics.json", "checkpoints/last.pt", "tb/"):
        assert f"\n  {name}" in tail, name
    assert "KiB" in tail and "steps/s" in tail and "wall time" in tail
    assert "quality: Pearson to the ground truth 0." in tail
    assert f"tensorboard --logdir {out / 'tb'}" in tail
    assert not any(ln.rstrip().endswith(":") for ln in text.splitlines())  # no dangling colon


def test_closing_summary_says_an_fsc_that_never_falls_below_its_threshold(tmp_path):
    """An FSC above its threshold up to Nyquist is the best outcome, not a missing score: the
    summary says so instead of 'no ground truth'."""
    from fasttomo.quality.report import summary_lines

    never = {"fsc0143_A": None, "fsc0143_status": "never", "fsc05_A": None, "fsc05_status": "never", "nyquist_A": 20.0}
    half = summary_lines(tmp_path, {"half_sets": {"fsc": never}}, tensorboard=False)
    assert "quality: half-set FSC above 0.143 up to Nyquist (20 A)" in half
    truth = summary_lines(tmp_path, {"pearson_global": 0.99, "fsc": never}, tensorboard=False)
    assert "quality: Pearson to the ground truth 0.9900; FSC to the truth above 0.5 up to Nyquist (20 A)" in truth
    crossed = summary_lines(tmp_path, {"half_sets": {"fsc0143_A": 31.25, "fsc": {**never, "fsc0143_status": "crossed"}}},
                            tensorboard=False)
    assert "quality: half-set FSC 0.143 at 31.2 A" in crossed


def test_closing_summary_names_the_refined_poses(tmp_path):
    """With pose=refine the summary says how far the poses moved and the tilt-axis correction."""
    from fasttomo.geometry.poses import Poses
    from fasttomo.quality.report import summary_lines

    poses = Poses(np.linspace(-60, 60, 7), 3, learn_rotations=True, learn_shifts=True, learn_z1=False,
                  learn_tilt_axis=True)
    with torch.no_grad():
        poses.shifts[0, 0] = -2.5
        poses.z3[6] = np.deg2rad(0.8)
        poses.axis.fill_(np.deg2rad(-0.4))
    lines = summary_lines(tmp_path, {"poses": poses.describe()}, tensorboard=False)
    assert ("poses refined: largest shift 2.50 px, largest in-plane rotation 0.40 deg, tilt-axis correction "
            "-0.40 deg (metrics.json poses)") in lines
    fixed = summary_lines(tmp_path, {"poses": Poses(np.linspace(-60, 60, 7), 3).describe()}, tensorboard=False)
    assert not any(ln.startswith("poses refined") for ln in fixed)


def test_rotation_plot_draws_z1_only_when_learned_and_names_the_tilt_axis():
    from fasttomo.geometry.poses import Poses
    from fasttomo.quality.report import rotation_series

    angles = np.linspace(-60, 60, 7)
    z3_only = Poses(angles, 3, learn_rotations=True, learn_z1=False, learn_tilt_axis=True)
    with torch.no_grad():
        z3_only.axis.fill_(np.deg2rad(0.75))
    title, ser = rotation_series(z3_only.describe())
    assert [s.label for s in ser] == ["z3 (in-plane, after the tilt)"]
    assert title == "Learned rotations per view (tilt axis +0.75 deg)"
    title, ser = rotation_series(Poses(angles, 3, learn_rotations=True, learn_z1=True).describe())
    assert [s.label for s in ser] == ["z1 (before the tilt)", "z3 (in-plane, after the tilt)"]
    assert title == "Learned rotations per view"


def test_report_png_is_readable_and_in_tensorboard(redirected_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = redirected_run
    img = np.asarray(Image.open(out / "report.png").convert("L"), dtype=np.float32)
    # the slice panel (24 x 20 x 12 voxels enlarged to ~300 px), the loss and FSC plots side by side
    assert img.shape[1] >= 1200 and img.shape[0] >= 800, img.shape
    assert img.std() > 20                                                  # not blank
    slices = Image.open(out / "slices.png")
    assert slices.size[0] >= 600 and slices.size[1] >= 300                 # readable, not 166 x 132
    acc = EventAccumulator(str(out / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert "report" in acc.Tags()["images"]
    event = acc.Images("report")[-1]
    assert event.step == 40 and (event.width, event.height) == (img.shape[1], img.shape[0])


# --------------------------------------------------------------------------------------- fasttomo-simulate
def test_simulate_messages_match_what_it_does(tmp_path):
    args = [f"out={tmp_path / 'ph'}", "format=mrc", "data.width=16", "data.height=16", "data.n_tilts=5"]
    first = _run("fasttomo.cli.simulate", args, tmp_path)
    text = first.stdout + first.stderr
    assert first.returncode == 0, text
    assert "does not keep" not in text and "WARNING" not in text           # the truth is written beside the stack
    assert (tmp_path / "ph_truth.mrc").is_file()
    (tmp_path / "ph.mrc").unlink()                                          # one of its files is left: refused
    again = _run("fasttomo.cli.simulate", args, tmp_path)
    assert again.returncode == 2
    assert "set overwrite=true" in again.stderr and "output.overwrite" not in again.stderr
    assert not (tmp_path / "ph.mrc").exists()                               # nothing written when refused
    assert _run("fasttomo.cli.simulate", [*args, "overwrite=true"], tmp_path).returncode == 0


def test_simulate_outputs_in_the_repository_are_git_ignored():
    names = ["phantom.mrc", "phantom.rawtlt", "phantom_truth.mrc", "phantom.h5", "mis_poses.json"]
    res = subprocess.run(["git", "check-ignore", *names], cwd=REPO, capture_output=True, text=True)
    if res.returncode == 128:
        pytest.skip("not a git checkout")
    assert sorted(res.stdout.split()) == sorted(names)
    kept = subprocess.run(["git", "check-ignore", "data/phantom32.mrc"], cwd=REPO, capture_output=True, text=True)
    assert kept.returncode == 1                                             # the shipped sample stays tracked


# --------------------------------------------------------------------------------------- console handler
def test_messages_go_above_the_progress_bar_and_ranks_stay_quiet(capsys):
    import io
    import logging

    from tqdm import tqdm

    from fasttomo.logging import PROGRESS_LOGGER, ConsoleHandler, quiet_other_ranks, restore_ranks

    handler = ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("fasttomo.test_console")  # level NOTSET: it follows "fasttomo", as the real ones do
    logger.addHandler(handler)
    parent = logging.getLogger("fasttomo")
    level = parent.level
    parent.setLevel(logging.INFO)
    try:
        bar_out = io.StringIO()
        with tqdm(total=10, file=bar_out) as bar:
            bar.update(3)
            logger.info("kernels: chosen")
            logging.getLogger(PROGRESS_LOGGER).handle(logging.LogRecord(PROGRESS_LOGGER, logging.INFO, "", 0,
                                                                        "step 3/10", None, None))
            handler.handle(logging.LogRecord(PROGRESS_LOGGER, logging.INFO, "", 0, "step 3/10", None, None))
            logger.warning("careful")
        out = capsys.readouterr()
        assert out.out == "INFO kernels: chosen\n"                     # a whole line of its own, not inside the bar
        assert out.err == "WARNING careful\n"
        assert "step 3/10" not in out.out + out.err                       # the bar shows the progress
        token = quiet_other_ranks(1, all_ranks=False)
        logging.getLogger("fasttomo.test_console").info("rank 1 says hello")
        logging.getLogger("fasttomo.test_console").error("rank 1 fails")
        restore_ranks(token)
        token = quiet_other_ranks(1, all_ranks=True)
        logger.info("now every rank")
        restore_ranks(token)
        out = capsys.readouterr()
        assert "hello" not in out.out and "ERROR rank 1 fails" in out.err
        assert out.out == "[rank 1] INFO now every rank\n"
    finally:
        logger.removeHandler(handler)
        parent.setLevel(level)


# --------------------------------------------------------------------------------------- generic schemas
@dataclasses.dataclass
class _PhantomData:
    width: int = 64
    """Image width."""


@dataclasses.dataclass
class _FileData:
    path: Optional[str] = None
    """The stack file."""


@dataclasses.dataclass
class _Base:
    steps: int = 10
    """Steps."""


@dataclasses.dataclass
class _Fancy(_Base):
    momentum: float = 0.9
    """Only the fancy option has it."""


@dataclasses.dataclass
class _Root:
    data: Union[_PhantomData, _FileData] = dataclasses.field(default_factory=_PhantomData)
    optim: _Base = dataclasses.field(default_factory=_Base)
    name: str = "x"
    """Run name."""


def test_help_reads_schemas_split_per_group_option():
    """One schema per group option (a Union, or subclasses of a base): --help and the checks know
    the keys and docstrings of all of them."""
    from fasttomo.cli.help import field_type, schema_keys

    keys = schema_keys(_Root)
    assert set(keys) == {"data.width", "data.path", "optim.steps", "optim.momentum", "name"}
    assert keys["data.path"].type_text == "str or null" and keys["data.path"].doc == "The stack file."
    assert keys["optim.momentum"].doc == "Only the fancy option has it." and keys["optim.steps"].default == 10
    assert field_type(_Root, "optim.momentum") is float and field_type(_Root, "data.nope") is None


@pytest.mark.parametrize("key,sub", [("hydra.run.dir", ""), ("output.dir", "/sub/run")])
def test_an_output_folder_that_is_a_file_is_one_line_before_any_work(tmp_path, key, sub):
    """hydra.run.dir=<a file> was a FileExistsError traceback from Hydra; output.dir=<a file> said
    "File exists" after the data was read and the model built."""
    made = tmp_path / "notes.txt"
    made.write_text("mine")
    res = cli([*TINY, f"{key}={made}{sub}"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "Traceback" not in text and "a file, not a folder" in text, text
    assert "device" not in text  # refused before the build
    assert made.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_ctrl_c_while_hydra_composes_is_one_line_and_exit_130(capsys):
    """A KeyboardInterrupt raised inside the entry point's app (Hydra composing, before the run's
    own handlers exist) printed a traceback."""
    from fasttomo.cli.errors import run_checked
    from fasttomo.cli.reconstruct import program

    def composing():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stopped:
        run_checked(program(), ["optim.steps=3"], composing)
    err = capsys.readouterr().err
    assert stopped.value.code == 130 and "interrupted before the run started; nothing was written" in err


def _no_dac_override() -> list[str] | None:
    """A command prefix that drops root's permission override (tests run as root, who may write
    into a read-only folder), or None where setpriv cannot."""
    import shutil

    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        return None
    return prefix


@pytest.mark.parametrize("module", ["fasttomo.cli.reconstruct", "fasttomo.cli.trace"])
def test_a_run_folder_hydra_cannot_create_is_one_line_and_exit_2(tmp_path, module):
    """The default outputs/ under a file (as a read-only working folder for a user): Hydra's mkdir
    raised a traceback, exit 1, even with dry_run=true."""
    (tmp_path / "outputs").write_text("not a folder")
    args = [*TINY, "dry_run=true"] if module.endswith("reconstruct") else ["volume=v.mrc"]
    res = _run(module, args, tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    assert f"cannot create the output folder {tmp_path / 'outputs'}/" in text, text
    assert "(Not a directory); choose a writable folder with hydra.run.dir=<dir>." in text, text


def test_a_read_only_parent_folder_is_one_line_and_exit_2(tmp_path):
    """What a user (not root) meets: hydra.run.dir under a folder they cannot write."""
    prefix = _no_dac_override()
    if prefix is None:
        pytest.skip("setpriv cannot drop root's permission override here")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    res = subprocess.run([*prefix, sys.executable, "-m", "fasttomo.cli.reconstruct", *TINY, "dry_run=true",
                          f"hydra.run.dir={locked / 'run'}"], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=120)
    text = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in text, text
    assert (f"cannot create the output folder {locked / 'run'} (Permission denied); choose a writable folder with "
            "hydra.run.dir=<dir>.") in text, text


def test_an_experiment_for_the_phantom_names_itself_with_file_data(tmp_path):
    """experiment=flagship data=mrc (scripts/launch_ddp.sh's example) said "Remove data.width", a key
    the user never typed: the experiment's file sets it. The message names the experiment, and the
    settings it gives instead of experiment=flagship run."""
    data = [*TINY_RUN[1:], "data=mrc", f"data.path={REPO / 'data' / 'phantom32.mrc'}",
            f"data.angles={REPO / 'data' / 'phantom32.rawtlt'}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]
    res = cli(["experiment=flagship", *data], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in text, text
    line = [ln for ln in text.splitlines() if "[ERROR]" in ln][0]
    assert ("experiment=flagship sets data.width, data.height, data.n_tilts, data.tilt_min, data.tilt_max, keys of "
            "data.source=phantom that data=mrc does not read; to use the recipe's other settings with data=mrc, "
            "replace experiment=flagship with: model.kind=kplanes_tilted model.n_rotations=8") in line, line
    instead = line.split("replace experiment=flagship with: ")[1].rstrip(".").split()
    # the command line's own keys win over the recipe's (here the tiny run's sizes)
    mine = {a.split("=")[0] for a in data}
    ok = cli([*data, *[a for a in instead if a.split("=")[0] not in mine]], tmp_path)
    assert ok.returncode == 0 and "dry run: config and data are valid" in ok.stdout + ok.stderr, ok.stderr


# --------------------------------------------------------------------------------------- simulate out=
@pytest.mark.parametrize("out, expected", [
    ("sim/", "out=sim/: a folder; out= is a file name without suffix, e.g. out=sim/phantom (writes "
             "sim/phantom.mrc and its companions)."),
    ("sim", "out=sim: a folder;"),
    ("sim/b.h5", "out=sim/b.h5: the suffix .h5 says format=h5, but format=mrc; write out=sim/b format=h5, or "
                 "out=sim/b for format=mrc."),
])
def test_simulate_refuses_a_folder_or_another_formats_suffix(tmp_path, out, expected):
    """out=<folder>/ wrote <folder>.mrc beside the folder; out=b.h5 with format=mrc wrote b.mrc."""
    (tmp_path / "sim").mkdir()
    res = _run("fasttomo.cli.simulate", [f"out={out}", "data.width=16", "data.height=16", "data.n_tilts=5"],
               tmp_path)
    assert res.returncode == 2 and expected in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sim"]


def test_simulate_drops_the_formats_suffix_from_out(tmp_path):
    """out=sim/b.mrc wrote b.mrc, b.rawtlt and b.mrc_truth.mrc."""
    res = _run("fasttomo.cli.simulate", ["out=b.mrc", "data.width=16", "data.height=16", "data.n_tilts=5"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.mrc", "b.rawtlt", "b_truth.mrc"]


def test_the_console_log_keeps_torchs_own_info_lines_out():
    """The console config (configs/hydra/job_logging/fasttomo.yaml) sets torch's loggers to
    WARNING: torch sets their levels on import, and a Ctrl-C inside that import left them at the
    root's INFO, so its exit hooks printed FakeTensor cache statistics. A fresh process, no torch."""
    code = ("import logging, logging.config, sys, yaml; "
            f"logging.config.dictConfig(yaml.safe_load(open({str(config_dir() + '/hydra/job_logging/fasttomo.yaml')!r}))); "
            "logging.getLogger('torch._subclasses.fake_tensor').info('FakeTensor cache stats:'); "
            "logging.getLogger('torch.x').warning('a torch warning'); logging.getLogger('fasttomo').info('ours'); "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert "FakeTensor" not in text and "a torch warning" in text and "ours" in text and "False" in res.stdout
