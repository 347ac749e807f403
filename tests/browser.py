"""Debian's Chromium (`apt-get install -y chromium`, as .ci/run does), headless, driven by Playwright: one page for a
browser test, with what a failure needs to be understood and a check that no browser process outlives the test."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deployments.servers import children

CHROMIUM = "/usr/bin/chromium"  # Debian's package: Playwright's own download cannot work here
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Browser:
    page: Any  # playwright.sync_api.Page
    refused: list = field(default_factory=list)  # the page's answers >= 400: the UIs show only "Something went wrong"
    pids: list[int] = field(default_factory=list)  # Playwright's driver and Chromium under it, read as it closes


@contextmanager
def chromium(failed: Path, width: int = 1400, height: int = 1000, timeout_s: float = 60) -> Iterator[Browser]:
    """A page `width` x `height`, every wait `timeout_s` long (a busy 2-core machine renders the apps slowly). On an
    error: a screenshot `failed` and the page's HTML beside it, and each refused answer as a note on the error. On
    leaving, `Browser.pids` lists the processes it started, then it closes."""
    from playwright.sync_api import expect, sync_playwright

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: `apt-get install -y chromium` (as .ci/run does)"
    already = set(children(os.getpid()))  # what this process started before (servers)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        browser = Browser(launched.new_page(viewport={"width": width, "height": height}))
        browser.page.set_default_timeout(timeout_s * 1000)
        expect.set_options(timeout=timeout_s * 1000)
        refused = browser.refused
        browser.page.on("response", lambda response: refused.append(response) if response.status >= 400 else None)
        try:
            yield browser
        except Exception as error:
            browser.page.screenshot(path=failed, full_page=True)
            failed.with_suffix(".html").write_text(browser.page.content())
            for response in browser.refused:
                error.add_note(f"{response.status} {response.request.method} {response.url}: {body(response)}")
            raise
        finally:
            browser.pids[:] = process_tree(set(children(os.getpid())) - already)
            launched.close()


def submit(browser: Browser, button, endpoint: str, tries: int = 3) -> Any:
    """Click `button` and wait for the page's POST to `endpoint`; on a 503 click it again, as a person would after the
    UI's "Something went wrong": Prefect's SQLite store answers a write that races its own services with "database is
    locked", sent as 503 (retryable for its Python client, which retries; a 503 changes nothing). Returns the answer."""
    for attempt in range(1, tries + 1):
        with browser.page.expect_response(
            lambda r: r.request.method == "POST" and r.url.rstrip("/").endswith(endpoint)
        ) as answered:
            button.click()
        if answered.value.status != 503 or attempt == tries:
            return answered.value
        browser.refused[:] = [r for r in browser.refused if r is not answered.value]  # answered, then retried
        time.sleep(2)


def body(response) -> str:
    try:
        return response.text()[:2000]
    except Exception as unreadable:  # the browser may have dropped it: keep the error being reported
        return f"<body unreadable: {unreadable}>"


def process_tree(pids) -> list[int]:
    found = list(pids)
    for pid in found:  # grows while it is walked: every descendant is visited
        found += [child for child in children(pid) if child not in found]
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def still_alive(pids: list[int], grace: float = 15) -> list[int]:
    """The pids still running after `grace` seconds: a Chromium helper can outlive `browser.close()` by a moment."""
    deadline = time.time() + grace
    while (running := [pid for pid in pids if alive(pid)]) and time.time() < deadline:
        time.sleep(0.2)
    return running
