"""Fault injection: kill a running reconstruction at random moments, several times in a row,
resume it each time, and check that the final volume equals an uninterrupted run's; or take its
disk away mid-run (full, or no longer writable) and check that nothing trained is lost.

    python scripts/fault_inject.py                       # 4 kills, SIGKILL/SIGTERM/SIGINT mixed
    python scripts/fault_inject.py --kills 8 --seed 3 --signals kill
    python scripts/fault_inject.py --out /tmp/fi -- model=voxel      # extra overrides after --
    python scripts/fault_inject.py --fault disk-full     # the run folder's file system fills up
    python scripts/fault_inject.py --fault permission    # the run folder turns read-only (chmod -R a-w)

Write faults (``--fault disk-full|permission``) need root: the faulted run's folder lies on a small
tmpfs mounted for it; at a random moment of the training the run is paused (SIGSTOP), the disk is
filled (or every file and folder of the run made read-only, the run then lacking root's right to
ignore permissions), and the run continues (SIGCONT). It must end with one line (exit 1, no
traceback) naming what was kept where, and the kept checkpoint and volume must equal an undisturbed
run's. Exit 0 when they do, 1 when not, 3 when the fault cannot be staged (no root, no mount).

Single process on the CPU (one thread, so the arithmetic is reproducible). The reference run goes
straight through; the faulted run is started in its own folder, killed after a random delay
(drawn over the reference run's duration, so kills land during start-up, training, checkpoint
writes and the final writes alike), and restarted with the same command -- with
``resume=<folder> hydra.run.dir=<folder>`` once the folder holds a checkpoint, as a cluster job
would be requeued -- until it finishes. Prints one line per attempt and exits 0 when the final
volumes (and the final parameters) are bit-identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

BASE = ["experiment=quick", "data.width=24", "data.height=20", "data.n_tilts=15", "model.resolutions=[8,16]",
        "sampler.batch_size=128", "projector.samples_per_ray=24", "logging=quiet", "runtime=cpu", "runtime.threads=1",
        "pose=refine", "pose.start_step=0"]
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}


def _log_text(folder: Path) -> str:
    try:
        return (folder / "reconstruct.log").read_text(errors="replace")
    except OSError:
        return ""


def _run(args: list[str], cwd: Path, folder: Path, plan: tuple[str, float] | None, sig: int
         ) -> tuple[int, float, bool, float | None]:
    """Run once; ``plan`` = ("startup", t): signal t s after the start, or ("training", t): t s
    after this process logged that training started. Returns (exit code, seconds, whether the
    signal was sent, seconds from the start until training started or None)."""
    before = _log_text(folder)
    t0 = time.monotonic()
    trained_at = None
    with open(cwd / "attempts.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fasttomo.cli.reconstruct", *args], cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sent = False
        kind, delay = plan if plan else ("none", None)
        while proc.poll() is None and trained_at is None:
            text = _log_text(folder)
            new = text[len(before):] if text.startswith(before) else text
            if "training from step" in new:
                trained_at = time.monotonic() - t0
                break
            if kind == "startup" and time.monotonic() - t0 >= delay:
                break
            time.sleep(0.02)
        try:
            if kind == "startup":
                proc.wait(timeout=max(0.0, delay - (time.monotonic() - t0)))
            elif kind == "training":
                proc.wait(timeout=delay)
            else:
                proc.wait()
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
            sent = True
        proc.wait(timeout=600)
    return proc.returncode, time.monotonic() - t0, sent, trained_at


def _paused_fault(cmd: list[str], cwd: Path, folder: Path, delay: float, fault) -> tuple[int, str]:
    """Run ``cmd`` (its environment: this one, with TMPDIR=<cwd>/tmp); ``delay`` s after training
    started pause it, call ``fault()``, let it go on. Returns (exit code, its output)."""
    env = {**os.environ, "TMPDIR": str(cwd / "tmp"), "PYTHONUNBUFFERED": "1"}
    with open(cwd / "attempts.log", "a") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
        start = log.tell()
        while proc.poll() is None and "training from step" not in _log_text(folder):
            time.sleep(0.02)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGSTOP)
            try:
                fault()
            finally:
                proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=600)
    with open(cwd / "attempts.log", errors="replace") as f:
        f.seek(start)
        return proc.returncode, f.read()


def _fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its file system is full."""
    with open(folder / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def _read_only(folder: Path) -> None:
    """chmod -R a-w ``folder``."""
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)


