"""Reading plans: JSON round trip, mismatch refusal, summary text, DOT, HTML report, diff."""

import copy
import json
import math
from html.parser import HTMLParser

import networkx as nx
import pydot
import pytest
import torch

import autoshard
from autoshard import Cluster, Plan
from autoshard.errors import PlanError, PlanMismatchError
from autoshard.planning.plan import PlanDiff
from autoshard.zoo import GPT, MLP, GPTConfig

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")


@pytest.fixture(scope="module")
def traced():
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny())
    idx = torch.empty(2, 16, dtype=torch.long, device="meta")
    return autoshard.trace(model, (idx, idx))


@pytest.fixture(scope="module")
def plans(traced):
    """A free plan and one with every parameter pinned S(0), both on 2 ranks."""
    cluster = Cluster.local(2)
    free = autoshard.plan(traced, cluster)
    pinned = autoshard.plan(traced, cluster, constraints={"*": ["S(0)"]})
    return cluster, free, pinned


def _dressed(plan: Plan) -> Plan:
    """A copy with every optional field set away from its default."""
    p = copy.deepcopy(plan)
    fwd = [n for n in p.nodes if n.phase == "fwd" and n.compute > 0]
    fwd[0].recompute = True
    p.memory_limit = 3.5 * 2**20
    p.memory_timeline = [(n.name, 1e6 + 1000.5 * i) for i, n in enumerate(p.nodes) if n.phase in ("fwd", "bwd")]
    p.mfu = 0.123456789
    p.breakdown = {"compute": 1e-3, "comm": 2.5e-4, "recompute": 1e-5}
    if not p.edges:
        p.edges = [(a.name, b.name) for a, b in zip(p.nodes, p.nodes[1:])]
    return p


# ---------------------------------------------------------------------------- JSON
def test_json_round_trip_is_lossless(plans, tmp_path):
    _, free, _ = plans
    p = _dressed(free)
    again = Plan.from_json(p.to_json())
    assert again == p                                   # every field (stats are not part of a plan)
    assert again.to_json() == p.to_json()
    assert isinstance(again.mesh_shape, tuple) and isinstance(again.edges[0], tuple)
    assert isinstance(again.memory_timeline[0], tuple) and again.memory_timeline == p.memory_timeline
    assert again.nodes[[n.name for n in p.nodes].index(next(n.name for n in p.nodes if n.recompute))].recompute
    assert (again.mfu, again.memory_limit, again.breakdown) == (p.mfu, p.memory_limit, p.breakdown)
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p
    assert "pickle" not in (tmp_path / "p.json").read_text()


def test_plan_json_carries_new_fields(plans):
    _, free, _ = plans
    d = json.loads(free.to_json())
    for key in ("edges", "memory_limit", "memory_timeline", "mfu", "breakdown"):
        assert key in d
    assert all(n["recompute"] in (True, False) for n in d["nodes"])


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["nodes"][0].pop("compute"), "nodes[0]"),
    (lambda d: d["nodes"][1]["comm"].insert(0, {"kind": "all_gather"}), "nodes[1].comm[0]"),
    (lambda d: d.update(edges=[["a"]]), "edges"),
    (lambda d: d.update(memory_timeline=[["a", "big"]]), "memory_timeline"),
    (lambda d: d.update(mfu="high"), "mfu"),
    (lambda d: d.update(param_names={"primals_1": 3}), "param_names"),
    (lambda d: d.update(memory_limit=-1), "memory_limit"),
    (lambda d: d.pop("fingerprint"), "fingerprint"),
    (lambda d: d["nodes"][0].update(recompute="yes"), "recompute"),
], ids=["node-compute", "comm-entry", "edges", "timeline", "mfu", "param-names", "limit", "fingerprint", "recompute"])
def test_corrupt_plan_says_where(plans, mutate, words):
    _, free, _ = plans
    d = json.loads(free.to_json())
    mutate(d)
    with pytest.raises(PlanError, match="corrupt plan file") as info:
        Plan.from_json(json.dumps(d))
    assert words in str(info.value)


