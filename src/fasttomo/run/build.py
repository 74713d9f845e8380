"""Typed config -> objects. Keeps the Trainer a loop rather than a hub that knows every module:
:func:`build` makes the parts of a run (device, box, projector, sampler, optimizer, schedule,
precision) and :func:`make_trainer` hands them, with the Trainer's own small config, to the
Trainer. Nothing under train/ imports this module."""

from __future__ import annotations

import dataclasses
import logging

import torch

from fasttomo.config import Config, ConfigError, IntensityConfig, LossConfig, OptimConfig
from fasttomo.data.tiltseries import TiltSeries
from fasttomo.geometry.rays import Box
from fasttomo.methods.field.intensity import Intensity
from fasttomo.methods.field.projector import Projector
from fasttomo.train.precision import Precision, cpu_has_native_bf16
from fasttomo.train.schedules import PlateauState, Schedule, build_schedule

log = logging.getLogger("fasttomo.run.build")


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"runtime.device: {spec!r} was asked for but torch sees no CUDA device "
                f"(torch {torch.__version__}); use runtime=auto or runtime=cpu, or install a CUDA build of torch."
            )
        return torch.device(spec if ":" in spec else f"cuda:{local_rank}")
    return torch.device("cpu")


def reconstruction_box(cfg: Config, ts: TiltSeries) -> Box:
    """The volume box (Z, Y, X) in voxels: X = W, Y = H, Z from data.thickness, else the ground
    truth's depth (synthetic data), else W/2."""
    z = cfg.data.thickness
    if z is None:
        z = ts.ground_truth.shape[0] if ts.ground_truth is not None else max(2, ts.width // 2)
    return Box((int(z), ts.height, ts.width))


@dataclasses.dataclass
class Components:
    """The parts :func:`build` made, for the pipeline, the dry run and the benchmarks (the
    Trainer takes them one by one, see :func:`make_trainer`)."""

    cfg: Config
    """The run's config, with the automatic batch size resolved."""
    device: torch.device
    ts: TiltSeries
    box: Box
    sampler: object
    projector: Projector
    model: torch.nn.Module  # the projector, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    schedule: Schedule
    plateau: PlateauState | None
    precision: Precision
    reg_generator: torch.Generator
    rank: int = 0
    world_size: int = 1
    cuda_graph: bool = False
    """Capture the training step in a CUDA graph (decided here from runtime.cuda_graph)."""
    plane_tv_why: str | None = None
    """Why loss.plane_tv has its value, when the build chose it from the data (:func:`from_data`)."""
    steps_why: str | None = None
    """Why optim.steps has its value, when the build chose it (:func:`from_data`)."""


def auto_batch_size(ts: TiltSeries, sampler_cfg, world_size: int = 1) -> int:
    """sampler.batch_size=None: 1024 x 2^round(log2(pixels / 2^18)), within [1024, 8192], rounded
    to the nearest whole number of patch_size x patch_size patches (at least one), and no more
    than the training pixels of one rank (a series of a few hundred pixels, a test's)."""
    from fasttomo.data.sampler import split_size

    pixels = int(ts.stack.size)
    train = (pixels - split_size(pixels, float(sampler_cfg.val_fraction))) // max(1, int(world_size))
    return batch_for_pixels(pixels, sampler_cfg.patch_size, train)


def batch_for_pixels(pixels: int, patch_size: int = 1, train_pixels: int | None = None) -> int:
    """:func:`auto_batch_size` of a series of ``pixels`` pixels (all views together) of which
    ``train_pixels`` (None: all) are one rank's training pixels."""
    import math

    k = round(math.log2(max(pixels, 1) / 2 ** 18))
    b = int(min(8192, max(1024, 1024 * 2 ** k)))
    p2 = int(patch_size) ** 2
    b = max(p2, int(round(b / p2)) * p2)
    if train_pixels is not None and b > train_pixels:
        b = max(p2, train_pixels // p2 * p2)
    return b


AUTO_STEPS = 1500
"""optim.steps=None: the step count of images up to AUTO_STEPS_FROM pixels a side."""
AUTO_STEPS_FROM = 256
AUTO_STEPS_PER_DOUBLING = 2000
"""optim.steps=None: steps added per doubling of the image's largest side above AUTO_STEPS_FROM."""


def auto_steps(image_hw: tuple[int, int]) -> int:
    """optim.steps=None: 1500 for images up to 256 pixels a side (the measured defaults of the
    embedded phantom and the 128^2 cases), plus 2000 per doubling of the largest side above 256.
    Measured on an H200: at 1024^2 x 61 views, 4000 steps with [128, 256, 512] gave FSC 0.5 at
    21.9 A against 43.4 A for 1500 with [256, 512, 1024]; at 2048^2 x 121 views, 5250 steps gave
    45.4-54.2 A over ten runs (within 1.2x of 10500 steps' 38.7 A in four), 6750 steps 44.8 A and
    7500 steps 43.4 A (one run each). PROVISIONAL at 512 (3500), 1024 (5500) and 4096 (9500) until
    measured."""
    import math

    side = max(int(image_hw[0]), int(image_hw[1]))
    if side <= AUTO_STEPS_FROM:
        return AUTO_STEPS
    return int(round(AUTO_STEPS + AUTO_STEPS_PER_DOUBLING * math.log2(side / AUTO_STEPS_FROM)))


def from_data(cfg: Config, ts: TiltSeries) -> tuple[Config, str | None, str | None]:
    """optim.steps=None and loss.plane_tv=None resolved from the series: (the config with both
    set, why plane TV has its weight, why the steps their count; None where the config set it).
    Steps: :func:`auto_steps` of the images' size, times ``models.regularizers.steps_factor_for``
    of the estimated per-pixel signal-to-noise (``data.noise.estimate_snr``) for a K-Planes
    field; plane TV: ``plane_tv_for`` of the same estimate (other fields take the default weight,
    unused, unestimated). The choices are logged."""
    from fasttomo.models.regularizers import PLANE_TV, plane_tv_for, steps_factor_for

    est = None
    if cfg.model.kind == "kplanes_tilted" and (cfg.optim.steps is None or cfg.loss.plane_tv is None):
        from fasttomo.data.noise import estimate_snr

        est = estimate_snr(ts.stack)
    steps_why = tv_why = None
    if cfg.optim.steps is None:
        steps = base = auto_steps((ts.height, ts.width))
        steps_why = f"from the images' size {ts.height} x {ts.width}"
        factor, rule = steps_factor_for(est.snr) if est is not None else (1.0, "")
        if factor != 1.0:
            steps = int(round(base * factor / 50.0)) * 50
            steps_why = f"{base} {steps_why}, x{factor:g}: {est.describe()}, {rule}"
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, steps=steps))
        log.info("optim: %d steps (%s; set optim.steps to choose)", steps, steps_why)
    if cfg.loss.plane_tv is None:
        weight, rule = plane_tv_for(est.snr) if est is not None else (PLANE_TV, None)
        tv_why = f"{est.describe()}, {rule}" if est is not None else None
        cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, plane_tv=weight))
        if tv_why:
            log.info("loss: plane TV %g (%s; set loss.plane_tv to choose)", weight, tv_why)
    _log_plane_tv_schedule(cfg)
    return cfg, tv_why, steps_why


