"""The hardware table of the cost model: per-device compute, memory and links, one entry per device kind.

Each constant names its source: vendor datasheets, the cluster table of the Nereus paper (arXiv
2609.34645; "paper" below) or a measurement on this machine (`cpu`). Bandwidths are bytes/s in ONE direction;
vendors quote NVLink and Infinity Fabric as the sum of both directions, so those are halved here.
``inter_node_bandwidth`` is what one node's NICs carry together; a device's share is that divided by
``devices_per_node`` when the whole node talks at once (the normal case for DP gradient sync).

`cpu` is this machine: 8 virtual XLA devices (``--xla_force_host_platform_device_count=8``) on 2 shared
cores. It is modelled as ONE shared compute unit (``shared_compute``): a stage's FLOPs divide by the
host's rate however many devices it spans, and every device a program runs on adds launch overhead.

    from nereus_jax.elastic.hardware import get_hardware
    hw = get_hardware("h200")
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Efficiency classes of the cost model (see costs/model.py): one learned efficiency each.
EFFICIENCY_CLASSES = ("gemm", "attention", "memory", "collective_intra", "collective_inter", "host", "overhead")
# An efficiency never measured on a hardware starts here (fraction of peak): pessimistic on purpose.
CONSERVATIVE_EFFICIENCY = 0.3
_GB = 1e9
_GIB = 2**30


class HardwareError(ValueError):
    """An unknown hardware name (the message lists the table's entries)."""


@dataclass(frozen=True)
class Hardware:
    """One device kind: what a single device can do and how devices connect."""

    name: str
    description: str
    memory_bytes: int  # per device
    peak_flops: float  # dense bf16 FLOP/s per device (cpu: float32, the whole host)
    memory_bandwidth: float  # device memory bytes/s per device (cpu: the whole host)
    devices_per_node: int
    intra_node_bandwidth: float  # bytes/s per device per direction inside a node
    inter_node_bandwidth: float  # bytes/s per NODE per direction (all NICs of a node)
    host_bandwidth: float  # device <-> host memory bytes/s per device per direction (offload)
    intra_node_latency_s: float  # per collective hop
    inter_node_latency_s: float
    launch_overhead_s: float  # per program launch
    launch_overhead_per_device_s: float  # added per device of the program (shared_compute only)
    layer_overhead_s: float  # per layer per launch (kernel launches, scan steps)
    workspace_bytes: int  # per device: compiler/library workspace and fragmentation
    shared_compute: bool = False  # devices time-slice one host's cores (cpu)
    fused_attention: bool = True  # fused kernel: no [t, s] scores kept, causal half skipped
    efficiency: Mapping[str, float] = field(default_factory=dict)  # measured (class -> fraction of peak)
    # measured n_1/2 per size term (costs.latency.SIZE_TERMS): the call size at which half the large-call
    # efficiency is reached; unmeasured terms start at 0 (no size effect) with the cost model's prior spread
    half_sizes: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.efficiency) - set(EFFICIENCY_CLASSES)
        assert not unknown, f"{self.name}: unknown efficiency classes {sorted(unknown)}"
        object.__setattr__(self, "efficiency", MappingProxyType(dict(self.efficiency)))
        object.__setattr__(self, "half_sizes", MappingProxyType(dict(self.half_sizes)))

    def inter_node_bandwidth_per_device(self) -> float:
        """A device's share of its node's NICs when every device of the node communicates."""
        return self.inter_node_bandwidth / self.devices_per_node

    def prior_efficiency(self, op_class: str) -> float:
        """The efficiency a cost model starts from: measured here if known, else conservative."""
        assert op_class in EFFICIENCY_CLASSES, op_class
        return self.efficiency.get(op_class, CONSERVATIVE_EFFICIENCY if op_class != "overhead" else 1.0)


