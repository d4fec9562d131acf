"""Peak bytes of live tensor storage on this process, for CPU runs where no allocator keeps stats.

:class:`PeakMemory` is a ``TorchDispatchMode``: every op's outputs are counted by their
storage (views and in-place results share their base's storage and are counted once), and a
weak reference on each storage takes its bytes off when the storage dies, wherever that
happens (a saved activation freed by autograd, a gradient dropped by ``zero_grad``). Tensors
that exist before the mode starts (parameters, optimizer state, the batch) are added with
:meth:`PeakMemory.track`. The same idea as ``torch.distributed._tools.mem_tracker.MemTracker``,
without its per-module bookkeeping, so it costs little enough to wrap a whole training step::

    >>> import torch
    >>> from autoshard.memtrack import PeakMemory
    >>> w = torch.zeros(256)                      # 1 KiB that already exists
    >>> with PeakMemory() as mem:
    ...     mem.track([w])
    ...     a = torch.ones(1024)                  # +4 KiB
    ...     b = a * 2                             # +4 KiB
    ...     del a, b
    ...     c = torch.ones(512)                   # +2 KiB, after 8 KiB were freed
    >>> mem.peak, mem.current
    (9216, 3072)

Storage bytes are what the tensors hold, not what the allocator reserved (no caching or
fragmentation); that is the quantity a plan's per-device memory predicts. A storage that a
collective or a C++ kernel allocates without dispatching an op in this thread is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemory"]


class PeakMemory(TorchDispatchMode):
    """Counts live storages (see the module docstring); ``peak`` and ``current`` in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}   # id(storage) -> [weakref, bytes counted]
        self.current = 0
        self.peak = 0
        self.peak_op: str | None = None   # the op whose outputs set the peak (where to look)
        self._op: str | None = None

    def track(self, tensors: Iterable) -> None:
        """Count tensors that already exist (each storage once); None and non-tensors are skipped."""
        self._op = "tracked"
        for t in tree_leaves(list(tensors)):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def live(self) -> list[int]:
        """Bytes of every storage live now, largest first."""
        return sorted((n for ref, n in self._live.values() if ref() is not None), reverse=True)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak, self.peak_op = self.current, None

    def _add(self, t: torch.Tensor) -> None:
        if hasattr(t, "_local_tensor"):          # a DTensor holds its bytes in its local shard
            t = t._local_tensor
        if t.device.type == "meta" or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return
        st = t.untyped_storage()
        key, nbytes = id(st), st.nbytes()
        entry = self._live.get(key)
        if entry is None or entry[0]() is not st:
            entry = self._live[key] = [weakref.ref(st, lambda _, k=key: self._free(k)), 0]
        # an out= kernel may have grown a storage that was counted empty
        self.current += nbytes - entry[1]
        entry[1] = nbytes
        if self.current > self.peak:
            self.peak, self.peak_op = self.current, self._op

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