def _kept(text: str, rescue_dir: Path, folder: Path) -> tuple[Path | None, Path | None]:
    """(checkpoint, volume) the run kept: in its folder, else in the rescue folder."""
    ckpt = folder / "checkpoints" / "last.pt"
    vol = folder / "volume.mrc"
    for d in sorted(rescue_dir.glob("fasttomo-rescue-*")):
        if not ckpt.is_file() and (d / "last.pt").is_file():
            ckpt = d / "last.pt"
        if not vol.is_file() and (d / "volume.mrc").is_file():
            vol = d / "volume.mrc"
    return (ckpt if ckpt.is_file() else None), (vol if vol.is_file() else None)


def write_fault(args, common: list[str], out: Path, rng: random.Random) -> int:
    """--fault disk-full|permission (see the module doc)."""
    import numpy as np

    from fasttomo.data.io.volume import read_volume
    from fasttomo.train.checkpoint import CheckpointError, load_checkpoint

    if os.geteuid() != 0:
        print("write faults need root (to mount a small tmpfs)", file=sys.stderr)
        return 3
    ref, mnt, rescue_dir = out / "reference", out / "fs", out / "tmp"
    code, ref_seconds, _, ref_start = _run([*common, f"hydra.run.dir={ref}"], out, ref, None, signal.SIGKILL)
    if code != 0 or ref_start is None:
        print(f"the reference run failed (exit {code}); see {out / 'attempts.log'}", file=sys.stderr)
        return 2
    mnt.mkdir()
    rescue_dir.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.fs_mb}m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        print(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode})", file=sys.stderr)
        return 3
    try:
        folder = mnt / "run"
        delay = rng.uniform(0.0, 0.5 * (ref_seconds - ref_start))
        prefix = []
        if args.fault == "permission":  # root ignores permissions: drop that right from the run
            prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
        fault = (lambda: _fill(mnt)) if args.fault == "disk-full" else (lambda: _read_only(folder))
        cmd = [*prefix, sys.executable, "-m", "fasttomo.cli.reconstruct", *common, f"hydra.run.dir={folder}"]
        code, text = _paused_fault(cmd, out, folder, delay, fault)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        print(f"{args.fault} {delay:.2f} s into training: exit {code}; last line: {lines[-1] if lines else ''}")
        ok = code == 1 and "Traceback" not in text
        ckpt, vol = _kept(text, rescue_dir, folder)
        a, _, _ = read_volume(ref / "volume.mrc")
        same_volume = vol is not None and np.array_equal(a, read_volume(vol)[0])
        try:
            ma = load_checkpoint(ref / "checkpoints" / "last.pt")["model"]
            mb = load_checkpoint(ckpt)["model"] if ckpt else {}
        except CheckpointError as exc:
            print(f"the kept checkpoint cannot be read: {exc}")
            mb = {}
        same_model = set(ma) == set(mb) and all(bool((ma[k] == mb[k]).all()) for k in ma)
        named = all(str(p) in text for p in (ckpt, vol) if p is not None and not str(p).startswith(str(folder)))
        print(f"kept checkpoint: {ckpt} ({'== the undisturbed run' if same_model else 'MISSING OR DIFFERENT'}); "
              f"kept volume: {vol} ({'== the undisturbed run' if same_volume else 'MISSING OR DIFFERENT'}); "
              f"{'one line, no traceback' if ok else 'UNEXPECTED EXIT OR A TRACEBACK'}"
              f"{'' if named else '; the rescued files are NOT NAMED in the output'}")
        return 0 if ok and same_volume and same_model and named else 1
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _finished(folder: Path) -> bool:
    import json

    try:
        return json.loads((folder / "manifest.json").read_text())["status"] == "finished"
    except (OSError, ValueError, KeyError):
        return False


