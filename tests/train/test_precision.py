"""Precision on a CPU: bf16 covers the decoder's layers in training alone (the interpolation's CPU
kernels are fp32), and precision=auto takes it only where the CPU has bf16 dot-product instructions."""

from __future__ import annotations

import torch

from fasttomo.models.decoder import Decoder
from fasttomo.train.precision import Precision, cpu_has_native_bf16, resolve_dtype

CPU = torch.device("cpu")


def test_auto_on_a_cpu_follows_its_instructions_and_explicit_choices_stand():
    assert resolve_dtype("auto", CPU) == ("bf16" if cpu_has_native_bf16() else "fp32")
    for name in ("fp32", "bf16", "fp16"):
        assert resolve_dtype(name, CPU) == name


def test_bf16_on_a_cpu_is_the_decoder_alone():
    bf = Precision("bf16", CPU)
    assert bf.decoder_only and not bf.enabled and bf.dtype == torch.bfloat16
    with bf.autocast():
        assert not torch.is_autocast_enabled("cpu")  # the field outside the decoder stays fp32
    fp16 = Precision("fp16", CPU)
    assert not fp16.decoder_only and fp16.enabled
    assert not Precision("fp32", CPU).decoder_only


def test_a_bf16_decoder_trains_in_bf16_and_evaluates_in_fp32():
    torch.manual_seed(0)
    ref = Decoder(24, hidden=32)
    dec = Decoder(24, hidden=32)
    dec.load_state_dict(ref.state_dict())
    dec.train_dtype = torch.bfloat16
    x = torch.randn(4096, 24)
    with torch.no_grad():
        assert torch.equal(dec(x), ref(x))  # no gradients recorded: fp32, the same values
    y_ref, y = ref(x), dec(x)
    assert y.dtype == torch.float32 and not torch.equal(y, y_ref)  # computed in bf16 ...
    torch.testing.assert_close(y, y_ref, rtol=0.05, atol=0.02)  # ... to bf16's precision
    y.square().mean().backward()
    y_ref.square().mean().backward()
    for p, q in zip(dec.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32  # the parameters and their gradients stay fp32
        assert torch.nn.functional.cosine_similarity(p.grad.ravel(), q.grad.ravel(), dim=0) > 0.99


def test_a_cpu_run_built_with_bf16_sets_its_decoder(tmp_path):
    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.data.load import load_tiltseries
    from fasttomo.run.build import build

    base = ["logging=quiet", "runtime=cpu", "data.width=16", "data.height=16", "data.n_tilts=5",
            f"output.dir={tmp_path}"]
    for dtype, want in (("bf16", torch.bfloat16), ("fp32", None)):
        cfg = compose_config([*base, f"precision={dtype}"])
        comps = build(cfg, load_tiltseries(cfg.data))
        assert comps.projector.field.decoder.train_dtype is want


def test_the_log_says_why_the_decoder_trains_in_bf16(tmp_path, caplog):
    """precision=bf16 chosen by hand names the choice (and, on a CPU without bf16 dot-product
    instructions, that fp32 is faster there); it never claims instructions the CPU lacks."""
    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.data.load import load_tiltseries
    from fasttomo.run.build import build

    cfg = compose_config(["logging=quiet", "runtime=cpu", "data.width=16", "data.height=16", "data.n_tilts=5",
                          f"output.dir={tmp_path}", "precision=bf16"])
    with caplog.at_level("INFO", logger="fasttomo.run.build"):
        build(cfg, load_tiltseries(cfg.data))
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision: bf16")]
    assert len(line) == 1 and "precision=bf16" in line[0], line
    assert ("fp32 is faster here" in line[0]) is not cpu_has_native_bf16()
    assert "chosen for a CPU with bf16" not in line[0]
