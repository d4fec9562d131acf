"""What the way a model writes one line costs a plan: a 13B Llama-style decoder (hidden 5120,
40 layers, 40 heads, SwiGLU 13824, vocabulary 32000, sequence 2048) whose rotary embedding is
written with ``torch.stack`` (interleaved pairs, as GPT-J) or with ``torch.cat`` (halves, as
Hugging Face's Llama), and GPT-J 6B as transformers builds it (interleaved RoPE), each planned on
8 DGX H100 nodes (mesh 8 x 8) at 2 sequences per GPU: the FSDP baseline and the free plan.
Prints step time, exposed communication, recompute and its communication, MFU, the coverage gaps;
writes bench/out/rope_styles.json.

    .venv/bin/python bench/rope_styles.py [--only 13b-stack 13b-cat gptj] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.zoo import corpus
from autoshard.planning.baselines import plan_baseline
from autoshard.cluster import Cluster

SEQ, PER_GPU, NODES = 2048, 2, 8


def model(name: str):
    with torch.device("meta"):
        if name.startswith("13b-"):
            m = corpus.HandLM(name[4:], dim=5120, layers=40, heads=40, ffn=13824, vocab=32000, seq=SEQ)
            vocab = 32000
        else:
            import transformers

            config = transformers.GPTJConfig(n_positions=SEQ, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
            config._attn_implementation = "sdpa"
            m = corpus.CausalLM(transformers.GPTJForCausalLM(config))
            vocab = config.vocab_size
        m = m.to(torch.bfloat16)
        batch = PER_GPU * 8 * NODES
        ids = torch.empty(batch, SEQ, dtype=torch.long, device="meta")
    return m, (ids, ids), vocab


def row(label: str, plan, seconds: float) -> dict:
    b = plan.breakdown
    return {"case": label, "step_s": plan.step_time, "exposed_comm_s": b["exposed_comm"],
            "recompute_s": b["recompute"], "recompute_comm_s": b["recompute_comm"], "mfu": plan.mfu,
            "gaps": len(plan.gaps), "gap_ops": sorted({g["op"] for g in plan.gaps}), "plan_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=["13b-stack", "13b-cat", "gptj"])
    ap.add_argument("--out", default="bench/out/rope_styles.json")
    args = ap.parse_args()
    cluster = Cluster.preset("dgx-h100", NODES)
    rows = []
    for name in args.only:
        m, inputs, _ = model(name)
        traced = autoshard.trace(m, inputs)
        for label, make in (("fsdp", lambda: plan_baseline(traced, cluster, "fsdp", recompute=True)),
                            ("free", lambda: autoshard.plan(traced, cluster))):
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = make()
            rows.append(row(f"{name} {label}", plan, time.perf_counter() - t0))
            r = rows[-1]
            print(f"{r['case']:16s} step {r['step_s']:.3f} s  exposed comm {r['exposed_comm_s']:.3f} s  "
                  f"recompute {r['recompute_s']:.3f} s  recompute comm {r['recompute_comm_s']:.3f} s  "
                  f"MFU {100 * (r['mfu'] or 0):.1f}%  gaps {r['gaps']} {r['gap_ops']}  ({r['plan_s']:.0f} s)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
