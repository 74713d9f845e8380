"""The run folder: one run at a time (a lock file), a manifest of what the run writes, and the
rules for reusing a folder.

* ``reconstruct.lock`` is created exclusively (a hard link of a fully written file, so it never
  exists half-written) and holds the owner's pid, host and start time; the owner keeps an
  ``flock`` on it for as long as it runs. A second run refuses the folder, with or without
  ``output.overwrite``. A lock whose owner is gone (killed, power cut: the kernel dropped its
  flock) is taken over, and the log says so. Locks from another host are never taken over.
* ``manifest.json`` (written atomically) lists what the run writes -- every output name or
  pattern is recorded BEFORE the file is written, so even a killed run's files are known -- and
  its status: ``running``, ``finished``, ``interrupted`` (a signal: volume and checkpoint so
  far), ``diverged`` or ``failed`` (the error line is recorded too).
* Reusing a folder (rank 0, under the lock, before anything else is written):

  - empty or new: used;
  - a finished run, or an unfinished one that left a checkpoint or a volume: refused, unless
    ``output.overwrite=true`` (then every file its manifest lists is removed first: the names it
    lists, its step checkpoints ``stepNNNNNNN.pt`` and the event files of its own processes) or this run
    resumes from a checkpoint in that folder and the run there is not finished (then it
    continues in place: the files are kept and replaced as the run writes them again);
  - a run that failed or was killed before leaving a checkpoint or a volume: its files are
    removed and the folder is used (the new log says so and repeats the old error);
  - files with fasttomo's result names but no manifest of a fasttomo run (an older fasttomo's
    results, or the user's own files, or a manifest.json of another tool): refused, unless
    ``output.overwrite=true`` (then they are moved into a new ``replaced-<time>/`` folder inside it).

Files a user put in the folder are never deleted: only what a fasttomo manifest names is removed.
"""

from __future__ import annotations

import datetime
import errno
import fnmatch
import json
import logging
import os
import socket
import sys
from pathlib import Path

log = logging.getLogger("fasttomo")

MANIFEST = "manifest.json"
LOCK = "reconstruct.lock"
FORMAT = "fasttomo-run-v1"
STEP_CHECKPOINTS = "checkpoints/step*.pt"
"""The output pattern a run records for its periodic checkpoints (run/results.planned_outputs)."""
STEP_CHECKPOINT_NAME = "checkpoints/step" + "[0-9]" * 7 + ".pt"
"""What :data:`STEP_CHECKPOINTS` stands for: the trainer's ``step%07d.pt`` and nothing else (a
user's ``step_best.pt`` beside them is not a run's)."""
EVENT_FILES = "tb/events.out.tfevents.*"
"""The output pattern a run records for its TensorBoard files."""
LEGACY_RESULTS = ("metrics.json", "volume.mrc", "volume.h5", "volume.tif", "volume_xzy.mrc", "config.yaml",
                  "slices.png", "reconstruct.log", "checkpoints/last.pt", STEP_CHECKPOINTS, EVENT_FILES)
WORK = ("checkpoints/last.pt", STEP_CHECKPOINT_NAME, "volume.*", "volume_xzy.mrc")
"""Worth keeping: a run that wrote one did not "just fail" (a user's checkpoints/my.pt is not a run's)."""


from fasttomo.data.io.common import OutputExistsError  # noqa: E402,F401 - the folder holds an earlier run's results


class OutputFolderError(OSError):
    """The output folder cannot be used (not writable, in use by another run, too little space)."""


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux /proc), to tell a live owner from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[19].decode()
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _write_json_atomic(path: Path, obj: dict) -> None:
    from fasttomo.data.io.atomic import atomic_write

    text = json.dumps(obj, indent=2, allow_nan=False)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"), overwrite=True)


