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
from dataclasses import asdict, replace
from pathlib import Path

import torch

from autoshard.cluster.presets import LOOPBACK, PRESETS, cpu_device
from autoshard.cluster.specs import COLLECTIVES, SCHEMA, DeviceSpec, LinkSpec, is_count
from autoshard.errors import ClusterError

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
            if not is_count(size):
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
        if not is_count(self.ranks_per_node):
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
        if not is_count(world_size):
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
        if not is_count(nodes):
            raise ClusterError(f"nodes must be a positive int, got {nodes!r}")
        p = PRESETS[name]
        return cls((nodes, p.gpus_per_node), ("node", "gpu"), p.device, [p.inter, p.intra],
                   ranks_per_node=p.gpus_per_node)

    @classmethod
    def calibrate(cls, process_group=None, *, save: str | os.PathLike | None = None, **options) -> Cluster:
        """Measure the machine of a live process group (default WORLD): matmul FLOP/s, memory
        bandwidth, kernel launch floor, and alpha/beta of every collective per mesh dim by a
        least-squares fit. Call on every rank; all ranks get the same Cluster; ``save`` writes
        its JSON on rank 0 (then :meth:`local` reads it through ``$AUTOSHARD_CALIBRATION``, or at
        :func:`calibration_path`). Details and ``options``: :func:`autoshard.cluster.calibrate.measure`."""
        import torch.distributed as dist

        from autoshard.cluster.calibrate import measure

        cluster = cls(**measure(process_group, **options))
        if save is not None:
            group = dist.group.WORLD if process_group is None else process_group
            if dist.get_rank(group) == 0:
                path = Path(save)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(cluster.to_json())
            dist.barrier(group=group)  # the file exists on return, on every rank
        return cluster

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

    def compute_time(self, flops: float, nbytes: float, dtype: torch.dtype = torch.float32,
                     launch: bool = True) -> float:
        """Roofline time of one kernel on one device, in seconds::

            max(flops / (peak(dtype) * compute_efficiency),
                nbytes / (memory_bandwidth * memory_efficiency)) + launch_overhead

        and exactly 0.0 for no work (ops that are views or no-ops launch nothing). ``launch=False``:
        work done inside another op's kernel (fused), without the launch."""
        if flops < 0 or nbytes < 0:
            raise ValueError(f"compute_time needs flops >= 0 and nbytes >= 0, got {flops}, {nbytes}")
        if flops == 0 and nbytes == 0:
            return 0.0
        d = self.device
        return max(flops / (d.flops(dtype) * d.compute_efficiency),
                   nbytes / (d.memory_bandwidth * d.memory_efficiency)) + (d.launch_overhead if launch else 0.0)

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
