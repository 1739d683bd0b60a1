"""The lanes page in a real browser: Debian's chromium, driven by Selenium through its chromedriver.

``tox -e browser`` (``pytest -m browser tests/browser``); ``.ci/run`` installs chromium and
chromium-driver when they are missing. With ``SINGLETON_TEST_WEB_SCREENSHOTS=1`` the tests rewrite
the screenshots in ``docs/screenshots/`` (otherwise a run leaves the tree as it was).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from conftest import StoreFactory, backend_params
from dramatiq.brokers.stub import StubBroker
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait
from services import unavailable
from test_cli import SCOPE, seed, spec
from web_server import serving

from singleton_tasks import Store, singleton
from singleton_tasks.dramatiq import SingletonMiddleware
from singleton_tasks.outcomes import Decision, Registered
from singleton_tasks.testing import ManualClock
from singleton_tasks.web import create_app

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS = Path(__file__).parents[2] / "docs" / "screenshots"
XSS_KEY = "<img src=x onerror=alert(1)>"
XSS_TASK = "<b>bold</b>"
WAIT = 15.0
TOKEN = "browser-test-token"


@pytest.fixture(params=backend_params(["sqlite"]))
def backend(request: pytest.FixtureRequest) -> str:
    """SQLite: a file the page's server and a worker both open, no server to start."""
    return str(request.param)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    for program in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(program):
            unavailable(f"{program} is not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,900")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(browser: WebDriver, condition: Callable[[WebDriver], Any], what: str) -> Any:
    """Wait for ``condition``; the page redraws its lanes on every frame, so an element found
    just before a redraw goes stale: the condition is then tried again on the new one."""
    wait = WebDriverWait(
        browser, WAIT, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    )
    return wait.until(condition, what)


def click(browser: WebDriver, find: Callable[[WebDriver], WebElement | None], what: str) -> None:
    """Click what ``find`` finds, found again if a redraw replaced it."""

    def clicked(b: WebDriver) -> bool:
        element = find(b)
        if element is None:
            return False
        element.click()
        return True

    until(browser, clicked, what)


#: The lanes as the page shows them, read in one go (a redraw cannot fall between two reads).
READ_LANES = """
const texts = (node, selector) => Array.from(node.querySelectorAll(selector), (e) => e.textContent);
return Array.from(document.querySelectorAll("#lanes .lane"), (node) => ({
  key: node.dataset.key,
  key_text: node.querySelector(".lane-key").textContent,
  task_text: node.querySelector(".lane-task").textContent,
  holder: texts(node, ".holder .run-id"),
  waiter: texts(node, ".waiter .run-id"),
  positions: texts(node, ".waiter .position"),
  text: node.innerText,
}));
"""


def lanes(browser: WebDriver) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = browser.execute_script(READ_LANES)
    return found


def lane(browser: WebDriver, key: str) -> dict[str, Any] | None:
    return next((found for found in lanes(browser) if found["key"] == key), None)


def run_ids(found: dict[str, Any] | None, kind: str) -> list[str] | None:
    return None if found is None else list(found[kind])


def run_button(run_id: str) -> Callable[[WebDriver], WebElement | None]:
    def find(browser: WebDriver) -> WebElement | None:
        for button in browser.find_elements(By.CSS_SELECTOR, "#lanes .run[data-run-id]"):
            if button.get_attribute("data-run-id") == run_id:
                return button
        return None

    return find


def screenshot(browser: WebDriver, name: str) -> None:
    if os.environ.get("SINGLETON_TEST_WEB_SCREENSHOTS"):
        SCREENSHOTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(SCREENSHOTS / name))


def hold(store: Store, key: str, *run_ids: str, scope: str = SCOPE) -> None:
    for run_id in run_ids:
        assert store.register(replace(spec(key, run_id), scope=scope)).status is Registered.REGISTERED
    assert store.claim(replace(spec(key, run_ids[0]), scope=scope), 0, None).decision is Decision.ADMITTED


def test_lanes_show_holders_and_waiters_in_order_and_user_data_as_text(
    browser: WebDriver, store_factory: StoreFactory, tmp_path: Path
) -> None:
    store = store_factory(clock=ManualClock())
    seeded = seed(store, store.url)
    hold(store, XSS_KEY, "xss-holder", "xss-waiter", scope=XSS_TASK)
    with serving(create_app(store, interval=0.5)) as base:
        browser.get(base + "/")
        a = until(browser, lambda b: lane(b, "store:A"), "the lane of store:A")
        assert run_ids(a, "holder") == [seeded.a0]
        assert run_ids(a, "waiter") == [seeded.a1, seeded.a2]  # in line order
        assert a["positions"] == ["1. ", "2. "]
        assert "slots 1/1" in a["text"] and "waiters 2" in a["text"]
        b = lane(browser, "store:B")
        assert b is not None and "waiting for retry" in b["text"]

        xss = lane(browser, XSS_KEY)
        assert xss is not None
        assert (xss["key_text"], xss["task_text"]) == (XSS_KEY, XSS_TASK)
        assert browser.find_elements(By.CSS_SELECTOR, "#lanes img, #lanes b") == []
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018  (raises when no alert was opened)

        # Read-only: no token field, no lane has a drop button, a run's detail no release button.
        assert not browser.find_element(By.ID, "token-field").is_displayed()
        assert browser.find_elements(By.CSS_SELECTOR, "#lanes .drop-waiters") == []
        click(browser, run_button(seeded.a1), "the first waiter")
        detail = until(browser, lambda b: b.find_element(By.ID, "detail").is_displayed(), "the run's detail")
        assert detail
        fields = browser.find_element(By.ID, "detail-fields").text
        assert seeded.a1 in fields and "position 1" in fields and "gated" in fields
        # Its arguments' size (the message kept to issue it again) and its live copies.
        assert f"arguments (message kept)\n{len(seeded.a1_payload)} bytes" in fields
        assert f"live copies (generations)\n0 (the producer's copy), {seeded.a1_generation}" in fields
        assert not browser.find_element(By.ID, "release").is_displayed()
        screenshot(browser, "web-lanes.png")

        # The filter narrows the lanes to one task, live.
        browser.find_element(By.ID, "filter-task").send_keys("<b>")
        until(
            browser,
            lambda b: (
                [n.get_attribute("data-key") for n in b.find_elements(By.CSS_SELECTOR, ".lane")] == [XSS_KEY]
            ),
            "the filtered lanes",
        )


