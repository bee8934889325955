"""Compute precision: one rule for every stage (the target in regen, dump and eval; training autocast; dump
storage through the target's dtype).

`auto` is bfloat16 where the hardware computes it fast and float32 elsewhere:
- CUDA: bfloat16 when the GPU supports it (Ampere and later).
- CPU: bfloat16 only when torch itself reports a bf16 matmul path (AMX tiles, whose OS permission torch
  requests, or AVX512-BF16) *and* a short measurement confirms bf16 matmuls run clearly faster than fp32.
  Advertised CPU features are not proof: a feature can be listed and still fault or be emulated slowly.
  The CPU decision is measured once per machine and torch version and kept in eaglet's cache
  (`precision-<key>.json`), so reruns, resumed stages and ranks agree.
`EAGLET_FAST_BF16=0|1` overrides the detection (the test suite pins it, so it means the same everywhere).
Explicit `float32` / `bfloat16` / `float16` always win over detection.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from pipeline.files import atomic_write_text, default_cache_root

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
ENV_OVERRIDE = "EAGLET_FAST_BF16"
# bf16 must beat fp32 by this factor on a training-sized matmul to count as fast (AMX measured 3-7x here;
# a CPU that emulates bf16 through fp32 lands below 1).
MIN_CPU_SPEEDUP = 1.5


def parse_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """A dtype name (or alias) -> torch dtype; `what` names the config field in the error."""
    key = ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"{what}={name!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}: use one of {', '.join(DTYPES)}")


def _cpu_bf16_advertised() -> bool:
    """torch's own capability query (CPUID + OS state), not /proc/cpuinfo."""
    cpu = torch.cpu
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    amx = getattr(cpu, "_is_amx_tile_supported", lambda: False)() and getattr(cpu, "_init_amx", lambda: False)()
    return bool(amx or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())


def measure_cpu_bf16_speedup(m: int = 512, k: int = 576, n: int = 1536, reps: int = 5) -> float:
    """fp32 time / bf16 time of one [m, k] x [k, n] matmul (best of `reps`, after a warm-up): ~20 ms."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        times[dtype] = best
    return times[torch.float32] / max(times[torch.bfloat16], 1e-9)


def _decision_file() -> Path:
    """Where this machine's CPU decision is kept: per CPU model and torch version, in eaglet's cache."""
    key = hashlib.sha256(f"{cpu_model_name()}|{torch.__version__}".encode()).hexdigest()[:12]
    return default_cache_root() / f"precision-{key}.json"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpu_decision() -> bool:
    """Measured once per machine and torch version, then read back: a rerun, a resumed stage or another rank
    on the same machine never flips precision on a measurement near the threshold."""
    path = _decision_file()
    try:
        return bool(json.loads(path.read_text())["fast_bf16"])
    except (OSError, ValueError, KeyError):
        pass
    speedup = measure_cpu_bf16_speedup()
    fast = speedup >= MIN_CPU_SPEEDUP
    log.info("CPU bf16 matmul %.1fx fp32: auto precision is %s (kept in %s)", speedup,
             "bfloat16" if fast else "float32", path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"fast_bf16": fast, "speedup": round(speedup, 2),
                                            "torch": torch.__version__}) + "\n")
    except OSError as e:  # a read-only cache: decide per process
        log.warning("could not keep the precision decision in %s: %s", path, e)
    return fast


@functools.lru_cache(maxsize=None)
def fast_bf16(device_type: str) -> bool:
    """Whether bf16 compute is fast on this kind of device (cached per process, and on disk for CPUs)."""
    override = os.environ.get(ENV_OVERRIDE)
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"{ENV_OVERRIDE}={override!r}: expected 0 or 1")
        return override == "1"
    if device_type == "cuda":  # native bf16 only (Ampere and later), not the emulation older GPUs offer
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type != "cpu" or not _cpu_bf16_advertised():
        return False
    return _cpu_decision()


def _cpu_flags() -> set[str]:
    line = next((line for line in _cpuinfo() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows where there is none."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                platform.processor() or platform.machine())


def cpu_description() -> str:
    """The CPU's model name and its bf16 matmul extensions, which every CPU figure depends on (AMX, AVX512-BF16 or
    neither: the model name alone does not say), e.g. 'Intel(R) Xeon(R) Processor (amx_bf16, avx512_bf16)'."""
    flags = [f for f in ("amx_bf16", "avx512_bf16") if f in _cpu_flags()]
    return f"{cpu_model_name()} ({', '.join(flags) or 'no bf16 matmul flags'})"


def machine_description(device) -> str:
    """The device a figure was measured on: a GPU's name, or the CPU's description and the threads torch uses."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_description()}, {torch.get_num_threads()} threads"


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX-BF16) rather than converting to fp32, from
    /proc/cpuinfo: what a server in another process (vLLM) will find, without measuring here."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def resolve_dtype(name: str, device: torch.device, what: str = "dtype",
                  choices: Optional[Iterable[str]] = None) -> torch.dtype:
    """The one reading of a configured dtype: a name or alias, or `auto`: bf16 where fast on `device` (this
    machine's measured decision, `fast_bf16`), else fp32. `choices` narrows the dtypes a setting accepts; `what`
    names the setting in the error."""
    if name == "auto":
        dtype = torch.bfloat16 if fast_bf16(device.type) else torch.float32
    else:
        dtype = parse_dtype(name, what)
    if choices is not None and dtype_name(dtype) not in (allowed := list(choices)):
        raise ValueError(f"{what}={name!r}: choose one of {', '.join(allowed)}")
    return dtype