def test_load_errors_are_plan_errors(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanError, match="bin.json"):
        Plan.load(tmp_path / "bin.json")
    (tmp_path / "cut.json").write_text('{"schema": 1, "nodes": [')
    with pytest.raises(PlanError, match="invalid JSON"):
        Plan.load(tmp_path / "cut.json")


def test_plan_for_model_a_refuses_model_b(plans, traced):
    cluster, free, _ = plans
    free.check_matches(traced.fingerprint, cluster.to_json())
    with torch.device("meta"):
        mlp = MLP()
    other = autoshard.trace(mlp, (torch.empty(4, 32, device="meta"), torch.empty(4, 16, device="meta")))
    with pytest.raises(PlanMismatchError, match="another model"):
        free.check_matches(other.fingerprint, cluster.to_json())
    with pytest.raises(PlanMismatchError, match="mesh"):
        free.check_matches(traced.fingerprint, Cluster.local(4).to_json())
    # the refusal survives a save and load
    with pytest.raises(PlanMismatchError):
        Plan.from_json(free.to_json()).check_matches(other.fingerprint, cluster.to_json())


# ---------------------------------------------------------------------------- summary
def test_summary_header_and_rows(plans):
    _, _, pinned = plans
    p = _dressed(pinned)
    text = p.summary(max_rows=6)
    assert "\x1b[" not in text                            # plain text, no colour codes
    head = "\n".join(text.splitlines()[:3])
    assert "step" in head and "MFU 12.3%" in head and "solver" in head and "gap" in head
    assert "peak memory" in head and "3.50 MiB cap" in head
    for section in ("forward", "backward", "parameter storage", "memory per device", "d0(2) in -> out"):
        assert section in text
    costly = sorted(p.nodes, key=lambda n: -(n.compute + sum(c["time"] for c in n.comm)))
    assert costly[0].name in text
    rows = text.splitlines()
    shown = [n.name for n in p.nodes if any(r.startswith(f"│ {n.name} ") for r in rows)]  # the node column
    assert 0 < len(shown) <= 6
    assert "cheaper nodes not shown" in text
    full = p.summary(expand=True)
    assert all(f"│ {n.name} " in full or n.name == "output" for n in p.nodes if len(n.name) <= 30)
    assert p.summary(max_rows=5) == p.summary(5)          # the old keyword form still works


def test_summary_marks_recompute_and_comm(plans):
    _, _, pinned = plans
    p = _dressed(pinned)
    rc = next(n for n in p.nodes if n.recompute)
    line = next(l for l in p.summary(expand=True).splitlines() if f"│ {rc.name} " in l)
    assert "│ R  │" in line
    with_comm = next(n for n in p.nodes if n.comm and n.comm[0]["time"] > 0)
    text = p.summary(expand=True)
    assert with_comm.comm[0]["kind"] in text and " d0 " in text


# ---------------------------------------------------------------------------- DOT
def _dot_graphs(text):
    (g,) = pydot.graph_from_dot_data(text)
    return g, nx.nx_pydot.from_pydot(g)