H100 = Hardware(
    name="h100",
    description="NVIDIA H100 SXM5 80GB, 8 per node (DGX H100), NVLink 4, 8x 400 Gb/s NDR InfiniBand",
    memory_bytes=80 * 10**9,  # H100 SXM5 datasheet: 80 GB HBM3
    peak_flops=989.4e12,  # datasheet: 1,979 TFLOPS bf16 with sparsity -> 989.4 dense
    memory_bandwidth=3.35e12,  # datasheet: 3.35 TB/s HBM3
    devices_per_node=8,  # DGX H100
    intra_node_bandwidth=450 * _GB,  # datasheet: NVLink 4 900 GB/s both directions -> 450 per direction
    inter_node_bandwidth=8 * 50 * _GB,  # DGX H100: 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU per direction
    host_bandwidth=64 * _GB,  # PCIe Gen5 x16: 64 GB/s per direction (nominal)
    intra_node_latency_s=5e-6,  # estimate: NCCL small-message all-reduce step over NVLink
    inter_node_latency_s=10e-6,  # estimate: InfiniBand RDMA round trip plus NCCL overhead
    launch_overhead_s=20e-6,  # estimate: XLA:GPU program dispatch
    launch_overhead_per_device_s=0.0,
    layer_overhead_s=30e-6,  # estimate: ~10 kernel launches per decoder layer at ~3 us
    workspace_bytes=2 * _GIB,  # estimate: cuBLAS/XLA workspace plus allocator fragmentation
)

H200 = Hardware(
    name="h200",
    description="NVIDIA H200 SXM 141GB, 8 per node, NVLink 4, 1x HDR InfiniBand per node (paper cluster #3)",
    memory_bytes=141 * 10**9,  # H200 datasheet and paper cluster #3: 141 GB HBM3e
    peak_flops=989.4e12,  # H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity -> 989.4 dense
    memory_bandwidth=4.8e12,  # datasheet: 4.8 TB/s HBM3e
    devices_per_node=8,  # paper cluster #3: 8 nodes / 64 GPUs
    intra_node_bandwidth=450 * _GB,  # paper: NVLink 4.0 900 GB/s (both directions) -> 450 per direction
    inter_node_bandwidth=25 * _GB,  # paper cluster #3: 1x HDR InfiniBand, 25+25 GB/s per node
    host_bandwidth=64 * _GB,  # PCIe Gen5 x16: 64 GB/s per direction (nominal)
    intra_node_latency_s=5e-6,  # estimate, as h100
    inter_node_latency_s=10e-6,  # estimate, as h100
    launch_overhead_s=20e-6,  # estimate, as h100
    launch_overhead_per_device_s=0.0,
    layer_overhead_s=30e-6,  # estimate, as h100
    workspace_bytes=2 * _GIB,  # estimate, as h100
)

A100 = Hardware(
    name="a100",
    description="NVIDIA A100 SXM4 64GB, 4 per node, NVLink 3, 4x HDR100 InfiniBand (paper cluster #2)",
    memory_bytes=64 * 10**9,  # paper cluster #2: 4 NVIDIA A100, 64 GB
    peak_flops=312e12,  # A100 datasheet: 312 TFLOPS bf16 dense
    memory_bandwidth=1.63e12,  # estimate: 4 of the 80 GB part's 5 HBM2e stacks (2.039 TB/s x 4/5)
    devices_per_node=4,  # paper cluster #2: 64 nodes / 256 GPUs
    intra_node_bandwidth=300 * _GB,  # paper: NVLink 3.0 600 GB/s (both directions) -> 300 per direction
    inter_node_bandwidth=4 * 12.5 * _GB,  # paper: 4x HDR100 InfiniBand, 12.5+12.5 GB/s each
    host_bandwidth=32 * _GB,  # PCIe Gen4 x16: 32 GB/s per direction (nominal)
    intra_node_latency_s=6e-6,  # estimate
    inter_node_latency_s=12e-6,  # estimate
    launch_overhead_s=20e-6,  # estimate
    launch_overhead_per_device_s=0.0,
    layer_overhead_s=30e-6,  # estimate
    workspace_bytes=2 * _GIB,  # estimate
)

