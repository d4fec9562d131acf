"""The `autoshard` command line, run as `python -m autoshard.cli` in subprocesses (started
together, since each pays torch's import), plus in-process checks of --help and parsing."""

import json
import subprocess
import sys
import textwrap

import pytest

import autoshard
from autoshard import cli
from autoshard.planning.plan import Plan


def _run_all(cwd, commands: dict[str, list[str]], timeout=120) -> dict:
    procs = {k: subprocess.Popen([sys.executable, "-m", "autoshard.cli", *args], cwd=cwd, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k, args in commands.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "corrupt.json").write_text('{"schema": 1, "nodes": [')
    first = _run_all(d, {
        "json": ["plan", "gpt-tiny", "--cluster", "cpu:1", "--out", "x.json", "--memory-limit", "5GB"],
        # one plan, three files (a plan takes seconds; each file is written the same way alone)
        "html_dot": ["plan", "gpt-tiny", "--cluster", "cpu:1", "--batch", "4", "--out", "x.html", "--out", "x.dot",
                     "--out", "y.json", "-q"],
        "inductor": ["plan", "gpt-tiny", "--cluster", "cpu:1", "--batch", "4", "--backend", "inductor", "--out",
                     "z.json", "-q"],
        "clusters": ["clusters"],
        "bad_preset": ["plan", "gpt-tiny", "--cluster", "nosuch:2"],
        "missing_model": ["plan", "no-such-model", "--cluster", "cpu:1"],
        "corrupt": ["show", "corrupt.json"],
    })
    second = _run_all(d, {"show": ["show", "x.json", "--max-rows", "5"], "diff": ["diff", "x.json", "y.json"]})
    return d, {**first, **second}


@pytest.mark.parametrize("name, files", [("json", ["x.json"]), ("html_dot", ["x.html", "x.dot", "y.json"])])
def test_plan_writes_its_file(runs, name, files):
    d, r = runs
    assert r[name].returncode == 0, r[name].stderr
    for f in files:
        assert (d / f).stat().st_size > 0


def test_plan_json_output(runs):
    d, r = runs
    plan = Plan.load(d / "x.json")
    assert plan.mesh_shape == (1, 2) and plan.memory_limit == 5e9
    assert "step" in r["json"].stdout and "parameter storage" in r["json"].stdout   # the summary printed
    assert "parameter storage" not in r["html_dot"].stdout                           # -q: no summary
    assert "wrote x.html" in r["html_dot"].stderr


def test_plan_for_the_inductor_backend(runs):
    d, r = runs
    assert r["inductor"].returncode == 0, r["inductor"].stderr
    fused, eager = Plan.load(d / "z.json"), Plan.load(d / "y.json")   # the same model, batch and cluster
    assert (fused.backend, eager.backend) == ("inductor", "eager")
    assert fused.compute_time < eager.compute_time


def test_plan_html_and_dot_outputs(runs):
    import networkx as nx
    import pydot

    d, _ = runs
    html = (d / "x.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and 'id="module-graph"' in html and 'id="memory-plot"' in html
    assert "https://" not in html and "http://" not in html and "src=" not in html
    (g,) = pydot.graph_from_dot_data((d / "x.dot").read_text())
    g = nx.DiGraph(nx.nx_pydot.from_pydot(g))   # the module graph: layers folded, no cycles
    assert 5 < g.number_of_nodes() < 60 and nx.is_directed_acyclic_graph(g)


def test_show_and_diff(runs):
    _, r = runs
    assert r["show"].returncode == 0, r["show"].stderr
    assert "step" in r["show"].stdout and "top 5 by cost" in r["show"].stdout
    assert r["diff"].returncode == 0, r["diff"].stderr
    assert "same graph: NO" in r["diff"].stdout and "step time" in r["diff"].stdout


def test_clusters(runs):
    from autoshard.cluster import PRESETS

    _, r = runs
    assert r["clusters"].returncode == 0
    for name, p in PRESETS.items():
        assert name in r["clusters"].stdout and p.device.name in r["clusters"].stdout


@pytest.mark.parametrize("name, words", [("bad_preset", "nosuch"), ("missing_model", "no-such-model"),
                                         ("corrupt", "corrupt.json")])
def test_errors_exit_nonzero_with_one_line(runs, name, words):
    _, r = runs
    res = r[name]
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoshard: error: ") and words in lines[0], res.stderr
    assert "Traceback" not in res.stderr


# ---------------------------------------------------------------------------- in process
@pytest.mark.parametrize("argv", [[], ["plan"], ["show"], ["diff"], ["clusters"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: autoshard")
    if argv == ["plan"]:
        assert "--memory-limit" in out and "gpt-tiny" in out and "package.module:factory" in out


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "gpt-tiny"])          # --cluster is required
    assert info.value.code == 2


@pytest.mark.parametrize("text, want", [("40GB", 40e9), ("80GiB", 80 * 2**30), ("1.5e10B", 1.5e10),
                                        ("512 MiB", 512 * 2**20), ("2tb", 2e12)])
def test_parse_bytes(text, want):
    assert cli.parse_bytes(text) == want


@pytest.mark.parametrize("text", ["40G", "-1GB", "lots", "0", "40", "1.5e10"])   # a size needs its unit
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="memory-limit"):
        cli.parse_bytes(text)


def test_parse_cluster():
    c = cli.parse_cluster("dgx-h100:2")
    assert c.mesh_shape == (2, 8) and c.mesh_dim_names == ("node", "gpu")
    assert cli.parse_cluster("local:4").mesh_shape == (4,)
    for bad in ("dgx-h100:x", "nope"):
        with pytest.raises(ValueError):
            cli.parse_cluster(bad)


def test_zoo_and_factory_models(tmp_path, monkeypatch):
    models = cli.zoo_models()
    assert {"gpt-tiny", "gpt2", "mlp"} <= set(models)
    model, (idx, _) = cli.build_model("gpt2", None, 128)
    assert idx.shape == (8, 128) and idx.device.type == "meta"
    assert all(p.device.type == "meta" for p in model.parameters())
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch
        from autoshard.zoo import MLP

        def pair():
            return MLP(), (torch.empty(4, 32), torch.empty(4, 16))

        class WithInputs(MLP):
            def example_inputs(self, batch, device="cpu"):
                return torch.empty(batch, 32, device=device), torch.empty(batch, 16, device=device)

        def bare():
            return WithInputs()
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, inputs = cli.build_model("my_models:pair", None, None)
    assert next(model.parameters()).device.type == "meta"
    model, (x, y) = cli.build_model("my_models:bare", 6, None)
    assert x.shape == (6, 32) and x.device.type == "meta"
    for bad, words in (("my_models:nope", "cannot load"), ("no_such_module:f", "cannot load"),
                       ("gpt", "unknown model")):
        with pytest.raises(ValueError, match=words):
            cli.build_model(bad, None, None)
    with pytest.raises(ValueError, match="--seq"):
        cli.build_model("mlp", None, 12)


def test_out_suffix_checked_before_planning(tmp_path, capsys):
    assert cli.main(["plan", "gpt-tiny", "--cluster", "cpu", "--out", str(tmp_path / "x.txt")]) == 1
    assert "must end in .json, .html or .dot" in capsys.readouterr().err


def test_out_folder_checked_before_planning(tmp_path, capsys, monkeypatch):
    planned = []
    monkeypatch.setattr(autoshard, "plan", lambda *a, **k: planned.append(a))
    assert cli.main(["plan", "gpt-tiny", "--cluster", "cpu", "--out", str(tmp_path / "no" / "x.json")]) == 1
    assert "no folder" in capsys.readouterr().err and not planned


def test_json_that_is_not_a_plan_says_so(tmp_path, capsys):
    (tmp_path / "other.json").write_text('{"name": "a config, not a plan"}')
    assert cli.main(["show", str(tmp_path / "other.json")]) == 1
    assert "not a plan file" in capsys.readouterr().err


def test_hints_name_flags(capsys):
    """The infeasibility hint names --memory-limit, as the user typed it, not the Python argument."""
    assert cli.main(["plan", "gpt-tiny", "--cluster", "local:1", "--memory-limit", "1KB", "-q"]) == 1
    err = capsys.readouterr().err
    assert "Raise --memory-limit to at least" in err and "memory_limit" not in err, err


def test_diff_in_process(runs, capsys):
    d, _ = runs
    assert cli.main(["diff", str(d / "x.json"), str(d / "x.json")]) == 0
    assert "same decisions" in capsys.readouterr().out
    assert cli.main(["diff", str(d / "x.json"), str(d / "corrupt.json")]) == 1
    assert "corrupt.json" in capsys.readouterr().err
    assert cli.main(["diff", str(d / "x.json"), str(d / "y.json"), "--by", "memory"]) == 0
    assert "largest change to the bytes held first" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["diff", str(d / "x.json"), str(d / "y.json"), "--by", "bytes"])
    assert "invalid choice" in capsys.readouterr().err


def test_show_converts_a_saved_plan(runs, tmp_path, capsys):
    d, _ = runs
    assert cli.main(["show", str(d / "x.json"), "--out", str(tmp_path / "s.html"), "--out", str(tmp_path / "s.dot"),
                     "--all"]) == 0
    assert (tmp_path / "s.html").stat().st_size > 0 and (tmp_path / "s.dot").read_text().startswith("digraph")
    assert "cheaper nodes not shown" not in capsys.readouterr().out
    assert json.loads((d / "x.json").read_text())["schema"] == 1


# ---------------------------------------------------------------------------- issue 31: readable at scale
HELP_PROBE = """
import runpy, sys
sys.argv = {argv!r}
try:
    {call}
except SystemExit as exc:
    code = exc.code
print("torch" in sys.modules, code)
"""


@pytest.mark.parametrize("call", ["runpy.run_module('autoshard.cli', run_name='__main__')",   # python -m autoshard.cli
                                  "__import__('autoshard.cli').cli.main()"])                  # the console script
@pytest.mark.parametrize("argv", [["autoshard", "--help"], ["autoshard", "plan", "--help"]])
def test_help_does_not_import_torch(call, argv):
    """--help answers at once: the entry point reaches argparse without importing torch (seconds)."""
    res = subprocess.run([sys.executable, "-c", HELP_PROBE.format(argv=argv, call=call)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "False 0", res.stdout
    assert "usage: autoshard" in res.stdout and ("gpt2" in res.stdout) == (argv[1] == "plan")


def test_lazy_package_keeps_its_names():
    """The names autoshard exports load on first use and are the objects they always were."""
    import importlib

    from autoshard import api, cluster

    assert autoshard.plan is api.plan and callable(autoshard.plan)   # the function, not the submodule
    assert autoshard.Plan is importlib.import_module("autoshard.planning.plan").Plan and autoshard.Cluster is cluster.Cluster
    assert autoshard.plan is api.plan                                 # importing the submodule did not rebind it
    with pytest.raises(AttributeError):
        autoshard.no_such_name  # noqa: B018


@pytest.mark.parametrize("text", ["40", " 512 ", "1.5e10"])
def test_bare_memory_limit_is_a_typed_error(text):
    from autoshard.errors import ConstraintError

    with pytest.raises(ConstraintError, match="no unit; add one") as info:
        cli.parse_bytes(text)
    assert f"{text.strip()}GB" in str(info.value)


def test_bare_memory_limit_fails_before_planning(capsys, monkeypatch):
    planned = []
    monkeypatch.setattr(autoshard, "plan", lambda *a, **k: planned.append(a))
    assert cli.main(["plan", "gpt-tiny", "--cluster", "cpu", "--memory-limit", "40"]) == 1
    err = capsys.readouterr().err
    assert "has no unit" in err and "40GB" in err and not planned


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_show_honours_the_terminal_width(runs, capsys, monkeypatch, columns):
    d, _ = runs
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["show", str(d / "x.json"), "--all"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= columns
    if columns == 200:
        assert max(map(len, lines)) > 100     # a wide terminal is used, not a fixed narrow width


def test_footers_name_flags_not_python(runs, capsys, monkeypatch):
    d, _ = runs
    monkeypatch.setenv("COLUMNS", "300")     # one footer per line
    assert cli.main(["show", str(d / "x.json"), "--max-rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "(--all shows all)" in out and "more rows not shown (--all shows all)" in out
    assert "expand" not in out and "summary(" not in out
    other = Plan.load(d / "x.json")
    for n in other.nodes[-5:]:
        n.strategy += " "               # five nodes decided "differently"
    other.save(d / "x_other.json")
    assert cli.main(["diff", str(d / "x.json"), str(d / "x_other.json"), "--max-rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "5 nodes decided differently" in out
    assert "(--max-rows N shows more)" in out and "PlanDiff" not in out


def test_plan_all_flag():
    args = cli.parser().parse_args(["plan", "gpt-tiny", "--cluster", "cpu", "--all"])
    assert args.all and args.max_rows == 40


def test_library_hints_become_flags():
    text = ("no plan fits 1.00 MiB per device; ... Raise memory_limit to at least 2.00 GiB, use more devices, "
            "allow recompute, or shrink the batch; the solver stopped at time_limit=5s")
    got = cli._as_flags(text)
    for flag in ("--memory-limit", "--cluster PRESET:NODES", "drop --no-recompute", "--batch", "--time-limit=5s"):
        assert flag in got
    assert "memory_limit" not in got and "time_limit" not in got


def test_zoo_table_names_real_models():
    """The CLI's static table of zoo models (read by --help without torch) names real configs."""
    from autoshard import zoo

    for name, (_, how) in cli._ZOO.items():
        if how is not None:
            cls, ctor, _ = how
            assert callable(getattr(zoo, cls)) and callable(getattr(getattr(zoo, f"{cls}Config"), ctor)), name
    model, (idx, _) = cli.build_model("llama-tiny", None, 8)
    assert idx.shape == (2, 8) and next(model.parameters()).device.type == "meta"
