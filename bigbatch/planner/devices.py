"""Devices the time model knows: compute rates, memory bandwidth, and the links between them.

    dev = device("h100")                 # a ready entry
    dev = load_device("my_gpu.toml")     # or your own (TOML or JSON, the fields below)

A file has the fields of `Device` at the top (``flops`` a table of dtype -> peak dense
FLOP/s) and two tables, ``[intra]`` and ``[inter]``, each with ``bandwidth`` (bytes/s one
GPU sends in one direction), ``latency`` (seconds per hop) and optionally ``efficiency``.
`bigbatch plan --calibrate` writes one for the machine it runs on.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from bigbatch.errors import ConfigError

__all__ = ["DEVICES", "Device", "Link", "device", "load_device"]


@dataclass(frozen=True)
class Link:
    """One kind of link: within a node (NVLink) or between nodes (a NIC per GPU)."""

    bandwidth: float
    """Bytes per second one GPU sends in one direction (the datasheet's figure)."""
    latency: float
    """Seconds per hop of a collective's ring or tree (software and wire)."""
    efficiency: float = 0.8
    """Fraction of `bandwidth` a large collective reaches (NCCL's bus bandwidth)."""

    @property
    def rate(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Device:
    """One accelerator, its node and its network."""

    name: str
    flops: dict[str, float]
    """Peak dense FLOP/s of a matrix product per dtype (``bfloat16``, ``float16``,
    ``float32``): the datasheet's, without sparsity. MFU is measured against these."""
    memory_bandwidth: float
    """Bytes/s of device memory (datasheet)."""
    intra: Link
    inter: Link
    gpus_per_node: int = 8
    matmul_efficiency: float = 0.8
    """Fraction of peak a large matrix product sustains."""
    attention_efficiency: float = 0.4
    """Fraction of peak a fused (flash) attention kernel sustains, forward and backward
    together, counting the FLOPs it does (half the score matrix when causal)."""
    memory_efficiency: float = 0.9
    """Fraction of `memory_bandwidth` a large copy reaches."""
    kernel_overhead: float = 3e-6
    """Seconds each kernel costs beyond its roofline (launch, tail: a GPU kernel's floor)."""
    source: str = ""

    def matmul_rate(self, dtype: str) -> float:
        """Sustained FLOP/s of a product in `dtype` (float32 without its own entry: the
        smallest rate given)."""
        peak = self.flops.get(dtype, min(self.flops.values()))
        return peak * self.matmul_efficiency

    def attention_rate(self, dtype: str) -> float:
        return self.peak(dtype) * self.attention_efficiency

    def peak(self, dtype: str) -> float:
        return self.flops.get(dtype, min(self.flops.values()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_NVIDIA_LATENCY = "latencies assumed (NVLink 3 us, InfiniBand 8 us per hop)"

DEVICES: dict[str, Device] = {
    "h100": Device(
        name="NVIDIA H100 SXM5 80GB", gpus_per_node=8,
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        memory_bandwidth=3.35e12,
        intra=Link(450e9, 3e-6), inter=Link(50e9, 8e-6),
        matmul_efficiency=0.8, attention_efficiency=0.4, memory_efficiency=0.9,
        source="NVIDIA H100 datasheet (SXM5: 989 TFLOP/s dense bf16, 67 fp32, 3.35 TB/s HBM3, "
               "NVLink 900 GB/s = 450 each way; 400 Gb/s NDR InfiniBand per GPU in a DGX H100). "
               "Measured on this workplace's H100 (the device notes it lends with): an "
               "8192^3 bf16 product at 798 TFLOP/s (0.80 of peak) and a device copy at ~3.0 "
               "TB/s (0.9); the H200s here ~790 TFLOP/s and ~4.2 TB/s (benchmarks/NOTES-"
               "gpu.md); attention 0.4 of peak (FlashAttention-2's published H100 rates, "
               f"~350-400 TFLOP/s); {_NVIDIA_LATENCY}"),
    "h200": Device(
        name="NVIDIA H200 SXM 141GB", gpus_per_node=8,
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        memory_bandwidth=4.8e12,
        intra=Link(450e9, 3e-6), inter=Link(50e9, 8e-6),
        matmul_efficiency=0.8, attention_efficiency=0.4, memory_efficiency=0.88,
        source="NVIDIA H200 datasheet (989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, NVLink 900 "
               "GB/s). Measured here (benchmarks/NOTES-gpu.md, KINDS.md): bf16 products at "
               "769-798 TFLOP/s (~790: 0.8 of peak), a 1 GiB copy at 4.17-4.3 TB/s (~4.2: "
               f"0.88); attention 0.4 of peak (FlashAttention-2's published H100 rates, "
               f"~350-400 TFLOP/s); {_NVIDIA_LATENCY}"),
    "a100": Device(
        name="NVIDIA A100 SXM4 80GB", gpus_per_node=8,
        flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
        memory_bandwidth=2.039e12,
        intra=Link(300e9, 3e-6), inter=Link(25e9, 8e-6),
        matmul_efficiency=0.8, attention_efficiency=0.6, memory_efficiency=0.9,
        source="NVIDIA A100 datasheet (312 TFLOP/s dense bf16, 19.5 fp32, 2.04 TB/s HBM2e, "
               "NVLink 600 GB/s = 300 each way; 200 Gb/s HDR InfiniBand per GPU in a DGX "
               "A100). Efficiencies not measured here: products H100's; attention 0.6 "
               "(FlashAttention-2's published A100 rates, forward and backward); "
               f"{_NVIDIA_LATENCY}"),
    "h100-hbm2e": Device(
        name="NVIDIA H100 96GB HBM2e at 500 W (Meta's Grand Teton, torchtitan's)",
        gpus_per_node=8,
        flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
        memory_bandwidth=2.4e12,
        intra=Link(450e9, 3e-6), inter=Link(50e9, 8e-6),
        matmul_efficiency=0.8, attention_efficiency=0.4, memory_efficiency=0.9,
        source="torchtitan's benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e at "
               "2.4 TB/s, NVLink within a host, 400 Gb/s RDMA per GPU, 500 W power limit; "
               "its footnote: \"the actual peak TFLOPs number is between SXM and NVL, and "
               "we don't know its exact value\" (NVIDIA's datasheets: SXM 989 dense bf16 at "
               "700 W, NVL 835 at 350-400 W). SXM's 989 is used, as torchtitan's MFU does: "
               "an upper bound on this GPU's rate; benchmarks/plan_anchors.py also predicts "
               "at NVL's 835. Efficiencies as h100"),
    "cpu": Device(
        name="this machine's CPU (2 cores, one rank per core)", gpus_per_node=2,
        flops={"float32": 40e9, "bfloat16": 10e9, "float16": 10e9},
        memory_bandwidth=6e9,
        intra=Link(1.0e9, 60e-6, 1.0), inter=Link(1.0e9, 60e-6, 1.0),
        matmul_efficiency=1.0, memory_efficiency=1.0, kernel_overhead=8e-6,
        source="measured by `bigbatch plan --calibrate` on this 2-core Intel Xeon (KVM) "
               "with one thread per rank; rerun it on another machine"),
}


def device(name: str) -> Device:
    """A ready entry by name (case-insensitive): h100, h200, a100, h100-hbm2e, cpu."""
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(f"--device {name!r}: not a known device; choose one of "
                          f"{', '.join(DEVICES)} or give --device-file")
    return DEVICES[key]


def _positive(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{where}: {key} = {value!r}, expected a number > 0")
    return float(value)


def _link(where: str, data: Any) -> Link:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table with bandwidth and latency")
    unknown = set(data) - {f.name for f in fields(Link)}
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    for key in ("bandwidth", "latency"):
        if key not in data:
            raise ConfigError(f"{where}: missing {key}")
    return Link(**{k: _positive(where, k, v) for k, v in data.items()})


def device_from_dict(data: Any, where: str) -> Device:
    """A `Device` from a dict of its fields, each checked (the error names file and key)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table of device fields")
    known = {f.name for f in fields(Device)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; known: "
                          f"{', '.join(sorted(known))}")
    for key in ("flops", "memory_bandwidth", "intra", "inter"):
        if key not in data:
            raise ConfigError(f"{where}: missing {key}")
    flops = data["flops"]
    if not isinstance(flops, dict) or not flops:
        raise ConfigError(f"{where}: flops must be a table of dtype = FLOP/s")
    out: dict[str, Any] = {
        "name": str(data.get("name", where)),
        "flops": {str(k): _positive(where, f"flops.{k}", v) for k, v in flops.items()},
        "memory_bandwidth": _positive(where, "memory_bandwidth", data["memory_bandwidth"]),
        "intra": _link(f"{where} [intra]", data["intra"]),
        "inter": _link(f"{where} [inter]", data["inter"]),
        "source": str(data.get("source", "")),
    }
    for key in ("matmul_efficiency", "attention_efficiency", "memory_efficiency",
                "kernel_overhead"):
        if key in data:
            out[key] = _positive(where, key, data[key])
    if "gpus_per_node" in data:
        value = data["gpus_per_node"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: gpus_per_node = {value!r}, expected an integer >= 1")
        out["gpus_per_node"] = value
    return Device(**out)


def load_device(path: str | Path) -> Device:
    """A device file (TOML, or JSON when it ends in .json)."""
    path = Path(path)
    where = f"--device-file {path}"
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{where}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}"
                          f" ({e})") from None
    return device_from_dict(data, where)


def device_toml(dev: Device) -> str:
    """`dev` as a device file (TOML) `load_device` reads back."""
    def value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {value(getattr(dev, k))}" for k in
             ("name", "memory_bandwidth", "gpus_per_node", "matmul_efficiency",
              "attention_efficiency", "memory_efficiency", "kernel_overhead", "source")]
    lines += ["", "[flops]"] + [f"{k} = {v!r}" for k, v in dev.flops.items()]
    for name in ("intra", "inter"):
        link = getattr(dev, name)
        lines += ["", f"[{name}]", f"bandwidth = {link.bandwidth!r}",
                  f"latency = {link.latency!r}", f"efficiency = {link.efficiency!r}"]
    return "\n".join(lines) + "\n"

