"""The placement notation reads back every placement the strategies write (autoshard/notation.py)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
from autoshard import _torch, zoo
from autoshard.zoo import corpus
from autoshard.notation import parse_placement, parse_placements, placement_str, placements_str
from autoshard.passes.strategies import META_KEY, find_strategies


class MaxPool(torch.nn.Module):
    """Reductions by max and min, whose rules may leave a max or min pending (P(max), P(min))."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.proj(x)
        return ((h.amax(dim=1) - h.amin(dim=1) - y) ** 2).mean()


def _models():
    yield "gpt", *zoo.get("gpt", "tiny")
    yield "mixtral", *zoo.get("mixtral", "tiny")
    yield "qwen2", *corpus.get("qwen2")
    yield "rope_complex", *corpus.get("rope_complex")
    yield "max", MaxPool(), (torch.randn(8, 4, 16), torch.randn(8, 16))


@pytest.fixture(scope="module")
def written():
    """Every placement tuple any strategy of these models holds on a 1-D and a 2-D mesh."""
    out = set()
    for _, model, inputs in _models():
        traced = autoshard.trace(model, inputs)
        for shape in ((4,), (2, 2)):
            find_strategies(traced.gm, _torch.planning_mesh(shape, tuple(f"d{i}" for i in range(len(shape)))))
            for node in traced.gm.graph.nodes:
                for s in getattr(node.meta.get(META_KEY), "strategies", []):
                    out.update(p for p in (*s.inputs, *s.outputs) if p is not None)
    return out


def test_every_written_placement_reads_back(written):
    kinds = {type(p) for ps in written for p in ps}
    assert {Replicate, Shard, Partial} <= kinds, kinds
    for ps in written:
        assert parse_placements(placements_str(ps), len(ps)) == tuple(ps), placements_str(ps)
        for p in ps:
            assert parse_placement(placement_str(p)) == p


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
def test_partial_reduce_ops_read_back(op):
    text = placements_str((Shard(1), Partial(op)))
    assert text == f"(S(1),{'P' if op == 'sum' else f'P({op})'})"
    assert parse_placements(text, 2) == (Shard(1), Partial(op))


@pytest.mark.parametrize("bad", ["X", "S()", "S(-1)", "P(", "(R,R"])
def test_unknown_notation_says_what_is_accepted(bad):
    with pytest.raises(ValueError, match="unknown placement|placements for a"):
        parse_placements(bad, 1)
