"""Pipeline runs inside real gloo processes (module level, so spawned ranks import them).

A 4-layer Llama with grouped-query attention on a (2, 2) mesh: 2 stages of 2 ranks, 4
micro-batches of a batch of 8. Every rank also runs the single-device model on the whole batch,
one SGD step, and reports how far the pipeline's loss, gradients and parameters after the step are
from it. The checkpoint case saves the pipeline with DCP, loads it into a module without stages
(its own plan on all 4 ranks), saves that and loads it into a new pipeline.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoshard
import autoshard.runtime.checkpoint as ckpt
from autoshard.planning.baselines import plan_baseline
from autoshard.planning.pipeline import plan_pipeline
from autoshard.precision import cast_module
from autoshard.zoo import Llama, LlamaConfig

CONFIG = LlamaConfig(layers=4, heads=4, kv_heads=2)
LR = 0.1


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _gap(module, reference: dict, grads: bool = False) -> float:
    """Largest |module - reference| over the module's parameters (or their gradients), by name."""
    return max((_full(p.grad if grads else p) - reference[name]).abs().max().item()
               for name, p in module.named_parameters())


def _policy(kind: str):
    """bf16 compute over fp32 master weights for the "-bf16" kinds."""
    return autoshard.MixedPrecision(torch.bfloat16) if kind.endswith("-bf16") else None


def _model(seed: int, kind: str = "llama"):
    torch.manual_seed(seed)
    if kind.startswith("llama"):
        return Llama(CONFIG)
    # model code autoshard did not write: transformers' Qwen2 from a config
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from autoshard.zoo import hf

    return hf.CausalLM(Qwen2ForCausalLM(hf._config(
        Qwen2Config, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2)))


def _pipeline(seed: int, batch, schedule: str, roles, kind: str = "llama"):
    cluster = autoshard.Cluster.local(dist.get_world_size(), (2, 2))
    model = _model(seed, kind)
    # transformers' model: its stages cut the logical mesh (4,) of the same ranks, not the (2, 2) given
    plan = plan_pipeline(model, cluster, batch, stages=2, micro_batches=4, schedules=(schedule,), roles=roles,
                         time_limit=60, meshes=[(4,)] if kind == "qwen2" else None, mixed_precision=_policy(kind))
    return autoshard.compile(model, cluster, batch, plan=plan, mixed_precision=_policy(kind))


def run_case(schedule: str, roles, checkpoint_dir: str | None, kind: str = "llama") -> dict:
    batch = tuple(torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    reference = _model(0, kind)
    run = cast_module(reference, _policy(kind))   # the single-device step under the same policy
    loss_ref = run(*batch)
    loss_ref.backward()
    grads_ref = {n: p.grad.clone() for n, p in reference.named_parameters()}
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad
    params_ref = {n: p.detach().clone() for n, p in reference.named_parameters()}

    pm = _pipeline(0, batch, schedule, roles, kind)
    opt = torch.optim.SGD(pm.parameters(), lr=LR)
    loss = pm.step(*batch)
    out = {"loss": abs(loss.item() - loss_ref.item()), "grad": _gap(pm, grads_ref, grads=True),
           "loss_ref": loss_ref.item(), "largest_grad": max(g.abs().max().item() for g in grads_ref.values()),
           "policy": pm.plan.mixed_precision, "loss_dtype": str(loss.dtype)}
    opt.step()
    out.update(param=_gap(pm, params_ref), names=sorted(n for n, _ in pm.named_parameters()),
               is_dtensor=all(isinstance(p, DTensor) for p in pm.parameters()),
               stage_programs=sorted(pm.stage_plans), schedule=type(pm.__dict__["_schedule"]).__name__,
               mesh=pm.plan.mesh_shape, pieces=pm.__dict__["_stages"][0].__dict__["hand"].size, stage_dims=sorted({p.device_mesh.mesh_dim_names for p in pm.parameters()}),
               # zero bubble: each program's backward split in two, every deferred weight part run
               split=[(s.body.__dict__["_split"] is not None, len(s.body.__dict__["_deferred"]))
                      for s in pm.__dict__["_stages"]],
               # matrix products in each part: (input part, weight part), per program
               split_mms=[tuple(sum("mm" in str(n.target) for n in g.graph.nodes) for g in s.body.__dict__["_split"])
                          for s in pm.__dict__["_stages"] if s.body.__dict__["_split"] is not None])
    # a second step from the same batch: the accumulation counters restart every step
    reference.zero_grad()
    run(*batch).backward()
    opt.zero_grad()
    pm.step(*batch)
    out["grad2"] = _gap(pm, {n: p.grad for n, p in reference.named_parameters()}, grads=True)
    # the norm over every stage's gradients, as the whole model's (nothing clipped at this bound)
    norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    out["norm"] = abs(pm.clip_grad_norm_(1e9).item() - norm_ref) / norm_ref
    try:   # every rank refuses a batch of another shape: none waits on a stage that raised
        pm.step(*(x[:4] for x in batch))
    except autoshard.errors.RuntimeMismatchError as exc:
        out["wrong_batch"] = str(exc)
    if _policy(kind) is not None:   # the plan runs under its own policy only: every rank refuses another
        try:
            autoshard.compile(_model(0, kind), autoshard.Cluster.local(dist.get_world_size(), (2, 2)), batch,
                              plan=pm.plan)
        except autoshard.errors.PlanMismatchError as exc:
            out["policy_error"] = str(exc)
    if checkpoint_dir is None:
        return out

    # pipeline -> a plan without stages (all 4 ranks, its own plan) -> a new pipeline
    trained = {n: _full(p) for n, p in pm.named_parameters()}   # this rank's stage
    ckpt.save(os.path.join(checkpoint_dir, "pp"), pm)
    # the plan without stages: FSDP over all 4 ranks, a small solve (the free one can take minutes
    # on a loaded machine); what matters here is that it has no stages
    cluster = autoshard.Cluster.local(dist.get_world_size(), (2, 2))
    fsdp = plan_baseline(_model(5), cluster, "fsdp", batch, time_limit=60) if dist.get_rank() == 0 else None
    box = [None if fsdp is None else fsdp.to_json()]
    dist.broadcast_object_list(box, src=0)
    flat = autoshard.compile(_model(5), cluster, batch, plan=autoshard.Plan.from_json(box[0]))
    ckpt.load(os.path.join(checkpoint_dir, "pp"), flat)
    loaded = {n: _full(p) for n, p in flat.named_parameters()}   # collective: every rank, every name
    out["pp_to_flat"] = max((loaded[n] - t).abs().max().item() for n, t in trained.items())
    out["flat_near_reference"] = max((loaded[n] - t).abs().max().item() for n, t in params_ref.items())
    ckpt.save(os.path.join(checkpoint_dir, "flat"), flat)
    again = _pipeline(7, batch, schedule, roles)
    before = _gap(again, loaded)
    ckpt.load(os.path.join(checkpoint_dir, "flat"), again)
    out.update(flat_to_pp=_gap(again, loaded), before_load=before)
    return out


def run_cases(cases: dict, checkpoint_dir: str) -> dict:
    return {name: run_case(schedule, roles, checkpoint_dir if ckpt_case else None, kind)
            for name, (kind, schedule, roles, ckpt_case) in cases.items()}
