"""`ampx info`: versions, devices and their fp16/bf16 support, the kernel backend, and the
bytes each parameter holds at each opt level.

One job: collect what a user (or a bug report) needs to know about this installation, as a
JSON-able dict, and format it as text. CPU features come from torch's own probes
(`torch.cpu._is_avx512_bf16_supported()` and friends), so they agree with the kernels torch
dispatches to.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any, Callable

__all__ = ["collect_info", "cpu_features", "cpu_support", "format_columns", "format_info"]

# feature name -> torch.cpu probe
_PROBES = {
    "avx2": "_is_avx2_supported",
    "avx512": "_is_avx512_supported",
    "avx512_bf16": "_is_avx512_bf16_supported",
    "vnni": "_is_vnni_supported",
    "amx_tile": "_is_amx_tile_supported",
    "amx_fp16": "_is_amx_fp16_supported",
}


def cpu_features() -> dict[str, bool]:
    """The CPU features torch can probe on this build (missing probes are left out)."""
    import torch

    found: dict[str, bool] = {}
    for name, probe in _PROBES.items():
        function: Callable[[], bool] | None = getattr(torch.cpu, probe, None)
        if function is not None:
            try:
                found[name] = bool(function())
            except RuntimeError:
                continue
    return found


def cpu_support(features: Mapping[str, bool]) -> dict[str, str]:
    """How fp16 and bf16 run on this CPU, from `cpu_features()`.

    >>> cpu_support({"avx512_bf16": True})["bf16"]
    'native (AVX512-BF16)'
    """
    if features.get("amx_tile"):
        bf16 = "native (AMX-BF16)"
    elif features.get("avx512_bf16"):
        bf16 = "native (AVX512-BF16)"
    else:
        bf16 = "emulated (slow)"
    if features.get("amx_fp16"):
        fp16 = "native (AMX-FP16)"
    else:
        fp16 = "emulated (slow: prefer bf16 on this CPU)"
    return {"fp16": fp16, "bf16": bf16}


def preferred_dtype() -> str:
    """The half dtype `ampx info` advises here: "fp16" with a GPU or a CPU that runs it natively.

    `ampx lists` defaults to it, so the two commands agree on a CPU where fp16 is emulated.
    """
    import torch

    if torch.cuda.is_available():
        return "fp16"  # apex's dtype, native on every CUDA GPU
    return "fp16" if cpu_support(cpu_features())["fp16"].startswith("native") else "bf16"


def _cpu_name() -> str:
    name = platform.processor() or platform.machine()
    try:  # the marketing name; the features come from torch, not from here
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return name


def _accelerators() -> list[dict[str, Any]]:
    import torch

    devices: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            bf16 = props.major >= 8 or bool(getattr(torch.version, "hip", None))
            devices.append({
                "device": f"cuda:{index}", "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "fp16": "native", "bf16": "native" if bf16 else "emulated (slow)",
            })
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"device": "mps", "name": "Apple GPU", "fp16": "native",
                        "bf16": "native (macOS 14+)"})
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        for index in range(xpu.device_count()):
            devices.append({"device": f"xpu:{index}", "name": xpu.get_device_name(index),
                            "fp16": "native", "bf16": "native"})
    return devices


def collect_info() -> dict[str, Any]:
    """Everything `ampx info` reports, as a JSON-able dict."""
    import torch

    from .. import __version__

    features = cpu_features()
    cpu = {
        "device": "cpu", "name": _cpu_name(), "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": sorted(name for name, present in features.items() if present),
        **cpu_support(features),
    }
    return {
        "ampx": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": [cpu, *_accelerators()],
        "kernels": _kernel_info(),
        "bytes_per_param": _memory_rows(),
    }


def _memory_rows() -> list[list[str]]:
    """Bytes each parameter holds at a step, per opt level (the rules; docs/opt-levels.md)."""
    from ..scaling.compensated import memory_rows

    return memory_rows()


def _kernel_info() -> dict[str, Any]:
    try:
        from .. import _ext

        return dict(_ext.describe())
    except Exception as exc:  # report, never fail `info`
        return {"backend": "unavailable", "error": f"{type(exc).__name__}: {exc}"}


def format_columns(rows: list[list[str]]) -> str:
    """Left-aligned columns with a dashed line under the header row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_info(info: Mapping[str, Any]) -> str:
    """`collect_info()` as the text `ampx info` prints."""
    torch_line = info["torch"]
    if info["torch_cuda"]:
        torch_line += f" (CUDA {info['torch_cuda']})"
    elif info["torch_hip"]:
        torch_line += f" (HIP {info['torch_hip']})"
    lines = [f"ampx   {info['ampx']}", f"torch  {torch_line}",
             f"python {info['python']} on {info['platform']}", ""]
    rows = [["device", "name", "fp16", "bf16"]]
    rows += [[dev["device"], str(dev["name"]), dev["fp16"], dev["bf16"]]
             for dev in info["devices"]]
    lines.append(format_columns(rows))
    cpu = info["devices"][0]
    lines.append(f"cpu: {cpu['threads']} threads, torch kernels {cpu['capability']}, "
                 f"features: {', '.join(cpu['flags']) or 'none of ' + ', '.join(_PROBES)}")
    lines += ["", "kernels:"]
    lines += [f"  {key}: {value}" for key, value in info["kernels"].items()]
    if info.get("bytes_per_param"):
        lines += ["", "bytes per parameter at a step (half = fp16/bf16; docs/opt-levels.md):",
                  format_columns(info["bytes_per_param"])]
    return "\n".join(lines)
