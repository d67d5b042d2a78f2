"""What a dashboard chart shows, read from the page: its legend's values and the scales uPlot
drew (gateway/admin_ui/static/charts.js keeps them on the chart's node)."""

from __future__ import annotations

from dataclasses import dataclass

from playwright.sync_api import Page

# What the page and uPlot print for a missing value: never in a legend once data is drawn.
EMPTY = {"–", "--", ""}

READ = """(selector) => {
  const node = document.querySelector(selector);
  const rows = [...node.querySelectorAll('.u-legend .u-series')];
  const note = node.querySelector('.scale-note');
  return {
    legend: rows.slice(1).map((r) => [r.querySelector('.u-label').textContent,
                                      r.querySelector('.u-value').textContent]),
    time: rows.length ? rows[0].querySelector('.u-value').textContent : null,
    xMin: Number(node.dataset.xMin), xMax: Number(node.dataset.xMax),
    yMax: Number(node.dataset.yMax), clipped: Number(node.dataset.clipped || 0),
    note: note && !note.hidden ? note.textContent : null,
    dashes: [...new Set(rows.slice(1).map((r) => r.querySelector('.u-marker').style.borderStyle))],
  };
}"""


@dataclass(frozen=True, slots=True)
class Chart:
    legend: dict[str, str]  # series label -> the value its legend shows
    time: str | None  # the legend's time cell
    x_min: float
    x_max: float
    y_max: float
    clipped: int  # points above a clipped scale
    note: str | None  # the note under the chart, when shown
    dashes: list[str]  # the legend markers' border styles (solid, dashed, dotted)


def chart(page: Page, selector: str) -> Chart:
    seen = page.evaluate(READ, selector)
    return Chart(
        dict(seen["legend"]), seen["time"], seen["xMin"], seen["xMax"], seen["yMax"],
        seen["clipped"], seen["note"], seen["dashes"],
    )  # fmt: skip


def hover_then_leave(page: Page, selector: str) -> Chart:
    """The chart while the cursor is over its middle, then leaves the page's charts alone."""
    box = page.locator(f"{selector} .u-over").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hovered = chart(page, selector)
    page.mouse.move(1, 1)
    return hovered
