"""Training-loop cases run inside real gloo processes (module level so spawned ranks import them).

One *setup* (model, mesh, constraints, precision policy) is compiled once and runs two loops,
each against the same loop on a single device in this process under the same policy:

* ``steps``: 3 optimizer steps of AdamW under a LambdaLR schedule with
  ``torch.nn.utils.clip_grad_norm_`` over the compiled module's parameters; per step the loss,
  the largest deviation of any gradient and the clipped norm, and the parameters after the last step.
* ``accum``: one SGD step over K = 4 micro-batches, the first three inside ``no_sync()``
  (and again with ``module.grad_accumulation = 4``, what ``compile(grad_accumulation=4)`` sets,
  instead of ``no_sync``), clipped with ``module.clip_grad_norm_``; the accumulated gradients,
  the parameters after the step, the collectives each micro-batch issued, counted by a dispatch
  mode, with those of the emitted graphs, and what each parameter moves once per step (its
  gradient's placements, its storage, its working copy's).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autoshard
from autoshard.precision import MixedPrecision, cast_module
from autoshard.zoo import GPT, GPTConfig

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
IN2 = [["S(0)"], ["S(0)"]]
CONSTRAINTS = {
    None: None,
    "ddp": {"inputs": IN2, "*": ["R"]},
    "fsdp": {"inputs": IN2, "*": ["S(0)"]},
    "megatron": {"inputs": [["R"], ["R"]], "*.qkv.*": ["S(0)"], "*.fc.*": ["S(0)"],
                 "*.proj.weight": ["S(1)"], "*.out.weight": ["S(1)"]},
    "ddp2d": {"inputs": [["S(0)", "S(0)"]] * 2, "*": ["R", "R"]},
    # fsdp_x_tensor with every other parameter pinned to (S(0),R): left free, the solver may store
    # one in (S(0),S(0)), whose gradient DTensor moves with one collective more than the cost
    # model counts (a nested shard of one tensor dim; see test_training_loop's module doc)
    "zero_x_tensor": {"inputs": [["S(0)", "R"]] * 2, "*": ["S(0)", "R"], "*.fc.weight": ["S(1)", "S(0)"],
                      "*.out.weight": ["S(0)", "S(1)"], "wte.weight": ["S(1)", "R"]},
    "data_x_tensor": {"inputs": [["S(0)", "R"]] * 2, "*.qkv.weight": ["R", "S(0)"], "*.fc.weight": ["R", "S(0)"],
                      "*.proj.weight": ["R", "S(1)"], "*.out.weight": ["R", "S(1)"]},
    "fsdp_x_tensor": {"inputs": [["S(0)", "R"]] * 2, "*.fc.weight": ["S(1)", "S(0)"],
                      "*.out.weight": ["S(0)", "S(1)"], "wte.weight": ["S(1)", "R"]},
}
K = 4
MAX_NORM = 0.5
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")  # not wait/wrap ops
_C10D = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter_tensor",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor", "_allgather_base_": "all_gather_into_tensor",
         "allgather_into_tensor_coalesced_": "all_gather_into_tensor", "broadcast_": "broadcast"}


def _is_collective(node) -> bool:
    target = node.target
    return (node.op == "call_function" and getattr(target, "namespace", "").startswith("_c10d_functional")
            and target._opname.startswith(COLLECTIVES))


def param_gathers(dm) -> list[str]:
    """dtype of every forward all-gather of what is computed from parameters alone (their views
    and casts, one at a time or several packed into one bucket)."""
    params = set(dm._fw.graph.find_nodes(op="placeholder")[:len(dm._param_names)])
    found = []
    for n in dm._fw.graph.nodes:
        if _is_collective(n) and n.target._opname.startswith("all_gather"):
            leaves, seen, todo = set(), set(), [n.args[0]]
            while todo:
                src = todo.pop()
                if src in seen:
                    continue
                seen.add(src)
                if src.op == "placeholder":
                    leaves.add(src)
                todo.extend(src.all_input_nodes)
            if leaves and leaves <= params:
                found.append(str(n.args[0].meta["val"].dtype))
    return found


class CollectiveCounter(TorchDispatchMode):
    """Counts the functional collectives issued while active (in the graphs and outside them)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        if func.namespace == "c10d":  # process-group collectives the runtime issues directly
            name = _C10D.get(name, "")
            tensor = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        elif func.namespace.startswith("_c10d_functional"):
            tensor = args[0]
        else:
            name = ""
        if name.startswith(COLLECTIVES):
            self.counts[(name, str(tensor.dtype))] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _batch(model, step: int, micro: int):
    return model.example_inputs(model.batch, generator=torch.Generator().manual_seed(1000 + 10 * step + micro))


def _optim(params, lr):
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))


def _full(model) -> dict:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _param_err(dm, ref) -> float:
    return max((p.full_tensor() - ref.get_parameter(n)).abs().max().item() for n, p in dm.named_parameters())


def _grad_err(dm, ref) -> tuple[float, float]:
    """The largest deviation of any gradient element from the single device's, and the largest
    single-device gradient element (the scale bf16 rounding errs relative to)."""
    err = scale = 0.0
    for n, p in dm.named_parameters():
        want = ref.get_parameter(n).grad
        err = max(err, (p.grad.full_tensor() - want).abs().max().item())
        scale = max(scale, want.abs().max().item())
    return err, scale


def _reset(dm, ref, start: dict) -> None:
    dm.load_state_dict(start, strict=False)
    ref.load_state_dict(start, strict=False)
    for p in [*dm.parameters(), *ref.parameters()]:
        p.grad = None


