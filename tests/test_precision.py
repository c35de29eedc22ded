"""Training precision (issue #25 item 5): run.precision=auto is bf16 autocast on CUDA and on a
CPU with AMX-BF16, fp32 elsewhere (AVX512-BF16 without AMX trained no faster in bf16), said
once in the log; the bf16 path itself trains (forced, tiny, on every machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.bcd import run_bcd
from preinfer.runtime import device as device_mod
from preinfer.runtime.device import autocast, training_precision
from tests.pipeline_fixtures import tiny_cfg
from tests.test_rotation_order import weights

CPU = torch.device("cpu")
NATIVE_FLAGS = {"avx512_bf16", "amx_bf16", "bf16", "svebf16"}  # x86 flags; ARM Features


def cpuinfo_flags() -> set[str] | None:
    """The CPU's feature flags as the kernel lists them (x86 'flags', ARM 'Features')."""
    p = Path("/proc/cpuinfo")
    if not p.is_file():
        return None
    for line in p.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def test_auto_follows_this_cpus_bf16_instructions():
    """The real detection, against the kernel's own list of this CPU's instructions."""
    flags = cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags on this system")
    want = "bf16" if "amx_bf16" in flags else "fp32"
    name, why = training_precision(CPU, "auto")
    assert name == want, (why, sorted(flags & NATIVE_FLAGS))
    assert ("without AMX" in why) == bool(flags & NATIVE_FLAGS and "amx_bf16" not in flags)
    assert why.startswith("run.precision=auto: CPU capability")
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with autocast(CPU, "auto"):
        got = (a @ b).dtype
    assert got == (torch.bfloat16 if want == "bf16" else torch.float32)


@pytest.mark.parametrize(
    ("amx", "native", "want"), [(True, True, "bf16"), (False, True, "fp32"), (False, False, "fp32")]
)
def test_auto_on_a_cpu_with_and_without_native_bf16(monkeypatch, amx, native, want):
    monkeypatch.setattr(device_mod, "cpu_native_bf16", lambda: (native, "TEST"))
    monkeypatch.setattr(device_mod, "cpu_amx_bf16", lambda: amx)
    assert training_precision(CPU, "auto")[0] == want
    with autocast(CPU, "auto"):
        dtype = (torch.randn(2, 2) @ torch.randn(2, 2)).dtype
    assert dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[want]
    for explicit in ("fp32", "bf16"):  # an explicit setting is what runs, on any CPU
        assert training_precision(CPU, explicit) == (explicit, f"run.precision={explicit}")
    assert training_precision(torch.device("cuda"), "auto")[0] == "bf16"


def test_an_unknown_precision_is_refused():
    with pytest.raises(Exception, match="run.precision must be auto, fp32 or bf16"):
        training_precision(CPU, "fp16")


STEPS = ("train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=0")


def test_forced_bf16_trains_close_to_fp32_and_says_so_once(tiny_run, tmp_path):
    """run.precision=bf16 (forced: the same on every CPU) trains every block from tokens and from
    caches: weights stay fp32, move as fp32's do to within bf16's rounding, and differ from them
    (the bf16 path ran). The log says the choice once for the rotation."""
    import shutil

    fp32 = tiny_run(*STEPS)
    start = weights(fp32)
    shutil.copytree(tmp_path / "run", tmp_path / "bf16")
    bf16 = tiny_cfg(tmp_path / "bf16", *STEPS, "run.precision=bf16")
    said: list[str] = []
    res = run_bcd(bf16, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    run_bcd(fp32, log=lambda *a, **k: None)
    assert [v["cache"] for v in res["visits"]] == ["tokens", "built", "refreshed"]
    lines = [m for m in said if "training precision" in m]
    assert lines == ["  training precision: bf16 (run.precision=bf16)"]
    got, want = weights(bf16), weights(fp32)
    moved, diffs = 0, []
    for name, t in got.items():
        assert t.dtype == torch.float32 and torch.isfinite(t).all(), name
        # AdamW moves a value by ~lr (3e-3) a step whatever its gradient's size: bf16 rounding
        # that flips a near-zero gradient's sign moves that value by a few steps' worth; the
        # bulk of the values stays within a small part of one step
        diffs.append((t - want[name]).abs().flatten())
        assert diffs[-1].max() <= 4 * 3e-3, name
        moved += not torch.equal(t, start[name])
    assert moved > 0.5 * len(got)
    assert torch.cat(diffs).mean() <= 0.1 * 3e-3
    assert any(not torch.equal(got[n], want[n]) for n in got)  # bf16 really ran
    assert all(v["loss"] == v["loss"] and v["loss"] < 20 for v in res["visits"])
