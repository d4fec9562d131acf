"""Training-loop cases run inside real gloo processes (module level so spawned ranks import them).

One *setup* (model, mesh, constraints, precision policy) is compiled once and runs two loops,
each against the same loop on a single device in this process under the same policy:

* ``steps``: 3 optimizer steps of AdamW under a LambdaLR schedule with
  ``torch.nn.utils.clip_grad_norm_`` over the compiled module's parameters; per step the loss
  and the clipped norm, and the parameters after the last step.
* ``accum``: one AdamW step over K = 4 micro-batches, the first three inside ``no_sync()``
  (and again with ``module.grad_accumulation = 4``, what ``compile(grad_accumulation=4)`` sets,
  instead of ``no_sync``), clipped with
  ``module.clip_grad_norm_``; the parameters after it, and the collectives each micro-batch
  issued, counted by a dispatch mode, next to the plan's gradient collectives (the comms of
  the edges that end at parameter placeholders) and the collective nodes of the emitted graphs.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.distributed as dist
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
    """dtype of every forward all-gather whose input is a parameter (through views and casts)."""
    params = set(dm._fw.graph.find_nodes(op="placeholder")[:len(dm._param_names)])
    found = []
    for n in dm._fw.graph.nodes:
        if _is_collective(n) and n.target._opname.startswith("all_gather"):
            src = n.args[0]
            while src.op == "call_function" and len(src.all_input_nodes) == 1:
                src = src.all_input_nodes[0]
            if src in params:
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
    return {n: (p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _param_err(dm, ref) -> float:
    return max((p.full_tensor() - ref.get_parameter(n)).abs().max().item() for n, p in dm.named_parameters())


def _reset(dm, ref, start: dict) -> None:
    dm.load_state_dict(start, strict=False)
    ref.load_state_dict(start, strict=False)
    for p in [*dm.parameters(), *ref.parameters()]:
        p.grad = None


def _steps(dm, ref, policy, lr: float, steps: int = 3) -> dict:
    run = cast_module(ref, policy)
    opt, sched = _optim(dm.parameters(), lr)
    ref_opt, ref_sched = _optim(ref.parameters(), lr)
    out = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": [], "lr": []}
    for s in range(steps):
        batch = _batch(ref, s, 0)
        loss = dm(*dm.shard_inputs(*batch))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(dm.parameters(), MAX_NORM)
        opt.step(), sched.step(), opt.zero_grad()
        ref_loss = run(*batch)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        out["loss"].append(loss.float().item())
        out["ref_loss"].append(ref_loss.float().item())
        out["norm"].append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        out["ref_norm"].append(ref_norm.item())
        out["lr"].append(sched.get_last_lr()[0])
    out["param"] = _param_err(dm, ref)
    return out


def _accumulate(dm, ref, policy, lr: float, explicit: bool) -> dict:
    """One optimizer step over K micro-batches (loss / K each, as users scale it)."""
    run = cast_module(ref, policy)
    opt, _ = _optim(dm.parameters(), lr)
    ref_opt, _ = _optim(ref.parameters(), lr)
    counts, kinds = [], {}
    dm.grad_accumulation = 1 if explicit else K
    for k in range(K):
        batch = _batch(ref, 7, k)
        local = dm.shard_inputs(*batch)
        counter = CollectiveCounter()
        quiet = explicit and k < K - 1
        with counter:
            if quiet:
                with dm.no_sync():
                    (dm(*local) / K).backward()
            else:
                (dm(*local) / K).backward()
        counts.append(counter.total)
        if k in (0, 1, K - 1):
            kinds[k] = {f"{op}:{dtype}": c for (op, dtype), c in sorted(counter.counts.items())}
        unreduced_grads = all(p.grad is None for p in dm.parameters())
        if k < K - 1 and not unreduced_grads:
            raise AssertionError(f"micro-batch {k}: gradients reached .grad before the last micro-batch")
        (run(*batch) / K).backward()
    dm.grad_accumulation = 1
    grad_dtypes = sorted({str(p.grad.dtype) for p in dm.parameters()})
    norm = dm.clip_grad_norm_(MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    opt.step()
    ref_opt.step()
    graph = sum(1 for g in (dm._fw, dm._bw) for n in g.graph.nodes if _is_collective(n))
    return {"counts": counts, "graph_collectives": graph, "param_gathers": param_gathers(dm),
            "param": _param_err(dm, ref), "kinds": kinds,
            "grad_dtypes": grad_dtypes,
            "norm": norm.full_tensor().item(), "ref_norm": ref_norm.item(),
            "working": {dm._param_names[i]: (_pl(dm.get_parameter(dm._param_names[i]).placements), _pl(pl))
                        for i, pl in dm._working.items()},
            "grad_collectives_planned": planned_buckets(dm, "grad"),
            "gathers_planned": planned_buckets(dm, "gather"),
            "per_micro_batch_planned": planned(dm.plan, "input") + planned(dm.plan, "output")}


def _pl(placements) -> str:
    from autoshard.passes.strategies import placement_str

    return "(" + ",".join(placement_str(p) for p in placements) + ")"


def planned(plan, role: str) -> int:
    """Collectives the plan lists for edges of one role: "grad" (gradient to storage, once per
    step), "gather" (storage to working copy, once per step), "input"/"output" (in the graph)."""
    return sum(1 for n in plan.nodes for c in n.comm if c.get("role") == role)


def planned_buckets(dm, role: str) -> int:
    """The once-per-step collectives of ``role`` ("grad", "gather") as the module issues them:
    the moves it buckets (bucket.to_storage_many, bucket.gather_many) one flat collective per
    group and mesh dim (the setups' tensors fit one bucket), any other move as the plan lists its
    collectives (at the parameter's node)."""
    from autoshard.passes import bucket

    params = [n.name for n in dm.plan.nodes if n.op == "placeholder"][:len(dm._param_names)]
    listed = {n.name: sum(1 for c in n.comm if c.get("role") == role) for n in dm.plan.nodes}
    groups, alone = set(), 0
    for i, name in enumerate(dm._param_names):
        p = dm.get_parameter(name)
        if role == "grad" and dm._grad_placements[i] is not None:
            pl = tuple(dm._grad_placements[i])
            how = bucket.bucketable(pl, p) if listed[params[i]] else None
            key = None if how is None else ("grad", how[:2], len(how[1]) if how[0] == "all_reduce" else 1)
        elif role == "gather" and i in dm._working:
            how = bucket._gather_dims(p, dm._working[i])
            key = None if how is None else ("gather", how[0], p.dtype, 1)
        else:
            continue
        if key is None:
            alone += listed[params[i]]
        else:
            groups.add(key)
    return sum(key[-1] for key in groups) + alone


def setup_case(mesh_shape, constraints: str | None, policy: MixedPrecision | None, lr: float,
               batch: int = 8, plan_k: int = 1) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    model.batch = batch
    ref = copy.deepcopy(model)
    start = _full(model)
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    dm = autoshard.compile(model, cluster, _batch(model, 0, 0), constraints=CONSTRAINTS[constraints],
                           mixed_precision=policy, grad_accumulation=plan_k)
    out = {"storage": dict(dm.plan.storage), "plan_k": dm.plan.grad_accumulation, "module_k": dm.grad_accumulation,
           "param_dtypes": sorted({str(p.dtype) for p in dm.parameters()}),
           "grad_placements": sorted({str(pl) for pl in dm._grad_placements})}
    dm.grad_accumulation = 1  # one micro-batch per step here, whatever the plan was priced for
    out["steps"] = _steps(dm, ref, policy, lr)
    for explicit in (True, False):
        _reset(dm, ref, start)
        out["accum" if explicit else "accum_auto"] = _accumulate(dm, ref, policy, lr, explicit)
    return out


def run_setups(setups: dict) -> dict:
    """setups: name -> (mesh_shape, constraints key, policy or None, lr, global batch, K planned for)."""
    return {name: setup_case(*spec) for name, spec in setups.items()}