def _log_plane_tv_schedule(cfg: Config) -> None:
    """Say what loss.plane_tv_hold / plane_tv_ramp do to this run's weight, or that they do nothing."""
    from fasttomo.models.regularizers import PLANE_TV, PlaneTVSchedule

    lc = cfg.loss
    if lc.plane_tv_hold <= 0 and lc.plane_tv_ramp <= 0:
        return
    schedule = PlaneTVSchedule(lc.plane_tv, lc.plane_tv_hold, lc.plane_tv_ramp)
    if not schedule.varies:
        log.warning("loss.plane_tv_hold / plane_tv_ramp change nothing: plane TV %g is not above %g, the weight "
                    "they hold", lc.plane_tv, PLANE_TV)
        return
    held, full = schedule.phase_ends(cfg.optim.steps)
    log.info("loss: plane TV held at %g for %d steps, then raised to %g by step %d", PLANE_TV, held, lc.plane_tv, full)


@dataclasses.dataclass(frozen=True)
class AutoSizes:
    """What a run sizes from its data when the keys are left unset (null)."""

    resolutions: list
    samples_per_ray: int
    batch_size: int
    steps: int
    why: dict
    """One reason per key (model.resolutions, projector.samples_per_ray, sampler.batch_size,
    optim.steps)."""