def test_a_handoff_by_a_real_worker_shows_without_a_reload(
    browser: WebDriver, store_factory: StoreFactory
) -> None:
    store = store_factory()
    broker = StubBroker()
    broker.emit_after("process_boot")
    broker.add_middleware(SingletonMiddleware(store_factory(), retry_delay=0.05, retry_jitter=0.01))
    holds = {label: threading.Event() for label in ("first", "second")}
    started: list[str] = []

    @singleton(key=lambda account, label: f"account:{account}")
    @dramatiq.actor(broker=broker, actor_name="statement")
    def statement(account: str, label: str) -> None:
        started.append(label)
        assert holds[label].wait(WAIT)

    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=2)
    worker.start()
    try:
        with serving(create_app(store, interval=0.25)) as base:
            browser.get(base + "/")
            until(browser, lambda b: b.find_element(By.ID, "status").text == "live", "the live stream")
            browser.execute_script("window.notReloaded = true;")
            first = statement.send("1", "first").message_id
            second = statement.send("1", "second").message_id
            key = "account:1"
            until(
                browser,
                lambda b: (
                    (n := lane(b, key))
                    and run_ids(n, "holder") == [first]
                    and run_ids(n, "waiter") == [second]
                ),
                "first holding, second waiting",
            )
            screenshot(browser, "web-waiting.png")
            holds["first"].set()
            until(
                browser, lambda b: (n := lane(b, key)) and run_ids(n, "holder") == [second], "second admitted"
            )
            handoff = until(
                browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#handoffs .handoff"), "a handoff"
            )
            assert handoff[0].find_element(By.CSS_SELECTOR, ".handoff-released").text == first
            assert handoff[0].find_element(By.CSS_SELECTOR, ".handoff-admitted").text == second
            assert " gap " in handoff[0].text
            assert browser.execute_script("return window.notReloaded === true;")
            screenshot(browser, "web-handoff.png")
            holds["second"].set()
            until(browser, lambda b: lane(b, key) is None, "the key idle")
    finally:
        for event in holds.values():
            event.set()
        broker.join(statement.queue_name, timeout=int(WAIT * 1000))
        worker.stop()
    assert started == ["first", "second"]


def drop_button(browser: WebDriver) -> WebElement | None:
    found = browser.find_elements(By.CSS_SELECTOR, "#lanes .drop-waiters")
    return found[0] if found else None


def test_release_and_drop_are_refused_without_the_token_and_done_with_it(
    browser: WebDriver, store_factory: StoreFactory
) -> None:
    store = store_factory()
    run_id = f"stuck-{uuid.uuid4().hex[:8]}"
    waiter_id = f"behind-{uuid.uuid4().hex[:8]}"
    hold(store, "stuck", run_id, waiter_id)
    with serving(create_app(store, interval=0.25, allow_release=True, token=TOKEN)) as base:
        browser.get(base + "/")
        until(browser, lambda b: lane(b, "stuck"), "the stuck lane")
        assert browser.find_element(By.ID, "token-field").is_displayed()
        click(browser, run_button(run_id), "the stuck run")
        release = until(
            browser, lambda b: (e := b.find_element(By.ID, "release")).is_displayed() and e, "release"
        )
        release.click()
        result = browser.find_element(By.ID, "release-result")
        until(browser, lambda b: result.text.startswith("refused"), "the refusal")
        assert "X-Singleton-Token" in result.text
        click(browser, drop_button, "the lane's drop button")
        dropped = browser.find_element(By.ID, "drop-result")
        until(browser, lambda b: dropped.text.startswith("refused"), "the drop's refusal")
        assert "X-Singleton-Token" in dropped.text
        time.sleep(0.5)  # two intervals: the runs are still there
        assert run_ids(lane(browser, "stuck"), "holder") == [run_id]
        assert run_ids(lane(browser, "stuck"), "waiter") == [waiter_id]
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        click(browser, drop_button, "the lane's drop button")
        until(browser, lambda b: dropped.text == "dropped 1 waiters of stuck", "the drop")
        until(browser, lambda b: run_ids(lane(b, "stuck"), "waiter") == [], "the waiter gone")
        assert drop_button(browser) is None  # no waiters: no button
        assert run_ids(lane(browser, "stuck"), "holder") == [run_id]  # the holder stays
        release.click()
        until(browser, lambda b: result.text.startswith("released " + run_id), "the release")
        until(browser, lambda b: lane(b, "stuck") is None, "the lane gone")
    assert store.snapshot() == []
