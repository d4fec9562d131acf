"""Plan GPT-2 small (124M) for a cluster preset without any GPU, and save the plan as JSON, an
HTML report (graph, table and memory plot in one self-contained file) or Graphviz DOT.

    python examples/plan_gpt2.py                          # 2 DGX H100 nodes -> plan.json
    python examples/plan_gpt2.py --cluster hgx-h200:4 --batch 32 --out h200.json

The model and the batch live on the ``meta`` device: nothing is allocated, only shapes are traced.
The JSON can be given back to ``autoshard.compile(..., plan=Plan.from_json(text))`` (or
``examples/train.py --plan``) on a cluster with the same mesh, for the same model and batch shape.
"""

from __future__ import annotations

import argparse
import time

import torch

import autoshard
from autoshard.cluster import PRESETS
from autoshard.zoo import GPT, GPTConfig


def parse_cluster(text: str) -> autoshard.Cluster:
    name, _, nodes = text.partition(":")
    if name not in PRESETS or (nodes and not nodes.isdigit()):
        raise argparse.ArgumentTypeError(f"expected PRESET[:NODES] with PRESET one of {', '.join(sorted(PRESETS))}, "
                                         f"got {text!r}")
    return autoshard.Cluster.preset(name, nodes=int(nodes or 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", type=parse_cluster, default="dgx-h100:2", metavar="PRESET[:NODES]",
                   help=f"cluster preset and node count (default dgx-h100:2); presets: {', '.join(sorted(PRESETS))}")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences of 1024 tokens (default 8)")
    p.add_argument("--time-limit", type=float, default=120.0, help="solver time limit in seconds")
    p.add_argument("--out", default="plan.json", nargs="+",
                   help="files to write, by extension: .json, .html (report), .dot (default plan.json)")
    args = p.parse_args()

    config = GPTConfig.gpt2_small()
    with torch.device("meta"):
        model = GPT(config)
        idx = torch.empty(args.batch, config.seq, dtype=torch.long)
        targets = torch.empty(args.batch, config.seq, dtype=torch.long)
    t0 = time.perf_counter()
    plan = autoshard.plan(model, args.cluster, (idx, targets), time_limit=args.time_limit)
    seconds = time.perf_counter() - t0
    print(plan.summary())
    outs = [args.out] if isinstance(args.out, str) else args.out
    for out in outs:
        if out.endswith(".html"):
            plan.save_html(out)
        elif out.endswith(".dot"):
            with open(out, "w") as f:
                f.write(plan.to_dot())
        else:
            plan.save(out)
    print(f"GPT-2 small, batch {args.batch}x{config.seq}, on {args.cluster}: predicted step "
          f"{plan.step_time * 1e3:.2f} ms, peak {plan.peak_memory / 2**30:.2f} GiB/device, "
          f"solver {plan.solver['status']}; planned in {seconds:.1f}s; wrote {', '.join(outs)}")


if __name__ == "__main__":
    main()
