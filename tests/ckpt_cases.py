"""Checkpoint cases run inside real gloo processes (module level, so spawned ranks import them).

The tiny GPT takes one AdamW step under an FSDP-like plan on 2 ranks and is saved with DCP; it is
then loaded under a Megatron plan on 2 ranks (same launch) and under a 2-D plan on 4 ranks (a
second launch reading the same directory). Every rank also runs the single-device model through
the same steps on the same batches, so each case reports how far the loaded module is from the
values saved (exact copy expected) and from the single-device run (the next steps' losses and
parameters). Errors a case provokes on purpose come back as ``"TypeName: message"`` strings.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import autoshard
import autoshard.runtime.checkpoint as ckpt
from autoshard.zoo import GPT, MLP, GPTConfig
from dist_cases import GPT_CASES, GPT_CASES_2D

FSDP = {"inputs": [["S(0)"], ["S(0)"]], "*": ["S(0)"]}
MEGATRON = GPT_CASES["megatron"][1]
MESH_2D, PLAN_2D = GPT_CASES_2D["fsdp_x_tensor"]
LR = 1e-3
SAVED = "saved_full.pt"  # what the saving ranks held, full tensors, written by rank 0


def _opt(module) -> torch.optim.AdamW:
    return torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)


def _batches(n: int = 3):
    model, g = GPT(GPTConfig.tiny()), torch.Generator().manual_seed(1)
    return [model.example_inputs(8, generator=g) for _ in range(n)]


def _tied(model) -> dict[str, str]:
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            out[name] = first[id(p)]
    return out


def _compile(seed: int, mesh_shape, constraints):
    torch.manual_seed(seed)
    model = GPT(GPTConfig.tiny())
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    dm = autoshard.compile(model, cluster, _batches()[0], constraints=constraints)
    return model, dm


def _step(module, opt, batch, local: bool) -> float:
    loss = module(*(module.shard_inputs(*batch) if local else batch))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _snapshot(module, opt) -> dict:
    """Full parameters and optimizer state by parameter name (collective: every rank calls it)."""
    params = dict(module.named_parameters())
    return {"param": {n: _full(p) for n, p in params.items()},
            "optim": {n: {k: _full(v) for k, v in opt.state.get(p, {}).items()} for n, p in params.items()}}


def _max_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over two snapshots; inf when their names or shapes differ."""
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for k in a:
        if isinstance(a[k], dict):
            worst = max(worst, _max_diff(a[k], b[k]))
        elif a[k].shape != b[k].shape:
            return float("inf")
        elif a[k].numel():
            worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    return worst