def test_dot_parses_with_pydot_and_networkx(plans):
    _, _, pinned = plans
    p = _dressed(pinned)
    g, nxg = _dot_graphs(p.to_dot(aten=True))
    names = {n.name for n in p.nodes}
    assert names <= set(nxg.nodes)
    assert {(a, b) for a, b in p.edges} <= set(nxg.edges())
    attrs = {n: d for n, d in nxg.nodes(data=True)}
    rc = next(n.name for n in p.nodes if n.recompute)
    assert "dashed" in attrs[rc]["style"]
    # one colour per output placement
    by_pl = {}
    for n in p.nodes:
        out = n.strategy.split("->", 1)[1].split("),")[0].rstrip(")") + ")" if "->" in n.strategy else ""
        by_pl.setdefault(out, set()).add(attrs[n.name]["fillcolor"])
    assert all(len(colours) == 1 for colours in by_pl.values())
    # collectives sit on edges (or, without a producer to pin them to, on the node)
    labelled = [d for _, _, d in nxg.edges(data=True) if "label" in d]
    xlabelled = [d for d in attrs.values() if "xlabel" in d]
    kinds = {c["kind"] for n in p.nodes for c in n.comm if c["time"] > 0}
    assert kinds and (labelled or xlabelled)
    assert any(k in d.get("label", "") + d.get("xlabel", "") for d in labelled + xlabelled for k in kinds)


def test_dot_pins_collectives_to_their_edge(plans):
    _, _, pinned = plans
    p = copy.deepcopy(pinned)
    consumer = next(n for n in p.nodes if n.comm and n.comm[0]["time"] > 0)
    producer = next(n for n in p.nodes if n.name != consumer.name)
    consumer.comm = [{**consumer.comm[0], "src": producer.name}]
    _, nxg = _dot_graphs(p.to_dot(aten=True))
    labels = [d.get("label", "") for d in nxg.get_edge_data(producer.name, consumer.name).values()]
    assert any(consumer.comm[0]["kind"] in l for l in labels)


def test_dot_without_edges_has_just_nodes(plans):
    _, free, _ = plans
    p = copy.deepcopy(free)
    p.edges = []
    for n in p.nodes:   # a collective naming its producer would draw that edge
        n.comm = []
    p.nodes[0].name = 'odd "name" \\ here'
    g, nxg = _dot_graphs(p.to_dot(aten=True))
    assert nxg.number_of_nodes() == len(p.nodes) and nxg.number_of_edges() == 0


# ---------------------------------------------------------------------------- HTML
class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.svgs, self.classes = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "svg":
            self.svgs.append(a.get("id"))
        if "class" in a:
            self.classes.append((tag, a["class"]))


def _check_html(text):
    parser = _Collect()
    parser.feed(text)
    parser.close()
    assert "http://" not in text and "https://" not in text and "src=" not in text
    assert "script" not in parser.tags and "link" not in parser.tags and "img" not in parser.tags
    # the only references are the inline arrow markers
    assert "url(" not in text.replace("url(#arrow)", "").replace("url(#marrow)", "")
    return parser


def test_html_report_is_self_contained(plans, tmp_path):
    _, _, pinned = plans
    p = _dressed(pinned)
    p.save_html(tmp_path / "plan.html")
    text = (tmp_path / "plan.html").read_text(encoding="utf-8")
    parser = _check_html(text)
    assert parser.svgs == ["memory-plot", "module-graph", "aten-graph"]
    assert ("line", "cap") in parser.classes and ("polyline", "memory") in parser.classes
    # the ATen drill-down draws the first copy of the repeated block, and every endpoint of its edges
    layer0 = {n.name for n in p.nodes if n.layer == 0}
    endpoints = {x for e in p.edges if e[0] in layer0 and e[1] in layer0 for x in e} | layer0
    endpoints |= {c["src"] for n in p.nodes if n.name in layer0 for c in n.comm if c.get("src") and c["time"] > 0}
    assert sum(1 for t, c in parser.classes if c == "node") == len(endpoints)
    assert "blocks.0-1  x 2" in text
    assert "solver&#x27;s prediction" in text or "solver's prediction" in text   # the given timeline
    assert "parameter storage" in text.lower() and "wte.weight" in text
    assert "<table>" in text and p.nodes[0].name in text


