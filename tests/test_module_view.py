"""The module-level plan view: nodes grouped by module, identical copies of a repeated block
folded into one x N block, copies that differ drawn apart, no cycles, one badge per mesh dim,
and the ATen graph of one layer or module still drawable."""

import copy
import json
import re

import networkx as nx
import pydot
import pytest

import autoshard
import autoshard.zoo
from autoshard import Cluster, Plan
from autoshard.errors import PlanError
from autoshard.report.modules import badge_colour, fold, legend_entries, module_svg

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2 124M on one DGX H100 (8 GPUs), planned on meta."""
    model, inputs = autoshard.zoo.get("hf_gpt2", "124m", device="meta")
    return autoshard.plan(model, Cluster.preset("dgx-h100", nodes=1), inputs)


def _layers(plan) -> set[int]:
    return {n.layer for n in plan.nodes if n.layer is not None}


def test_nodes_carry_module_paths(gpt2):
    mods = {n.module for n in gpt2.nodes}
    assert "model.transformer.h.3.attn.c_attn" in mods and "model.transformer.h.11.mlp.c_proj" in mods
    assert all(n.module is not None for n in gpt2.nodes if n.name != "output")
    # every parameter's placeholder belongs to its own module
    c_attn = next(n for n in gpt2.nodes if n.module == "model.transformer.h.3.attn.c_attn" and n.phase == "bwd")
    assert c_attn.layer == 3


def test_identical_layers_fold_into_one_block(gpt2):
    f = fold(gpt2)
    assert sorted(k for b in f.blocks for k in b.layers) == sorted(_layers(gpt2))
    if len(f.blocks) == 1:
        assert f.blocks[0].title.endswith("x 12")
    # a box per module of one copy, not per ATen node or per copy
    assert len(f.groups) < 30 < len(gpt2.nodes) // 10
    assert {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "ln_1", "ln_2"} <= {
        g.module for g in f.groups.values() if g.block is not None}
    assert nx.is_directed_acyclic_graph(f.graph)
    svg = module_svg(gpt2, f)
    assert "primals_" not in svg and "attn.c_attn" in svg and "weight gpu:" not in svg


def test_a_differing_layer_is_drawn_apart(gpt2):
    p = copy.deepcopy(gpt2)
    odd = next(n for n in p.nodes if n.layer == 5 and n.phase == "fwd" and n.compute > 0)
    odd.strategy = odd.strategy + " "          # any change of decision in copy 5 only
    f = fold(p)
    assert [b.layers for b in f.blocks] == [[k for k in sorted(_layers(p)) if k != 5], [5]]
    assert {b.title for b in f.blocks} == {"model.transformer.h.0-4,6-11  x 11", "model.transformer.h.5  x 1"}


def test_dot_is_acyclic_and_small(gpt2):
    (g,) = pydot.graph_from_dot_data(gpt2.to_dot())
    nxg = nx.nx_pydot.from_pydot(g)
    assert nx.is_directed_acyclic_graph(nx.DiGraph(nxg))       # no gradient-to-parameter loops
    assert nxg.number_of_nodes() == len(fold(gpt2).groups) < 40
    assert any(s.get_name().startswith('"cluster_') for s in g.get_subgraphs())


def test_collectives_sit_on_module_edges_with_dims(gpt2):
    f = fold(gpt2)
    rows = [r for _, _, d in f.graph.edges(data=True) for r in d["rows"]]
    rows += [r for g in f.groups.values() for r in g.own]
    kinds = {c["kind"] for n in gpt2.nodes for c in n.comm if c["time"] > 0}
    assert kinds and all(any(k in r for r in rows) for k in kinds)
    assert all(re.search(r" (node|gpu) ", r) for r in rows)     # each names its mesh dim


def test_badges_tell_every_placement_apart(gpt2):
    legend = legend_entries(gpt2, fold(gpt2))
    assert [d for d, _ in legend] == ["node (1)", "gpu (8)"]  # the mesh, dim by dim
    colours = {p: badge_colour(p) for p in ["R", "S(0)", "S(1)", "S(2)", "P(sum)"]}
    assert len(set(colours.values())) == len(colours)
    # each badge prints its dim's name and placement, so (R,R) and (R) or (P,P) and (S(1),S(0)) differ
    svg = module_svg(gpt2)
    assert re.search(r">gpu:S\(0\)<", svg) and re.search(r">node:R<", svg)


def test_aten_drill_down_of_one_layer_and_module(gpt2):
    (g,) = pydot.graph_from_dot_data(gpt2.to_dot(layer=3))
    names = {n.get_name().strip('"') for n in g.get_nodes()} - {"node", "edge", "graph"}
    layer3 = {n.name for n in gpt2.nodes if n.layer == 3}
    assert layer3 <= names and not names & {n.name for n in gpt2.nodes if n.layer == 4}
    (g,) = pydot.graph_from_dot_data(gpt2.to_dot(module="model.transformer.h.3.mlp"))
    names = {n.get_name().strip('"') for n in g.get_nodes()}
    assert {n.name for n in gpt2.nodes if (n.module or "").startswith("model.transformer.h.3.mlp")} <= names
    with pytest.raises(PlanError, match="no node"):
        gpt2.to_dot(layer=99)


def test_plans_saved_without_module_names_still_load_and_fold(gpt2):
    doc = json.loads(gpt2.to_json())
    for n in doc["nodes"]:
        n.pop("module")
    old = Plan.from_json(json.dumps(doc))
    assert all(n.module is None for n in old.nodes)
    f = fold(old)                                   # grouped by layer alone
    assert sorted(k for b in f.blocks for k in b.layers) == sorted(_layers(old))
    assert "module-graph" in old.to_html()
    doc["nodes"][0]["module"] = 3
    with pytest.raises(PlanError, match="'module' must be a string"):
        Plan.from_json(json.dumps(doc))


def test_page_size_does_not_grow_with_folded_copies(gpt2):
    f = fold(gpt2)
    per_copy = sum(1 for n in gpt2.nodes if n.layer == 0)
    assert len(f.folded_away) >= 10 * per_copy * 0.9       # 11 of the 12 copies left out of the node list
    text = gpt2.to_html()
    assert len(text.encode()) < 400_000
    listing = text[text.index("<details><summary>all "):]
    listing = listing[:listing.index("</details>")]
    # a row starts with the node's name, then its parameter's name for a placeholder
    listed = set(re.findall(r"<tr><td>([^<( ]+)", listing))
    assert not listed & set(f.folded_away)
    assert {n.name for n in gpt2.nodes if n.layer == 0 and n.name not in f.folded_away} <= listed


def test_terminal_summary_lists_the_plan_by_module(gpt2):
    """The text summary carries the module view too: the 12 layers under one "x 12" title, a row
    for every module a node of the first layer was made by (named inside its layer), none of the
    other copies named, and each row's placement per mesh dim that of its costliest forward op."""
    text = gpt2.summary(max_rows=None, width=400)
    table = text[text.index("plan by module"):text.index("nodes by phase")]
    assert table.count("x 12") == 1 and ".h.0-11" in table
    inside = {n.module.split(".h.0.", 1)[1] for n in gpt2.nodes if n.module and ".h.0." in n.module}
    assert inside and all(f"│   {m} " in table for m in inside), sorted(inside)
    assert not any(f".h.{k}." in table for k in range(1, 12))
    c_fc = [n for n in gpt2.nodes if n.layer == 0 and n.module and n.module.endswith("mlp.c_fc") and n.phase == "fwd"]
    main = max(c_fc, key=lambda n: n.compute)
    out = [p.strip() for p in main.strategy.split("->")[1][1:-1].split(",")]   # "->(R,S(0))"
    row = next(line for line in table.splitlines() if "│   mlp.c_fc " in line)
    assert [cell.strip() for cell in row.split("│")[2:2 + len(out)]] == out


def test_drawings_do_not_depend_on_the_hash_seed(gpt2, tmp_path):
    """The module DOT, the ATen drill-down and the HTML page of a saved plan, drawn in fresh
    processes under two hash seeds: byte-identical (string sets iterate by hash; the drawings
    must not)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "gpt2.json"
    gpt2.save(path)
    draw = "from autoshard import Plan; p = Plan.load({!r}); print(p.to_dot()); print(p.to_dot(layer=3)); print(p.to_html())".format(str(path))
    outs = [subprocess.run([sys.executable, "-c", draw], env=dict(os.environ, PYTHONHASHSEED=seed),
                           capture_output=True, text=True, timeout=300) for seed in ("1", "2")]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout
