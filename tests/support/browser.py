"""A real headless browser for the admin page's tests: Debian's `chromium`, driven through its
`chromium-driver` with Selenium. Both are Debian packages, installed by the suite's set-up
(tests/support/system.py); browsers downloaded from elsewhere are not used, nor Selenium's own
driver manager.

A module that imports `browser` gets one browser for all its tests (each opens its own pages).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_until
from tests.support.system import tool

# The commands of Debian's `chromium` and `chromium-driver` packages.
CHROMIUM, CHROMIUM_DRIVER = "chromium", "chromedriver"
# Headless as root, with nothing reaching out on its own: no updates, sync, QUIC or first-run pages.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000")
WINDOW = (1400, 1000)


def chromium() -> tuple[str, str] | None:
    """Paths of `chromium` and `chromedriver`, or None if either is missing."""
    binary, driver = shutil.which(CHROMIUM), shutil.which(CHROMIUM_DRIVER)
    return (binary, driver) if binary and driver else None


class Browser:
    """One headless Chromium: open a page, read it, run a script in it, and read its console."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def open(self, url: str) -> None:
        """Open `url` afresh: the page before is closed first (it stops polling its server) and its
        console's messages are dropped, so that `console_errors` speaks of this page alone."""
        self.driver.get("about:blank")
        self.driver.get_log("browser")
        self.driver.get(url)

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def text(self, element_id: str) -> str:
        return str(self.js("const e = document.getElementById(arguments[0]); return e ? e.textContent : null;",
                           element_id))

    def shown(self, element_id: str) -> bool:
        return bool(self.js("const e = document.getElementById(arguments[0]); return !!e && !e.closest('[hidden]');",
                            element_id))

    def wait(self, check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """`wait_until`, its failure naming the console's errors too (a file the page could not load)."""
        try:
            wait_until(check, what, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}; the console's errors: {self.console_errors()}") from None

    def console_errors(self) -> list[dict[str, Any]]:
        """The console's errors since the last call (a failed request for a file counts as one)."""
        return [entry for entry in self.driver.get_log("browser") if entry.get("level") == "SEVERE"]

    def table_rows(self) -> dict[str, dict[str, str]]:
        """The queue table's rows in view: queue name -> column key -> the cell's text (a lone
        surrogate, in a name not UTF-8 on disk, as U+FFFD: WebDriver cannot carry it)."""
        rows = self.js("""
            const keys = [...document.querySelectorAll('#queues thead th')].map(th => th.dataset.key);
            return [...document.querySelectorAll('#queues tbody tr:not(.spacer)')]
                .filter(tr => tr.children.length === keys.length)
                .map(tr => Object.fromEntries(keys.map((k, i) => [k, tr.children[i].textContent.toWellFormed()])));""")
        return {row["name"]: row for row in rows}

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page: the window made as tall as the page, and again once the page has
        drawn itself for that size (its next poll)."""
        try:
            for _ in range(2):
                # The window's height less its viewport's is what the browser's frame takes.
                height = self.js("return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight")
                self.driver.set_window_size(WINDOW[0], int(height))
                time.sleep(1.5)  # the page polls once a second, and draws what a taller window shows
            self.driver.save_screenshot(str(path))
        finally:
            self.driver.set_window_size(*WINDOW)


def start_browser(binary: str, driver_path: str, profile: str, *flags: str) -> Browser:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", *flags):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: never download a driver or browser
    return Browser(webdriver.Chrome(options=options, service=Service(executable_path=driver_path)))


@pytest.fixture(scope="module", name="browser")
def one_browser() -> Iterator[Browser]:
    binary, driver = tool(CHROMIUM), tool(CHROMIUM_DRIVER)  # skips, naming the package, if missing
    with tempfile.TemporaryDirectory(prefix="kestrel-chromium-") as profile:  # a fresh, empty profile
        opened = start_browser(binary, driver, profile)
        try:
            yield opened
        finally:
            opened.driver.quit()