def test_html_derives_a_timeline_without_one(plans):
    _, free, _ = plans
    p = copy.deepcopy(free)
    p.memory_timeline, p.memory_limit, p.edges = [], None, []
    parser = _check_html(p.to_html())
    assert parser.svgs == ["memory-plot", "module-graph", "aten-graph"] and ("line", "cap") not in parser.classes
    from autoshard.report.html import memory_timeline

    line, derived = memory_timeline(p)
    assert derived and max(b for _, b in line) == pytest.approx(p.peak_memory)
    assert line[0][1] == pytest.approx(line[-1][1])       # forward saves, backward frees


# ---------------------------------------------------------------------------- diff
@pytest.fixture(scope="module")
def sharded(traced, plans):
    """Every parameter and the batch pinned S(0) (FSDP with data parallelism): unlike the free
    plan, which keeps the batch replicated here, it differs in node strategies, not just storage."""
    cluster, _, _ = plans
    return autoshard.plan(traced, cluster, constraints={"*": ["S(0)"], "inputs": [["S(0)"], ["S(0)"]]})


def test_diff_lists_differing_nodes(plans, sharded):
    _, free, _ = plans
    pinned = sharded
    d = free.diff(pinned)
    assert isinstance(d, PlanDiff) and not d.identical and d.same_graph and d.same_cluster
    a, b = {n.name: n for n in free.nodes}, {n.name: n for n in pinned.nodes}
    want = {n for n in a if n in b and a[n].strategy != b[n].strategy}
    assert want and {c.name for c in d.nodes} == want
    assert set(d.storage) == {k for k in free.storage if free.storage[k] != pinned.storage[k]}
    assert all(v[1] == "(S(0))" for v in d.storage.values())
    assert d.step_time_delta == pytest.approx(pinned.step_time - free.step_time)
    assert d.peak_memory_delta == pytest.approx(pinned.peak_memory - free.peak_memory)
    text = str(d)
    assert "step time" in text and "peak memory" in text and d.nodes[0].name in text
    from autoshard.report.text import storage_rows

    folded = storage_rows(type("S", (), {"storage": {k: f"{a} -> {b}" for k, (a, b) in d.storage.items()}}))
    assert d.storage and all(name in text for name, _, _ in folded)
    assert sum(copies for _, _, copies in folded) == len(d.storage)
    same = free.diff(Plan.from_json(free.to_json()))
    assert same.identical and same.nodes == [] and "same decisions" in str(same)


def test_diff_sees_recompute_changes(plans):
    _, free, _ = plans
    other = copy.deepcopy(free)
    n = next(n for n in other.nodes if n.phase == "fwd" and n.compute > 0)
    n.recompute = True
    d = free.diff(other)
    assert [c.name for c in d.nodes] == [n.name] and (d.nodes[0].recompute_a, d.nodes[0].recompute_b) == (False, True)
    assert math.isclose(d.step_time_delta, 0.0)


def test_storage_folds_repeated_layers_in_natural_order():
    from types import SimpleNamespace

    from autoshard.report.text import storage_rows

    storage = {"wte.weight": "(S(0))", "ln_f.weight": "(R)"}
    for i in range(12):
        storage |= {f"h.{i}.mlp.weight": "(S(1))" if i != 7 else "(S(0))", f"h.{i}.mlp.bias": "(R)"}
    plan = SimpleNamespace(storage=dict(sorted(storage.items())))   # as a saved plan reads back: text order
    assert storage_rows(plan) == [
        ("h.[0-11].mlp.bias", "(R)", 12),
        ("h.[0-6,8-11].mlp.weight", "(S(1))", 11),
        ("h.7.mlp.weight", "(S(0))", 1),   # the layer stored otherwise, apart
        ("ln_f.weight", "(R)", 1),
        ("wte.weight", "(S(0))", 1),
    ]


def test_summary_storage_obeys_max_rows(plans):
    _, plan, _ = plans
    folded = len({(n.split(".", 2)[-1] if n.startswith("blocks.") else n, pl) for n, pl in plan.storage.items()})
    short, full = plan.summary(max_rows=1), plan.summary(expand=True)
    assert f"{folded - 1} more rows not shown" in short
    assert "more rows not shown" not in full and "x2" in full   # the tiny GPT's two layers, folded