def _steps(dm, ref, policy, lr: float, start: dict, steps: int = 3) -> dict:
    run = cast_module(ref, policy)
    opt, sched = _optim(dm.parameters(), lr)
    ref_opt, ref_sched = _optim(ref.parameters(), lr)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "lr": [], "grad": [], "grad_scale": []}
    for s in range(steps):
        batch = _batch(ref, s, 0)
        loss = dm(*dm.shard_inputs(*batch))
        loss.backward()
        ref_loss = run(*batch)
        ref_loss.backward()
        grad, scale = _grad_err(dm, ref)
        norm = torch.nn.utils.clip_grad_norm_(dm.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        opt.step(), sched.step(), opt.zero_grad()
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        out["loss"].append(loss.float().item())
        out["ref_loss"].append(ref_loss.float().item())
        out["grad"].append(grad)
        out["grad_scale"].append(scale)
        out["norm"].append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        out["ref_norm"].append(ref_norm.item())
        out["lr"].append(sched.get_last_lr()[0])
    out["param"] = _param_err(dm, ref)
    off = moved = 0.0
    for n, p in dm.named_parameters():
        want = ref.get_parameter(n).detach()
        off += (p.full_tensor() - want).square().sum().item()
        moved += (want - start[n]).square().sum().item()
    out["update"] = (off / moved) ** 0.5  # how far the steps went astray, relative to how far they went
    return out


def _accumulate(dm, ref, policy, explicit: bool, lr: float = 1.0) -> dict:
    """One SGD step over K micro-batches (loss / K each, as users scale it): the step moves each
    parameter by lr x its clipped gradient, so the parameters after it check the values summed.
    The collectives are counted under the eager backend only: torch.compile does not run its
    programs under a dispatch mode (the counter), so counting would run them uncompiled."""
    run = cast_module(ref, policy)
    opt, ref_opt = torch.optim.SGD(dm.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    kinds = []
    dm.grad_accumulation = 1 if explicit else K
    for k in range(K):
        batch = _batch(ref, 7, k)
        local = dm.shard_inputs(*batch)
        counter = CollectiveCounter()
        quiet = explicit and k < K - 1
        with counter if dm.backend == "eager" else contextlib.nullcontext():
            if quiet:
                with dm.no_sync():
                    (dm(*local) / K).backward()
            else:
                (dm(*local) / K).backward()
        kinds.append({f"{op}:{dtype}": c for (op, dtype), c in sorted(counter.counts.items())})
        unreduced_grads = all(p.grad is None for p in dm.parameters())
        if k < K - 1 and not unreduced_grads:
            raise AssertionError(f"micro-batch {k}: gradients reached .grad before the last micro-batch")
        (run(*batch) / K).backward()
    dm.grad_accumulation = 1
    grad_dtypes = sorted({str(p.grad.dtype) for p in dm.parameters()})
    grad, scale = _grad_err(dm, ref)
    norm = dm.clip_grad_norm_(MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    opt.step()
    ref_opt.step()
    graph = [n for g in (dm._fw, dm._bw) for n in g.graph.nodes if _is_collective(n)]
    return {"kinds": kinds, "graph_kinds": dict(Counter(f"{n.target._opname}:{_dtype(n)}" for n in graph)),
            "param_gathers": param_gathers(dm), "param": _param_err(dm, ref), "grad": grad, "grad_scale": scale,
            "grad_dtypes": grad_dtypes, "norm": norm.full_tensor().item(), "ref_norm": ref_norm.item(),
            "moves": moves(dm)}


def _dtype(node) -> str:
    val = node.args[0].meta["val"]
    return str((val[0] if isinstance(val, (list, tuple)) else val).dtype)


def moves(dm) -> dict:
    """What each parameter's once-per-step moves are, read off the module's tensors: per
    parameter, its gradient's placements as backward leaves it, its storage placements, and the
    working placements it is gathered to once per step (None: computed from storage)."""
    out = {}
    for i, name in enumerate(dm._param_names):
        p = dm.get_parameter(name)
        grad = dm._grad_placements[i]
        out[name] = (None if grad is None else _pl(grad), _pl(p.placements),
                     _pl(dm._working[i]) if i in dm._working else None)
    return out


def _pl(placements) -> str:
    from autoshard.notation import placements_str

    return placements_str(placements)


def setup_case(mesh_shape, constraints: str | None, policy: MixedPrecision | None, lr: float,
               batch: int = 8, plan_k: int = 1, backend: str = "eager") -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    model.batch = batch
    ref = copy.deepcopy(model)
    start = _full(model)
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    dm = autoshard.compile(model, cluster, _batch(model, 0, 0), constraints=CONSTRAINTS[constraints],
                           mixed_precision=policy, grad_accumulation=plan_k, backend=backend)
    out = {"plan_k": dm.plan.grad_accumulation, "module_k": dm.grad_accumulation, "backend": dm.plan.backend,
           "param_dtypes": sorted({str(p.dtype) for p in dm.parameters()})}
    dm.grad_accumulation = 1  # one micro-batch per step here, whatever the plan was priced for
    out["steps"] = _steps(dm, ref, policy, lr, start)
    for explicit in (True, False):
        _reset(dm, ref, start)
        out["accum" if explicit else "accum_auto"] = _accumulate(dm, ref, policy, explicit)
    # the graph calls that ran compiled (inductor; the counted micro-batches run uncompiled)
    out["compiled_calls"] = sum(getattr(run, "compiled_calls", 0) for run in dm._run.values() if run is not None)
    return out


def run_setups(setups: dict) -> dict:
    """setups: name -> (mesh_shape, constraints key, policy or None, lr, global batch, K planned
    for[, backend])."""
    return {name: setup_case(*spec) for name, spec in setups.items()}
