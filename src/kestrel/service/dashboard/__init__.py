"""The admin port's page at `/`: an overview of the server, a table of every queue and a page per
queue, polling the figures `/stats.json` gives (docs/dashboard.md). Read-only; nothing of it runs
while no page is open."""

from kestrel.service.dashboard.pages import Dashboard

__all__ = ["Dashboard"]