# ---------------------------------------------------------------------------- repeated layers folded
def _layered(strategies: dict[int, str], layers=12):
    """A plan-like object: per layer a matmul (strategy from ``strategies``, default "(R)->(R)") and an add."""
    from types import SimpleNamespace

    from autoshard.planning.plan import NodeDecision

    nodes = [NodeDecision("embed", "aten.embedding.default", "(R)->(R)", 1e-3, "fwd")]
    for j in range(layers):
        nodes += [NodeDecision(f"mm_{j}", "aten.mm.default", strategies.get(j, "(R)->(R)"), 2e-3, "fwd", layer=j),
                  NodeDecision(f"add_{j}", "aten.add.Tensor", "(R)->(R)", 1e-4, "fwd", layer=j)]
    return SimpleNamespace(nodes=nodes, mesh_shape=(2,))


def test_alike_layers_fold_into_one_group():
    from autoshard.report.text import node_groups

    plan = _layered({5: "(S(0))->(S(0))"})
    groups, hidden = node_groups(plan, max_rows=40)
    assert [g.title for g in groups] == ["forward", "forward, layers 0-4,6-11 x 11", "forward, layer 5"]
    folded = groups[1]
    assert [n.name for n in folded.nodes] == ["mm_0", "add_0"]              # the first copy stands for all
    assert folded.total == 22 and folded.compute == pytest.approx(11 * 2.1e-3)
    assert hidden == 0                                                      # every node has a row standing for it
    unfolded, _ = node_groups(plan, max_rows=None, fold=False)
    assert len(unfolded) == 13 and sum(len(g.nodes) for g in unfolded) == len(plan.nodes)


def test_top_rows_rank_a_folded_row_by_all_its_copies():
    from autoshard.report.text import node_groups

    plan = _layered({})
    plan.nodes[0].compute = 5e-3                      # one embedding: 5 ms; twelve matmuls: 2 ms each, 24 in all
    groups, hidden = node_groups(plan, max_rows=1)
    assert [n.name for g in groups for n in g.nodes] == ["mm_0"]
    assert hidden == 1 + 12                           # the embedding and the twelve adds


def test_summary_folds_the_real_layers(plans):
    """The tiny GPT's two layers fold where their decisions match, and the folded table names no node
    of layer 1 while the full one does."""
    from autoshard.report.text import _signature

    _, free, _ = plans
    text, full = free.summary(max_rows=40), free.summary(expand=True)
    for phase, word in (("fwd", "forward"), ("bwd", "backward")):
        per_layer = [[n for n in free.nodes if n.phase == phase and n.layer == j] for j in (0, 1)]
        alike = _signature(per_layer[0]) == _signature(per_layer[1])
        assert (f"{word}, layers 0-1 x 2" in text) == alike
        assert (f"{word}, layer 1 " in text or f"{word}, layer 1\n" in text) == (not alike)
        if alike:
            names = {n.name for n in per_layer[1]}
            first_cells = lambda t: {line.split("│")[1].strip()  # noqa: E731
                                     for line in t.splitlines() if line.startswith("│")}
            assert not names & first_cells(text)
            assert names & first_cells(full)
    assert "layers 0-1 x 2" not in full


# ---------------------------------------------------------------------------- names and order
def test_placeholders_are_named_by_their_parameter(plans, traced):
    _, free, _ = plans
    assert free.param_names == {node.name: name for name, node in traced.params}
    assert Plan.from_json(free.to_json()).param_names == free.param_names
    d = json.loads(free.to_json())
    d.pop("param_names")                                   # a plan saved before the field existed
    assert Plan.from_json(json.dumps(d)).param_names == {}
    text = free.summary(expand=True, width=300)
    assert all(f"{node} ({name})" in text for node, name in free.param_names.items())


