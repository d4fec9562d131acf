"""Run a function on N local processes joined in a torch.distributed process group.

Used by the tests, the demo and the benchmarks. A rank that raises, dies or hangs never
hangs the caller: every child is reaped and :class:`DistributedRunError` says which rank
failed and why. Example::

    import torch, torch.distributed as dist
    from autoshard.runtime.launch import run_local

    def job(scale):                     # module level, so the ranks can import it
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return scale * t.item()

    if __name__ == "__main__":
        assert run_local(job, 2, 10.0) == [30.0, 30.0]
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from datetime import timedelta

from autoshard.errors import AutoshardError

__all__ = ["DistributedRunError", "free_port", "run_local"]


class DistributedRunError(AutoshardError, RuntimeError):
    """A rank of :func:`run_local` raised, died or did not finish in time. ``errors`` maps
    each failing rank to its traceback (or cause); ``missing`` lists ranks that had not
    reported when the job was torn down."""

    def __init__(self, message: str, errors: dict[int, str], missing: list[int]):
        super().__init__(message)
        self.errors, self.missing = errors, missing


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, backend, pg_timeout, q, environ, job):
    status, payload, inited = "load_error", "", False
    try:
        # a rank forks from the server (below), not from the caller: it takes the caller's
        # environment as it is now, as a spawned process would, before the job's module imports
        os.environ.clear()
        os.environ.update(environ)
        fn, args = pickle.loads(job)
        status = "init_error"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        inited, status = True, "error"
        payload = pickle.dumps(fn(*args))  # pickled here so an unpicklable result is an error
        status = "ok"
    except BaseException:  # noqa: BLE001 - SystemExit/KeyboardInterrupt are reported too
        payload = traceback.format_exc()
    finally:
        q.put((rank, status, payload))
        if inited:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# Ranks fork from one server process that imported these once, instead of each importing torch
# and autoshard anew (about 3 s of CPU per rank; a test suite starts hundreds of ranks). The
# server starts on the first launch; each rank then takes the environment, working directory and
# sys.path of its own launch, but shares the server's hash seed and the modules it imported.
PRELOAD = ["torch", "torch.distributed", "autoshard.api", "autoshard.runtime.checkpoint"]


def _context(start_method: str):
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={start_method!r}: use 'forkserver' (the default) or 'spawn'")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set env vars while a rank is spawned: a fresh interpreter reads some at start."""
    old = os.environ.copy()
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(old)


def _reap(procs, grace: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10.0)


def _collect(procs, q, deadline):
    """Read reports until all ranks succeeded, one failed, one died silently, or deadline."""
    results, errors, dead_since = {}, {}, {}
    while len(results) < len(procs) and not errors:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, status, payload = q.get(timeout=min(0.1, deadline - now))
        except queue.Empty:
            for r, p in enumerate(procs):  # exited without a report (after a grace for in-flight data)
                if r not in results and p.exitcode is not None:
                    if now - dead_since.setdefault(r, now) > 1.0:
                        errors[r] = ("died", _died(p.exitcode))
            continue
        _record(results, errors, rank, status, payload)
    if errors:  # a rank's "connection reset" is often the echo of a peer that crashed, and a
        # fault in the job itself reaches every rank at once: a second's grace names them too
        # (a rank's queue flushes before it exits: one that exited and left nothing died silently)
        end = min(deadline, time.monotonic() + 1.0)
        waiting = lambda: [r for r in range(len(procs)) if r not in results and r not in errors]  # noqa: E731
        while waiting() and time.monotonic() < end:
            try:
                _record(results, errors, *q.get(timeout=0.05))
            except queue.Empty:
                if all(procs[r].exitcode is not None for r in waiting()):
                    break
        with contextlib.suppress(queue.Empty):
            while True:
                _record(results, errors, *q.get_nowait())
        for r in waiting():
            if procs[r].exitcode not in (None, 0):
                errors[r] = ("died", _died(procs[r].exitcode))
    return results, errors


def _record(results, errors, rank, status, payload) -> None:
    if status == "ok":
        results[rank] = pickle.loads(payload)
    else:
        errors[rank] = (status, payload)


def _died(exitcode: int) -> str:
    how = f" ({signal.Signals(-exitcode).name})" if exitcode < 0 and -exitcode in signal.valid_signals() else ""
    return f"process exited with code {exitcode}{how} without reporting"


def run_local(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo",
              pg_timeout: float = 120.0, env: dict[str, str] | None = None,
              start_method: str = "forkserver") -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks; return their results by rank.

    ``fn`` must be a picklable module-level function; the rank is
    ``torch.distributed.get_rank()``. ``timeout`` bounds the whole job, ``pg_timeout`` each
    collective. Raises DistributedRunError on any failure, after reaping every child.

    ``env`` adds to the caller's environment. Ranks fork from a server that imported torch and
    autoshard when the first launch started it: variables read when the interpreter starts
    (``PYTHONHASHSEED``) or those modules import (``TORCH_LOGS``) keep that launch's values, and
    every rank has the server's hash seed. ``start_method="spawn"`` starts each rank from a fresh
    interpreter (about 1.5 s more per launch) that reads them anew.
    """
    ctx = _context(start_method)
    job = pickle.dumps((fn, args))   # loaded in the rank once its environment is in place
    deadline = time.monotonic() + timeout
    for attempt in range(2):
        port, q, procs = free_port(), ctx.Queue(), []
        try:
            for rank in range(world_size):
                environ = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **(env or {})}
                p = ctx.Process(target=_worker, args=(rank, world_size, backend, pg_timeout, q, environ, job),
                                name=f"autoshard-rank{rank}", daemon=True)
                with _environ(environ) if start_method == "spawn" else contextlib.nullcontext():
                    p.start()
                procs.append(p)
            results, errors = _collect(procs, q, deadline)
            if not errors and len(results) == world_size:
                for p in procs:  # all reported: they exit on their own, stragglers get reaped
                    p.join(max(0.1, min(10.0, deadline - time.monotonic())))
                return [results[r] for r in range(world_size)]
        finally:
            _reap(procs)
            q.close()
        in_use = [e for s, e in errors.values() if s == "init_error" and
                  ("EADDRINUSE" in e or "address already in use" in e.lower())]
        if not (attempt == 0 and in_use):
            break
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    name = getattr(fn, "__qualname__", repr(fn))
    lines = [f"run_local({name}, world_size={world_size}) failed:"]
    for r, (status, text) in sorted(errors.items()):
        what = {"load_error": "could not load the job (its module must import in a fresh process)",
                "init_error": "failed in init_process_group", "died": "died"}.get(status, "raised")
        lines.append(f"--- rank {r} {what}:\n{text.rstrip()}")
    if missing:
        why = f"timed out after {timeout:g}s" if not errors else "were terminated"
        lines.append(f"--- ranks {missing} had not reported ({why})")
    raise DistributedRunError("\n".join(lines), {r: t for r, (_, t) in errors.items()}, missing)
