"""The ``autoshard`` command: plan a model, read a saved plan, compare two, list cluster presets.

    autoshard plan gpt2 --cluster dgx-h100:2 --out plan.json --out plan.html
    autoshard plan llama3-8b --cluster hgx-h200:4 --memory-limit 120GB --batch 16 --seq 8192
    autoshard plan mypkg.models:build --cluster dgx-a100-80gb --out plan.dot
    autoshard show plan.json [--all] [--out plan.html]
    autoshard diff a.json b.json
    autoshard clusters

Models are built on the ``meta`` device: planning allocates no parameter memory. A failure the
user can fix (unknown preset or model, corrupt plan, infeasible cap) exits 1 with one line on
stderr, ``autoshard: error: ...``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

OUT_KINDS = {".json": "json", ".html": "html", ".htm": "html", ".dot": "dot", ".gv": "dot"}
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """"40GB" -> 4e10, "80GiB" -> 80 * 2**30, "1.5e10B" -> 1.5e10 bytes. The unit is required: a
    bare "40" (meant as GB, read as bytes) would plan for a cap no model fits."""
    from autoshard.errors import ConstraintError

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m and not m.group(2) and float(m.group(1)) > 0:
        raise ConstraintError(f"--memory-limit {text!r} has no unit; add one, as in {m.group(1)}GB or "
                              f"{m.group(1)}GiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConstraintError(f"--memory-limit {text!r}: give a positive size with its unit, such as 40GB, 80GiB or "
                              f"1.5e10B (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_cluster(text: str):
    """"PRESET[:NODES]" (see ``autoshard clusters``) or "local:N" (this machine, N processes)."""
    from autoshard.cluster import PRESETS, Cluster

    name, _, nodes = text.partition(":")
    if nodes and not nodes.isdigit():
        raise ValueError(f"--cluster {text!r}: NODES must be a positive integer, as in dgx-h100:2")
    if name == "local":
        return Cluster.local(int(nodes or 1))
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {', '.join(sorted(PRESETS))} "
                         "(or local:N); see 'autoshard clusters'")
    return Cluster.preset(name, nodes=int(nodes or 1))


# ---------------------------------------------------------------------- models
def _tokens(batch: int, seq: int):
    import torch

    idx = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return idx, torch.empty(batch, seq, dtype=torch.long, device="meta")


def _decoder(model_cls: str, config: str, default_batch: int):
    def build(batch, seq):
        import dataclasses

        import torch

        from autoshard import zoo

        c = getattr(getattr(zoo, f"{model_cls}Config"), config)()
        c = c if seq is None else dataclasses.replace(c, seq=seq)
        with torch.device("meta"):
            model = getattr(zoo, model_cls)(c)
        return model, _tokens(batch or default_batch, c.seq)
    return build


def _mlp(batch, seq):
    import torch

    from autoshard.zoo import MLP

    if seq is not None:
        raise ValueError("model 'mlp' has no sequence length; drop --seq")
    with torch.device("meta"):
        model = MLP()
    dims = (model.layers[0].in_features, model.layers[-1].out_features)
    b = batch or 8
    return model, tuple(torch.empty(b, d, device="meta") for d in dims)


# A table, not a scan of autoshard.zoo: `autoshard plan --help` lists these names without importing torch.
_ZOO = {
    "gpt-tiny": ("GPT, 2 layers, hidden 64 (tests)", ("GPT", "tiny", 2)),
    "gpt2": ("GPT-2 small, 124M, seq 1024", ("GPT", "gpt2_small", 8)),
    "mlp": ("3-layer MLP 32-64-64-16 (tests)", None),
    "llama-tiny": ("Llama, 2 layers, hidden 64 (tests)", ("Llama", "tiny", 2)),
    "llama2-7b": ("Llama 2 7B, seq 4096", ("Llama", "llama2_7b", 8)),
    "llama3-8b": ("Llama 3 8B, GQA, seq 8192", ("Llama", "llama3_8b", 8)),
    "llama3-70b": ("Llama 3 70B, GQA, seq 8192", ("Llama", "llama3_70b", 8)),
}


def zoo_models() -> dict:
    """name -> (description, build(batch, seq) -> (model, example_inputs))."""
    return {name: (text, _mlp if how is None else _decoder(*how)) for name, (text, how) in _ZOO.items()}


def build_model(spec: str, batch: int | None, seq: int | None):
    """A zoo name, or ``package.module:factory`` whose ``factory()`` returns ``(model,
    example_inputs)`` or a model with ``.example_inputs(batch)``; built on ``meta``."""
    models = zoo_models()
    if spec in models:
        return models[spec][1](batch, seq)
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}; zoo models: {', '.join(models)}, "
                         "or give package.module:factory")
    import torch

    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would, so a local module.py is found
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load model factory {spec!r}: {exc}") from exc
    if seq is not None:
        raise ValueError(f"--seq applies to zoo models only; {spec} sets its own shapes")
    with torch.device("meta"):
        made = factory()
    if isinstance(made, tuple) and len(made) == 2:
        return made
    if not hasattr(made, "example_inputs"):
        raise ValueError(f"{spec}() returned {type(made).__name__}; return (model, example_inputs) "
                         "or a model with an example_inputs(batch) method")
    params = inspect.signature(made.example_inputs).parameters
    kwargs = {"device": "meta"} if "device" in params else {}
    return made, made.example_inputs(batch or 8, **kwargs)


# ---------------------------------------------------------------------- commands
def _write(plan, paths: list[str]) -> None:
    for path in paths:
        kind = OUT_KINDS[Path(path).suffix.lower()]
        if kind == "json":
            plan.save(path)
        elif kind == "html":
            plan.save_html(path)
        else:
            Path(path).write_text(plan.to_dot())
        print(f"wrote {path}", file=sys.stderr)


def _check_outs(paths: list[str]) -> None:
    """Before planning: a plan that cannot be written is a plan lost."""
    for path in paths:
        if Path(path).suffix.lower() not in OUT_KINDS:
            raise ValueError(f"--out {path!r}: the file name must end in .json, .html or .dot")
        folder = Path(path).parent
        if not folder.is_dir():
            raise ValueError(f"--out {path!r}: no folder {str(folder)!r}; create it first")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--out {path!r}: folder {str(folder)!r} is not writable")


def cmd_plan(args) -> int:
    import autoshard

    _check_outs(args.out)
    cluster = parse_cluster(args.cluster)
    limit = None if args.memory_limit is None else parse_bytes(args.memory_limit)
    model, inputs = build_model(args.model, args.batch, args.seq)
    accepts = inspect.signature(autoshard.plan).parameters
    kwargs = {"time_limit": args.time_limit, "backend": args.backend}
    if limit is not None:
        if "memory_limit" in accepts:
            kwargs["memory_limit"] = limit
        else:
            print("autoshard: warning: this autoshard does not enforce --memory-limit yet; the plan records "
                  "the cap but was not held to it", file=sys.stderr)
    if args.no_recompute:
        if "recompute" not in accepts:
            raise ValueError("--no-recompute: this autoshard does not plan recompute yet")
        kwargs["recompute"] = False
    plan = autoshard.plan(model, cluster, inputs, **kwargs)
    if limit is not None and plan.memory_limit is None:
        plan.memory_limit = limit
    _write(plan, args.out)
    if not args.quiet:
        print(_summary(plan, args))
    return 0


def width() -> int:
    """The terminal's width (COLUMNS first, as a shell exports it); 160 when the output is a file or a pipe,
    which nothing wraps."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return max(40, int(columns))
    if sys.stdout.isatty():
        return max(40, shutil.get_terminal_size().columns)
    return 160