def test_storage_rows_follow_the_model(plans):
    from autoshard.report.text import storage_rows

    _, free, _ = plans
    with torch.device("meta"):
        order = [name for name, _ in GPT(GPTConfig.tiny()).named_parameters()]
    first = [name.replace("[0-1]", "0") for name, _, _ in storage_rows(Plan.from_json(free.to_json()))]
    positions = [order.index(name) for name in first]
    assert positions == sorted(positions) and len(first) < len(order)


def test_diff_ranks_by_step_time_change(plans):
    """Three changes of known size: an alike change in both layers (+1 ms each), one backward node
    outside the layers (+1.5 ms) and a placeholder whose cost does not move."""
    from autoshard.report.text import diff_rows

    _, free, _ = plans
    other = copy.deepcopy(free)
    by_layer = [[n for n in other.nodes if n.phase == "fwd" and n.layer == j] for j in (0, 1)]
    i = next(i for i, (x, y) in enumerate(zip(*by_layer))
             if (x.op, x.strategy, x.compute, x.comm) == (y.op, y.strategy, y.compute, y.comm) and x.compute > 0)
    for n in (by_layer[0][i], by_layer[1][i]):
        n.strategy, n.compute = n.strategy + " ", n.compute + 1e-3
    lone = next(n for n in other.nodes if n.phase == "bwd" and n.layer is None and n.compute > 0)
    lone.strategy, lone.compute = lone.strategy + " ", lone.compute + 1.5e-3
    holder = next(n for n in other.nodes if n.name in other.param_names)
    holder.strategy += " "
    d = free.diff(other)
    rows = diff_rows(d)
    assert [(r.change.name, r.layers) for r in rows] == [(by_layer[0][i].name, [0, 1]), (lone.name, []),
                                                        (holder.name, [])]
    assert [r.impact for r in rows] == pytest.approx([2e-3, 1.5e-3, 0.0])
    from autoshard.report.text import diff_text

    text = diff_text(d, width=300)
    assert text.index(by_layer[0][i].name) < text.index(lone.name) < text.index(holder.name)
    assert f"{holder.name} ({free.param_names[holder.name]})" in text and "0-1 x 2" in text


def test_diff_rows_add_up(plans, sharded):
    """On two real plans: every changed node is in one row, and the rows' changes add up to the
    nodes' own cost differences."""
    from autoshard.report.text import diff_rows

    _, free, _ = plans
    d = free.diff(sharded)
    rows = diff_rows(d)
    a, b = {n.name: n for n in free.nodes}, {n.name: n for n in sharded.nodes}
    cost = lambda n: n.compute * (1 + n.recompute) + sum(c["time"] for c in n.comm)  # noqa: E731
    assert sum(r.impact for r in rows) == pytest.approx(sum(cost(b[c.name]) - cost(a[c.name]) for c in d.nodes))
    assert sum(max(1, len(r.layers)) for r in rows) == len(d.nodes)
    impacts = [abs(r.impact) for r in rows]
    assert impacts == sorted(impacts, reverse=True)


def _local_bytes(val, placements: str, mesh_size: int) -> float:
    """Bytes of one rank's piece of ``val`` on a 1-D mesh: split in ``mesh_size`` when sharded."""
    return val.numel() * val.element_size() / (mesh_size if "S(" in placements else 1)


