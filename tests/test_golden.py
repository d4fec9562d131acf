"""Golden plans: every zoo case re-planned and compared with tests/golden/<case>.json, written by
``make golden``. Fails when a plan is more than 1% slower than its golden or any decision changed
(a faster plan with the same decisions passes: a cost-model change, regenerate to record it)."""

import json

import pytest

from golden_update import SLOWER_BY, cases, path, plan_case, summary


@pytest.mark.parametrize("name", cases())
def test_plan_matches_golden(name):
    if not path(name).is_file():
        pytest.fail(f"no golden for {name}: run `make golden` and commit tests/golden/{name}.json")
    want = json.loads(path(name).read_text())
    got = json.loads(json.dumps(summary(name, plan_case(name))))  # the same JSON round trip as the file
    assert got["step_time"] <= want["step_time"] * (1 + SLOWER_BY), \
        f"{name}: predicted step {got['step_time'] * 1e3:.4f} ms vs golden {want['step_time'] * 1e3:.4f} ms"
    assert got["mesh"] == want["mesh"]
    assert got["storage"] == want["storage"]
    assert got["inputs"] == want["inputs"]
    changed = {(block, node): (d, got["decisions"].get(block, {}).get(node))
               for block, nodes in want["decisions"].items() for node, d in nodes.items()
               if got["decisions"].get(block, {}).get(node) != d}
    added = {(b, n) for b, ns in got["decisions"].items() for n in ns if n not in want["decisions"].get(b, {})}
    assert not changed and not added, f"{name}: decisions changed (golden, now): {dict(list(changed.items())[:8])}" \
                                      f"{' new nodes: ' + str(sorted(added)[:8]) if added else ''}"
