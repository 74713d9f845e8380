"""What a run shows when it ends: ``report.png`` and the closing summary on the console.

* :func:`slice_panel`: the central slices in three planes (XY, XZ, YZ), enlarged with whole pixels,
  with a scale bar (nm or A, from the voxel size) and a colour bar with its values; a second row
  shows the ground truth when there is one. It is ``slices.png`` and the top of the report.
* :func:`report_image`: the slice panel, then the plots that exist for the run: training and
  validation loss, FSC against the ground truth, half-set FSC, the quality-against-time curve and
  the learned poses when they were refined. Pillow only (``fasttomo.quality.plots``).
* :func:`summary_lines`: the run folder, the files written with their sizes, wall time, steps/s,
  the quality numbers that exist and the ``tensorboard --logdir`` command.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fasttomo.logging import duration_text, size_text, to_uint8

BG = (255, 255, 255)
TEXT = (20, 20, 20)
MUTED = (90, 90, 90)
PLOT_SIZE = (640, 400)
GAP = 12


def number_text(value, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec``, or "n/a" for a number that could not be computed (None,
    NaN, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "n/a"
    return format(value, spec)


def _font(size: int):
    from fasttomo.quality.plots import _font as plots_font

    return plots_font(size)


def _text_w(draw, text: str, font) -> tuple[int, int]:
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    return x1 - x0, y1 - y0


def nice_length(target: float) -> float:
    """The largest of 1, 2, 5 x 10^k not above ``target`` (> 0)."""
    exp = math.floor(math.log10(target))
    for m in (5, 2, 1):
        if m * 10 ** exp <= target:
            return m * 10 ** exp
    return 10 ** exp  # pragma: no cover


def scale_bar_label(length_A: float) -> str:
    """'20 nm' from 10 A up, else '5 A'."""
    if length_A >= 10:
        nm = length_A / 10
        return f"{nm:g} nm"
    return f"{length_A:g} A"


def _enlarge(img: np.ndarray, zoom: float):
    from PIL import Image

    im = Image.fromarray(img)
    w, h = round(img.shape[1] * zoom), round(img.shape[0] * zoom)
    return im.resize((max(1, w), max(1, h)), Image.NEAREST if zoom >= 1 else Image.BOX)


def _zoom(shape_zyx: tuple[int, int, int], target: int) -> float:
    """Whole-pixel enlargement so the largest side is about ``target`` pixels (a plain reduction
    for volumes larger than 2 x target)."""
    big = max(shape_zyx)
    z = target / big
    return float(max(1, round(z))) if z >= 1 else (1.0 if big <= 2 * target else 2 * target / big / 2)


def central_slices(vol: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies of the central XY, XZ and YZ slices of a (Z, Y, X) volume. A memory-mapped volume
    is read a slab of about 64 MB at a time and each slab's pages released as it is left
    (fasttomo.data.io.mrc.drop_mapped_pages): the YZ slice touches every page of the file, and
    a 4096^2 x 256 volume would otherwise stay resident whole (17 GB)."""
    from fasttomo.data.io.mrc import drop_mapped_pages

    z, y, x = vol.shape
    xy, xz = np.array(vol[z // 2]), np.array(vol[:, y // 2])
    yz = np.empty((z, y), dtype=vol.dtype)
    step = max(1, (1 << 26) // max(1, y * x * vol.itemsize))
    for z0 in range(0, z, step):
        part = vol[z0:z0 + step]
        yz[z0:z0 + step] = part[:, :, x // 2]
        drop_mapped_pages(part)
    drop_mapped_pages(vol[z // 2])
    return xy, xz, yz


def slice_panel(volume: np.ndarray, pixel_size: float, truth: np.ndarray | None = None, target: int = 300):
    """The three central slices (row 1: the reconstruction; row 2: the ground truth, when given),
    each row windowed to its 0.5-99.5 % values with its own colour bar; a scale bar in the XY
    slice. Returns a PIL image."""
    from PIL import Image, ImageDraw

    rows = [("reconstruction", volume)] + ([("ground truth", truth)] if truth is not None else [])
    zoom = _zoom(volume.shape, target)
    f_title, f_small = _font(15), _font(12)
    probe = ImageDraw.Draw(Image.new("RGB", (10, 10)))
    title_h = _text_w(probe, "Ag", f_title)[1] + 8
    bar_w, bar_label_w = 16, max(_text_w(probe, "-0.000e-00", f_small)[0], 60) + 6
    rendered = []
    for name, vol in rows:
        z, y, x = vol.shape
        xy, xz, yz = central_slices(vol)
        cuts = [(f"XY  (z = {z // 2} of {z})", xy, "x", "y"),
                (f"XZ  (y = {y // 2} of {y})", xz, "x", "z"),
                (f"YZ  (x = {x // 2} of {x})", yz, "y", "z")]
        lo, hi = np.percentile(np.concatenate([c[1].ravel() for c in cuts]), [0.5, 99.5])
        if hi <= lo:
            hi = lo + 1e-6
        images = [(t, _enlarge(to_uint8(a, lo, hi), zoom), hx, vy) for t, a, hx, vy in cuts]
        rendered.append((name, images, float(lo), float(hi)))
    row_h = max(im.height for _, images, _, _ in rendered for _, im, _, _ in images)
    label_w = max(_text_w(probe, name, f_title)[0] for name, _, _, _ in rendered) + 16
    width = label_w + sum(im.width + GAP for _, im, _, _ in rendered[0][1]) + bar_w + bar_label_w + GAP
    height = sum(title_h + row_h + GAP for _ in rendered) + GAP
    out = Image.new("RGB", (int(width), int(height)), BG)
    draw = ImageDraw.Draw(out)
    y0 = GAP
    for r, (name, images, lo, hi) in enumerate(rendered):
        draw.text((6, y0 + title_h + row_h // 2 - 8), name, fill=TEXT, font=f_title)
        x0 = label_w
        for i, (title, im, _hx, _vy) in enumerate(images):
            draw.text((x0, y0), title, fill=TEXT, font=f_small)
            out.paste(im.convert("RGB"), (x0, y0 + title_h))
            draw.rectangle([x0 - 1, y0 + title_h - 1, x0 + im.width, y0 + title_h + im.height], outline=MUTED)
            if i == 0 and r == 0:
                _scale_bar(draw, x0, y0 + title_h, im.width, im.height, pixel_size / zoom, f_small)
            x0 += im.width + GAP
        _colour_bar(out, draw, x0, y0 + title_h, bar_w, row_h, lo, hi, f_small)
        y0 += title_h + row_h + GAP
    return out


def _scale_bar(draw, x0: int, y0: int, w: int, h: int, A_per_px: float, font) -> None:
    length = nice_length(0.3 * w * A_per_px)
    px = max(2, round(length / A_per_px))
    label = scale_bar_label(length)
    bx, by = x0 + 8, y0 + h - 12
    draw.rectangle([bx - 1, by - 1, bx + px + 1, by + 5], fill=(0, 0, 0))
    draw.rectangle([bx, by, bx + px, by + 4], fill=(255, 255, 255))
    tw, th = _text_w(draw, label, font)
    draw.text((bx, by - th - 6), label, fill=(255, 255, 255), font=font, stroke_width=2, stroke_fill=(0, 0, 0))


def _colour_bar(out, draw, x0: int, y0: int, w: int, h: int, lo: float, hi: float, font) -> None:
    from PIL import Image

    ramp = np.linspace(255, 0, h, dtype=np.float32)[:, None].repeat(w, axis=1).astype(np.uint8)
    out.paste(Image.fromarray(ramp).convert("RGB"), (x0, y0))
    draw.rectangle([x0 - 1, y0 - 1, x0 + w, y0 + h], outline=MUTED)
    for frac in (0.0, 0.5, 1.0):
        v = hi - frac * (hi - lo)
        ty = y0 + round(frac * (h - 1))
        text = "0" if abs(v) < 1e-3 * (hi - lo) else f"{v:.3g}"
        th = _text_w(draw, text, font)[1]
        draw.line([x0 + w, ty, x0 + w + 4, ty], fill=MUTED)
        draw.text((x0 + w + 6, min(max(y0, ty - th // 2 - 2), y0 + h - th - 2)), text, fill=TEXT, font=font)


# --------------------------------------------------------------------------------------- plots
def loss_series(metrics: dict) -> list:
    from fasttomo.quality.plots import Series

    series = []
    for key, label in (("loss", "training loss (batch, with regularizers)"),
                       ("val_loss", "validation loss (held-out pixels)")):
        curve = [c for c in ((metrics.get(key) or {}).get("curve") or []) if c[1] is not None and np.isfinite(c[1])]
        if curve:
            series.append(Series(label, [c[0] for c in curve], [c[1] for c in curve]))
    if "best_val" in metrics and series:
        series.append(Series(f"exported: step {metrics['best_val']['step']}", [metrics["best_val"]["step"]],
                             [metrics["best_val"]["loss"]], width=0, markers=True))
    return series


def _plots(metrics: dict, truth_curves: dict | None, half_curves: dict | None, tilt_range) -> list:
    """The plot images that exist for this run, in a fixed order."""
    from fasttomo.quality.plots import Series, render_fsc, render_line_plot

    out = []
    series = loss_series(metrics)
    if series:
        out.append(render_line_plot(series, "Loss curves", "step", "loss", log_y=True, legend="below",
                                    size=PLOT_SIZE)[0])
    if truth_curves:
        out.append(render_fsc(truth_curves, "FSC against the ground truth", tilt_range, size=(PLOT_SIZE[0], 470)))
    if half_curves:
        out.append(render_fsc(half_curves, "FSC of the even and odd half sets", tilt_range, size=(PLOT_SIZE[0], 470)))
    curve = metrics.get("curve") or []
    keys = [k for k in ("pearson_global", "pearson_foreground") if curve and k in curve[0]]
    if keys:
        ser = [Series(k.replace("pearson_", "Pearson, "), [c["fit_seconds"] for c in curve], [c[k] for c in curve],
                      markers=True) for k in keys]
        out.append(render_line_plot(ser, "Quality against fit time", "fit time (s)", "Pearson to the ground truth",
                                    legend="below", size=PLOT_SIZE)[0])
    poses = metrics.get("poses")
    if poses and poses.get("tilt_deg"):
        tilt = poses["tilt_deg"]
        if poses.get("learn_shifts", True):
            ser = [Series("shift u (across the tilt axis)", tilt, poses["shift_u_px"], markers=True),
                   Series("shift v (along the tilt axis)", tilt, poses["shift_v_px"], markers=True)]
            out.append(render_line_plot(ser, "Learned shifts per view", "tilt angle (deg)", "shift (px)",
                                        hlines=[0.0], legend="below", size=PLOT_SIZE)[0])
        if poses.get("learn_rotations", True):
            title, ser = rotation_series(poses)
            out.append(render_line_plot(ser, title, "tilt angle (deg)", "angle (deg)",
                                        hlines=[0.0], legend="below", size=PLOT_SIZE)[0])
    return out


def rotation_series(poses: dict) -> tuple[str, list]:
    """Title and curves of the learned-rotations plot of a pose dict (``Poses.describe()``): z3
    per view, z1 only when it was learned (or is not zero), the tilt-axis correction in the title."""
    from fasttomo.quality.plots import Series

    tilt = poses["tilt_deg"]
    ser = [Series("z3 (in-plane, after the tilt)", tilt, poses["z3_deg"], markers=True)]
    if poses.get("learn_z1", True) or any(poses["z1_deg"]):
        ser.insert(0, Series("z1 (before the tilt)", tilt, poses["z1_deg"], markers=True))
    title = "Learned rotations per view"
    if poses.get("learn_tilt_axis"):
        title += f" (tilt axis {poses['tilt_axis_deg']:+.2f} deg)"
    return title, ser


def headline(metrics: dict) -> str:
    """Steps, time and the quality numbers of a run in one line."""
    parts = []
    planned = metrics.get("steps_planned")
    if metrics.get("status") == "interrupted" and isinstance(planned, int):
        parts.append(f"stopped at step {metrics.get('steps') or 0} of {planned}")
    elif metrics.get("steps"):
        parts.append(f"{metrics['steps']} {'SIRT iterations' if metrics.get('model') == 'sirt' else 'steps'}")
    if isinstance(metrics.get("wall_seconds"), (int, float)):
        parts.append(f"{duration_text(metrics['wall_seconds'])} in all")
    q = quality(metrics)
    return ", ".join(parts) + (f"; {'; '.join(q)}" if q else "")


def report_image(volume: np.ndarray, pixel_size: float, metrics: dict, title: str, truth: np.ndarray | None = None,
                 truth_curves: dict | None = None, half_curves: dict | None = None, tilt_range=None, panel=None):
    """The whole report (a PIL image): title, the slice panel (``panel``: ``slice_panel(volume,
    pixel_size, truth)`` when already drawn), the plots two per row."""
    from PIL import Image, ImageDraw

    if panel is None:
        panel = slice_panel(volume, pixel_size, truth)
    plots = _plots(metrics, truth_curves, half_curves, tilt_range)
    cols = 2
    plot_rows = [plots[i:i + cols] for i in range(0, len(plots), cols)]
    plots_w = max((sum(p.width for p in row) + GAP * (len(row) + 1) for row in plot_rows), default=0)
    width = max(panel.width + 2 * GAP, plots_w, 900)
    f_title, f_text = _font(20), _font(14)
    probe = ImageDraw.Draw(Image.new("RGB", (10, 10)))
    lines = [headline(metrics), f"volume (Z, Y, X) = {tuple(volume.shape)}, voxel {pixel_size:.4g} A"]
    th = _text_w(probe, "Ag", f_title)[1] + 10
    lh = _text_w(probe, "Ag", f_text)[1] + 6
    head = GAP + th + lh * len(lines) + GAP
    height = head + panel.height + sum(max(p.height for p in row) + GAP for row in plot_rows) + GAP
    out = Image.new("RGB", (int(width), int(height)), BG)
    draw = ImageDraw.Draw(out)
    draw.text((GAP, GAP), title, fill=TEXT, font=f_title)
    for i, line in enumerate(lines):
        draw.text((GAP, GAP + th + i * lh), line, fill=MUTED, font=f_text)
    out.paste(panel, (GAP, head))
    y = head + panel.height
    for row in plot_rows:
        x = GAP
        for p in row:
            out.paste(p.convert("RGB"), (x, y))
            x += p.width + GAP
        y += max(p.height for p in row) + GAP
    return out


def png_bytes(img) -> bytes:
    """The picture encoded as PNG at zlib's default level (``optimize=True``, level 9 with a
    search, took 3x the time for 3 % smaller pictures)."""
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def save_png(path: Path, img, overwrite: bool = True, encoded: bytes | None = None) -> str:
    """Write ``img`` (or its ``encoded`` PNG bytes) to ``path`` atomically."""
    from fasttomo.data.io.atomic import atomic_write

    data = png_bytes(img) if encoded is None else encoded
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), overwrite=overwrite)


def add_to_tensorboard(tb_dir: Path, tag: str, img, step: int, encoded: bytes | None = None) -> None:
    """The picture as a TensorBoard image (a new event file in the run's tb/ folder); ``encoded``:
    its PNG bytes when already made (TensorBoard stores images as PNG: no second encoding)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter

    if encoded is None:
        img = img.convert("RGB")
        encoded = png_bytes(img)
    image = Summary.Image(height=img.height, width=img.width, encoded_image_string=encoded,
                          colorspace={"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}.get(img.mode, 3))
    writer = SummaryWriter(log_dir=str(tb_dir))
    try:
        writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
    finally:
        writer.close()


# --------------------------------------------------------------------------------------- closing summary
def _crossing_text(m: dict, key: str, threshold: str, what: str) -> str | None:
    """'<what> <threshold> at X A', or, where the curve never falls below the threshold, that it
    stays above it up to Nyquist (the volume's finest detail); None without the FSC."""
    if m.get(f"{key}_A") is not None:
        return f"{what} {threshold} at {m[f'{key}_A']:.3g} A"
    curve = m.get("fsc") or {}
    if curve.get(f"{key}_status") == "never" and isinstance(curve.get("nyquist_A"), (int, float)):
        return f"{what} above {threshold} up to Nyquist ({curve['nyquist_A']:.3g} A)"
    return None


def quality(m: dict) -> list[str]:
    """The quality numbers a run has, in words (empty when there are none)."""
    out = []
    if "pearson_global" in m:
        text = f"Pearson to the ground truth {number_text(m['pearson_global'])}"
        if "pearson_foreground" in m:
            text += f" (foreground {number_text(m['pearson_foreground'])})"
        out.append(text)
    if isinstance(m.get("psnr_dB"), float) and math.isfinite(m["psnr_dB"]):
        out.append(f"PSNR {m['psnr_dB']:.2f} dB")
    truth = _crossing_text(m, "fsc05", "0.5", "FSC to the truth")
    if truth:
        out.append(truth)
    half = _crossing_text(m.get("half_sets") or {}, "fsc0143", "0.143", "half-set FSC")
    if half:
        out.append(half)
    hold = m.get("holdout") or {}
    if hold.get("pearson"):
        vals = [v for v in hold["pearson"] if isinstance(v, float)]
        if vals:
            out.append(f"held-out views reprojection Pearson {np.mean(vals):.4f} (mean of {len(vals)})")
    pe = m.get("pose_errors") or {}
    if "shift_rms_px" in pe:
        out.append(f"pose errors {pe['shift_rms_px']:.3f} px / {pe['rotation_rms_deg']:.4f} deg RMS")
    return out


def _files(out_dir: Path, written: dict[str, int] | None = None) -> list[tuple[str, int]]:
    """(name, bytes) of the run's files: ``written`` (relative name: bytes, the manifest's list of
    what the run wrote) or else every file in ``out_dir``; a sub-folder's files are summed into one
    entry (tb/, checkpoints/ listed file by file when there are a few)."""
    if written is None:
        written = {str(p.relative_to(out_dir)): p.stat().st_size for p in out_dir.rglob("*")
                   if p.is_file() and not p.name.startswith(".") and p.name != "reconstruct.lock"}
    top: dict[str, int] = {}
    sub: dict[str, list[tuple[str, int]]] = {}
    for name, size in written.items():
        folder, _, rest = name.partition("/")
        if rest:
            sub.setdefault(folder, []).append((rest, size))
        else:
            top[name] = size
    out = []
    for name in sorted([*top, *sub]):
        if name in top:
            out.append((name, top[name]))
            continue
        files = sorted(sub[name])
        if name == "checkpoints" and len(files) <= 4:
            out += [(f"{name}/{f}", size) for f, size in files]
        else:
            out.append((f"{name}/ ({len(files)} file{'s' * (len(files) != 1)})", sum(size for _, size in files)))
    return out


def summary_lines(out_dir: Path, metrics: dict[str, Any], tensorboard: bool,
                  written: dict[str, int] | None = None) -> list[str]:
    """The closing summary: folder, the run's files (``written``, else the folder's) with sizes,
    time and speed, quality, refined poses, how to look."""
    lines = [f"run folder: {out_dir}"]
    files = _files(out_dir, written)
    w = max((len(n) for n, _ in files), default=0)
    lines += [f"  {n.ljust(w)}  {size_text(s):>10}" for n, s in files]
    speed = []
    if isinstance(metrics.get("wall_seconds"), (int, float)):
        speed.append(f"wall time {duration_text(metrics['wall_seconds'])}")
    what = "SIRT iterations" if metrics.get("model") == "sirt" else "steps"
    rate = metrics.get("steps_per_second")
    since = (metrics.get("resumed_from") or {}).get("step")
    if isinstance(since, int) and isinstance(rate, (int, float)) and rate > 0 and metrics.get("steps"):
        speed.append(f"steps {since + 1}-{metrics['steps']} in {duration_text((metrics['steps'] - since) / rate)} "
                     f"(resumed at step {since})")
    elif isinstance(metrics.get("train_seconds"), (int, float)) and metrics.get("steps"):
        speed.append(f"{metrics['steps']} {what} in {duration_text(metrics['train_seconds'])}")
    if not isinstance(rate, (int, float)) and isinstance(metrics.get("seconds_per_iteration"), (int, float)):
        rate = 1.0 / metrics["seconds_per_iteration"] if metrics["seconds_per_iteration"] > 0 else None
    if isinstance(rate, (int, float)):
        speed.append(f"{rate:.3g} {what.split()[-1]}/s")
    if speed:
        lines.append(", ".join(speed))
    q = quality(metrics)
    lines.append(("quality: " + "; ".join(q)) if q else
                 "quality: no ground truth (evaluation.half_sets=true or evaluation.holdout_views=[...] score "
                 "real data)")
    poses = metrics.get("poses") or {}
    if poses.get("learn_rotations") or poses.get("learn_shifts"):
        moved = [f"largest shift {poses['max_abs_shift_px']:.2f} px"] if poses.get("learn_shifts") else []
        if poses.get("learn_rotations"):
            moved.append(f"largest in-plane rotation {poses['max_abs_inplane_deg']:.2f} deg")
        if poses.get("learn_tilt_axis"):
            moved.append(f"tilt-axis correction {poses['tilt_axis_deg']:+.2f} deg")
        lines.append("poses refined: " + ", ".join(moved) + " (metrics.json poses)")
    if (out_dir / "report.png").is_file():
        lines.append(f"look at it: {out_dir / 'report.png'}")
    if tensorboard and (out_dir / "tb").is_dir():
        lines.append(f"tensorboard --logdir {out_dir / 'tb'}")
    return lines