def test_nodes_hold_their_parameters_and_saved_activations(traced, plans, capped):
    """NodeDecision.memory by hand: a parameter holds its piece at rest four times (itself, its
    gradient, AdamW's two moments) and its working copy when that is placed otherwise; a forward
    node holds its output's piece when backward reads it unrecomputed; the saved ones add up to
    the plan's saved_for_backward."""
    vals = {n.name: n.meta.get("val") for n in traced.gm.graph.nodes}
    for plan in (plans[1], plans[2], capped):
        for n in plan.nodes:
            if n.name in plan.param_names:
                val, rest, work = vals[n.name], plan.storage[plan.param_names[n.name]], n.strategy.split("->")[1]
                expect = 4 * _local_bytes(val, rest, 2) + (_local_bytes(val, work, 2) if work != rest else 0.0)
                assert n.memory == pytest.approx(expect), (n.name, rest, work)
        saved = [n for n in plan.nodes if n.phase == "fwd" and n.name not in plan.param_names and n.memory > 0]
        assert saved and not any(n.recompute for n in saved)
        assert sum(n.memory for n in saved) == pytest.approx(plan.saved_for_backward)
        for n in saved:
            out = n.strategy.split("->")[1]
            if isinstance(vals[n.name], torch.Tensor) and out.count("(") == 1:   # one output
                assert n.memory == pytest.approx(_local_bytes(vals[n.name], out, 2)), n.name
    assert any(n.recompute for n in capped.nodes)


def test_diff_ranks_by_memory_change(plans, capped):
    """Ranked by the bytes held: the rows' changes add up to the nodes' own, largest first; a
    recomputed node gives up what it held; parameters stored otherwise show their change too."""
    from autoshard.report.text import diff_rows, diff_text

    _, free, _ = plans
    d = free.diff(capped)
    rows = diff_rows(d, by="memory")
    assert sum(r.memory for r in rows) == pytest.approx(sum(c.memory_b - c.memory_a for c in d.nodes))
    held = [abs(r.memory) for r in rows]
    assert held == sorted(held, reverse=True) and held[0] > 0
    flipped = [c for c in d.nodes if not c.recompute_a and c.recompute_b and c.memory_a > 0]
    assert flipped and all(c.memory_b == 0 for c in flipped)
    a, b = {n.name: n for n in free.nodes}, {n.name: n for n in capped.nodes}
    assert all(c.module == (a[c.name].module or b[c.name].module) for c in d.nodes)
    assert any("blocks." in (c.module or "") for c in d.nodes)
    text = diff_text(d, width=300, by="memory")
    assert "largest change to the bytes held first" in text and "memory change" in text
    assert d.storage_memory and set(d.storage_memory) == set(d.storage)
    for param, (ma, mb) in d.storage_memory.items():
        node = next(k for k, v in free.param_names.items() if v == param)
        assert (ma, mb) == (a[node].memory, b[node].memory)
    with pytest.raises(ValueError, match="by must be one of"):
        diff_rows(d, by="bytes")


# ---------------------------------------------------------------------------- the memory plot
def _svg(plan):
    import xml.etree.ElementTree as ET

    from autoshard.report.html import memory_svg

    root = ET.fromstring(memory_svg(plan))
    ns = lambda tag: tag.split("}")[-1]  # noqa: E731
    return [(ns(el.tag), el.get("class") or "", el, "".join(el.itertext())) for el in root.iter()]


def _one(items, cls):
    (el,) = [el for _, c, el, _ in items if c == cls]
    return el


@pytest.fixture(scope="module")
def capped(traced, plans):
    """A plan held under 75% of the free plan's peak: its peak is not the top of its timeline."""
    cluster, free, _ = plans
    return autoshard.plan(traced, cluster, memory_limit=0.75 * free.peak_memory)


def test_memory_plot_peak_is_the_plans_peak(capped):
    from autoshard.report.format import fmt_bytes
    from autoshard.report.text import header_lines

    curve_top = max(b for _, b in capped.memory_timeline)
    assert capped.peak_memory > curve_top            # the two models differ here: the case the label got wrong
    items = _svg(capped)
    label = "".join(_one(items, "peak-label").itertext())
    assert label.startswith(f"peak {fmt_bytes(capped.peak_memory)} ({capped.peak_moment})")
    assert f"peak memory {fmt_bytes(capped.peak_memory)}" in header_lines(capped)[2]
    assert fmt_bytes(curve_top) not in label


