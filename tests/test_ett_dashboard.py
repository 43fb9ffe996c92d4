"""The dashboard shows ETT in a real headless Chromium: the ETT% tile, a stacked bar per job
whose parts are the API's seconds, and the checkpoint advice per model."""

from __future__ import annotations

import html
import re
import time
from pathlib import Path

import httpx
import pytest
from conftest import ensure_tools
from helpers import ServerProcess

from benchmarks.dashboard_shot import dump_dom
from megacache_client.wire import routes


@pytest.mark.e2e
def test_dashboard_shows_ett(tmp_path: Path) -> None:
    ensure_tools({"chromium": "chromium"})
    server = ServerProcess(tmp_path / "data", env={"MEGACACHE_ETT_ROLL_S": "0.5"}).start()
    try:
        now = time.time()
        base = now - 1100
        with httpx.Client(base_url=server.url) as c:
            for attempt, records in enumerate((
                    [{"kind": "start", "at": base}, {"kind": "training", "at": base + 30},
                     {"kind": "checkpoint_save", "at": base + 100, "step": 7,
                      "blocking_s": 4.0},
                     {"kind": "heartbeat", "at": base + 350, "step": 30}],
                    [{"kind": "start", "at": base + 400}, {"kind": "training", "at": base + 450,
                                                          "phases": [
                        {"phase": "distributed", "at": base + 402, "seconds": 3.0, "count": 2},
                        {"phase": "first_batch", "at": base + 420, "seconds": 0.047}]},
                     {"kind": "checkpoint_save", "at": base + 700, "step": 50,
                      "blocking_s": 6.0},
                     {"kind": "heartbeat", "at": now - 5, "step": 90}])):
                r = c.post(routes.JOB_PROGRESS.url(job="live-job"),
                           json={"attempt": attempt, "records": records, "model": "llm"})
                assert r.status_code == 202, r.text
            api = c.get("/v1/dashboard").json()["ett"]
            deadline = time.monotonic() + 30
            while not (trend := c.get("/v1/ett/trend").json())["time_to_recover"]["n"]:
                assert time.monotonic() < deadline, trend  # rolled within a second or so
                time.sleep(0.2)
        dom = dump_dom(server.url + "/", tmp_path / "chromium")
    finally:
        server.stop()
    assert 'data-loaded="true"' in dom, dom[:2000]
    assert api["live"] == 1 and api["jobs"] == 1
    tile = re.search(r'data-testid="ett-pct"[^>]*>([^<]*)<', dom)
    assert tile and tile.group(1) == f"{api['ett_pct']:.1f}%"
    (job,) = api["shown"]
    row = re.search(r'<tr data-job="live-job">(.*?)</tr>', dom, re.S)
    assert row, dom[:3000]
    parts = dict(re.findall(r'data-category="([a-z_]+)" data-seconds="([0-9.]+)"',
                            row.group(1)))
    assert {k: float(v) for k, v in parts.items()} == {
        k: v for k, v in job["seconds"].items() if v}
    assert set(parts) >= {"training", "startup", "lost_progress", "recovery"}
    assert ">live<" in row.group(1)
    cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)<", row.group(1))]
    # the report's words, per job: time to start, to recover, checkpoint save time,
    # unsaved training time (30 s, 100 s, 10 s, 246 s)
    assert job["time_to_start_s"] == 30 and job["time_to_recover_s"] == 100
    assert (job["checkpoint_save_s"], job["unsaved_training_s"]) == (10, 246)
    assert cells[-6:-2] == ["30.0 s", "100.0 s", "10.0 s", "4.1 min"], cells

    def tile(testid: str) -> str:
        found = re.search(rf'data-testid="{testid}"[^>]*>([^<]*)<', dom)
        assert found, testid
        return html.unescape(found.group(1))

    # the tiles: ETT's figures (one recovery of 100 s is 100 s, not a histogram's guess)
    assert (tile("ett-tts-p50"), tile("ett-tts-p90")) == ("30.0 s", "30.0 s")
    assert (tile("ett-ttr-p50"), tile("ett-ttr-p90"), tile("ett-ttr-n")) == (
        "100.0 s", "100.0 s", "1 recoveries")
    assert (tile("ett-ckpt-save"), tile("ett-unsaved")) == ("10.0 s", "4.1 min")
    advice = re.search(r'<tr data-model="llm">(.*?)</tr>', dom.split('data-testid="ett-advice"')[1],
                       re.S)
    assert advice and "low" in html.unescape(advice.group(1))
    # failures by cause, per namespace and per model (attempt 0 sent no end: lost)
    causes = dom.split('data-testid="ett-causes"')[1].split("</table>")[0]
    for scope in ("namespace default", "model llm"):
        found = re.search(rf'<tr data-scope="{scope}" data-cause="lost">(.*?)</tr>', causes, re.S)
        assert found, causes[:2000]
        assert [html.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)<", found.group(1))] \
            == [scope, "lost", "1", "4.1 min", "100.0 s"]
    # the recovery's stacked bar: the API's components, and a 47 ms part never "0.0"
    starts = dom.split('data-testid="ett-starts"')[1].split("</table>")[0]
    bar = re.search(r'<tr data-bar-job="live-job" data-bar-attempt="1">(.*?)</tr>', starts,
                    re.S)
    assert bar, starts[:2000]
    shown = {k: float(v) for k, v in re.findall(
        r'data-component="([a-z_]+)" data-seconds="([0-9.]+)"', bar.group(1))}
    want = job["starts"][1]["seconds"]
    assert shown == {k: v for k, v in want.items() if v} and shown["first_batch"] == 0.047
    table = dom.split('data-testid="ett-components"')[1].split("</table>")[0]
    row = re.search(r'<tr data-model="llm" data-kind="recover">(.*?)</tr>', table, re.S)
    assert row and "47 ms / 47 ms" in html.unescape(row.group(1)), table[:2000]
    # the trend: the day's row (its split, its failure's cause) and the job that lost most
    assert 'data-trend="true"' in dom
    days = dom.split('data-testid="ett-trend"')[1].split("</table>")[0]
    (day,) = [p for p in trend["series"] if p["wall_s"]]
    found = re.search(rf'<tr data-day="{day["start"]}">(.*?)</tr>', days, re.S)
    assert found, days[:2000]
    cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)<", found.group(1))]
    assert cells[1] == f"{day['ett_pct']:.1f}%" and "lost 1" in cells, cells
    top = dom.split('data-testid="ett-top-lost"')[1].split("</table>")[0]
    assert '<tr data-job="live-job">' in top


