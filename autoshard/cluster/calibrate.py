"""Measure the machine a live process group runs on and describe it as a :class:`Cluster`.

Call on every rank of an initialized process group (gloo on CPUs, NCCL on GPUs)::

    cluster = Cluster.calibrate(save="calibration.json")   # every rank gets the same Cluster

Every rank measures at once, as in training (two processes on a two-core host share it). Each
figure is a median over repeats after warm-up, and every rank takes the slowest rank's figure
(``all_reduce(MAX)`` of the times), so all ranks build the same Cluster and plan the same way.

========== ===================================================================================
compute    fp32 ``A @ B`` at a few sizes n (CPU 256..1024, GPU 2048..8192): 2 n^3 / time; the
           best size's rate is ``peak_flops["float32"]`` (on GPUs also "tf32" and "bfloat16").
memory     ``dst.copy_(src)`` (bytes = read + write = 2 x size) and ``add(a, b, out=c)``
           (3 x size) on large tensors; the better rate is ``memory_bandwidth``.
launch     median time of a one-element in-place add: ``launch_overhead``; the same add on a
           replicated DTensor, less that: ``calibration["dtensor_op_overhead"]`` (what each op of
           an optimizer step over the emitted module's DTensor parameters pays on top).
links      per mesh dim (a 1-D mesh: the whole group), each of all_reduce, all_gather,
           reduce_scatter and all_to_all (a DTensor Shard(0) -> Shard(1), what the runtime
           issues) at 6 sizes from 64 KiB to 16 MiB (``n`` as in
           :meth:`Cluster.collective_time`), sampled round-robin over the sizes, fitted to
           ``t = a + b n`` by least squares weighted by 1/t (:func:`fit_line`).
========== ===================================================================================

A fitted line becomes a ring's (alpha, B) with the formula's factors (p ranks on the dim)::

    all_reduce                      t = 2(p-1) alpha + 2(p-1)/p n/B  ->  alpha = a / (2(p-1)),  B = 2(p-1)/p / b
    all_gather, reduce_scatter,     t =  (p-1) alpha +  (p-1)/p n/B  ->  alpha = a / (p-1),     B =  (p-1)/p / b
    all_to_all

Each kind keeps its own fit, and :meth:`Cluster.collective_time` prices each kind by it on that
mesh dim, since the kinds do not keep the ring's ratios on every backend (gloo runs a
reduce-scatter as an all-reduce: it costs an all-reduce, not half of one). The :class:`LinkSpec`
stored for a mesh dim is the **all-reduce** fit (what a kind without a fit, or a logical mesh that
regroups the ranks, is priced by), with ``efficiency = 1``: B is already an achieved rate. The
measured figures are achieved rates too, so the DeviceSpec has ``compute_efficiency =
memory_efficiency = 1``. Every fit (all four kinds, with its sizes, times and error) and every raw
figure is kept in ``cluster.calibration``, a dict that travels with :meth:`Cluster.to_json`.
A negative fitted intercept (noise on a fast link) is clamped to 0 and the line refitted through
the origin; the fit then says ``"clamped": true``. The sizes are then run once each, in turn
(``"mixed"``), and what that costs beyond the line is spread over the calls and added to the
intercept (``"switch"``, :func:`size_switch_latency`): the collectives of a step change size
from call to call, which a line fitted on repeated same-size calls does not see.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from autoshard import _torch
from autoshard.cluster.presets import LOOPBACK
from autoshard.cluster.specs import COLLECTIVES, DeviceSpec, LinkSpec
from autoshard.errors import ClusterError

KiB, MiB = 2**10, 2**20
MESSAGE_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
MATMUL_SIZES = {"cpu": (256, 512, 1024), "cuda": (2048, 4096, 8192)}
COPY_BYTES = {"cpu": 64 * MiB, "cuda": 1024 * MiB}
# A timed sample repeats the op back to back until it lasts about this long (a noisy VM needs
# tens of ms to give a sustained compute rate; a few ms hide a collective's timer granularity).
SAMPLE_S = {"compute": 20e-3, "comm": 5e-3}
REPEATS = 9
WARMUP = 3

__all__ = ["measure", "fit_line", "link_from_fit", "size_switch_latency", "time_collective", "MESSAGE_SIZES"]


# --- timing --------------------------------------------------------------------------------------
def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _median_times(fns: Sequence[Callable[[], object]], device: torch.device, group=None, *,
                  repeats: int = REPEATS, warmup: int = WARMUP, inner: int | None = None,
                  sample_s: float = SAMPLE_S["comm"]) -> list[float]:
    """Median seconds of one call of each of ``fns`` over ``repeats`` samples, after ``warmup`` calls.

    The samples go round-robin over ``fns`` (f0, f1, .., f0, f1, ..), so a load that comes and
    goes on a shared machine lands on every fn alike instead of bending the curve being fitted.
    A sample runs a fn ``inner`` times back to back (default: enough for ~``sample_s``, from a
    probe call). With a ``group``, a barrier lines the ranks up before each sample and the probe
    is agreed (MAX) over the group, so every rank runs the same number of collectives."""
    sync = _sync(device)
    inners = []
    for fn in fns:
        for _ in range(warmup):
            fn()
        sync()
        if inner is None:
            t0 = time.perf_counter()
            fn()
            sync()
            inners.append(time.perf_counter() - t0)
        else:
            inners.append(inner)
    if inner is None:
        probes = _agree(inners, group, device) if group is not None else inners
        inners = [max(1, min(1000, math.ceil(sample_s / max(t, 1e-9)))) for t in probes]
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, k, out in zip(fns, inners, samples):
            if group is not None:
                dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            sync()
            out.append((time.perf_counter() - t0) / k)
    return [statistics.median(x) for x in samples]


def _median_time(fn: Callable[[], object], device: torch.device, group=None, **kw) -> float:
    return _median_times([fn], device, group, **kw)[0]


def _agree(values: Sequence[float], group, device: torch.device, op=dist.ReduceOp.MAX) -> list[float]:
    """The element-wise MAX (or ``op``) of ``values`` over ``group``: every rank gets the same floats."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def _collective(kind: str, nbytes: int, group, device: torch.device) -> tuple[Callable[[], object], int]:
    """A closure running one ``kind`` collective of ``nbytes`` (``collective_time``'s n: the
    gathered size for all_gather, the input size for reduce_scatter, each rank's tensor for
    all_reduce and all_to_all) and the bytes it actually moves (rounded to p float32s)."""
    p = dist.get_world_size(group)
    numel = max(p, nbytes // 4 // p * p)
    full = torch.ones(numel, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), numel * 4
    if kind == "all_to_all":
        # as the emitted module runs it: a DTensor Shard(0) -> Shard(1) (on CPU process groups
        # DTensor gathers and chunks instead of calling all_to_all, at an all-gather's cost)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        numel = max(p * p, numel // (p * p) * p * p)
        mesh = DeviceMesh.from_group(group, device.type)
        dt = DTensor.from_local(torch.ones(p, numel // p, device=device), mesh, [Shard(0)], run_check=False)
        return (lambda: dt.redistribute(mesh, [Shard(1)]).to_local()), numel * 4
    part = torch.ones(numel // p, dtype=torch.float32, device=device)
    if kind == "all_gather":
        return (lambda: _torch.all_gather_flat(full, part, group)), numel * 4
    if kind == "reduce_scatter":
        return (lambda: _torch.reduce_scatter_flat(part, full, group)), numel * 4
    raise ValueError(f"unknown collective kind {kind!r}; known kinds: {', '.join(COLLECTIVES)}")


def time_collective(kind: str, nbytes: int, group=None, *, repeats: int = REPEATS) -> tuple[int, float]:
    """``(bytes, seconds)``: the median time of one ``kind`` collective of about ``nbytes`` on
    ``group`` (default WORLD), the max over its ranks. Call on every rank of the group."""
    group = dist.group.WORLD if group is None else group  # _median_time: None means "no group"
    device = _group_device(group)
    fn, actual = _collective(kind, nbytes, group, device)
    t = _median_time(fn, device, group, repeats=repeats)
    return actual, _agree([t], group, device)[0]


# --- fitting -------------------------------------------------------------------------------------
def fit_line(sizes: Sequence[float], times: Sequence[float]) -> dict:
    """Weighted least squares ``t = a + b n``, minimising ``sum (a + b n - t)^2 / t``.

    The 1/t weight treats timing noise as growing with the time measured (it does: a loaded
    host stretches a long collective more): plain least squares lets the 16 MiB point decide the
    intercept alone (alpha off by 10x), relative residuals (1/t^2) let the small messages decide
    the slope (the bandwidth of large messages off by 20-30% on this host, where the time per
    byte grows past ~1 MiB). ``a < 0`` is clamped to 0 (b refitted through the origin).
    Returns a, b, clamped, and the RMS relative error of the fit."""
    if len(sizes) != len(times) or len(sizes) < 2 or len(set(sizes)) < 2:
        raise ClusterError(f"a line needs times at 2 or more distinct sizes, got sizes {list(sizes)}")
    if not all(t > 0 and math.isfinite(t) for t in times):
        raise ClusterError(f"measured times must be positive and finite, got {list(times)}")
    w = [1.0 / t for t in times]
    s, sx, sy = sum(w), sum(wi * n for wi, n in zip(w, sizes)), sum(wi * t for wi, t in zip(w, times))
    sxx = sum(wi * n * n for wi, n in zip(w, sizes))
    sxy = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    b = (s * sxy - sx * sy) / (s * sxx - sx * sx)
    a = (sy - b * sx) / s
    clamped = a < 0
    if clamped:
        a, b = 0.0, sxy / sxx
    if not b > 0:
        raise ClusterError(f"collective times do not grow with message size (sizes {list(sizes)}, times "
                           f"{list(times)}): the machine was too noisy to calibrate; retry on an idle machine")
    err = math.sqrt(sum(((a + b * n) / t - 1) ** 2 for n, t in zip(sizes, times)) / len(sizes))
    return {"a": a, "b": b, "clamped": clamped, "rms_rel_err": err}


def size_switch_latency(sizes: Sequence[float], mixed: float, a: float, b: float) -> float:
    """Seconds each call pays on top of the line ``a + b n`` when the sizes change from call to
    call: ``max(0, (mixed - sum_i (a + b n_i)) / len(sizes))``, ``mixed`` the time of one call of
    each size in turn. The line is fitted on a size repeated back to back; a training step's
    collectives change size every call, and gloo pays for each change (measured on this host
    under load: six all-reduces of mixed sizes took 3x the sum of their same-size times). The
    priced intercept is ``a + switch``."""
    return max(0.0, (mixed - sum(a + b * n for n in sizes)) / len(sizes))


def _factors(kind: str, p: int) -> tuple[float, float]:
    """(latency factor, bandwidth factor) of the ring formula: t = lat * alpha + bw * n / B."""
    rounds = 2 if kind == "all_reduce" else 1
    return rounds * (p - 1), rounds * (p - 1) / p


def link_from_fit(kind: str, p: int, a: float, b: float, name: str) -> LinkSpec:
    """The ring LinkSpec whose ``kind`` formula over ``p`` ranks is the line ``a + b n``."""
    if p < 2:
        raise ClusterError(f"a link needs p >= 2 ranks to be measured, got p={p}")
    lat, bw = _factors(kind, p)
    return LinkSpec(name, latency=a / lat, bandwidth=bw / b, efficiency=1.0)


# --- the pieces ----------------------------------------------------------------------------------
def _group_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _matmul_rates(device: torch.device, group, sizes: Sequence[int], dtype: torch.dtype) -> dict[int, float]:
    times = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        times.append(_median_time(lambda: torch.mm(a, b, out=out), device, group, warmup=1,
                                  repeats=5, sample_s=SAMPLE_S["compute"]))
        del a, b, out
    times = _agree(times, group, device)
    return {n: 2 * n**3 / t for n, t in zip(sizes, times)}


def _memory_rates(device: torch.device, group, nbytes: int) -> dict[str, float]:
    numel = nbytes // 4
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    c = torch.empty(numel, device=device)
    kw = dict(warmup=1, repeats=5, sample_s=SAMPLE_S["compute"])
    copy = _median_time(lambda: c.copy_(a), device, group, **kw)
    add = _median_time(lambda: torch.add(a, b, out=c), device, group, **kw)
    copy, add = _agree([copy, add], group, device)
    return {"copy": 2 * numel * 4 / copy, "add": 3 * numel * 4 / add}  # read + write


def _launch_overhead(device: torch.device, group) -> float:
    x = torch.zeros(1, device=device)
    t = _median_time(lambda: x.add_(1.0), device, group, inner=200)
    return _agree([t], group, device)[0]


def _dtensor_overhead(device: torch.device, group, launch: float) -> float:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = DeviceMesh.from_group(group, device.type)
    x = DTensor.from_local(torch.zeros(1, device=device), mesh, [Replicate()], run_check=False)
    t = _median_time(lambda: x.add_(1.0), device, group, inner=200)
    return max(0.0, _agree([t], group, device)[0] - launch)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _device_memory(device: torch.device, ranks_per_node: int, group) -> float:
    if device.type == "cuda":
        mem = float(torch.cuda.get_device_properties(device).total_memory)
    else:  # host memory, split evenly between the ranks that share it
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_node
    return -_agree([-mem], group, device)[0]  # the smallest over ranks


def _dim_groups(group, mesh_shape: tuple[int, ...]) -> list:
    """For each mesh dim, the sub-group of this rank's mesh slice along it (row-major ranks)."""
    if len(mesh_shape) == 1:
        return [group]
    ranks = torch.tensor(dist.get_process_group_ranks(group)).reshape(mesh_shape)
    me = dist.get_rank()
    out = []
    for d in range(len(mesh_shape)):
        rows = ranks.movedim(d, -1).reshape(-1, mesh_shape[d]).tolist()
        row = next(r for r in rows if me in r)
        out.append(dist.new_group(row, use_local_synchronization=True) if len(row) > 1 else None)
    return out


def _measure_dim(group, p: int, device: torch.device, sizes: Sequence[int], repeats: int) -> dict:
    fits = {}
    for kind in COLLECTIVES:
        fn, _ = _collective(kind, max(sizes), group, device)
        for _ in range(WARMUP):  # the first large messages set up buffers and connections
            fn()
        fns, actual = zip(*(_collective(kind, n, group, device) for n in sizes))
        times = _median_times(fns, device, group, repeats=repeats)
        # one call of each size in turn, as a training step issues them (see size_switch_latency)
        (mixed,) = _median_times([lambda: [fn() for fn in fns]], device, group, repeats=repeats)
        fits[kind] = {"sizes": list(actual), "times": times, "mixed": mixed}
    return fits


# --- calibrate -----------------------------------------------------------------------------------
def _links(group, shape: tuple[int, ...], names: tuple[str, ...], device: torch.device,
           message_sizes: Sequence[int], repeats: int) -> tuple[list[LinkSpec], list[dict]]:
    """Per mesh dim, each collective kind timed on this rank's slice and fitted, every rank taking
    the slowest slice's times: the link of each dim (its all-reduce fit; a dim of one rank, which
    never communicates, the slowest measured link) and what was measured, for the JSON."""
    raw = []
    for d, sub in enumerate(_dim_groups(group, shape)):
        raw.append(_measure_dim(sub, shape[d], device, message_sizes, repeats) if shape[d] > 1 else None)
        if sub is not None and sub is not group:
            dist.destroy_process_group(sub)
    flat = [t for r in raw if r for kind in COLLECTIVES for t in [*r[kind]["times"], r[kind]["mixed"]]]
    flat = iter(_agree(flat, group, device))
    links, dims = [], []
    for d, r in enumerate(raw):
        if r is None:
            links.append(None)
            dims.append({"name": names[d], "size": shape[d], "measured": False})
            continue
        fits = {}
        for kind in COLLECTIVES:
            times = [next(flat) for _ in r[kind]["times"]]
            mixed = next(flat)
            fit = fit_line(r[kind]["sizes"], times)
            switch = size_switch_latency(r[kind]["sizes"], mixed, fit["a"], fit["b"])
            link = link_from_fit(kind, shape[d], fit["a"] + switch, fit["b"],
                                 f"calibrated {dist.get_backend(group)} {kind}")
            fits[kind] = {"sizes": r[kind]["sizes"], "times": times, **fit, "mixed": mixed, "switch": switch,
                          "latency": link.latency, "bandwidth": link.bandwidth}
        ar = fits["all_reduce"]
        links.append(LinkSpec(f"calibrated {dist.get_backend(group)} (p={shape[d]}, all_reduce fit)",
                              latency=ar["latency"], bandwidth=ar["bandwidth"], efficiency=1.0))
        dims.append({"name": names[d], "size": shape[d], "measured": True, "fits": fits})
    measured = [l for l in links if l is not None]
    spare = min(measured, key=lambda l: l.bandwidth) if measured else LOOPBACK
    links = [spare if l is None else l for l in links]
    return links, dims


def measure(process_group=None, *, mesh_shape: Sequence[int] | None = None,
            mesh_dim_names: Sequence[str] | None = None, message_sizes: Sequence[int] = MESSAGE_SIZES,
            repeats: int = REPEATS) -> dict:
    """Measure this process group's machine (see the module docstring for what and how): the
    keyword arguments of the :class:`~autoshard.cluster.cluster.Cluster` that describes it, which
    :meth:`Cluster.calibrate` builds.

    ``process_group``: default WORLD; must be initialized. ``mesh_shape`` (default: one dim of
    the whole group, named "d0" as :meth:`Cluster.local` names it) lays the group's ranks out
    row-major; each dim with more than one rank gets its own measured link, a dim of one rank
    the slowest measured link (it never communicates). Collective on every rank of the group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ClusterError("Cluster.calibrate needs an initialized process group (torch.distributed."
                           "init_process_group, or launch with torchrun / autoshard.launch.run_local)")
    group = dist.group.WORLD if process_group is None else process_group
    world = dist.get_world_size(group)
    shape = (world,) if mesh_shape is None else tuple(mesh_shape)
    if math.prod(shape) != world:
        raise ClusterError(f"mesh_shape {shape} holds {math.prod(shape)} ranks but the process group has "
                           f"{world}; pick a shape whose entries multiply to {world}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"d{i}" for i in range(len(shape)))
    device = _group_device(group)

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    ranks_per_node = hosts.count(hosts[0])

    # Compute, memory, launch: the whole group at once.
    dtypes = {"float32": torch.float32}
    if device.type == "cuda":
        dtypes |= {"tf32": torch.float32, "bfloat16": torch.bfloat16}
    matmul = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for key, dtype in dtypes.items():
            torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
            matmul[key] = _matmul_rates(device, group, MATMUL_SIZES[device.type], dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    memory = _memory_rates(device, group, COPY_BYTES[device.type])
    launch = _launch_overhead(device, group)
    dtensor = _dtensor_overhead(device, group, launch)
    capacity = _device_memory(device, ranks_per_node, group)

    links, dims = _links(group, shape, names, device, message_sizes, repeats)

    base = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    # gloo on CPU processes: the emitted module waits on each collective where the graph needs
    # it, so nothing hides behind compute (NCCL streams keep the DeviceSpec default). On CUDA
    # torch's AdamW runs foreach, as the vendor presets say; on CPU parameter by parameter
    # (DeviceSpec's default)
    per_type = {"comm_overlap": 0.0} if device.type == "cpu" else {"optimizer": "foreach"}
    spec = DeviceSpec(f"calibrated {device.type}: {base}",
                      {k: max(rates.values()) for k, rates in matmul.items()},
                      memory_bandwidth=max(memory.values()), memory=capacity,
                      compute_efficiency=1.0, memory_efficiency=1.0, launch_overhead=launch, **per_type)
    calibration = {
        "backend": dist.get_backend(group), "device_type": device.type, "world_size": world,
        "ranks_per_node": ranks_per_node, "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
        "matmul_flops": {k: {str(n): v for n, v in rates.items()} for k, rates in matmul.items()},
        "memory_bandwidth": memory, "launch_overhead": launch, "dtensor_op_overhead": dtensor, "mesh_dims": dims,
        "link_is": "the all_reduce fit of each mesh dim; every kind is priced by its own fit",
    }
    return {"mesh_shape": shape, "mesh_dim_names": names, "device": spec, "links": links,
            "ranks_per_node": min(ranks_per_node, world), "calibration": calibration}