def test_memory_plot_counts_the_recomputed_term(plans):
    """As in a recompute plan: the timeline tops out at the peak less the recomputed values."""
    from autoshard.report.format import fmt_bytes

    _, free, _ = plans
    p = copy.deepcopy(free)
    p.nodes[next(i for i, n in enumerate(p.nodes) if n.phase == "fwd" and n.compute > 0)].recompute = True
    p.memory = {**p.memory, "recomputed": 42.0 * 2**20}
    p.peak_memory = sum(p.memory.values())
    top = max(b for _, b in p.memory_timeline)
    p.memory_timeline = [(n, b * (p.peak_memory - 42.0 * 2**20) / top) for n, b in p.memory_timeline]
    label = "".join(_one(_svg(p), "peak-label").itertext())
    assert f"peak {fmt_bytes(p.peak_memory)}" in label
    assert "recomputed" in p.to_html().split('<ul class="legend">')[1].split("</ul>")[0]


def test_memory_plot_axes(plans):
    """One unit on the y axis (bare numbers under one unit name); phases and layers on the x axis."""
    _, free, _ = plans
    items = _svg(free)
    ticks = [text for _, c, _, text in items if "ytick" in c]
    assert len(ticks) >= 3 and all(float(t) >= 0 for t in ticks)
    assert [text for _, c, _, text in items if c == "unit"] in (["KiB"], ["MiB"], ["GiB"])
    phases = [text for _, c, _, text in items if c == "phase"]
    assert phases == ["forward", "backward", "optimizer"]
    layers = {n.layer for n in free.nodes if n.layer is not None}
    assert {text for _, c, _, text in items if c == "layer"} == {f"L{j}" for j in layers}
    # a tick where each layer starts, in forward and again in backward
    assert sum(1 for _, c, _, _ in items if c == "layer-tick") >= 2 * len(layers)


@pytest.mark.parametrize("cap_over_peak", [0.95 + 0.0025 * k for k in range(81)] + [1.5, 2.5])
def test_memory_plot_labels_clear_the_cap(plans, cap_over_peak):
    _, free, _ = plans
    p = copy.deepcopy(free)
    p.memory_limit = p.peak_memory * cap_over_peak
    items = _svg(p)
    cap_y, peak_y = float(_one(items, "cap").get("y1")), float(_one(items, "peak").get("y1"))
    peak_label, cap_label = float(_one(items, "peak-label").get("y")), float(_one(items, "cap-label").get("y"))
    box = lambda y: (y - 11, y + 3)  # noqa: E731  11 px text about its baseline
    for (lo, hi), line in ((box(peak_label), cap_y), (box(cap_label), peak_y)):
        assert not lo - 1 <= line <= hi + 1, (cap_over_peak, lo, hi, line)
    (a, b), (c, d) = box(peak_label), box(cap_label)
    assert b < c or d < a                            # the two labels do not overlap
    plot = _one(items, "plot")
    assert all(0 <= y - 11 and y + 3 <= float(plot.get("height")) for y in (peak_label, cap_label))


def test_memory_legend_explains_the_curve(plans):
    _, free, _ = plans
    legend = free.to_html().split('<ul class="legend">')[1].split("</ul>")[0]
    for words in ("rises as each layer saves activations", "falls as each layer", "gradients are made",
                  "working set", "Peak"):
        assert words in legend


def test_memory_table_lists_the_parts_that_hold_bytes(plans):
    from autoshard.report.text import memory_rows

    _, free, _ = plans
    empty = [k for k, v in free.memory.items() if v == 0]
    assert empty, free.memory   # the free plan recomputes nothing, at least
    listed = [r[0] for r in memory_rows(free)]
    parts = listed[:listed.index("peak")]   # then the cap, where the plan has one
    assert parts == [k for k, v in free.memory.items() if v]