@pytest.mark.e2e
def test_the_advice_row_says_why_there_is_none(tmp_path: Path) -> None:
    """A model with a failure but no checkpoint save: the row says so (it said "no
    failure seen yet" beside "failures seen: 1")."""
    ensure_tools({"chromium": "chromium"})
    server = ServerProcess(tmp_path / "data").start()
    try:
        base = time.time() - 600
        with httpx.Client(base_url=server.url) as c:
            for attempt, records in enumerate((
                    [{"kind": "start", "at": base}, {"kind": "training", "at": base + 10},
                     {"kind": "heartbeat", "at": base + 100, "step": 30}],
                    [{"kind": "start", "at": base + 200}, {"kind": "training", "at": base + 210},
                     {"kind": "end", "at": base + 300, "reason": "finished"}])):
                r = c.post(routes.JOB_PROGRESS.url(job="unsaved-job"),
                           json={"attempt": attempt, "records": records, "model": "nosave"})
                assert r.status_code == 202, r.text
        dom = dump_dom(server.url + "/", tmp_path / "chromium")
    finally:
        server.stop()
    advice = re.search(r'<tr data-model="nosave">(.*?)</tr>',
                       dom.split('data-testid="ett-advice"')[1], re.S)
    assert advice, dom[:3000]
    text = html.unescape(advice.group(1))
    assert "1 failure but no checkpoint save seen" in text and "no failure seen" not in text
