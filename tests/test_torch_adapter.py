"""autoshard/_torch.py: every private torch name autoshard relies on resolves on this torch."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from autoshard import _torch


@pytest.mark.parametrize("name", _torch.__all__)
def test_every_exported_name_resolves(name):
    obj = getattr(_torch, name)
    assert obj is not None
    assert callable(obj) or isinstance(obj, type), f"{name} resolved to a non-callable {obj!r}"


def test_all_has_no_duplicates():
    assert len(_torch.__all__) == len(set(_torch.__all__))


def test_planning_mesh_2x8_needs_no_process_group():
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "tests of this file run without a process group"
    mesh = _torch.planning_mesh((2, 8), ("node", "gpu"))
    assert tuple(mesh.shape) == (2, 8)
    assert mesh.ndim == 2
    assert mesh.mesh_dim_names == ("node", "gpu")
    assert mesh.size() == 16
    assert torch.equal(mesh.mesh, torch.arange(16).view(2, 8))
    # still no process group afterwards
    assert not (dist.is_available() and dist.is_initialized())


def test_planning_mesh_any_world_size():
    mesh = _torch.planning_mesh((64,), ("d0",))
    assert tuple(mesh.shape) == (64,) and mesh.size() == 64


def test_sharding_propagator_has_mm_rule():
    prop = _torch.sharding_propagator()
    mm = torch.ops.aten.mm.default
    assert mm in prop.op_single_dim_strategy_funcs or mm in prop.op_strategy_funcs


def test_unpriced_strategies_keeps_the_placements_and_drops_dtensor_prices():
    """Enumerating with DTensor's redistribution prices at 0 gives the same strategies on every
    node of a traced Llama (2-D mesh), and the prices come back afterwards."""
    from torch.distributed.tensor._ops import utils

    import autoshard
    from autoshard.passes.strategies import META_KEY, _enumerate_graph
    from autoshard.zoo import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab=256, seq=32, hidden=64, heads=4, intermediate=128, layers=1))
    traced = autoshard.trace(model, tuple(torch.empty(8, 32, dtype=torch.long, device="meta") for _ in range(2)))
    mesh = _torch.planning_mesh((2, 2), ("a", "b"))
    spec = _torch.DTensorSpec(mesh, (Shard(0), Replicate()), _torch.TensorMeta((8, 16), (16, 1), torch.float32))
    target = _torch.DTensorSpec(mesh, (Replicate(), Replicate()), spec.tensor_meta)
    price = lambda: utils.generate_redistribute_costs(_torch.OpStrategy([_torch.OpSpec(spec)]), target)  # noqa: E731

    def enumerate_all():
        _enumerate_graph(traced.gm, mesh, (2, 2))
        return {n: n.meta.get(META_KEY) for n in traced.gm.graph.nodes}

    priced = enumerate_all()
    with _torch.unpriced_strategies():
        assert price() == [0.0]
        unpriced = enumerate_all()
    assert price()[0] > 0
    assert unpriced == priced and sum(len(ns.strategies) for ns in priced.values() if ns) > 100


def test_flop_formula_for_mm_matches_hand_count():
    f = _torch.flop_formula(torch.ops.aten.mm.default)
    assert f is not None
    a, b = torch.empty(3, 5), torch.empty(5, 7)
    assert f(a, b, out_val=torch.empty(3, 7)) == 2 * 3 * 5 * 7


def test_flop_formula_unknown_op_is_none():
    assert _torch.flop_formula(torch.ops.aten.mse_loss.default) is None


def test_register_flop_formula_is_idempotent():
    from autoshard.passes.rules import attention

    before = _torch.flop_formula(attention.FWD)
    assert before is not None
    # a second registration of an op that already has a formula must not raise nor replace it
    _torch.register_flop_formula([attention.FWD.overloadpacket], lambda *a, **k: 0)
    assert _torch.flop_formula(attention.FWD) is before


def test_is_data_dependent_error():
    from torch._subclasses.fake_tensor import DataDependentOutputException

    assert _torch.is_data_dependent_error(DataDependentOutputException(torch.ops.aten._local_scalar_dense.default))
    assert not _torch.is_data_dependent_error(ValueError("shape mismatch"))


def test_dtensor_spec_builds_on_planning_mesh():
    mesh = _torch.planning_mesh((2,), ("d0",))
    t = torch.empty(4, 6)
    spec = _torch.DTensorSpec(mesh, (Shard(0),), _torch.TensorMeta(t.shape, t.stride(), t.dtype))
    assert spec.placements == (Shard(0),)
    assert _torch.DTensorSpec(mesh, (Replicate(),), spec.tensor_meta).placements == (Replicate(),)


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"])
def test_supported_versions_pass(version):
    _torch.check_version(version)


@pytest.mark.parametrize("version", ["2.10.2", "2.16.0", "2.16.0a0+git1234567", "3.0.0", "1.13.1", "nightly"])
def test_unsupported_version_names_the_range(version, monkeypatch):
    from autoshard.errors import UnsupportedTorchError

    monkeypatch.delenv(_torch.ANY_TORCH, raising=False)
    with pytest.raises(UnsupportedTorchError, match=r"supports torch 2\.11 to 2\.15, but torch .* is installed"):
        _torch.check_version(version)
    monkeypatch.setenv(_torch.ANY_TORCH, "1")
    with pytest.warns(UserWarning, match="going on because"):
        _torch.check_version(version)


@pytest.mark.parametrize("code", [
    "import torch; torch.__version__ = '2.10.0'; import autoshard",
    # autoshard imported first loads torch lazily (for a fast `autoshard --help`): the first use checks
    "import autoshard, torch; torch.__version__ = '2.10.0'; autoshard.plan",
    "import autoshard.cli, torch; torch.__version__ = '2.10.0'; import autoshard.api",
])
def test_import_on_unsupported_torch_fails_at_import(code):
    """A fresh interpreter whose torch claims 2.10: ``import autoshard`` (or, when torch was not
    imported yet, the first use of a name that needs it) fails with the typed error naming the
    range, before any private name is looked up (no AttributeError from a pass)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != _torch.ANY_TORCH}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("autoshard.errors.UnsupportedTorchError: autoshard supports torch 2.11 to 2.15"), last


def test_pyproject_asks_for_the_supported_range():
    """The install requirement and the import check name the same releases."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    (lo_major, lo), (hi_major, hi) = _torch.SUPPORTED
    assert spec.replace(" ", "") == f"torch>={lo_major}.{lo},<{hi_major}.{hi + 1}", spec


def test_grouped_mm_any_float_is_scoped():
    """Fake tensors multiply float32 grouped GEMMs inside the context, with the shape the CPU
    kernel gives, and bfloat16 ones as torch does; outside, afterwards, torch's meta kernel
    answers float32 as it did before (2.11 to 2.13 refuse it, 2.15 accepts it): the result cache
    made inside answers nothing later."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w = torch.randn(10, 8), torch.randn(3, 8, 16)
    offs = torch.tensor([2, 7, 10], dtype=torch.int32)
    want = torch._grouped_mm(x, w, offs=offs).shape

    def fake(dtype):
        mode = FakeTensorMode()
        a, b, o = (mode.from_tensor(t) for t in (x.to(dtype), w.to(dtype), offs))
        with mode:
            return torch._grouped_mm(a, b, offs=o).shape

    def torchs_own():
        try:
            return fake(torch.float32)
        except RuntimeError as e:
            return str(e)

    before = torchs_own()
    with _torch.grouped_mm_any_float():
        assert fake(torch.float32) == want and fake(torch.bfloat16) == want
    assert torchs_own() == before
