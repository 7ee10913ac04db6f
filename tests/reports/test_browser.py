"""The report in a real browser: headless Chromium opens report.html without console errors, every image decodes,
and a screenshot is saved (path printed; look at it when the layout changes).

Skipped where no Chromium is installed (Debian: ``apt-get install -y chromium``; ``.ci/run`` installs it). Set
``RANDATTN_CHROMIUM`` to a browser binary to use another one, and ``RANDATTN_ARTIFACTS`` to a folder to keep a copy of
the screenshot.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from randattn.reports.html import write_report
from randattn.reports.testing import make_results_table


def _find_browser() -> str | None:
    candidates = [os.environ.get("RANDATTN_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]
    for candidate in filter(None, candidates):
        found = shutil.which(candidate)
        if found:
            return found
    return None


BROWSER = _find_browser()
pytestmark = pytest.mark.skipif(
    BROWSER is None,
    reason="no Chromium browser found (Debian/Ubuntu: apt-get install -y chromium; or set RANDATTN_CHROMIUM)",
)

#: records errors (script errors, console.error, resources that fail to load) and every image's decoded size into
#: the DOM on load, where --dump-dom can read them
_PROBE = """<script>
window.__problems = [];
window.addEventListener("error", function (e) {
  var target = e.target && e.target !== window ? (e.target.tagName + " " + (e.target.alt || "")) : "";
  window.__problems.push("error: " + (e.message || "resource failed to load") + " " + target);
}, true);
var __consoleError = console.error;
console.error = function () { window.__problems.push("console.error: " + Array.from(arguments).join(" "));
                              __consoleError.apply(console, arguments); };
window.addEventListener("load", function () {
  var images = Array.from(document.images).map(function (i) {
    return {alt: i.alt, complete: i.complete, width: i.naturalWidth, height: i.naturalHeight}; });
  var out = document.createElement("pre");
  out.id = "randattn-probe";
  out.textContent = JSON.stringify({problems: window.__problems, images: images,
    sections: Array.from(document.querySelectorAll("h2[id]")).map(function (h) { return h.id; }),
    width: document.documentElement.scrollWidth, viewport: window.innerWidth});
  document.body.appendChild(out);
});
</script>"""


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    command = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def _probe(page: Path, tmp_path: Path) -> dict:
    """Open an instrumented copy of ``page`` and return what the probe recorded."""
    text = page.read_text(encoding="utf-8")
    probed = page.with_name(page.stem + ".probe.html")
    probed.write_text(text.replace("<head>", "<head>" + _PROBE, 1), encoding="utf-8")
    result = _chromium("--dump-dom", probed.as_uri(), profile=tmp_path / "profile-probe")
    match = re.search(r'<pre id="randattn-probe">(.*?)</pre>', result.stdout, re.S)
    assert match, f"the probe did not run (exit {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(html.unescape(match.group(1)))


def _console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_probe_detects_broken_images_and_console_errors(tmp_path):
    """The harness has teeth: a page with a console error and an undecodable image is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><script>console.error("boom")</script></head>'
                   '<body><img alt="broken" src="data:image/png;base64,AAAA"></body></html>', encoding="utf-8")
    found = _probe(bad, tmp_path)
    assert any("boom" in p for p in found["problems"])
    assert found["images"] == [{"alt": "broken", "complete": True, "width": 0, "height": 0}]


def test_report_renders_in_chromium(tmp_path):
    table = make_results_table(tokens=(197,), samples=(16, 64), heads=2, layers=(0, 11),
                               labels=["softmax", "rfa", "rfa:coupling=orthogonal", "lara"])
    metadata = {"command_line": "randattn mse acts.safetensors --out results.parquet", "warnings": [
        {"category": "NonPositiveDenominatorWarning", "label": "lara", "count": 38,
         "message": "the estimator's normalizer is zero or negative for 2 of 197 queries"}]}
    page = write_report(table, tmp_path / "out", metadata=metadata, dpi=60)
    expected_images = page.read_text(encoding="utf-8").count("<img ")

    found = _probe(page, tmp_path)
    assert found["problems"] == []
    assert len(found["images"]) == expected_images >= 5
    for image in found["images"]:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0, image
    assert found["sections"] == ["summary", "figures", "warnings", "diagnostics", "provenance"]
    assert found["width"] <= found["viewport"]  # nothing forces a horizontal scroll bar on the page itself

    screenshot = tmp_path / "report.png"
    result = _chromium(f"--screenshot={screenshot}", "--window-size=1280,2200", page.as_uri(),
                       profile=tmp_path / "profile-shot")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console_lines(result.stderr) == []  # the unmodified page logs nothing at all
    assert screenshot.stat().st_size > 10_000
    print(f"report screenshot: {screenshot}")
    artifacts = os.environ.get("RANDATTN_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(artifacts) / "report.png")
