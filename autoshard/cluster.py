"""The hardware a plan is made for: a device mesh, its links, and the cost formulas over them.

Every constant the cost model uses lives here, on a :class:`Cluster`, so a plan's numbers can be
traced back to one place (and one JSON file, :meth:`Cluster.to_json`).

>>> c = Cluster.preset("dgx-h100", nodes=2)
>>> c
Cluster(mesh=(2, 8) ('node', 'gpu'), device='H100 SXM', links=['IB NDR', 'NVLink 4'])
>>> round(c.collective_time("all_reduce", 2**30, "gpu") * 1e3, 3)   # ms, 1 GiB in the node
5.262
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from autoshard.errors import ClusterError

SCHEMA = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
OPTIMIZERS = ("foreach", "fused", "for-loop")   # DeviceSpec.optimizer: torch's AdamW implementations
GiB = 2**30


_RANGES = {
    "positive": (lambda v: 0 < v < math.inf, "a positive finite number"),
    "nonnegative": (lambda v: 0 <= v < math.inf, ">= 0"),
    "fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "share": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def _check(who: str, what: str, value: object, kind: str) -> float:
    test, wording = _RANGES[kind]
    # NaN fails every comparison, so it is rejected here instead of poisoning every cost later.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not test(value):
        raise ClusterError(f"{who}: {what} must be {wording}, got {value!r}")
    return float(value)


def _validate(spec: object, **kinds: str) -> None:
    """Range-check the named fields of a frozen spec and store them as floats, so 40e9 and
    40_000_000_000 (the same hardware) give the same JSON and compare equal."""
    who = f"{type(spec).__name__} {getattr(spec, 'name')!r}"
    for name, kind in kinds.items():
        object.__setattr__(spec, name, _check(who, name, getattr(spec, name), kind))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU process). Rates are vendor-sheet peaks; the efficiency
    fields turn them into achievable rates, so the sheet numbers stay recognisable.

    peak_flops: dense FLOP/s by dtype key ("float32", "tf32", "bfloat16", "float16", optionally
    "float64"); "float32" is required, since it is the fallback for every other dtype.
    compute_efficiency: large GEMMs reach ~60-80% of peak (docs/cost_model.md); 0.7 is the middle.
    memory_efficiency: streaming kernels reach ~80% of HBM bandwidth.
    usable_fraction: the CUDA context, allocator fragmentation and library workspaces take the rest.
    launch_overhead: the floor of any kernel, however small (launch + sync), in seconds.
    comm_overlap: the fraction of a block's compute time behind which its parameter gathers and
    gradient reductions can hide (1: GPUs run NCCL on their own streams and the runtime prefetches;
    0: every collective waits in line, as gloo on CPU processes does).
    optimizer: how the training step's ``torch.optim.AdamW`` runs here, which sets the optimizer
    step's time and temporaries (autoshard/costmodel.py, solver/memory.py): "foreach" (torch's
    default on CUDA: each of its ops over every parameter at once, a pass through memory each, and
    a temporary the size of the parameters), "fused" (``AdamW(fused=True)``: one kernel, no
    temporary) or "for-loop" (torch's default on CPU, ``foreach=False``: parameter by parameter).
    The vendor presets' GPUs say "foreach"; a spec says "for-loop" unless told, as a CPU's does.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)  # a dict is unhashable; the rest still hashes
    memory_bandwidth: float
    memory: float
    usable_fraction: float = 0.9
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    launch_overhead: float = 5e-6
    comm_overlap: float = 1.0
    optimizer: str = "for-loop"

    def __post_init__(self) -> None:
        who = f"DeviceSpec {self.name!r}"
        if self.optimizer not in OPTIMIZERS:
            raise ClusterError(f"{who}: optimizer must be one of {', '.join(map(repr, OPTIMIZERS))} (how torch runs "
                               f"AdamW: torch's default on CUDA, fused=True, or foreach=False), got {self.optimizer!r}")
        if not isinstance(self.peak_flops, dict) or "float32" not in self.peak_flops:
            raise ClusterError(f"{who}: peak_flops must be a dict with at least a 'float32' entry "
                               f"(FLOP/s), got {self.peak_flops!r}")
        # Copy so a caller mutating their dict cannot change a frozen spec behind its back.
        object.__setattr__(self, "peak_flops", {
            k: _check(who, f"peak_flops[{k!r}]", v, "positive") for k, v in self.peak_flops.items()})
        _validate(self, memory_bandwidth="positive", memory="positive", usable_fraction="fraction",
                  compute_efficiency="fraction", memory_efficiency="fraction", launch_overhead="nonnegative",
                  comm_overlap="share")

    def flops(self, dtype: torch.dtype | str) -> float:
        """Peak FLOP/s for ``dtype``. float32 uses the "float32" entry, not "tf32": TF32 is opt-in
        in PyTorch (``torch.backends.cuda.matmul.allow_tf32``), so pass "tf32" to ask for it.
        A dtype without an entry (integers, float64 on GPU presets, fp8) runs at the float32 rate."""
        key = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        return self.peak_flops.get(key, self.peak_flops["float32"])


@dataclass(frozen=True)
class LinkSpec:
    """The link one mesh dimension communicates over.

    latency: alpha, seconds per ring step. bandwidth: bytes/s per rank, each way (half the
    "bidirectional" figure vendors print). efficiency: NCCL's bus bandwidth reaches ~70-85% of
    the link rate (docs/cost_model.md), so 0.8.
    """

    name: str
    latency: float
    bandwidth: float
    efficiency: float = 0.8

    def __post_init__(self) -> None:
        _validate(self, latency="nonnegative", bandwidth="positive", efficiency="fraction")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


# --- presets ---------------------------------------------------------------------------------
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


# --- memory formulas (docs/cost_model.md) ------------------------------------------------------------
# Bytes per parameter of training state, by precision: the parameter as the model computes with
# it, its gradient, and the fp32 master copy that mixed precision keeps (fp32 training has none).
_STATE_BYTES = {"fp32": {"params": 4, "grads": 4, "master": 0},
                "bf16-mixed": {"params": 2, "grads": 2, "master": 4}}
# Optimizer state per parameter, kept in fp32: Adam/AdamW two moments, SGD with momentum one.
_OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4}


def training_state_bytes(num_params: float, precision: str = "fp32", optimizer: str = "adam", *,
                         fp32_grads: bool = False, breakdown: bool = False) -> float | dict[str, float]:
    """Bytes of parameters + gradients + master weights + optimizer state for ``num_params``
    parameters, unsharded (divide by the shards of a ZeRO/FSDP placement). Per parameter::

        fp32 training, Adam           4 param + 4 grad + 8 moments               = 16
        bf16 mixed precision, Adam    2 param + 2 grad + 4 fp32 master + 8 moments = 16

    ``fp32_grads``: gradients kept/reduced in fp32 under mixed precision (+2 bytes).
    ``breakdown``: a dict {params, grads, master, optimizer, total} instead of the total.

    >>> training_state_bytes(6.74e9, "bf16-mixed") / 1e9   # Llama-2 7B with AdamW: ~108 GB
    107.84
    """
    if precision not in _STATE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(_STATE_BYTES)}")
    if optimizer not in _OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(_OPTIMIZER_BYTES)}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    per = dict(_STATE_BYTES[precision], optimizer=_OPTIMIZER_BYTES[optimizer])
    if fp32_grads:
        per["grads"] = 4
    parts = {k: float(v * num_params) for k, v in per.items()}
    parts["total"] = sum(parts.values())
    return parts if breakdown else parts["total"]


def transformer_activation_bytes(hidden: int, heads: int, seq: int, batch: int, layers: int, *,
                                 recompute: bool = False, fused_attention: bool = False) -> float:
    """Activations a transformer saves for backward, 16-bit, no tensor/sequence parallelism
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    eq. 1; docs/cost_model.md). Per layer, per token::

        34 h + 5 a s     bytes   (h hidden, a heads, s sequence length)
        34 h             with fused attention (flash attention recomputes the a*s*s scores)
         2 h             with full recompute (only each layer's input is kept)

    times ``seq * batch * layers``. Counts the layers only, not embeddings or the loss.
    """
    for name, v in (("hidden", hidden), ("heads", heads), ("seq", seq), ("batch", batch), ("layers", layers)):
        if not _is_count(v):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if recompute:
        per_token = 2 * hidden
    else:
        per_token = 34 * hidden + (0 if fused_attention else 5 * heads * seq)
    return float(per_token * seq * batch * layers)


def calibration_path() -> Path:
    """Where :meth:`Cluster.local` looks for saved calibration: $AUTOSHARD_CALIBRATION, else
    ~/.cache/autoshard/calibration.json."""
    env = os.environ.get("AUTOSHARD_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "autoshard" / "calibration.json"


# --- the cluster -----------------------------------------------------------------------------
class Cluster:
    """An N-D device mesh: one :class:`DeviceSpec` for every rank, one :class:`LinkSpec` per mesh dim.

    ``ranks_per_node`` says how many ranks share a host (presets: the GPUs per node; default: all
    ranks on one host); it does not change any cost here and travels with the JSON.
    ``calibration``: what :meth:`calibrate` measured (raw figures and every per-collective fit),
    as a JSON-able dict, or None; it travels with the JSON (only when present). On a mesh dim
    whose size is the calibrated one, each collective kind with a fit of its own is priced by
    that fit (:meth:`collective_time`); the dim's LinkSpec prices the rest.
    """

    def __init__(self, mesh_shape: Sequence[int] | int, mesh_dim_names: Sequence[str] | None = None,
                 device: DeviceSpec | None = None, links: Sequence[LinkSpec] | None = None, *,
                 ranks_per_node: int | None = None, calibration: dict | None = None,
                 levels: Sequence[Sequence[tuple[int, LinkSpec]]] | None = None):
        shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
        if not shape:
            raise ClusterError("mesh_shape is empty; give at least one dimension, e.g. (world_size,)")
        for size in shape:
            if not _is_count(size):
                raise ClusterError(f"mesh_shape {shape} has entry {size!r}; every entry must be a "
                                   "positive int (use 1 for a dimension you do not split over)")
        self.mesh_shape: tuple[int, ...] = shape
        self.ndim = len(shape)
        self.world_size = math.prod(shape)

        if mesh_dim_names is None:
            names = tuple(f"d{i}" for i in range(self.ndim))
        else:
            names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if len(names) != self.ndim:
            raise ClusterError(f"mesh_dim_names {names} has {len(names)} names for a {self.ndim}-D mesh "
                               f"{shape}; give one name per dimension or none")
        if not all(isinstance(n, str) and n for n in names):
            raise ClusterError(f"mesh_dim_names {names} must be non-empty strings")
        if len(set(names)) != len(names):
            raise ClusterError(f"mesh_dim_names {names} has duplicates; each dimension needs its own name")
        self.mesh_dim_names: tuple[str, ...] = names

        self.device = cpu_device(self.world_size) if device is None else device
        if not isinstance(self.device, DeviceSpec):
            raise ClusterError(f"device must be a DeviceSpec, got {type(self.device).__name__}")
        self.links: tuple[LinkSpec, ...] = (LOOPBACK,) * self.ndim if links is None else tuple(links)
        if len(self.links) != self.ndim:
            raise ClusterError(f"{len(self.links)} links given for a {self.ndim}-D mesh {shape}; "
                               "give exactly one LinkSpec per mesh dimension")
        for link in self.links:
            if not isinstance(link, LinkSpec):
                raise ClusterError(f"links must be LinkSpec objects, got {type(link).__name__}")

        # levels[d]: the hardware levels mesh dim d spans, innermost first, as (ranks, link). A
        # logical dim that spans NVLink and the network (16 GPUs as one dim over 2 nodes) is priced
        # over both levels, hierarchically, not as its fast or its slow link alone.
        self.levels: tuple[tuple[tuple[int, LinkSpec], ...], ...] = (
            tuple(((p, l),) for p, l in zip(shape, self.links)) if levels is None
            else tuple(tuple((int(p), l) for p, l in lv) for lv in levels))
        if len(self.levels) != self.ndim or any(math.prod(p for p, _ in lv) != size
                                                for lv, size in zip(self.levels, shape)):
            raise ClusterError(f"levels {levels} do not multiply to the mesh shape {shape}; give, per mesh "
                               "dim, (ranks, LinkSpec) pairs whose ranks multiply to that dim's size")
        self.ranks_per_node = self.world_size if ranks_per_node is None else ranks_per_node
        if not _is_count(self.ranks_per_node):
            raise ClusterError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if calibration is not None and not isinstance(calibration, dict):
            raise ClusterError(f"calibration must be a dict (JSON-able) or None, got {type(calibration).__name__}")
        self.calibration: dict | None = calibration
        self._fitted = _fitted_links(calibration, shape, self.levels)

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def local(cls, world_size: int, mesh_shape: Sequence[int] | None = None) -> Cluster:
        """CPU processes on this machine talking over gloo. Uses the saved calibration
        (:func:`calibration_path`) when there is one, else the rough "cpu" defaults."""
        if not _is_count(world_size):
            raise ClusterError(f"world_size must be a positive int, got {world_size!r}")
        shape = (world_size,) if mesh_shape is None else tuple(mesh_shape)
        if math.prod(shape) != world_size:
            raise ClusterError(f"mesh_shape {shape} holds {math.prod(shape)} ranks but world_size is "
                               f"{world_size}; pick a shape whose entries multiply to {world_size}")
        path = calibration_path()
        if os.environ.get("AUTOSHARD_CALIBRATION") and not path.is_file():
            # An explicit path that is missing is a mistake; planning on defaults would hide it.
            raise ClusterError(f"AUTOSHARD_CALIBRATION={path} does not exist; unset it or run calibration")
        if not path.is_file():
            return cls(shape, ranks_per_node=world_size)
        try:
            saved = cls.from_json(path.read_text())
        except ClusterError as e:
            raise ClusterError(f"calibration file {path}: {e}; delete it or re-run calibration") from e
        mesh = saved.with_mesh(shape)
        device = mesh.device
        if (saved.calibration or {}).get("device_type") == "cpu":
            # A CPU calibration measured host memory split over its ranks; split it over these.
            device = replace(device, memory=device.memory * saved.ranks_per_node / world_size)
        # local processes talk over gloo, and the emitted module waits on each collective in turn
        device = replace(device, comm_overlap=0.0)
        return cls(shape, mesh.mesh_dim_names, device, mesh.links, ranks_per_node=world_size,
                   calibration=mesh.calibration)

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> Cluster:
        """A vendor-sheet cluster: mesh (nodes, gpus_per_node) named ("node", "gpu")."""
        if name not in PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
        if not _is_count(nodes):
            raise ClusterError(f"nodes must be a positive int, got {nodes!r}")
        p = PRESETS[name]
        return cls((nodes, p.gpus_per_node), ("node", "gpu"), p.device, [p.inter, p.intra],
                   ranks_per_node=p.gpus_per_node)

    @classmethod
    def calibrate(cls, process_group=None, *, save: str | os.PathLike | None = None, **options) -> Cluster:
        """Measure the machine of a live process group (default WORLD): matmul FLOP/s, memory
        bandwidth, kernel launch floor, and alpha/beta of every collective per mesh dim by a
        least-squares fit. Call on every rank; all ranks get the same Cluster; ``save`` writes
        its JSON on rank 0. Details and ``options``: :func:`autoshard.calibrate.calibrate`."""
        from autoshard.calibrate import calibrate

        return calibrate(process_group, save=save, **options)

    def with_mesh(self, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] | None = None) -> Cluster:
        """Same hardware, another logical mesh (row-major over the ranks, as DeviceMesh lays it
        out): the innermost logical dim takes the innermost hardware level first, so (16,) over 2
        nodes of 8 spans NVLink x 8 then the network x 2, and (4, 4) gives the inner dim 4 GPUs of a
        node and the outer dim 2 GPUs x 2 nodes. A grid that does not factor so gets the slowest link
        on every dim (an upper bound)."""
        shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
        if shape == self.mesh_shape:
            # the same ranks on every dim: only the names (the roles a baseline gives) change, so
            # the calibration's per-dim fits still describe them (matched by position, not name)
            names = self.mesh_dim_names if mesh_dim_names is None else mesh_dim_names
            return Cluster(shape, names, self.device, self.links, ranks_per_node=self.ranks_per_node,
                           levels=self.levels, calibration=self.calibration)
        levels = _map_levels(shape, [lv for dim in reversed(self.levels) for lv in dim])
        if levels is None:  # the new grid does not factor over the hardware levels: bound it
            slowest = min(self.links, key=lambda l: (l.effective_bandwidth, -l.latency))
            levels = [((p, slowest),) for p in shape]
        slowest_of = lambda lv: min((l for _, l in lv), key=lambda l: (l.effective_bandwidth, -l.latency))  # noqa: E731
        links = [slowest_of(lv) if lv else self.links[-1] for lv in levels]
        return Cluster(shape, mesh_dim_names, self.device, links, ranks_per_node=self.ranks_per_node,
                       levels=[lv if lv else ((1, self.links[-1]),) for lv in levels])

    # --- costs -------------------------------------------------------------------------------
    @property
    def memory_limit(self) -> float:
        """Bytes a plan may use per device: ``device.memory * device.usable_fraction``."""
        return self.device.memory * self.device.usable_fraction

    def peak_flops(self, dtype: torch.dtype | str = torch.float32) -> float:
        """Vendor peak FLOP/s of one device for ``dtype`` (see :meth:`DeviceSpec.flops`)."""
        return self.device.flops(dtype)

    def compute_time(self, flops: float, nbytes: float, dtype: torch.dtype = torch.float32) -> float:
        """Roofline time of one kernel on one device, in seconds::

            max(flops / (peak(dtype) * compute_efficiency),
                nbytes / (memory_bandwidth * memory_efficiency)) + launch_overhead

        and exactly 0.0 for no work (ops that are views or no-ops launch nothing)."""
        if flops < 0 or nbytes < 0:
            raise ValueError(f"compute_time needs flops >= 0 and nbytes >= 0, got {flops}, {nbytes}")
        if flops == 0 and nbytes == 0:
            return 0.0
        d = self.device
        return max(flops / (d.flops(dtype) * d.compute_efficiency),
                   nbytes / (d.memory_bandwidth * d.memory_efficiency)) + d.launch_overhead

    def collective_time(self, kind: str, nbytes: float, mesh_dims: int | str | Sequence[int | str]) -> float:
        """Seconds for one collective over the ranks spanned by ``mesh_dims`` (ints or dim names).

        ``nbytes``: all_gather the gathered (output) size; reduce_scatter the input size;
        all_reduce and all_to_all the tensor size on each rank. One dim of p ranks, link alpha
        and B = bandwidth * efficiency (ring, the NCCL bus-bandwidth factors)::

            all_reduce                   2(p-1)/p * n/B + 2(p-1) alpha
            all_gather, reduce_scatter   (p-1)/p * n/B + (p-1) alpha
            all_to_all                   (p-1)/p * n/B + (p-1) alpha

        Several dims: hierarchical, the fastest link (highest B) innermost. With f the fastest dim
        (p_f ranks) and R the remaining dims, recursively::

            all_reduce(n, f+R)     = reduce_scatter(n, f) + all_reduce(n/p_f, R) + all_gather(n, f)
            reduce_scatter(n, f+R) = reduce_scatter(n, f) + reduce_scatter(n/p_f, R)
            all_gather(n, f+R)     = all_gather(n/p_f, R) + all_gather(n, f)

        so the slow links carry only 1/p_f of the data, and with equal links the bandwidth term
        equals the flat ring over all P ranks. all_to_all is a direct exchange (n/P bytes to each
        of P-1 peers); a peer whose slowest differing dim is d is reached over link d, and the
        levels are charged one after another (one port per rank, conservative)::

            all_to_all = sum_d c_d * (n/P/B_d + alpha_d),   c_d = (p_d - 1) * prod(p_e, e faster than d)

        which is the flat formula when all links are equal. p == 1 or n == 0 -> 0.0.

        On a calibrated mesh dim (:class:`Cluster`'s ``calibration``), each of these terms uses
        the (alpha, B) fitted for its own kind there, so it reproduces that kind's measured line
        ``a + b n``: gloo, for one, runs a reduce-scatter as an all-reduce, at an all-reduce's
        cost, not half of it. A hierarchical all-reduce's pieces take the reduce-scatter and
        all-gather fits of their dims.
        """
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective kind {kind!r}; known kinds: {', '.join(COLLECTIVES)}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        dims = self._resolve_dims(mesh_dims)
        # Fastest first; ties broken by lower latency, then the later (innermost) mesh dim.
        levels = sorted(((p, link, d) for d in dims for p, link in self.levels[d] if p > 1),
                        key=lambda t: (-t[1].effective_bandwidth, t[1].latency, -t[2]))
        if not levels or nbytes == 0:
            return 0.0
        if kind == "all_to_all":
            world, inner, total = math.prod(p for p, _, _ in levels), 1, 0.0
            for p, link, d in levels:
                link = self._fitted.get((d, kind), link)
                peers = (p - 1) * inner
                total += peers * (nbytes / world / link.effective_bandwidth + link.latency)
                inner *= p
            return total
        return _hierarchical(kind, float(nbytes), [
            (p, lambda k, d=d, link=link: self._fitted.get((d, k), link)) for p, link, d in levels])

    def _resolve_dims(self, mesh_dims: int | str | Sequence[int | str]) -> list[int]:
        items = [mesh_dims] if isinstance(mesh_dims, (int, str)) else list(mesh_dims)
        dims = []
        for item in items:
            if isinstance(item, str) and item in self.mesh_dim_names:
                dims.append(self.mesh_dim_names.index(item))
            elif isinstance(item, int) and not isinstance(item, bool) and -self.ndim <= item < self.ndim:
                dims.append(item % self.ndim)
            else:
                raise ClusterError(f"mesh dim {item!r} is not in mesh {self.mesh_shape} "
                                   f"{self.mesh_dim_names}; use 0..{self.ndim - 1} or a dim name")
        if len(set(dims)) != len(dims):
            raise ClusterError(f"mesh dims {items} name a dimension twice")
        return dims

    # --- serialization -----------------------------------------------------------------------
    def to_json(self) -> str:
        """Stable JSON (sorted keys, ``"schema": 1``): equal clusters give equal text."""
        doc = {"schema": SCHEMA, "mesh_shape": list(self.mesh_shape),
               "mesh_dim_names": list(self.mesh_dim_names), "ranks_per_node": self.ranks_per_node,
               "device": asdict(self.device), "links": [asdict(l) for l in self.links]}
        if self.calibration is not None:
            doc["calibration"] = self.calibration
        if any(lv != ((p, l),) for lv, p, l in zip(self.levels, self.mesh_shape, self.links)):
            doc["levels"] = [[[p, asdict(l)] for p, l in lv] for lv in self.levels]
        return json.dumps(doc, sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Cluster:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ClusterError(f"cluster JSON is corrupt ({e}); regenerate it with Cluster.to_json()") from e
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            got = doc.get("schema") if isinstance(doc, dict) else None
            raise ClusterError(f"cluster JSON has schema {got!r}, this autoshard reads schema {SCHEMA}; "
                               "regenerate it with Cluster.to_json()")
        try:
            return cls(doc["mesh_shape"], doc["mesh_dim_names"], DeviceSpec(**doc["device"]),
                       [LinkSpec(**l) for l in doc["links"]], ranks_per_node=doc["ranks_per_node"],
                       calibration=doc.get("calibration"),
                       levels=None if "levels" not in doc else
                       [[(p, LinkSpec(**l)) for p, l in lv] for lv in doc["levels"]])
        except (KeyError, TypeError) as e:
            raise ClusterError(f"cluster JSON is missing or has a malformed field ({e!r}); "
                               "regenerate it with Cluster.to_json()") from e

    def fingerprint(self) -> str:
        """First 16 hex chars of sha256(to_json()): names the hardware a plan was made for."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __repr__(self) -> str:
        return (f"Cluster(mesh={self.mesh_shape} {self.mesh_dim_names}, device={self.device.name!r}, "
                f"links={[l.name for l in self.links]})")


def _ring(kind: str, n: float, p: int, link: LinkSpec) -> float:
    """One ring collective over p ranks: the formulas in :meth:`Cluster.collective_time`."""
    if p == 1 or n == 0:
        return 0.0
    rounds = 2 if kind == "all_reduce" else 1
    return rounds * ((p - 1) / p * n / link.effective_bandwidth + (p - 1) * link.latency)


def _map_levels(shape, physical: list[tuple[int, LinkSpec]]):
    """Split the hardware levels (innermost first) over the logical dims (innermost first)."""
    remaining = list(physical)
    out: list[list[tuple[int, LinkSpec]]] = []
    for q in reversed(shape):
        mine = []
        while q > 1:
            if not remaining:
                return None
            p, link = remaining[0]
            take = math.gcd(p, q)
            if take == 1:
                return None
            mine.append((take, link))
            q //= take
            remaining[0] = (p // take, link)
            if remaining[0][0] == 1:
                remaining.pop(0)
        out.append(mine)
    return list(reversed(out))


def _fitted_links(calibration: dict | None, shape: tuple[int, ...], levels) -> dict[tuple[int, str], LinkSpec]:
    """{(mesh dim, kind): the ring LinkSpec of that kind's calibrated fit} for every dim that
    spans exactly the ranks calibrated on it (one hardware level of the calibrated size)."""
    dims = (calibration or {}).get("mesh_dims")
    if not isinstance(dims, list) or len(dims) != len(shape):
        return {}
    out = {}
    for d, dim in enumerate(dims):
        if not (isinstance(dim, dict) and dim.get("measured") and dim.get("size") == shape[d]
                and len(levels[d]) == 1):
            continue
        for kind, fit in (dim.get("fits") or {}).items():
            if kind in COLLECTIVES and "latency" in fit and "bandwidth" in fit:
                out[d, kind] = LinkSpec(f"calibrated {kind}", latency=fit["latency"], bandwidth=fit["bandwidth"],
                                        efficiency=1.0)
    return out


def _hierarchical(kind: str, n: float, levels: list) -> float:
    """all_reduce / all_gather / reduce_scatter over ``levels`` (fastest first), recursively;
    a level is (ranks, kind -> the LinkSpec that prices that kind there)."""
    (p, link), rest = levels[0], levels[1:]
    if not rest:
        return _ring(kind, n, p, link(kind))
    if kind == "all_reduce":
        return (_ring("reduce_scatter", n, p, link("reduce_scatter")) + _hierarchical("all_reduce", n / p, rest)
                + _ring("all_gather", n, p, link("all_gather")))
    if kind == "reduce_scatter":
        return _ring("reduce_scatter", n, p, link("reduce_scatter")) + _hierarchical("reduce_scatter", n / p, rest)
    return _hierarchical("all_gather", n / p, rest) + _ring("all_gather", n, p, link("all_gather"))