def auto_sizes(box: Box, image_hw: tuple[int, int], angles_deg, patch_size: int = 1,
               val_fraction: float = 0.02) -> AutoSizes:
    """The automatic sizes of a reconstruction of ``box`` from ``len(angles_deg)`` views of
    ``image_hw`` pixels: plane resolutions (``models.auto_resolutions``), samples per ray
    (``geometry.rays.auto_samples_per_ray``), rays per step (:func:`batch_for_pixels`) and steps
    (:func:`auto_steps`). A pure function of the shapes (the table test pins it)."""
    from fasttomo.data.sampler import split_size
    from fasttomo.geometry.rays import auto_samples_per_ray
    from fasttomo.models import auto_finest, auto_resolutions

    n_views, (h, w) = len(angles_deg), image_hw
    pixels = n_views * int(h) * int(w)
    res = auto_resolutions(box)
    spr = auto_samples_per_ray(box, angles_deg)
    batch = batch_for_pixels(pixels, patch_size, pixels - split_size(pixels, val_fraction))
    steps = auto_steps(image_hw)
    why = {"model.resolutions": auto_finest(max(box.shape_zyx))[1] + ", halved down to >= 32 texels, at most 3 scales",
           "projector.samples_per_ray": "one per 4/3 voxel of the longest chord through the box",
           "sampler.batch_size": f"1024 x 2^round(log2({pixels} pixels / 2^18)) within [1024, 8192]"
                                 + ("" if batch >= 1024 else ", at most the training pixels"),
           "optim.steps": (f"the images' largest side {max(h, w)} <= {AUTO_STEPS_FROM}" if max(h, w) <= AUTO_STEPS_FROM
                           else f"{AUTO_STEPS} + {AUTO_STEPS_PER_DOUBLING} per doubling of the images' largest side "
                                f"{max(h, w)} above {AUTO_STEPS_FROM} (measured at 2048, provisional elsewhere)")}
    return AutoSizes(res, spr, batch, steps, why)


def sizing_lines(cfg: Config, comps: Components) -> list[str]:
    """One line per automatic size of the run ``comps`` was built for: the value chosen and why,
    or that ``cfg`` (the config as given) set it."""
    sizes = auto_sizes(comps.box, (comps.ts.height, comps.ts.width), comps.ts.angles, cfg.sampler.patch_size,
                       cfg.sampler.val_fraction)
    given = {"model.resolutions": getattr(cfg.model, "resolutions", None),
             "projector.samples_per_ray": cfg.projector.samples_per_ray,
             "sampler.batch_size": cfg.sampler.batch_size, "optim.steps": cfg.optim.steps}
    chosen = {"model.resolutions": sizes.resolutions, "projector.samples_per_ray": sizes.samples_per_ray,
              "sampler.batch_size": sizes.batch_size, "optim.steps": sizes.steps}
    lines = []
    for key, value in given.items():
        if key == "model.resolutions" and cfg.model.kind != "kplanes_tilted":
            continue
        if value is not None:
            lines.append(f"    {key} = {value} (set)")
        elif key == "optim.steps" and comps.cfg.optim.steps != chosen[key]:  # the data's rule beyond the shapes
            lines.append(f"    {key} = {comps.cfg.optim.steps} (automatic: {comps.steps_why})")
        else:
            lines.append(f"    {key} = {chosen[key]} (automatic: {sizes.why[key]})")
    if cfg.model.kind == "kplanes_tilted":
        how = "set" if comps.plane_tv_why is None else f"automatic: {comps.plane_tv_why}"
        lines.append(f"    loss.plane_tv = {comps.cfg.loss.plane_tv:g} ({how})")
    return lines


def samples_per_ray(cfg: Config, box: Box, ts: TiltSeries) -> int:
    """projector.samples_per_ray, or the automatic count for this box and these tilts."""
    from fasttomo.geometry.rays import auto_samples_per_ray

    if cfg.projector.samples_per_ray is not None:
        return cfg.projector.samples_per_ray
    s = auto_samples_per_ray(box, ts.angles)
    log.info("projector: %d samples per ray (one per 4/3 voxel of the longest chord; set projector.samples_per_ray "
             "to choose)", s)
    return s