# --------------------------------------------------------------------------------------- lock
class RunLock:
    """An exclusive, flock-held lock file (see the module doc)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK
        self.fd: int | None = None
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
                     "proc_start": _proc_start(os.getpid()), "command": " ".join(sys.argv)}

    def _describe(self, info: dict) -> str:
        return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"

    def _in_use(self, info: dict) -> OutputFolderError:
        return OutputFolderError(
            f"output folder {self.path.parent} is in use by another fasttomo run ({self._describe(info)}); wait for it "
            f"to finish or choose another folder (e.g. hydra.run.dir=outputs/my_run2). If that run is gone, delete "
            f"{self.path}.")

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            return json.loads(os.read(fd, 65536).decode("utf-8") or "{}")
        except (OSError, ValueError):
            return {}

    def _write(self, fd: int) -> None:
        data = json.dumps(self.info).encode()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
        os.fsync(fd)

    def acquire(self) -> dict | None:
        """Take the lock; returns the info of a dead owner whose lock was taken over (else None).
        Raises :class:`OutputFolderError` when another live run holds it."""
        import fcntl

        for _ in range(20):
            tmp = self.path.with_name(f".{LOCK}.{os.getpid()}.tmp")
            if tmp.exists():
                tmp.unlink()
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._write(fd)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                os.close(fd)
                tmp.unlink()
            except OSError as err:  # no hard links on this file system: exclusive create of the name itself
                os.close(fd)
                tmp.unlink()
                if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
                except FileExistsError:
                    pass
                else:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._write(fd)
                    self.fd = fd
                    return None
            else:
                tmp.unlink()
                self.fd = fd
                return None
            # the lock exists: is its owner alive?
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                continue  # released meanwhile: try again
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                info = self._read(fd)
                os.close(fd)
                raise self._in_use(info) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (unlinked) or replaced between open and flock: start over
                os.close(fd)
                continue
            old = self._read(fd)
            if old.get("host") not in (None, self.info["host"]) or (
                    isinstance(old.get("pid"), int) and old["pid"] != os.getpid()
                    and _pid_alive(old["pid"], old.get("proc_start"))):
                os.close(fd)  # another host's run, or a live owner on a file system without flock: never taken over
                raise self._in_use(old)
            self._write(fd)
            self.fd = fd
            return old or {"pid": "?", "host": "?", "started": "?"}
        raise OutputFolderError(f"output folder {self.path.parent}: could not take the lock {self.path} (it keeps "
                                "changing); is another run starting there? Choose another folder.")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


# --------------------------------------------------------------------------------------- folder
def _matches(folder: Path, pattern: str) -> list[Path]:
    """Files under ``folder`` matching a relative ``pattern`` (glob in the last part only)."""
    rel = Path(pattern)
    parent = folder / rel.parent
    if not parent.is_dir():
        return []
    if not any(ch in rel.name for ch in "*?["):
        p = parent / rel.name
        return [p] if p.is_file() or p.is_symlink() else []
    return sorted(p for p in parent.iterdir()
                  if fnmatch.fnmatchcase(p.name, rel.name) and (p.is_file() or p.is_symlink()))


def _own_patterns(pattern: str, run: dict) -> list[str]:
    """A manifest's output pattern narrowed to the names the run itself writes: step checkpoints
    to their 7 digits, TensorBoard event files to the host and pid of each of its processes (the
    one it records and, for a run continued in place, the earlier ones in ``processes``;
    TensorBoard names them ``events.out.tfevents.<time>.<host>.<pid>.<n>``). None of them for
    event files of a manifest without a host and pid: only the names its ending recorded."""
    if pattern == STEP_CHECKPOINTS:
        return [STEP_CHECKPOINT_NAME]
    if pattern == EVENT_FILES:
        procs = [*run.get("processes", []), {"host": run.get("host"), "pid": run.get("pid")}]
        return [f"{EVENT_FILES}.{_literal(str(p['host']))}.{p['pid']}.*" for p in procs if p.get("host") and p.get("pid")]
    return [pattern]


def _literal(text: str) -> str:
    """``text`` matched as it is by fnmatch (a host name with '*', '?' or '[')."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _temp_leftovers(folder: Path, pattern: str) -> list[Path]:
    """Temporary files of atomic writes of ``pattern`` (``.<name>.*.part``) a killed writer left."""
    rel = Path(pattern)
    parent = folder / rel.parent
    if not parent.is_dir():
        return []
    glob = f".{rel.name}.*.part"
    return sorted(p for p in parent.iterdir() if fnmatch.fnmatchcase(p.name, glob) and p.is_file())