def _has_checkpoint(folder: Path) -> bool:
    return any((folder / "checkpoints").glob("*.pt")) if (folder / "checkpoints").is_dir() else False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=4, help="signals to deliver before letting the run finish")
    p.add_argument("--signals", default="mix", choices=["mix", *SIGNALS], help="which signal kills (mix: random)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", default="kill", choices=["kill", "disk-full", "permission"],
                   help="kill: signals and resumes; disk-full, permission: the run folder's disk fails mid-run")
    p.add_argument("--fs-mb", type=int, default=64, help="size of the tmpfs of a write fault (MiB)")
    p.add_argument("--out", default="outputs/fault_inject")
    p.add_argument("overrides", nargs="*", help="more config overrides (after --)")
    args = p.parse_args(argv)

    import numpy as np

    from fasttomo.data.io.volume import read_volume
    from fasttomo.train.checkpoint import load_checkpoint

    rng = random.Random(args.seed)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [*BASE, f"optim.steps={args.steps}", f"logging.checkpoint_every={args.checkpoint_every}",
              *args.overrides]
    ref, faulted = out / "reference", out / "faulted"
    for folder in (ref, faulted, out / "fs", out / "tmp"):
        if folder.exists():
            print(f"{folder} exists; give an empty --out", file=sys.stderr)
            return 2
    if args.fault != "kill":  # with TensorBoard and its images: their writes fail too
        common = [c for c in common if c != "logging=quiet"] + ["logging.image_every=20"]
        return write_fault(args, common, out, rng)

    code, ref_seconds, _, ref_start = _run([*common, f"hydra.run.dir={ref}"], out, ref, None, signal.SIGKILL)
    if code != 0 or ref_start is None:
        print(f"the reference run failed (exit {code}); see {out / 'attempts.log'}", file=sys.stderr)
        return 2
    ref_train = ref_seconds - ref_start  # training and the final writes
    print(f"reference run: {ref_seconds:.1f} s ({ref_start:.1f} s start-up, {ref_train:.1f} s training and writing)")

    kills, attempt = 0, 0
    while True:
        attempt += 1
        cmd = [*common, f"hydra.run.dir={faulted}"]
        if _has_checkpoint(faulted):
            cmd.append(f"resume={faulted}")
        plan, name = None, "none"
        if kills < args.kills:  # a quarter of the kills during start-up, the rest while training or writing
            plan = (("startup", rng.uniform(0.1, ref_start)) if rng.random() < 0.25
                    else ("training", rng.uniform(0.0, 0.35 * ref_train)))
            name = rng.choice(sorted(SIGNALS)) if args.signals == "mix" else args.signals
        sig = SIGNALS.get(name, signal.SIGKILL)
        code, seconds, sent, _ = _run(cmd, out, faulted, plan, sig)
        kills += sent
        print(f"attempt {attempt}: {'resumed' if 'resume=' in cmd[-1] else 'fresh'}, "
              f"{'SIG' + name.upper() if sent else 'no signal'}" + (f" {plan[1]:.2f} s into {plan[0]}" if sent else "")
              + f", exit {code} after {seconds:.1f} s")
        if code == 0 or _finished(faulted):  # a signal can land after the run finished, during exit
            break
        # 128 + n: stopped cleanly by fasttomo; -n: the signal arrived before its handlers were installed
        if not sent or code not in (128 + sig, -sig):
            print(f"unexpected exit {code}; see {out / 'attempts.log'}", file=sys.stderr)
            return 1
        if attempt > 4 * args.kills + 10:
            print("too many attempts", file=sys.stderr)
            return 1

    a, _, _ = read_volume(ref / "volume.mrc")
    b, _, _ = read_volume(faulted / "volume.mrc")
    same_volume = a.shape == b.shape and np.array_equal(a, b)
    ma = load_checkpoint(ref / "checkpoints" / "last.pt")["model"]
    mb = load_checkpoint(faulted / "checkpoints" / "last.pt")["model"]
    same_model = set(ma) == set(mb) and all(bool((ma[k] == mb[k]).all()) for k in ma)
    diff = float(np.abs(a - b).max()) if a.shape == b.shape else float("inf")
    print(f"{kills} signal(s) over {attempt} attempts; final volume {'==' if same_volume else '!='} the uninterrupted "
          f"run's (max |diff| {diff:.3g}); parameters {'identical' if same_model else 'DIFFER'}")
    return 0 if same_volume and same_model else 1


if __name__ == "__main__":
    sys.exit(main())
