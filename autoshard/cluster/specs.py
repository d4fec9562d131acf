"""What one device and one link are: the specs a Cluster is built from, checked on construction."""


import math
from dataclasses import dataclass, field

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


def is_count(value: object) -> bool:
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
    step's time and temporaries (autoshard/cluster/costmodel.py, solver/memory.py): "foreach" (torch's
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