def background_start(cfg: IntensityConfig, ts: TiltSeries):
    """(starting background in the stack's units, the vacuum estimate): intensity.background_value
    or the robust vacuum estimate; 0 for background=none. The estimate is kept in ts.metadata."""
    from fasttomo.data.background import estimate_background, warn_if_mass_dark

    est = estimate_background(ts.stack, ts.valid)
    ts.metadata["background_estimate"] = est.describe()
    warn_if_mass_dark(est, log, str(ts.source))
    if cfg.background == "none":
        return 0.0, est
    return (est.value if cfg.background_value is None else float(cfg.background_value)), est


def build_intensity(cfg: IntensityConfig, ts: TiltSeries, scale: float, start: float, est) -> Intensity:
    """The intensity model, its background at ``start`` (stack units; see :func:`background_start`),
    in the sampler's units (stack / ``scale``)."""
    if cfg.background != "none":
        log.info("intensity: background=%s at %.6g (%s; vacuum estimate %.6g, tile spread %.3g, from the %d darkest "
                 "%d-px tiles)", cfg.background, start,
                 "intensity.background_value" if cfg.background_value is not None else "the vacuum estimate",
                 est.value, est.spread, est.n_tiles, est.block)
    else:
        log.info("intensity: background=none (the data is taken as background-subtracted; the vacuum estimate "
                 "is %.6g)", est.value)
    return Intensity(ts.n_tilts, ts.reference_index(), cfg.background, start / scale, est.per_view / scale,
                     cfg.gain_per_view)


def build_optimizer(cfg: OptimConfig, projector: Projector, capturable: bool = False
                    ) -> tuple[torch.optim.Optimizer, list[float]]:
    """Adam over the projector's parameter groups (:meth:`Projector.param_groups`), one learning
    rate per group; returns it and the groups' base learning rates."""
    groups = projector.param_groups()
    lrs = {"grids": cfg.lr_grids, "decoder": cfg.lr_decoder, "rotations": cfg.lr_rotations,
           "pose_rotations": cfg.lr_pose_rotations, "pose_shifts": cfg.lr_pose_shifts,
           "intensity": cfg.lr_intensity}
    param_groups, base = [], []
    for name, params in groups.items():
        params = [p for p in params if p.requires_grad]
        if not params:
            continue
        param_groups.append({"params": params, "lr": lrs[name], "name": name})
        base.append(lrs[name])
    # fused: one kernel per step, and it takes the divergence guard's skip flag on the device
    # (found_inf), so a bad step is cancelled without a host sync (see train/guard.py)
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
                for g in param_groups for p in g["params"])
    # torch's Adam without its first-call import of torch._dynamo (3.6 s of a run's start on an H200)
    from fasttomo.train.adam import Adam

    opt = Adam(param_groups, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
               capturable=capturable, fused=fused or None)
    return opt, base


