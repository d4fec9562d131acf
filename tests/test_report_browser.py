"""The reports looked at, not only generated: the GPT-2 HTML opened in headless Chromium (page
loads without errors, the graph fits a 1440 px wide window, a screenshot is taken) and its DOT
drawn by graphviz ``dot`` in seconds.

Chromium and graphviz come from Debian's packages: the test installs them with apt-get when
they are missing, and fails (never skips) when it cannot, so CI always looks at the page."""

import json
import os
import re
import resource
import shutil
import struct
import subprocess
import time

import pytest

import autoshard
import autoshard.zoo
from autoshard import Cluster
from autoshard.report.modules import fold

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")

WIDTH, HEIGHT = 1440, 900


def _ensure(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian's ``package`` first if it is missing."""
    if shutil.which(binary):
        return shutil.which(binary)
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.fail(f"{binary} is missing and this test cannot install it (needs root and apt-get): "
                    f"run 'apt-get install -y {package}'")
    log = ""
    for cmd in (["apt-get", "install", "-y", package], ["apt-get", "update"], ["apt-get", "install", "-y", package]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        log += f"$ {' '.join(cmd)}\n{r.stdout[-1500:]}{r.stderr[-1500:]}\n"
        if cmd[1] == "install" and r.returncode == 0 and shutil.which(binary):
            return shutil.which(binary)
    pytest.fail(f"could not install {package} with 'apt-get install -y {package}', so {binary} is missing:\n{log}")


@pytest.fixture(scope="module")
def gpt2():
    model, inputs = autoshard.zoo.get("hf_gpt2", "124m", device="meta")
    return autoshard.plan(model, Cluster.preset("dgx-h100", nodes=1), inputs)


def _chromium(browser: str, url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=10000", *args, url],
                          capture_output=True, text=True, timeout=120)


# Collects script errors and failed loads (images, styles) and measures the page once it has
# laid out; the result goes to the title, which --dump-dom prints.
_PROBE = """<script>
window.__errors = [];
addEventListener("error", e => __errors.push(String(e.message || (e.target && e.target.outerHTML))), true);
addEventListener("load", () => {
  const g = document.getElementById("module-graph").getBoundingClientRect();
  document.title = "PROBE" + JSON.stringify({errors: __errors, left: g.left, right: g.right, width: g.width,
    height: g.height, inner: innerWidth, scroll: document.documentElement.scrollWidth}) + "PROBE";
});
</script>"""


def test_gpt2_page_loads_and_fits_in_chromium(gpt2, tmp_path):
    browser = _ensure("chromium", "chromium")
    page = tmp_path / "plan.html"
    gpt2.save_html(page)
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + _PROBE, 1), encoding="utf-8")
    r = _chromium(browser, probe.as_uri(), "--dump-dom")
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"PROBE(.*?)PROBE", r.stdout)
    assert m, f"the page did not finish loading:\n{r.stderr[-3000:]}"
    got = json.loads(m.group(1).replace("&quot;", '"'))
    assert got["errors"] == []
    assert got["inner"] == WIDTH and got["width"] > 0.5 * WIDTH and got["height"] > 200
    assert got["left"] >= 0 and got["right"] <= WIDTH, f"graph {got['left']}-{got['right']} px wider than the window"
    assert got["scroll"] <= WIDTH, f"the page scrolls sideways ({got['scroll']} px)"
    drawn = float(re.search(r'<svg id="module-graph"[^>]* width="([\d.]+)"', page.read_text()).group(1))
    assert got["width"] >= 0.95 * drawn, "the graph fits only by shrinking its text"

    shot = tmp_path / "plan.png"
    r = _chromium(browser, page.as_uri(), f"--screenshot={shot}")
    assert r.returncode == 0 and shot.exists(), r.stderr[-3000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (WIDTH, HEIGHT)
    assert len(data) > 30_000       # a blank page compresses to a few kB; text and plot do not


def test_gpt2_dot_renders_in_seconds(gpt2, tmp_path):
    dot = _ensure("dot", "graphviz")
    src = tmp_path / "plan.dot"
    src.write_text(gpt2.to_dot())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([dot, "-Tpng", str(src), "-o", str(tmp_path / "plan.png")],
                       capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr
    # CPU time is the figure: on a loaded machine the wall clock mostly measures the others
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 10 and wall < 60, f"dot took {cpu:.1f} s CPU, {wall:.1f} s wall"
    data = (tmp_path / "plan.png").read_bytes()
    w, h = struct.unpack(">II", data[16:24])
    assert w * h < 4000 * 4000      # a picture a screen can hold, not a 4520 x 17580 px scroll
    assert len(fold(gpt2).blocks) == 1


def test_a_missing_browser_that_cannot_be_installed_fails_the_test(monkeypatch):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package chromium")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(pytest.fail.Exception, match="(?s)could not install chromium.*Unable to locate"):
        _ensure("chromium", "chromium")
    assert ["apt-get", "install", "-y", "chromium"] in calls and ["apt-get", "update"] in calls
