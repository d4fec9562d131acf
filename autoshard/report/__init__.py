"""Reading a plan: the terminal summary (:mod:`.summary`) over text tables (:mod:`.text`), the
plan by module (:mod:`.modules`), and DOT, SVG and HTML (:mod:`.html`)."""

from autoshard.report.summary import summary_text
from autoshard.report.text import CLI_HINTS, diff_text

__all__ = ["CLI_HINTS", "diff_text", "summary_text"]