MI250X = Hardware(
    name="mi250x",
    description="AMD MI250X, one GCD (64 GB), 8 GCDs per node, Infinity Fabric, 4x Slingshot-11 (cluster #1)",
    memory_bytes=64 * 10**9,  # paper cluster #1 and AMD datasheet: 128 GB HBM2e per MI250X = 64 per GCD
    peak_flops=191.5e12,  # AMD datasheet: 383 TFLOPS bf16 per MI250X (2 GCDs)
    memory_bandwidth=1.6384e12,  # AMD datasheet: 3.2768 TB/s per MI250X (2 GCDs)
    devices_per_node=8,  # paper cluster #1: 128 nodes / 1,024 GCDs
    intra_node_bandwidth=200 * _GB,  # paper: Infinity Fabric 400 GB/s (both directions) -> 200
    inter_node_bandwidth=4 * 25 * _GB,  # paper: 4x Slingshot-11, 25+25 GB/s each
    host_bandwidth=36 * _GB,  # Frontier node: CPU-GCD Infinity Fabric 36+36 GB/s
    intra_node_latency_s=8e-6,  # estimate: RCCL over Infinity Fabric
    inter_node_latency_s=15e-6,  # estimate: Slingshot
    launch_overhead_s=30e-6,  # estimate: HIP launches are slower than CUDA's
    launch_overhead_per_device_s=0.0,
    layer_overhead_s=40e-6,  # estimate
    workspace_bytes=2 * _GIB,  # estimate
)

# `cpu`: the "measured" constants are measurements on this machine (AMD EPYC, 2 cores, 23 GiB RAM, jax 0.12,
# 8 virtual devices); the figures they come from, with their dates, are in docs/results.md ("Figures moved from
# code comments"). The 8 devices share the cores (their aggregate matmul rate is one device's), and the peak is
# the quiet host's rate: other jobs' load slows the same matmul several times over.
CPU = Hardware(
    name="cpu",
    description="this machine: 8 virtual XLA CPU devices sharing 2 cores (shared compute)",
    memory_bytes=2 * _GIB,  # measured host RAM 23 GiB / 8 devices, leaving room for the host process
    peak_flops=4.4e11,  # measured: f32 matmul, whole host, quiet (see above)
    memory_bandwidth=5.0e9,  # measured: elementwise stream, whole host
    devices_per_node=8,  # one process sees all 8 devices
    intra_node_bandwidth=2.8e9,  # measured: all-reduce bus bandwidth over the 8 devices (memcpy)
    inter_node_bandwidth=8 * 2.8e9,  # one node only; set equal to intra so it never matters
    host_bandwidth=5.0e9,  # measured: memcpy rate (device memory is host memory)
    intra_node_latency_s=25e-6,  # measured: per-device launch cost of a collective program
    inter_node_latency_s=25e-6,
    launch_overhead_s=5e-6,  # measured: trivial program on 1 device
    launch_overhead_per_device_s=27e-6,  # measured: (220 - 4) us / 8 devices
    layer_overhead_s=1.8e-6,  # measured: per scan step per device ((14.4 us on 8 devices) / 8)
    workspace_bytes=16 * 2**20,  # XLA:CPU scratch beyond the modelled buffers: measured -4 to +30 MiB (results.md)
    shared_compute=True,
    fused_attention=False,  # our XLA einsum attention materialises [t, s] scores in float32
    efficiency={"gemm": 1.0, "memory": 1.0, "collective_intra": 1.0, "host": 1.0},  # peaks are measurements
    # measured: [R, 512] @ [512, 1536] f32 (the bench_cost_model MLP), CPU time over the 2 cores, R = 32 to
    # 1,024 rows: n_1/2 ~ 25 rows
    half_sizes={"gemm_rows": 25.0},
)

HARDWARE: Mapping[str, Hardware] = MappingProxyType({hw.name: hw for hw in (H100, H200, A100, MI250X, CPU)})


def get_hardware(name: str) -> Hardware:
    """The table entry ``name`` (h100, h200, a100, mi250x, cpu); unknown names list the valid ones."""
    key = name.strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    close = difflib.get_close_matches(key, list(HARDWARE), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise HardwareError(f"unknown hardware '{name}'{hint}; valid: {', '.join(HARDWARE)}")
