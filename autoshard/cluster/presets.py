"""Data-sheet presets: devices, links and whole machines (``Cluster.preset(name)``), and this
machine's CPU processes over gloo."""

from __future__ import annotations

from typing import NamedTuple

from autoshard.cluster.specs import GiB, DeviceSpec, LinkSpec


class Preset(NamedTuple):
    device: DeviceSpec
    intra: LinkSpec  # the "gpu" mesh dim
    inter: LinkSpec  # the "node" mesh dim
    gpus_per_node: int
    description: str


# NVIDIA A100 Tensor Core GPU data sheet (SXM4): 312 TF bf16/fp16, 156 TF tf32, 19.5 TF fp32 dense;
# 40GB at 1,555 GB/s, 80GB at 2,039 GB/s. Memory in sheet GB (1e9); usable_fraction absorbs the rest.
_A100_FLOPS = {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12, "float16": 312e12}
A100_40GB = DeviceSpec("A100 SXM 40GB", _A100_FLOPS, memory_bandwidth=1.555e12, memory=40e9, optimizer="foreach")
A100_80GB = DeviceSpec("A100 SXM 80GB", _A100_FLOPS, memory_bandwidth=2.039e12, memory=80e9, optimizer="foreach")
# NVIDIA H100 / H200 data sheets (SXM): 989 TF bf16/fp16, 494 TF tf32, 67 TF fp32 dense;
# H100 80GB at 3.35 TB/s, H200 141GB at 4.8 TB/s.
_H100_FLOPS = {"float32": 67e12, "tf32": 494e12, "bfloat16": 989e12, "float16": 989e12}
# torch's AdamW on CUDA runs foreach (DeviceSpec.optimizer)
H100 = DeviceSpec("H100 SXM", _H100_FLOPS, memory_bandwidth=3.35e12, memory=80e9, optimizer="foreach")
H200 = DeviceSpec("H200 SXM", _H100_FLOPS, memory_bandwidth=4.8e12, memory=141e9, optimizer="foreach")

# NVLink 3 via NVSwitch: 600 GB/s per GPU both directions (A100 sheet) = 300 GB/s each way.
NVLINK3 = LinkSpec("NVLink 3", latency=3e-6, bandwidth=300e9)
# NVLink 4 via NVSwitch: 900 GB/s per GPU both directions (H100/H200 sheets) = 450 GB/s each way.
NVLINK4 = LinkSpec("NVLink 4", latency=3e-6, bandwidth=450e9)
# DGX A100 user guide: one ConnectX-6 200 Gb/s HDR NIC per GPU = 25 GB/s per GPU each way.
IB_HDR = LinkSpec("IB HDR", latency=8e-6, bandwidth=25e9)
# DGX H100 user guide: one ConnectX-7 400 Gb/s NDR NIC per GPU = 50 GB/s per GPU each way.
IB_NDR = LinkSpec("IB NDR", latency=8e-6, bandwidth=50e9)
# NERSC Perlmutter docs: 4 HPE Slingshot-11 NICs per GPU node, 200 Gb/s each = 25 GB/s per GPU.
SLINGSHOT11 = LinkSpec("Slingshot-11", latency=8e-6, bandwidth=25e9)
# Perlmutter's 4 A100s have no NVSwitch: 4 NVLink-3 links join each pair (NERSC docs), 12 links x
# 25 GB/s = 300 GB/s each way per GPU, which NCCL spreads over several rings.
NVLINK3_P2P = LinkSpec("NVLink 3 (4-GPU mesh)", latency=3e-6, bandwidth=300e9)


def cpu_device(procs_per_node: int = 2) -> DeviceSpec:
    """One CPU process on a small x86 host (this machine: 2 cores, ~24 GiB). Rough, meant to be
    replaced by ``Cluster.calibrate()``: ~50 GFLOP/s fp32 per core with AVX2 FMA, float64 at half
    rate (half the SIMD lanes), bf16/fp16 fall back to the fp32 rate (converted to fp32 without AMX);
    ~10 GB/s of DRAM bandwidth per process; host memory split evenly between the processes;
    ~10 us per eager op dispatch; AdamW parameter by parameter (torch's default on CPU)."""
    return DeviceSpec("cpu", {"float32": 50e9, "float64": 25e9}, memory_bandwidth=10e9,
                      memory=24 * GiB / procs_per_node, launch_overhead=10e-6, comm_overlap=0.0,
                      optimizer="for-loop")


# gloo over loopback TCP: ~50 us per message round, ~1-2 GB/s. The rate is already an achieved
# one (not a wire rate), hence efficiency 1.
LOOPBACK = LinkSpec("loopback (gloo)", latency=50e-6, bandwidth=1.5e9, efficiency=1.0)
# Between CPU hosts: gloo over 10 GbE = 1.25 GB/s wire rate; TCP round trips ~100 us. A guess.
ETHERNET_10G = LinkSpec("10GbE (gloo)", latency=100e-6, bandwidth=1.25e9)

PRESETS: dict[str, Preset] = {
    "dgx-a100-40gb": Preset(A100_40GB, NVLINK3, IB_HDR, 8, "DGX A100: 8x A100-40GB, NVSwitch, 8x HDR IB"),
    "dgx-a100-80gb": Preset(A100_80GB, NVLINK3, IB_HDR, 8, "DGX A100: 8x A100-80GB, NVSwitch, 8x HDR IB"),
    "dgx-h100": Preset(H100, NVLINK4, IB_NDR, 8, "DGX H100: 8x H100 SXM, NVSwitch, 8x NDR IB"),
    "hgx-h200": Preset(H200, NVLINK4, IB_NDR, 8, "HGX H200: 8x H200 SXM, NVSwitch, 8x NDR IB"),
    "perlmutter": Preset(A100_40GB, NVLINK3_P2P, SLINGSHOT11, 4,
                         "NERSC Perlmutter GPU node: 4x A100-40GB, NVLink 3, 4x Slingshot-11"),
    "cpu": Preset(cpu_device(2), LOOPBACK, ETHERNET_10G, 2, "this machine: 2 CPU processes, gloo"),
}
