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
from autoshard.plan import PlanDiff
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
    (lambda d: d.update(memory_limit=-1), "memory_limit"),
    (lambda d: d.pop("fingerprint"), "fingerprint"),
    (lambda d: d["nodes"][0].update(recompute="yes"), "recompute"),
], ids=["node-compute", "comm-entry", "edges", "timeline", "mfu", "limit", "fingerprint", "recompute"])
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
    g, nxg = _dot_graphs(p.to_dot())
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
    _, nxg = _dot_graphs(p.to_dot())
    labels = [d.get("label", "") for d in nxg.get_edge_data(producer.name, consumer.name).values()]
    assert any(consumer.comm[0]["kind"] in l for l in labels)


def test_dot_without_edges_has_just_nodes(plans):
    _, free, _ = plans
    p = copy.deepcopy(free)
    p.edges = []
    for n in p.nodes:   # a collective naming its producer would draw that edge
        n.comm = []
    p.nodes[0].name = 'odd "name" \\ here'
    g, nxg = _dot_graphs(p.to_dot())
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
    assert "url(" not in text.replace("url(#arrow)", "")   # the only reference is the inline arrow marker
    return parser


def test_html_report_is_self_contained(plans, tmp_path):
    _, _, pinned = plans
    p = _dressed(pinned)
    p.save_html(tmp_path / "plan.html")
    text = (tmp_path / "plan.html").read_text(encoding="utf-8")
    parser = _check_html(text)
    assert parser.svgs == ["memory-plot", "plan-graph"]
    assert ("line", "cap") in parser.classes and ("polyline", "memory") in parser.classes
    endpoints = {x for e in p.edges for x in e} | {n.name for n in p.nodes}   # "output" may be only an endpoint
    assert sum(1 for t, c in parser.classes if c == "node") == len(endpoints)
    assert "solver&#x27;s prediction" in text or "solver's prediction" in text   # the given timeline
    assert "parameter storage" in text.lower() and "wte.weight" in text
    assert "<table>" in text and p.nodes[0].name in text


def test_html_derives_a_timeline_without_one(plans):
    _, free, _ = plans
    p = copy.deepcopy(free)
    p.memory_timeline, p.memory_limit, p.edges = [], None, []
    parser = _check_html(p.to_html())
    assert parser.svgs == ["memory-plot", "plan-graph"] and ("line", "cap") not in parser.classes
    from autoshard.report_html import memory_timeline

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
    assert d.storage and all(name in text for name in d.storage)
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

    from autoshard.report import storage_rows

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
