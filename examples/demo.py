"""autoshard demo (run by `make demo`).

1. Plan GPT-2 small (124M, seq 1024, global batch 8) for two DGX H100 nodes (mesh 2 x 8 = 16
   GPUs) on the ``meta`` device: no GPU, no process group, no parameter memory.
2. Compile a tiny GPT on 2 local CPU processes (gloo), train 5 SGD steps on a fixed batch, and
   check every step's loss against the same model trained on a single device.
"""

from __future__ import annotations

import copy
import time

import torch
from rich.console import Console
from rich.table import Table

import autoshard
from autoshard.runtime.launch import run_local
from autoshard.zoo import GPT, GPTConfig

SEED = 0
STEPS = 5
LR = 0.1
BATCH = 8          # global batch of the tiny run
WORLD_SIZE = 2

console = Console()


def plan_gpt2() -> None:
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    console.rule(f"[bold]1. Plan GPT-2 small (124M) for 2 x DGX H100, mesh {cluster.mesh_shape}")
    with torch.device("meta"):
        model = GPT(GPTConfig.gpt2_small())
        idx = torch.empty(8, 1024, dtype=torch.long)
        targets = torch.empty(8, 1024, dtype=torch.long)
    t0 = time.perf_counter()
    plan = autoshard.plan(model, cluster, (idx, targets))
    seconds = time.perf_counter() - t0
    print(plan.summary(max_rows=15))  # plain text, already laid out 160 columns wide
    console.print(f"[bold green]GPT-2 small on {cluster.world_size}x {cluster.device.name}:[/] predicted step "
                  f"{plan.step_time * 1e3:.2f} ms, peak memory {plan.peak_memory / 2**30:.2f} GiB/device, "
                  f"solver {plan.solver['status']}, planned in {seconds:.1f} s", soft_wrap=True)


def train_tiny() -> tuple[str, list[tuple[float, float | None]]]:
    """Runs on every rank of the process group run_local sets up."""
    import torch.distributed as dist

    torch.manual_seed(SEED)
    model = GPT(GPTConfig.tiny())  # GPT-2 initialization (the zoo does it)
    reference = copy.deepcopy(model)          # same weights, trained on one device below
    batch = model.example_inputs(BATCH, generator=torch.Generator().manual_seed(SEED))

    cluster = autoshard.Cluster.local(dist.get_world_size())
    dmodel = autoshard.compile(model, cluster, batch)
    local_batch = dmodel.shard_inputs(*batch)
    opt = torch.optim.SGD(dmodel.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)

    rows = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = dmodel(*local_batch)           # the full loss, identical on every rank
        loss.backward()
        opt.step()
        ref_loss = None
        if dist.get_rank() == 0:
            ref_opt.zero_grad()
            ref = reference(*batch)
            ref.backward()
            ref_opt.step()
            ref_loss = ref.item()
        rows.append((loss.item(), ref_loss))
    plan = dmodel.plan
    sharded = sum(pl.strip("()") != ",".join("R" * len(plan.mesh_shape)) for pl in plan.storage.values())
    about = (f"tiny GPT plan on {cluster}: {plan!r}; inputs {', '.join(plan.inputs)}; "
             f"{sharded}/{len(plan.storage)} parameters sharded at rest")
    return about, rows


def main() -> None:
    torch.manual_seed(SEED)
    start = time.perf_counter()
    plan_gpt2()

    console.rule(f"[bold]2. Train a tiny GPT on {WORLD_SIZE} gloo processes vs. one device")
    about, rows = run_local(train_tiny, WORLD_SIZE, timeout=300)[0]
    console.print(about, markup=False, highlight=False, soft_wrap=True)
    table = Table(title=f"{STEPS} SGD steps (lr {LR}), global batch {BATCH}, fixed batch", title_justify="left")
    for col in ("step", f"distributed loss ({WORLD_SIZE} ranks)", "single-device loss", "abs diff"):
        table.add_column(col, justify="right")
    worst = 0.0
    for step, (dist_loss, ref_loss) in enumerate(rows, 1):
        diff = abs(dist_loss - ref_loss)
        worst = max(worst, diff)
        table.add_row(str(step), f"{dist_loss:.6f}", f"{ref_loss:.6f}", f"{diff:.2e}")
    console.print(table)
    ok = worst < 1e-4
    console.print(f"[bold {'green' if ok else 'red'}]max |distributed - single-device| = {worst:.2e}"
                  f"{'' if ok else '  (MISMATCH)'}[/]; demo took {time.perf_counter() - start:.0f} s")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