def _summary(plan, args) -> str:
    from autoshard import report

    return report.summary_text(plan, max_rows=None if args.all else args.max_rows, width=width(),
                               hints=report.CLI_HINTS)


def cmd_show(args) -> int:
    from autoshard.planning.plan import Plan

    _check_outs(args.out)
    plan = Plan.load(args.plan)
    _write(plan, args.out)
    print(_summary(plan, args))
    return 0


def cmd_diff(args) -> int:
    from autoshard import report
    from autoshard.planning.plan import Plan

    a, b = Plan.load(args.a), Plan.load(args.b)
    print(report.diff_text(a.diff(b), max_rows=args.max_rows, width=width(), hints=report.CLI_HINTS, by=args.by))
    return 0


def cmd_clusters(args) -> int:
    from rich.table import Table

    from autoshard.cluster import PRESETS
    from autoshard.report.format import export, recording_console

    t = Table(title="cluster presets (--cluster PRESET[:NODES]; mesh (node, gpu)); also local:N", title_justify="left")
    for col in ("preset", "device", "memory", "gpus/node", "link in node (gpu)", "link between nodes (node)",
                "description"):
        t.add_column(col, no_wrap=col in ("preset", "device"))   # names to type whole; the description wraps
    for name, p in PRESETS.items():
        link = lambda l: f"{l.name}, {l.bandwidth / 1e9:g} GB/s, {l.latency * 1e6:g} us"  # noqa: E731
        t.add_row(name, p.device.name, f"{p.device.memory / 1e9:.3g} GB", str(p.gpus_per_node), link(p.intra),
                  link(p.inter), p.description)
    console = recording_console(width())
    console.print(t)
    print(export(console), end="")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoshard", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pl = sub.add_parser("plan", help="plan a model for a cluster", description=(
        "Plan MODEL for a cluster and print the plan's summary. MODEL is a zoo name (" + ", ".join(
            _zoo_names()) + ") or package.module:factory, where factory() returns (model, example_inputs) or "
        "a model with .example_inputs(batch); models are built on the meta device."))
    pl.add_argument("model", metavar="MODEL")
    pl.add_argument("--cluster", required=True, metavar="PRESET[:NODES]",
                    help="a preset from 'autoshard clusters' and a node count (default 1), or local:N")
    pl.add_argument("--memory-limit", metavar="SIZE", help="cap on predicted peak memory per device, e.g. 40GB "
                    "or 80GiB (default: the device's usable memory)")
    pl.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    pl.add_argument("--backend", choices=["eager", "inductor"], default="eager",
                    help="what will run the program: op by op (eager, the default) or compiled by inductor, "
                         "whose fused kernels the plan is priced for")
    pl.add_argument("--batch", type=int, metavar="N", help="global batch (zoo default: 2 for tiny models, else 8)")
    pl.add_argument("--seq", type=int, metavar="N", help="sequence length of a zoo decoder")
    pl.add_argument("--time-limit", type=float, default=120.0, metavar="S", help="solver time limit (default 120)")
    pl.add_argument("--out", action="append", default=[], metavar="FILE",
                    help="write the plan to FILE.json, FILE.html (report) or FILE.dot (Graphviz); repeatable")
    pl.add_argument("--max-rows", type=int, default=40, metavar="N", help="rows of each table in the summary; alike "
                    "layers fold into one group (default 40)")
    pl.add_argument("--all", action="store_true", help="every node of every layer and every parameter row")
    pl.add_argument("-q", "--quiet", action="store_true", help="do not print the summary")
    pl.set_defaults(run=cmd_plan)

    sh = sub.add_parser("show", help="print a saved plan's summary", description="Print the summary of a plan "
                        "saved as JSON; --out converts it to HTML or DOT.")
    sh.add_argument("plan", metavar="PLAN.json")
    sh.add_argument("--max-rows", type=int, default=40, metavar="N", help="rows of each table; alike layers fold "
                    "into one group (default 40)")
    sh.add_argument("--all", action="store_true", help="every node of every layer and every parameter row")
    sh.add_argument("--out", action="append", default=[], metavar="FILE", help="also write FILE.json/.html/.dot")
    sh.set_defaults(run=cmd_show)

    df = sub.add_parser("diff", help="compare two saved plans", description="The change in predicted time and "
                        "memory, then the nodes whose strategy or recompute mark differ, largest change to the step "
                        "time (or, with --by memory, to the bytes they hold) first, alike layers folded, and the "
                        "parameters stored differently, largest change to the bytes they hold first.")
    df.add_argument("a", metavar="A.json")
    df.add_argument("b", metavar="B.json")
    df.add_argument("--max-rows", type=int, default=100, metavar="N", help="node rows (default 100)")
    df.add_argument("--by", choices=["time", "memory"], default="time",
                    help="rank changed nodes by their change to the step time (default) or to the bytes they hold")
    df.set_defaults(run=cmd_diff)

    cl = sub.add_parser("clusters", help="list cluster presets", description="List the cluster presets "
                        "--cluster accepts: device, memory, GPUs per node and links.")
    cl.set_defaults(run=cmd_clusters)
    return p


def _zoo_names() -> list[str]:
    return list(_ZOO)


# The library's hints name its Python arguments; on the command line they are flags.
_FLAGS = {r"\bmemory_limit\b": "--memory-limit", r"\btime_limit\b": "--time-limit",
          r"\ballow recompute\b": "drop --no-recompute",
          r"\buse more devices\b": "use more nodes (--cluster PRESET:NODES)",
          r"\bshrink the batch\b": "shrink the batch (--batch)"}


def _as_flags(text: str) -> str:
    for pattern, flag in _FLAGS.items():
        text = re.sub(pattern, flag, text)
    return text


def _warn(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"autoshard: warning: {_as_flags(str(message).removeprefix('autoshard: '))}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from autoshard.errors import AutoshardError

    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn
            return args.run(args)
    except BrokenPipeError:  # `autoshard show plan.json | head`: stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (AutoshardError, ValueError, OSError) as exc:
        print(f"autoshard: error: {_as_flags(' '.join(str(exc).split())) or type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autoshard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
