"""The live dashboard in headless Chromium: page loads clean, published events reach the charts.

Uses Debian's chromium at /usr/bin/chromium through playwright's executable_path (playwright
never downloads a browser here); skipped, saying so, when that binary is absent.
"""

from __future__ import annotations

import os

import pytest

from asyncrl.dashboard.server import DashboardServer, StreamFeed
from asyncrl.metrics.stream import MetricsEmitter, MetricsForwarder

CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (Debian's chromium package; .ci/run installs it)")


def _step_events(step: int) -> dict[str, float]:
    return {
        "train/reward_mean": 0.1 * step,
        "train/loss": -0.01 * step,
        "train/grad_norm": 1.0 + step,
        "throughput/trained_tokens_per_s": 100.0 * step,
        "fully_async/trainer/idle_ratio": 0.25,
        "timing_s/param_sync": 0.05 * step,
        "stream/depth": step,
        "response_length/p50": 4.0, "response_length/p90": 6.0, "response_length/max": 8.0,
        "response_length/truncated": 2.0,
        "staleness/mean": 0.5,
        **{f"staleness/hist/{k}": (7.0 if k == 1 else 0.0) for k in range(9)},
        **{f"fully_async/partial/age_hist/{k}": (3.0 if k == 2 else 0.0) for k in range(5)},
    }


def test_dashboard_shows_published_events(tmp_path):
    from playwright.sync_api import sync_playwright

    with MetricsForwarder() as fwd:
        server = DashboardServer(StreamFeed(fwd.endpoints.subscribe), title="browser-test")
        trainer = MetricsEmitter(fwd.endpoints.publish, "trainer")
        rollouter = MetricsEmitter(fwd.endpoints.publish, "rollouter")
        errors: list[str] = []
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1100})
                page.on("console", lambda m: m.type == "error" and errors.append(m.text))
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(server.url)
                page.wait_for_function("document.getElementById('status').textContent.startsWith('live')",
                                       timeout=15_000)
                for step in (1, 2, 3):
                    trainer.emit_many(_step_events(step), step=step, version=step - 1)
                rollouter.emit_many({"throughput/generated_tokens_per_s": 640.0, "stream/credit": 5.0,
                                     "fully_async/rollouter/idle_ratio": 0.125,
                                     "engine/0/running": 3.0, "engine/1/running": 7.0,
                                     "agent/tool_calls_per_turn": 0.75, "agent/tool_errors": 1.0})
                total = 3 * len(_step_events(1)) + 7
                page.wait_for_function(f"document.getElementById('status').dataset.received === '{total}'",
                                       timeout=15_000)
                page.wait_for_function("document.querySelector('[data-panel=replicas] .chart canvas') !== null",
                                       timeout=15_000)
                data = page.evaluate("""() => {
                    const d = window.asyncrlDashboard;
                    return {reward: d.panelData('reward'), staleness: d.panelData('staleness'),
                            partial: d.panelData('partial'), replicas: d.panelData('replicas'),
                            throughput: d.panelData('throughput'), agent: d.panelData('agent')};
                }""")
                assert data["reward"][1] == pytest.approx([0.1, 0.2, 0.3])
                assert data["staleness"] == [list(range(9)), [0, 7, 0, 0, 0, 0, 0, 0, 0]]
                assert data["partial"][1] == [0, 0, 3, 0, 0]
                assert [v for v in data["replicas"][1] if v is not None] == [3]
                assert [v for v in data["replicas"][2] if v is not None] == [7]
                trained = [v for v in data["throughput"][2] if v is not None]
                assert trained == [100, 200, 300]
                assert [v for v in data["throughput"][1] if v is not None] == [640]
                assert [[v for v in data["agent"][k] if v is not None] for k in (2, 3)] == [[0.75], [1]]
                # The DOM shows the latest values, and every panel drew a chart.
                assert page.inner_text("[data-panel=reward] [data-series='train/reward_mean'] b") == "0.300"
                assert page.inner_text("[data-panel=idle] [data-series='fully_async/rollouter/idle_ratio'] b") \
                    == "0.125"
                for panel in ("throughput", "reward", "staleness", "stream", "idle", "sync", "lengths",
                              "partial", "replicas", "loss", "agent"):
                    assert page.locator(f"[data-panel={panel}] canvas").count() == 1, panel
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                browser.close()
        finally:
            trainer.close()
            rollouter.close()
            server.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert errors == []
