"""Train a GPT with autoshard under torchrun, on CPU processes (gloo) or GPUs (NCCL).

    # 2 CPU processes on this machine
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/train.py --steps 3
    # one GPU (NCCL, world size 1), planned for that GPU alone (the preset is found by its name)
    torchrun --nproc-per-node 1 examples/train.py --steps 3
    # 2 nodes x 8 H100s, planned for the DGX H100 preset (run on every node)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train.py --preset dgx-h100 --layers 12 --hidden 768 --heads 12 --seq 1024 \\
        --vocab 50304 --batch 8 --steps 100 --save-plan plan.json

Every rank builds the same model and the same global batch; ``shard_inputs`` cuts this rank's
piece of it. The data is synthetic (random tokens, the target of each token is the next id), so
the loss falls quickly; put your data loader where ``batch_for`` is.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.cluster import PRESETS
from autoshard.zoo import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    tiny = GPTConfig.tiny()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=tiny.layers)
    p.add_argument("--hidden", type=int, default=tiny.hidden)
    p.add_argument("--heads", type=int, default=tiny.heads)
    p.add_argument("--seq", type=int, default=tiny.seq)
    p.add_argument("--vocab", type=int, default=tiny.vocab)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step, all ranks together)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="GPUs only: plan for this cluster preset (mesh nodes x GPUs per node; fewer GPUs than "
                        "a node: one node's mesh of that many); default: the preset whose GPU this is")
    p.add_argument("--plan", metavar="PATH", default=None,
                   help="run a saved plan (JSON from --save-plan or examples/plan_gpt2.py) instead of planning")
    p.add_argument("--save-plan", metavar="PATH", default=None, help="rank 0 writes the plan as JSON here")
    p.add_argument("--backend", choices=["eager", "inductor"], default=None,
                   help="run the program op by op or compiled by inductor (default: the --plan's, else eager)")
    return p.parse_args()


def gpu_preset() -> str:
    """The preset whose device is this process's GPU, by its name (and memory, for the A100s)."""
    name = torch.cuda.get_device_name()
    if "A100" in name:
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return "dgx-a100-80gb" if memory > 50e9 else "dgx-a100-40gb"
    for key, preset in (("H200", "hgx-h200"), ("H100", "dgx-h100")):
        if key in name:
            return preset
    raise SystemExit(f"no cluster preset describes the GPU {name!r}; pass --preset with the closest of "
                     f"{', '.join(sorted(PRESETS))}")


def make_cluster(args, world_size: int, on_gpu: bool) -> autoshard.Cluster:
    if not on_gpu:
        return autoshard.Cluster.local(world_size)
    name = args.preset or gpu_preset()
    preset = PRESETS[name]
    if world_size < preset.gpus_per_node:  # part of one node (one GPU, say): a flat mesh over its links
        return autoshard.Cluster((world_size,), ("gpu",), preset.device, [preset.intra], ranks_per_node=world_size)
    if world_size % preset.gpus_per_node:
        raise SystemExit(f"--preset {name} has {preset.gpus_per_node} GPUs per node, but the world size is "
                         f"{world_size}; launch fewer than {preset.gpus_per_node} processes or a multiple of it")
    return autoshard.Cluster.preset(name, nodes=world_size // preset.gpus_per_node)


def batch_for(step: int, config: GPTConfig, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank (same seed), so ranks agree on it."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, config.vocab, (batch, config.seq), generator=g)
    return idx.to(device), ((idx + 1) % config.vocab).to(device)


def main() -> None:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:  # one GPU per process, by its index on this node; compile builds on the current device
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    try:
        config = GPTConfig(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers)
        torch.manual_seed(args.seed)
        model = GPT(config)  # built on CPU; compile copies each rank's shard of every parameter to `device`
        cluster = make_cluster(args, world_size, on_gpu)
        example = batch_for(0, config, args.batch, "cpu")  # shapes of the global batch
        plan = autoshard.Plan.from_json(open(args.plan).read()) if args.plan else None

        t0 = time.perf_counter()
        dmodel = autoshard.compile(model, cluster, example, plan=plan, backend=args.backend)
        log(f"{dist.get_backend()} x {world_size}, {cluster}: compiled in {time.perf_counter() - t0:.1f}s; "
            f"{dmodel.plan!r}")
        if args.save_plan and rank == 0:
            with open(args.save_plan, "w") as f:
                f.write(dmodel.plan.to_json())
            log(f"plan written to {args.save_plan}")

        opt = torch.optim.AdamW(dmodel.parameters(), lr=args.lr)
        for step in range(args.steps):
            t0 = time.perf_counter()
            inputs = dmodel.shard_inputs(*batch_for(step, config, args.batch, device))
            loss = dmodel(*inputs)  # the full loss, the same on every rank
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_value = loss.item()
            log(f"step {step:4d}  loss {loss_value:.4f}  {(time.perf_counter() - t0) * 1e3:7.1f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
