"""The report: one self-contained HTML page of the run, and its rendering in a real (headless) browser, offline."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stages import report
from stages.shared.artifacts import REPORT

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
# Chromium as the probe of this workplace runs it: no sandbox (root), and none of its own background traffic
BROWSER_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EXTERNAL = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?(?:https?:)?//|<script|<link""", re.I)


@pytest.fixture(scope="module")
def page(tiny_run, tiny_params, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    shutil.copytree(tiny_run / "data", root / "data")
    summary = report.run(tiny_params, root)
    assert summary.endswith(str(REPORT))
    return root / REPORT


def test_the_report_shows_the_run_and_needs_nothing_from_outside(page, tiny_run):
    text = page.read_text()
    for section in ("Evaluation on the held-out prompts", "PPO, step by step", "SFT and PPO side by side",
                    "the best and worst of the first and last steps", "Reward model and SFT", "Params that differ"):
        assert section in text, section
    metrics = json.loads((tiny_run / "data" / "eval" / "metrics.json").read_text())
    assert f"<b>{metrics['win_rate']:.3f}</b>" in text
    # what the held-out figures are over: evaluate measured it (prepare splits by distinct prompt)
    assert f"Over {metrics['heldout']['prompts']} held-out prompts, none of them a training prompt." in text
    assert text.count("<svg") >= 7  # six curve charts and SFT's loss, inline
    assert not EXTERNAL.search(text), EXTERNAL.search(text)  # no script, stylesheet, image or font to fetch
    chart = timings_chart(page)  # the wall-clock seconds per step: beside the page, drawn from this run's timings
    assert chart.read_text().startswith("<svg") and chart.is_relative_to(page.parents[2] / "data" / "logs")


def timings_chart(page: Path) -> Path:
    """The file the page's one image links to."""
    links = re.findall(r'<img src="([^"]+)"', page.read_text())
    assert len(links) == 1, links
    return (page.parent / links[0]).resolve()


def test_a_run_restored_from_dvc_s_cache_gets_the_same_page_and_no_chart(page, tiny_params, tmp_path):
    """Without this run's timings (its ppo stage restored from DVC's cache, or timings of other results) the page is
    the same bytes, and no chart is drawn: the image's text says why."""
    root = tmp_path / "restored"
    shutil.copytree(page.parents[2] / "data", root / "data", ignore=shutil.ignore_patterns("logs", "report"))
    report.run(tiny_params, root)
    assert (root / REPORT).read_bytes() == page.read_bytes()
    assert not timings_chart(root / REPORT).exists() and "not measured in this workspace" in page.read_text()
    (root / "data" / "logs").mkdir()
    shutil.copytree(page.parents[2] / "data" / "logs" / "ppo", root / "data" / "logs" / "ppo")
    (root / "data" / "logs" / "ppo" / "run.json").write_text('{"curves_sha256": "of other results"}')
    report.run(tiny_params, root)
    assert (root / REPORT).read_bytes() == page.read_bytes() and not timings_chart(root / REPORT).exists()


def test_the_report_is_the_same_for_the_same_results(page, tiny_params):
    first = page.read_bytes()
    report.run(tiny_params, page.parents[2])
    assert page.read_bytes() == first


def page_requests(page: Path, profile: Path) -> tuple[str, set[str]]:
    """Open ``page`` in headless Chromium with its network log on: (the rendered DOM, the URLs the page asked for).
    The browser's own traffic (time, accounts) has no origin; a file page's requests have the opaque one."""
    netlog = profile.with_suffix(".netlog.json")
    result = subprocess.run([BROWSER, *BROWSER_FLAGS, f"--user-data-dir={profile}", f"--log-net-log={netlog}",
                             "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    events = json.loads(netlog.read_text())["events"]
    urls = {e["params"]["url"] for e in events
            if isinstance(e.get("params"), dict) and e["params"].get("initiator") not in (None, "not an origin")}
    return result.stdout, urls


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no chromium: `make test` installs Debian's package where apt can")
def test_the_report_renders_in_a_browser_with_no_request_leaving_the_machine(page, tmp_path):
    """Every chart is an SVG element of the page Chromium rendered, and the page asked the network for nothing
    (checked against a page that does ask, so that the check can fail)."""
    dom, urls = page_requests(page, tmp_path / "profile")
    assert dom.count("<svg") >= 7 and "RLHF run report" in dom
    assert urls <= {timings_chart(page).as_uri()}  # the one image: a file beside the page
    control = tmp_path / "control.html"
    control.write_text('<html><body><img src="http://127.0.0.1:9/x.png"></body></html>')
    assert page_requests(control, tmp_path / "control-profile")[1] == {"http://127.0.0.1:9/x.png"}


def test_numbers_down_a_column_share_one_format_and_every_header_names_its_column(page):
    from stages.report.html import number

    assert [number(x) for x in (0.4266, -2.6, 1.38, 15.2, 0.0, 12345.6, 0.00012)] == \
        ["0.4266", "-2.600", "1.380", "15.20", "0.000", "1.235e+04", "1.200e-04"]
    text = page.read_text()
    assert "<th></th>" not in text


def test_a_chart_without_the_gold_score_is_not_titled_with_it():
    import pandas as pd

    from stages.report.sections import charts

    curves = pd.DataFrame({"step": [0, 1], "reward_mean": [0.1, 0.2]})
    assert "Reward (proxy) and gold score" not in charts(curves, "callable my:score")
    assert "Reward (proxy)" in charts(curves, "callable my:score")
    curves["gold_mean"] = [0.0, 0.1]
    assert "Reward (proxy) and gold score" in charts(curves, "reward model")


def test_the_report_draws_the_heldout_evaluations_and_says_which_policy_was_kept(page):
    text = page.read_text()
    assert "Held-out prompts during the run" in text and "Held-out KL to SFT during the run" in text
    assert "Watching the run: the policy kept and the doctor" in text
    assert "data/models/ppo holds the last step's policy (step 2)." in text  # of 2, counted from 1 as the console does


def test_the_watch_section_names_the_best_policy_a_stop_and_the_alerts():
    from stages.report.sections import watched

    metrics = {"steps": 3, "kept": {"policy": "best", "step": 1, "by": "gold", "kl_price": 0.5, "value": 2.25},
               "alerts": {"approxkl": {"steps": 1, "first_step": 2, "first": "an update's approximate KL is 47"}},
               "stopped": {"step": 2, "reason": "an update's approximate KL is 47 (watch.alerts.approxkl: 0.5)"}}
    text = watched(metrics)
    # steps counted from 1, as the console and the charts count them (data/ppo/metrics.json counts from 0)
    assert "holds the policy of step 2, the best by the held-out gold - 0.5 x KL to SFT (2.250)" in text
    assert "The run stopped at step 3</b>: an update&#x27;s approximate KL is 47" in text
    assert "<td>approxkl</td><td class=\"n\">1</td><td class=\"n\">3</td>" in text
    assert "The doctor found nothing" in watched({"steps": 2, "kept": {"policy": "last", "step": 1}, "alerts": {}})


def x_ticks(svg: str) -> list[str]:
    """The x-axis tick labels of each chart in ``svg`` (the texts before each chart's "PPO step" label)."""
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    ticks, chart = [], []
    for text in texts:
        if text == "PPO step":
            ticks.append(chart)
        chart = [] if text == "PPO step" or not re.fullmatch(r"[-\u2212]?[\d.]+", text) else chart + [text]
    return ticks


def test_charts_count_steps_from_1_with_whole_ticks(tmp_path):
    """The page counts PPO steps from 1, as the console does (`step 4/4`), on whole-number ticks: the held-out
    evaluations after steps 2 and 4 (0-based 1 and 3 in data/ppo/eval.csv) stand at 2 and 4, with no tick at 2.5."""
    import pandas as pd

    from stages.report.sections import charts, heldout_charts

    curves = pd.DataFrame({"step": [0, 1, 2, 3], "reward_mean": [0.1, 0.4, 0.2, 0.3], "kl": [0.0, 0.5, 1.0, 1.5]})
    evals = tmp_path / "eval.csv"
    pd.DataFrame({"step": [1, 3], "reward": [0.2, 0.3], "kl": [0.5, 1.5], "length": [4.0, 5.0]}).to_csv(evals)
    for svg, first, last in ((charts(curves, "RM"), "1", "4"), (heldout_charts(evals, "RM"), "2", "4")):
        for ticks in x_ticks(svg):
            assert all(re.fullmatch(r"\d+", tick) for tick in ticks), ticks
            assert first in ticks and last in ticks and "0" not in ticks, ticks
    assert "Steps are counted from 1 on this page, as the console counts them" in charts(curves, "RM")


def test_a_table_has_one_number_format_per_column():
    """One format down a column (a mean's gold score, KL, share and length side by side read -0.1550, 10.61, 0.8300,
    1.667 with 4 significant digits): 2 decimals, as the stages' summary lines print means; scientific where a column
    reaches 1e4."""
    from stages.report.html import table

    rows = [["gold", -0.1550, 4.1649, 4.3199], ["kl", 0.0, 10.61, 10.61], ["share", 0.83, 1 / 3, -0.4967],
            ["length", 1.6667, 15.355, 13.688]]
    cells = re.findall(r'<td class="n">([^<]*)</td>', table(rows, ["metric", "SFT", "PPO", "PPO - SFT"]))
    assert cells == ["-0.15", "4.16", "4.32", "0.00", "10.61", "10.61", "0.83", "0.33", "-0.50", "1.67", "15.36",
                     "13.69"]
    huge = re.findall(r'<td class="n">([^<]*)</td>', table([["a", 12.0, 0.5], ["b", 2.5e6, 0.01]], ["", "x", "y"]))
    assert huge == ["1.20e+01", "0.50", "2.50e+06", "0.01"]  # x reaches 1e4: all of it in scientific notation


def a_sweep(n_steps: int = 4) -> dict:
    """sweep_page's inputs for three experiments on a user's own data and scorer, where the params that differ from
    main's are many and long (as with params.yaml's own-material edits left uncommitted): names, params, rows (as
    `dvc.api.exp_show` gives them), the params that differ, curves."""
    import pandas as pd

    names = ["main", "gauge-thaw", "vocal-pons", "dutch-stob"]
    own = {"data.prompts.source": "data/my_own_prompts_collected_in_2026.jsonl", "data.prompts.columns.query": "prompt",
           "scorer.source": "callable", "scorer.name": "rewards.my_sentiment_scorer:positivity_per_word",
           "tokenize.max_query_tokens": 24, "data.n_eval_prompts": 40, "model.lora.target_modules": '["c_attn"]'}
    main = {key: "synthetic" if key.endswith("source") else None for key in own}
    params = [{**main, "ppo.learning_rate": 0.0003}] + [{**own, "ppo.learning_rate": lr} for lr in (1e-4, 3e-4, 1e-3)]
    rows = [{"win_rate": 0.5 + i / 10, "gold": None, "reward": 0.1 * i, "kl": 0.01 * i, "accuracy": 0.75}
            for i in range(4)]
    varying = sorted(own) + ["ppo.learning_rate"]
    curves = {name: pd.DataFrame({"step": range(n_steps), "reward_mean": [i * s / 10 for s in range(n_steps)],
                                  "kl": [i * s / 100 for s in range(n_steps)]}) for i, name in enumerate(names)}
    curves["main"]["gold_mean"] = 0.5  # the synthetic data's gold score; the user's own data has none
    return {"names": names, "params": params, "rows": rows, "varying": varying, "curves": curves}


def test_a_sweep_s_table_shows_the_results_first_and_its_params_wrap_at_their_dots():
    """The evaluation's columns come before the params' (a reader looks there first, however many params differ), and
    a long param name or value has a line-break opportunity at each dot, slash, colon or underscore before a letter,
    never inside a number."""
    from stages.report.sweep import METRICS, breakable, experiments_table

    sweep = a_sweep()
    text = experiments_table(sweep["names"], sweep["params"], sweep["rows"], sweep["varying"])
    headers = re.findall(r"<th[^>]*>(.*?)</th>", text)
    assert len(headers) == 1 + len(METRICS) + len(sweep["varying"])
    assert headers[1:3] == ["win rate", "PPO gold"] and headers[4:6] == ["PPO KL to SFT", "RM accuracy"]
    assert [h.replace("<wbr>", "") for h in headers[1 + len(METRICS):]] == sweep["varying"]
    assert "data.<wbr>prompts.<wbr>columns.<wbr>query" in headers
    assert breakable("rewards.my_scorer:positivity") == "rewards.<wbr>my_<wbr>scorer:<wbr>positivity"
    assert [breakable(v) for v in ("0.0001", "1e-05", "3.5e+02", "<b>&")] == ["0.0001", "1e-05", "3.5e+02",
                                                                               "&lt;b&gt;&amp;"]
    cells = re.findall(r'<td class="param">(.*?)</td>', text)
    runs = sorted((part for cell in cells for part in cell.split("<wbr>")), key=len)
    assert runs[-1] == "positivity_", runs[-3:]  # the longest unbreakable run: 11 characters, not 43


def test_a_sweep_s_charts_are_wide_and_their_legends_name_the_experiments_only():
    """Each overlaid chart is drawn at the page's width, its legend lists the experiments' names and nothing else (their
    params are in the table), so the plot fills its chart: the axes span at least 85% of the SVG's width."""
    from stages.report.sweep import sweep_page

    text = sweep_page(**a_sweep())
    charts = re.findall(r"<svg.*?</svg>", text, re.S)
    assert len(charts) == 3  # the reward, gold (main's only) and KL curves
    everyone = ["main", "gauge-thaw", "vocal-pons", "dutch-stob"]
    for chart, names in zip(charts, [everyone, ["main"], everyone]):
        legend = re.search(r'<g id="legend_1">.*', chart, re.S).group(0)
        assert re.findall(r"<text[^>]*>([^<]*)</text>", legend) == names
        width = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', chart).group(1))
        xs = [float(x) for x in re.findall(r"[ML] ([\d.]+) ", re.search(r'<g id="patch_2">.*?</g>', chart, re.S)[0])]
        assert (max(xs) - min(xs)) / width >= 0.85, (max(xs) - min(xs), width)
        assert width >= 600  # points: about the page's 1180 px, so the page does not scale its text up
    assert "ppo.learning_rate" not in "".join(charts)


LAYOUT_PROBE = """<script>
const box = element => element.getBoundingClientRect();
const layout = {page: box(document.body).width, table: box(document.querySelector("table")).width,
  charts: [...document.querySelectorAll("svg")].map(s => [box(s).width, box(s.querySelector("[id=patch_2]")).width]),
  headers: [...document.querySelectorAll("th")].map(h => [h.textContent, box(h).left])};
document.body.insertAdjacentHTML("beforeend", "<pre id=layout>" + JSON.stringify(layout) + "</pre>");
</script>"""


def layout(page: Path, profile: Path, width: int = 1400) -> dict:
    """The sizes Chromium lays ``page`` out at in a ``width`` px window (px): the page's content, the first table,
    each chart (the SVG, its axes), each header cell's text and left edge; measured by a script added to a copy."""
    probe = page.with_name(f"{page.stem}.probe.html")
    probe.write_text(page.read_text().replace("</body>", f"{LAYOUT_PROBE}</body>"))
    result = subprocess.run([BROWSER, *BROWSER_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},1000",
                             "--virtual-time-budget=3000", "--dump-dom", probe.resolve().as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(re.search(r"<pre id=\"layout\">(.*?)</pre>", result.stdout, re.S).group(1))


@pytest.mark.skipif(BROWSER is None, reason="no chromium: `make test` installs Debian's package where apt can")
def test_a_sweep_s_page_at_1400_px_has_full_width_charts_and_a_table_within_the_page(tmp_path):
    """In a 1400 px window: every chart is the page's full width and its plot nearly so, the table (eight params
    that differ, some of 40 characters) is no wider than the page, and its results lie left of its params."""
    from stages.report.sweep import sweep_page

    page = tmp_path / "experiments.html"
    page.write_text(sweep_page(**a_sweep()))
    sizes = layout(page, tmp_path / "profile")
    assert sizes["page"] == 1180  # html.STYLE's max-width
    assert len(sizes["charts"]) == 3
    for chart, axes in sizes["charts"]:
        assert chart >= sizes["page"] - 1 and axes >= 0.85 * chart, sizes["charts"]
    assert sizes["table"] <= sizes["page"], sizes["table"]
    lefts = dict(sizes["headers"])
    assert lefts["RM accuracy"] < min(lefts[key] for key in a_sweep()["varying"]), lefts