def build(cfg: Config, ts: TiltSeries, *, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> Components:
    from fasttomo.data.sampler import build_sampler
    from fasttomo.data.io.alignment import view_poses
    from fasttomo.geometry.poses import Poses
    from fasttomo.kernels import dispatch
    from fasttomo.models import build_field

    device = resolve_device(cfg.runtime.device, local_rank)
    from fasttomo.kernels import prewarm

    prewarm.wait()  # the kernels' background load (reconstruct.main) ends before anything uses them
    if device.type == "cpu":
        from fasttomo.run.allocator import tune_cpu_allocator

        tune_cpu_allocator()  # a CPU step's MB-sized tensors stay in the heap (no page-fault churn)
    if cfg.kernels.backend == "triton" and device.type != "cuda":
        raise ConfigError(f"kernels.backend=triton: the fused kernels need a CUDA device, but this run is on "
                          f"{device}; use kernels=auto (fused where possible) or kernels=torch.")
    dispatch.configure(cfg.kernels.backend, gpu_decoder=cfg.kernels.gpu_decoder, step_fusion=cfg.kernels.step_fusion)
    box = reconstruction_box(cfg, ts)
    torch.manual_seed(cfg.runtime.seed)
    field = build_field(cfg.model, box).to(device)  # no host copy (1 GB at 4096^2) beside the estimates below
    refine = cfg.pose.learn  # pose=refine: a PoseRefineConfig
    poses = Poses(ts.angles, ts.reference_index(), learn_rotations=refine and cfg.pose.learn_rotations,
                  learn_shifts=refine and cfg.pose.learn_shifts, learn_z1=refine and cfg.pose.learn_z1,
                  free_reference_shift=refine and cfg.pose.free_reference_shift,
                  learn_tilt_axis=refine and cfg.pose.learn_tilt_axis, initial=view_poses(ts.metadata))
    if cfg.sampler.batch_size is None:
        batch = auto_batch_size(ts, cfg.sampler, world_size)
        cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, batch_size=batch))
        share = (f"about 1/256 of the series' {ts.stack.size} pixels" if batch >= 1024 else
                 f"all training pixels of this small series of {ts.stack.size}")
        log.info("sampler: %d rays per step (%s; set sampler.batch_size to choose)", batch, share)
    cfg, why, steps_why = from_data(cfg, ts)
    start, est = background_start(cfg.intensity, ts)
    sampler = build_sampler(ts, cfg.sampler, seed=cfg.runtime.seed, device=device, rank=rank, world_size=world_size,
                            offset=start)
    intensity = build_intensity(cfg.intensity, ts, sampler.scale, start, est)
    projector = Projector(field, poses, box, (ts.height, ts.width), samples_per_ray(cfg, box, ts),
                          intensity, loss=cfg.loss).to(device)
    model: torch.nn.Module = projector
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The Projector holds the field AND the poses, so DDP all-reduces the pose gradients too.
        # Its only buffers (tilt angles, reference mask) are constants built identically on every
        # rank, so the per-forward buffer broadcast is skipped (one collective less per step).
        # Every trainable parameter gets a gradient each step (frozen ones are not trainable and
        # DDP ignores them), so find_unused_parameters stays off. The plane TV comes from DDP's
        # forward with the features; the other regularizers run on the unwrapped field outside it,
        # which is safe: they join the same backward, so each parameter's AccumulateGrad (where
        # DDP's hook fires) sees data + regularizer gradients.
        import inspect

        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})  # the older spelling (deprecated in newer torch)
        model = DDP(projector, device_ids=[device.index] if device.type == "cuda" else None,
                    find_unused_parameters=False, **no_buffer_sync)
    graph = use_cuda_graph(cfg, device, world_size)
    optimizer, base_lrs = build_optimizer(cfg.optim, projector, capturable=graph)
    schedule, plateau = build_schedule(cfg.schedule, cfg.optim.steps)
    reg_gen = torch.Generator(device=device)
    reg_gen.manual_seed(cfg.runtime.seed + 1000003 * (rank + 1))
    precision = field_precision(cfg, device, projector.field)
    if device.type == "cuda":
        compile_ahead(cfg.loss, projector, sampler.batch_size, precision)
    log.info("device %s, box (Z,Y,X)=%s, %d parameters, %d train / %d val pixels, world size %d",
             device, box.shape_zyx, sum(p.numel() for p in projector.parameters()),
             sampler.n_train, sampler.n_val, world_size)
    return Components(cfg, device, ts, box, sampler, projector, model, optimizer, base_lrs, schedule, plateau,
                      precision, reg_gen, rank, world_size, graph, why, steps_why)


def compile_ahead(loss: LossConfig, projector: Projector, batch_size: int, precision: Precision) -> int:
    """Start compiling the run's fused kernels in background threads (``dispatch.compile_ahead``;
    with a warm Triton cache they only load): a step evaluates the field at ``batch_size`` rays'
    samples and, with a field volume TV, its sub-grid in the same call. Returns the number of
    kernels being compiled."""
    from fasttomo.kernels import dispatch
    from fasttomo.models.regularizers import needs_noise

    field = projector.field
    n = batch_size * projector.samples_per_ray
    volume_tv = None
    if needs_noise(field, loss):
        side = int(loss.volume_tv_points)
        n += side ** 3
        volume_tv = ((side, side, side), loss.volume_tv_kind == "l1")
    need_dq = any(p.requires_grad for p in projector.poses.parameters())
    return dispatch.compile_ahead(field, n, out_bf16=precision.enabled and precision.dtype == torch.bfloat16,
                                  need_dq=need_dq, plane_tv=bool(loss.plane_tv), volume_tv=volume_tv,
                                  rays=(batch_size, projector.samples_per_ray))