def _reference() -> dict:
    """The single-device run: step 1 (the saved state), then steps 2 and 3 (what resuming must give)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    opt = _opt(model)
    batches = _batches()
    out = {"loss1": _step(model, opt, batches[0], False), "after1": _snapshot(model, opt)}
    out["loss2"] = _step(model, opt, batches[1], False)
    out["after2"] = _snapshot(model, opt)["param"]
    out["loss3"] = model(*batches[2]).item()
    return out


def _resume_errors(dm, opt, saved: dict, ref: dict) -> dict:
    """After a load: distance to what was saved, then two more steps against the single-device run."""
    batches = _batches()
    err = {"vs_saved": _max_diff(_snapshot(dm, opt), saved)}
    err["loss2"] = abs(_step(dm, opt, batches[1], True) - ref["loss2"])
    err["param2"] = _max_diff(_snapshot(dm, opt)["param"], ref["after2"])
    err["loss3"] = abs(dm(*dm.shard_inputs(*batches[2])).item() - ref["loss3"])
    return err


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and text are what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _scramble(module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.to_local().fill_(0.5)


def two_rank_suite(tmp: str) -> dict:
    """Save under FSDP, reload under Megatron; single-device import/export; mismatches; inputs."""
    rank, out = dist.get_rank(), {}
    ref = _reference()
    # -- save after one AdamW step under the FSDP-like plan (DCP, as torch documents it) --------
    model, dm = _compile(0, None, FSDP)
    opt = _opt(dm)
    out["save_loss1"] = abs(_step(dm, opt, _batches()[0], True) - ref["loss1"])
    saved = _snapshot(dm, opt)
    out["saved_vs_single"] = _max_diff(saved, ref["after1"])
    out["fsdp_storage"] = sorted(set(dm.plan.storage.values()))
    out["state_keys"] = sorted(dm.state_dict())
    out["single_keys"] = sorted(model.state_dict())
    msd, osd = get_state_dict(dm, opt)
    out["get_state_dict_keys"] = sorted(msd)
    out["dtensor_values"] = all(isinstance(v, DTensor) for v in msd.values()) and all(
        isinstance(s["exp_avg"], DTensor) for s in osd["state"].values())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "fsdp"))
    dcp.save(dm.state_dict(), checkpoint_id=os.path.join(tmp, "fsdp_model_only"))
    untied = {k: v for k, v in dm.state_dict().items() if k != "head.weight"}  # saved before the tie was known
    dcp.save(untied, checkpoint_id=os.path.join(tmp, "fsdp_untied"))
    if rank == 0:
        torch.save(saved, os.path.join(tmp, SAVED))

    # -- export to a single-device state dict; rank 0 only --------------------------------------
    full = ckpt.full_state_dict(dm)
    out["export_rank0_only"] = (full == {}) if rank else bool(full)
    if rank == 0:
        torch.manual_seed(3)
        single = GPT(GPTConfig.tiny())
        single.load_state_dict(full)  # strict: every key of the model, tied head included
        out["export_keys"] = sorted(full) == sorted(single.state_dict())
        out["export_vs_saved"] = max((full[n] - v).abs().max().item() for n, v in saved["param"].items())
        out["export_tied"] = single.head.weight is single.wte.weight
        out["export_loss2"] = abs(single(*_batches()[1]).item() - ref["loss2"])

    # -- load under a Megatron plan on the same 2 ranks -----------------------------------------
    _, tp = _compile(5, None, MEGATRON)
    out["tp_storage"] = sorted(set(tp.plan.storage.values()))
    tp_opt = _opt(tp)
    # the module's own state_dict() through dcp.load, then load_state_dict
    sd = tp.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "fsdp_model_only"))
    tp.load_state_dict(sd)
    out["tp_model_only_vs_saved"] = _max_diff(_snapshot(tp, tp_opt)["param"], saved["param"])
    _scramble(tp)
    ckpt.load(os.path.join(tmp, "fsdp_untied"), tp)
    out["tp_untied_vs_saved"] = _max_diff(_snapshot(tp, tp_opt)["param"], saved["param"])
    _scramble(tp)
    # model and optimizer through get_state_dict / dcp.load / set_state_dict
    msd2, osd2 = get_state_dict(tp, tp_opt)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, checkpoint_id=os.path.join(tmp, "fsdp"))
    set_state_dict(tp, tp_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    out["tp"] = _resume_errors(tp, tp_opt, saved, ref)

    # -- the autoshard.checkpoint helpers: load, then save under TP and reload under FSDP -------
    _scramble(tp)
    tp_opt2 = _opt(tp)
    ckpt.load(os.path.join(tmp, "fsdp"), tp, tp_opt2)
    out["tp_helpers"] = _resume_errors(tp, tp_opt2, saved, ref)

    # -- single-device import: every rank passes the state dict, or rank 0 alone ----------------
    torch.manual_seed(7)
    single = GPT(GPTConfig.tiny())
    want = {n: p.detach().clone() for n, p in single.named_parameters()}
    ckpt.load_full_state_dict(tp, single.state_dict())
    got = {n: _full(p) for n, p in tp.named_parameters()}
    out["import_vs_single"] = _max_diff(got, want)
    out["import_loss"] = abs(tp(*tp.shard_inputs(*_batches()[0])).item() - single(*_batches()[0]).item())
    _scramble(dm)
    ckpt.load_full_state_dict(dm, single.state_dict() if rank == 0 else None, from_rank0=True)
    out["import_rank0_vs_single"] = _max_diff({n: _full(p) for n, p in dm.named_parameters()}, want)

    # -- mismatches: another model's checkpoint, other shapes, missing optimizer state ----------
    mlp_cluster = autoshard.Cluster.local(dist.get_world_size())
    g = torch.Generator().manual_seed(2)
    mlp_in = (torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g))
    mlp = autoshard.compile(MLP(), mlp_cluster, mlp_in)
    ckpt.save(os.path.join(tmp, "mlp"), mlp)
    wide = autoshard.compile(MLP((32, 48, 48, 16)), mlp_cluster, mlp_in)
    out["mismatch_names"] = _error(lambda: ckpt.load(os.path.join(tmp, "mlp"), tp))
    out["mismatch_names_rev"] = _error(lambda: ckpt.load(os.path.join(tmp, "fsdp"), mlp))
    out["mismatch_shapes"] = _error(lambda: ckpt.load(os.path.join(tmp, "mlp"), wide))
    out["mismatch_no_optim"] = _error(lambda: ckpt.load(os.path.join(tmp, "fsdp_model_only"), tp, tp_opt2))
    ckpt.save(os.path.join(tmp, "fsdp_weights"), dm)  # save()'s layout, model alone
    fresh = _opt(tp)
    out["mismatch_no_optim_nested"] = _error(lambda: ckpt.load(os.path.join(tmp, "fsdp_weights"), tp, fresh))
    out["fresh_optimizer_untouched"] = not fresh.state
    out["mismatch_missing_dir"] = _error(lambda: ckpt.load(os.path.join(tmp, "nothing_here"), tp))
    out["mismatch_full"] = _error(lambda: ckpt.load_full_state_dict(wide, MLP().state_dict()))
    out["mismatch_full_rank0"] = _error(lambda: ckpt.load_full_state_dict(
        tp, MLP().state_dict() if rank == 0 else None, from_rank0=True))
    out["mismatch_module"] = _error(lambda: wide.load_state_dict(mlp.state_dict()))
    out["after_mismatch_vs_single"] = _max_diff({n: _full(p) for n, p in tp.named_parameters()}, want)

    # -- run-time input validation ---------------------------------------------------------------
    idx, tgt = _batches()[0]
    out["input_global_batch"] = _error(lambda: dm(idx, tgt))  # FSDP plan: each rank takes half
    li, lt = dm.shard_inputs(idx, tgt)
    out["input_dtype"] = _error(lambda: dm(li.to(torch.int32), lt))
    out["input_count"] = _error(lambda: dm(li))
    out["input_ok"] = abs(dm(li, lt).item() - single(idx, tgt).item())
    return out


def four_rank_load(tmp: str) -> dict:
    """Load the 2-rank FSDP checkpoint under a 2-D plan on mesh (2, 2) and keep training."""
    ref = _reference()
    saved = torch.load(os.path.join(tmp, SAVED))
    _, dm = _compile(5, MESH_2D, PLAN_2D)
    opt = _opt(dm)
    ckpt.load(os.path.join(tmp, "fsdp"), dm, opt)
    full = ckpt.full_state_dict(dm)
    out = {"storage": sorted(set(dm.plan.storage.values())),
           "export_vs_saved": _max_diff({n: full[n] for n in saved["param"]}, saved["param"]) if full else None,
           "group_timeouts": [_timeout(dist.group.WORLD)] + [_timeout(dm.mesh.get_group(d)) for d in range(dm.mesh.ndim)]}
    return {**out, **_resume_errors(dm, opt, saved, ref)}


def _timeout(group) -> float:
    """A process group's collective timeout in seconds (private torch API: test-only)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