class RunFolder:
    """The output folder of one run, opened by rank 0 (see the module doc).

    ``open()`` takes the lock, decides whether the folder can be used, removes what must go and
    writes the new manifest; ``will_write(name)`` records an output before it is written;
    ``finish(status, ...)`` records the outcome and releases the lock."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, resume: str | None = None,
                 outputs: list[str] | tuple[str, ...] = ()):
        self.path = Path(path).resolve()
        self.overwrite = overwrite
        self.resume = Path(resume).resolve() if resume else None
        self.outputs = list(dict.fromkeys([MANIFEST, *outputs]))
        self.lock = RunLock(self.path)
        self.manifest: dict = {}
        self.notes: list[str] = []  # for the run's log, once it is open
        self.continuing = False     # resuming in place: earlier files kept, the log appended to

    # ---------------------------------------------------------------- opening
    def open(self) -> "RunFolder":
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = not_a_folder(self.path) or f"cannot be created ({exc.strerror or exc})"
            raise OutputFolderError(
                f"output folder {self.path} {why}; choose a folder you can write to "
                "(hydra.run.dir=<folder> or output.dir=<folder>).") from None
        try:
            stale = self.lock.acquire()
        except OutputFolderError:
            raise
        except OSError as exc:
            raise OutputFolderError(f"cannot write to output folder {self.path} ({exc.strerror or exc}); choose a "
                                    "folder you can write to (hydra.run.dir=<folder> or output.dir=<folder>), or fix "
                                    "its permissions.") from None
        try:
            if stale:
                self.notes.append(f"took over the lock of a run that is no longer running (pid {stale.get('pid')} on "
                                  f"{stale.get('host')}, started {stale.get('started')}); its files are treated as "
                                  "those of an interrupted run")
            self._decide()
            self.manifest.update({"format": FORMAT, "status": "running", "pid": os.getpid(),
                                  "host": socket.gethostname(), "command": " ".join(sys.argv), "updated": _now()})
            self.manifest.setdefault("started", _now())
            self.manifest["outputs"] = list(dict.fromkeys([*self.manifest.get("outputs", []), *self.outputs]))
            self.manifest.pop("error", None)
            self._save()
        except OutputExistsError:
            self.lock.release()
            raise
        except OSError as exc:
            self.lock.release()
            raise OutputFolderError(f"cannot write to output folder {self.path} ({exc.strerror or exc}); choose a "
                                    "folder you can write to, or fix its permissions.") from None
        return self

    def _previous(self) -> tuple[dict | None, list[str]]:
        """(manifest of the run found in the folder or None, its output patterns)."""
        path = self.path / MANIFEST
        if path.is_file():
            try:
                prev = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(prev, dict) and prev.get("format") == FORMAT:
                    return prev, list(prev.get("outputs", []))
            except (OSError, ValueError):
                pass
            return {"status": "unknown"}, list(LEGACY_RESULTS) + [MANIFEST]
        if any(_matches(self.path, n) for n in LEGACY_RESULTS):
            return {"status": "legacy"}, list(LEGACY_RESULTS)
        return None, []

    def plan(self) -> dict:
        """What opening the folder would do, without changing anything: ``action`` is ``new``,
        ``continue`` (resume in place), ``replace`` (overwrite a run's files), ``reuse`` (remove a
        failed run's files) or ``refuse`` (with ``error``)."""
        prev, patterns = self._previous()
        if prev is None:
            return {"action": "new", "patterns": self.outputs, "status": None}
        status = prev.get("status")
        if status == "running":  # the caller holds the lock (or checked it), so its owner is gone: killed
            status = "killed"
        unproven = status in ("legacy", "unknown")  # no fasttomo manifest: the files may be the user's own
        found = sorted({str(p.relative_to(self.path)) for p in self._files_of(prev, patterns, unproven)} - {MANIFEST})
        work = sorted({str(p.relative_to(self.path)) for n in WORK for p in _matches(self.path, n)})
        if status == "legacy":  # a fasttomo without manifests: judge by the names
            status = "finished" if (work or "metrics.json" in found) else "failed"
        plan = {"prev": prev, "patterns": patterns, "status": status, "found": found, "unproven": unproven}
        resume_here = self.resume is not None and self.path in self.resume.parents
        if resume_here and (status != "finished" or self.overwrite):
            return {**plan, "action": "continue"}
        if unproven and not self.overwrite and (found or status == "unknown"):
            names = (["manifest.json (not fasttomo's)"] if status == "unknown" else []) + found
            listing = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            return {**plan, "action": "refuse", "error": (
                f"output folder {self.path} holds files with the names fasttomo writes ({listing}) but no manifest of "
                "a fasttomo run, so they may be yours: nothing was touched. Choose a new folder (e.g. "
                "hydra.run.dir=outputs/my_run2), or set output.overwrite=true to replace them.")}
        if unproven and (found or status == "unknown"):  # output.overwrite=true: they are moved aside
            return {**plan, "action": "replace"}
        if not found:
            return {**plan, "action": "new"}
        if status == "finished" or work:
            if self.overwrite:
                return {**plan, "action": "replace"}
            what = ("results of an earlier run" if status in ("finished", "unknown")
                    else f"the checkpoint or volume of an earlier {status} run")
            hint = ("" if status in ("finished", "unknown") else
                    f"continue it (fasttomo-reconstruct resume={self.path} hydra.run.dir={self.path}), ")
            listing = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
            return {**plan, "action": "refuse", "error": (
                f"output folder {self.path} already holds {what} ({listing}); {hint}choose a new folder (e.g. "
                "hydra.run.dir=outputs/my_run2) or set output.overwrite=true to replace them.")}
        return {**plan, "action": "reuse"}  # a failed or killed run without checkpoint or volume

    def _decide(self) -> None:
        plan = self.plan()
        action, status, patterns = plan["action"], plan["status"], plan["patterns"]
        if action == "refuse":
            raise OutputExistsError(plan["error"])
        if action == "new":
            self._cleanup_temp(patterns)
        elif action == "continue":
            prev = plan["prev"]
            self.continuing = True
            self.manifest = {k: v for k, v in prev.items() if k in ("started", "outputs", "resumed", "files")}
            earlier = [*prev.get("processes", []), {"host": prev.get("host"), "pid": prev.get("pid")}]
            self.manifest["processes"] = [p for p in earlier if p.get("host") and p.get("pid")]  # their event files
            self.manifest.setdefault("outputs", patterns)
            self.manifest.setdefault("resumed", []).append({"checkpoint": str(self.resume), "at": _now()})
            self._cleanup_temp(self.manifest["outputs"])
            self.notes.append(f"continuing the {status} run in {self.path} from {self.resume} (its files are kept "
                              "and replaced as this run writes them again)")
        elif action == "replace" and plan["unproven"]:
            aside, moved = self._set_aside(plan["found"] + ([MANIFEST] if status == "unknown" else []))
            self.notes.append(f"output.overwrite=true: moved the {len(moved)} file(s) with fasttomo's names but no "
                              f"fasttomo manifest (they may be yours) from {self.path} into {aside} "
                              f"({', '.join(moved[:6])}{', ...' if len(moved) > 6 else ''})")
        elif action == "replace":
            removed = self._remove(plan["prev"], patterns)
            self.notes.append(f"output.overwrite=true: removed the {len(removed)} file(s) of the earlier {status} run "
                              f"in {self.path} ({', '.join(removed[:6])}{', ...' if len(removed) > 6 else ''})")
        else:
            error = plan["prev"].get("error") or _last_error(self.path / "reconstruct.log")
            removed = self._remove(plan["prev"], patterns)
            self.notes.append(f"the folder held a {status} run without results (" + (f"its error: {error}; " if error
                              else "") + f"started {plan['prev'].get('started', '?')}); removed its {len(removed)} "
                              "file(s): " + ", ".join(removed[:6]))

    def _files_of(self, prev: dict, patterns: list[str], unproven: bool) -> list[Path]:
        """The files in the folder that the run ``prev`` wrote: its outputs' names, its patterns
        narrowed to what the run itself names (:func:`_own_patterns`), and the exact names its
        last ending recorded (``files``: event files of earlier processes of a run continued in
        place). Without a fasttomo manifest (``unproven``) every file with fasttomo's names."""
        if unproven:
            return sorted({p for n in patterns for p in _matches(self.path, n)})
        recorded = set(prev.get("files", {}))
        out = set()
        for n in patterns:
            own = _own_patterns(n, prev)
            for p in own:
                out.update(_matches(self.path, p))
            if own != [n]:
                out.update(p for p in _matches(self.path, n) if str(p.relative_to(self.path)) in recorded)
        return sorted(out)

    def _set_aside(self, names: list[str]) -> tuple[Path, list[str]]:
        """Move ``names`` (relative) into a new ``replaced-<time>`` folder inside the run folder,
        keeping their relative paths: files that may be the user's are never deleted."""
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        aside, k = self.path / f"replaced-{stamp}", 1
        while aside.exists():
            k += 1
            aside = self.path / f"replaced-{stamp}-{k}"
        names = [n for n in names if (self.path / n).is_file() or (self.path / n).is_symlink()]
        here = os.stat(self.path).st_dev
        elsewhere = [n for n in names if os.stat((self.path / n).parent).st_dev != here]
        if elsewhere:  # a sub-folder linked to another file system: a rename cannot move them, nothing is moved
            raise OutputExistsError(
                f"output folder {self.path}: {', '.join(elsewhere[:3])} (no fasttomo manifest names them, so they "
                f"may be yours) lie on another file system than the folder, so output.overwrite=true cannot move "
                "them aside into it; move them yourself, or choose a new folder (e.g. hydra.run.dir=outputs/my_run2).")
        moved = []
        for name in names:
            (aside / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path / name, aside / name)
            moved.append(name)
        return aside, moved

    def _remove(self, prev: dict, patterns: list[str]) -> list[str]:
        removed = []
        for p in self._files_of(prev, [n for n in patterns if n != LOCK], unproven=False):
            p.unlink()
            removed.append(str(p.relative_to(self.path)))
        for n in patterns:
            if n == LOCK:
                continue
            for p in _temp_leftovers(self.path, n):
                p.unlink()
                removed.append(str(p.relative_to(self.path)))
        for sub in sorted({Path(n).parent for n in patterns if Path(n).parent != Path(".")}, reverse=True):
            try:
                (self.path / sub).rmdir()  # only when empty: a user's files stay
            except OSError:
                pass
        return removed

    def _cleanup_temp(self, patterns: list[str]) -> None:
        for n in patterns:
            for p in _temp_leftovers(self.path, n):
                p.unlink()

    # ---------------------------------------------------------------- while running
    def _save(self) -> None:
        self.manifest["updated"] = _now()
        _write_json_atomic(self.path / MANIFEST, self.manifest)

    def will_write(self, *names: str) -> None:
        """Record outputs (relative names or glob patterns) before writing them."""
        new = [n for n in names if n not in self.manifest.get("outputs", [])]
        if new:
            self.manifest["outputs"] = [*self.manifest.get("outputs", []), *new]
            self._save()

    def finish(self, status: str, *, error: str | None = None, step: int | None = None,
               extra: dict | None = None) -> None:
        """Record the outcome (``finished``, ``interrupted``, ``diverged`` or ``failed``) and the
        files written, then release the lock. Never raises (a folder that became unwritable
        keeps the old manifest; the caller has logged what happened)."""
        try:
            self.manifest.update({"status": status, "ended": _now()})
            if step is not None:
                self.manifest["step"] = step
            if error:
                self.manifest["error"] = error
            if extra:
                self.manifest.update(extra)
            files = self._files_of(self.manifest, self.manifest.get("outputs", []), unproven=False)
            self.manifest["files"] = {str(p.relative_to(self.path)): p.stat().st_size for p in files
                                      if p.name != MANIFEST}
            self._save()
        except (OSError, ValueError) as exc:
            log.warning("could not update %s (%s)", self.path / MANIFEST, exc)
        finally:
            self.lock.release()


def not_a_folder(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a run's folder because a file stands in its way ("is a file, not a
    folder" or "lies under <file>, which is a file, not a folder"), or None."""
    p = Path(path).expanduser()
    for q in (p, *p.parents):
        if q.exists() and not q.is_dir():
            return ("is a file" if q == p else f"lies under {q}, which is a file") + ", not a folder"
    return None


def _last_error(log_path: Path) -> str | None:
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    errors = [ln.split("[ERROR] ", 1)[1] for ln in lines if "[ERROR] " in ln]
    return errors[-1] if errors else None


STOPS_AT = ("NOT WRITABLE", "IN USE", "REFUSED")
"""How :func:`inspect_folder`'s line begins where the run would stop at the folder."""


def inspect_folder(path: str | os.PathLike, *, overwrite: bool = False, resume: str | None = None) -> str:
    """One line on what a run would do with folder ``path`` (the dry run's report; a line that
    begins with one of :data:`STOPS_AT` says the run would stop there); changes nothing."""
    import fcntl

    folder = Path(path)
    if not folder.exists():
        return "does not exist yet (it will be created)"
    if not os.access(folder, os.W_OK):
        return "NOT WRITABLE (the run would stop at once)"
    lock = folder / LOCK
    if lock.exists():
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            fd = None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                info = RunLock._read(fd)
                return (f"IN USE by another run (pid {info.get('pid', '?')} on {info.get('host', '?')}); the run would "
                        "be refused")
            finally:
                os.close(fd)
    plan = RunFolder(folder, overwrite=overwrite, resume=resume).plan()
    return {"new": "empty or new: usable",
            "continue": f"holds a {plan['status']} run: it would be continued in place",
            "replace": (f"holds files with fasttomo's names but no fasttomo manifest: they would be moved into a "
                        "replaced-<time> folder first (output.overwrite=true)" if plan.get("unproven") else
                        f"holds a {plan['status']} run: its files would be removed first (output.overwrite=true)"),
            "reuse": f"holds a {plan['status']} run without results: its files would be removed",
            "refuse": f"REFUSED: {plan.get('error')}"}[plan["action"]]