def field_precision(cfg: Config, device: torch.device, field) -> Precision:
    """The run's Precision; bf16 on a CPU sets the field's decoder to train in it (its layers alone);
    precision.planes=bf16 sets the field to sample its planes rounded to bf16."""
    precision = Precision(cfg.precision.dtype, device)
    if cfg.precision.planes == "bf16":  # a K-Planes field (Config refuses the key for other models)
        field.planes_bf16 = True
        log.info("precision: the interpolation samples the planes rounded to bf16 (precision.planes=bf16)")
    decoder = getattr(field, "decoder", None)
    if precision.decoder_only and decoder is not None:
        decoder.train_dtype = precision.dtype
        if cfg.precision.dtype == "auto":
            why = "chosen for a CPU with bf16 dot-product instructions; precision=fp32 to choose"
        elif cpu_has_native_bf16():
            why = "precision=bf16"
        else:  # emulated: slower than fp32, and fp32 keeps the native C decoder
            why = "precision=bf16, but this CPU has no bf16 dot-product instructions: fp32 is faster here"
        log.info("precision: bf16 for the decoder's layers in training, the rest fp32 (%s)", why)
    return precision


def use_cuda_graph(cfg: Config, device: torch.device, world_size: int) -> bool:
    """runtime.cuda_graph -> whether the training step is captured (on: an error says what prevents it)."""
    if cfg.runtime.cuda_graph == "off":
        return False
    problem = capture_problem_of(cfg, device, world_size)
    if problem is None:
        return True
    if cfg.runtime.cuda_graph == "on":
        raise ConfigError(f"runtime.cuda_graph=on: the training step cannot be captured: {problem}; "
                          "fix that or set runtime.cuda_graph=auto (or off).")
    if device.type == "cuda":  # on the CPU there is nothing to capture: no need to say so
        log.info("training step runs eagerly, not in a CUDA graph: %s", problem)
    return False


def capture_problem_of(cfg: Config, device: torch.device, world_size: int) -> str | None:
    """Why the training step of ``cfg`` cannot be captured in a CUDA graph, or None when it can
    (the rules: :func:`fasttomo.train.cuda_graph.capture_problem`)."""
    from fasttomo.train.cuda_graph import capture_problem

    svd = cfg.model.kind == "kplanes_tilted" and cfg.model.learn_frames and cfg.model.rotation_param == "svd"
    return capture_problem(device, world_size, dtype=cfg.precision.dtype, svd_rotations=svd,
                           drop_last=cfg.sampler.drop_last)


def make_trainer(c: Components, out_dir=None, *, stop=None, probe=None):
    """The Trainer of the parts ``c``, with its own config taken from ``c.cfg`` (optim, pose,
    logging, evaluation and guard groups) and the run's resolved config stored in its checkpoints;
    ``stop`` and ``probe``: the Trainer's hooks (see :class:`fasttomo.train.trainer.Trainer`)."""
    from fasttomo.config import to_dict
    from fasttomo.models.regularizers import PlaneTVSchedule
    from fasttomo.train.trainer import Trainer, TrainerConfig

    lc = c.cfg.loss
    tv = PlaneTVSchedule(lc.plane_tv, lc.plane_tv_hold, lc.plane_tv_ramp) if lc.plane_tv is not None else None
    return Trainer(TrainerConfig.from_config(c.cfg), projector=c.projector, model=c.model, sampler=c.sampler,
                   optimizer=c.optimizer, base_lrs=c.base_lrs, schedule=c.schedule, plateau=c.plateau,
                   precision=c.precision, reg_generator=c.reg_generator, device=c.device, out_dir=out_dir,
                   rank=c.rank, world_size=c.world_size, cuda_graph=c.cuda_graph, run_config=to_dict(c.cfg),
                   stop=stop, probe=probe, plane_tv_schedule=tv if tv is not None and tv.varies else None)
