"""The web console at ``/``: served without the key, off with --disable-web-ui, and driven in
headless Chromium (Debian's ``chromium`` and ``chromium-driver``, through Selenium): a chat
message streams its answer in, the monitor's page-frame map fills and empties during a long
request, and with a host tier its frames show as a map of their own, swapped-out pages and all.
``PAGEDSERVE_SCREENSHOTS=DIR`` saves both views there (the README's images)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import TOKEN_RATE_HISTORY_S, TokenRateHistory
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.presets import demo_model_dir
from pagedserve.server.app import build_app
from pagedserve.testing import serve_app
from tests.helpers.models import host_tier_gib
from tests.helpers.tools import missing_tool, require_module, which

API_KEY = "test-key"  # the key the console is opened with (the screenshots type it)


# ---- the routes (no browser) --------------------------------------------------------------------
def test_console_page_and_files_are_served_without_the_api_key(live_server):
    page = httpx.get(live_server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("console/console.js", "console/console.css"):
        assert asset in page.text
        assert httpx.get(f"{live_server.url}/{asset}").status_code == 200
    # the data routes the page reads stay behind the key
    assert httpx.get(live_server.url + "/device/pages").status_code == 401


def test_page_map_agrees_with_the_device_figures(live_server):
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    pages = httpx.get(live_server.url + "/device/pages", headers=headers).json()
    kv = httpx.get(live_server.url + "/device", headers=headers).json()["kv_pages"]
    counts = pages["counts"]
    assert sum(counts.values()) == pages["total"] == kv["total"] == len(pages["cells"])
    assert counts["used"] + counts["shared"] == kv["in_use"]
    assert (counts["cached"], counts["free"]) == (kv["cached"], kv["free"])
    assert pages["block_size"] == kv["block_size"]


def test_token_rate_history_counts_each_second_and_forgets_after_the_window():
    history = TokenRateHistory(window_s=3)
    history.record(100.2, 50)  # the first message only sets the running total
    history.record(100.7, 58)
    history.record(101.5, 60)
    history.record(103.1, 61)  # nothing came in second 102
    assert history.per_second(103.9) == [8, 2, 0]
    assert history.per_second(105.0) == [0, 1, 0]  # seconds 102, 103, 104
    history.record(106.0, 61)  # seconds 100 and 101 fall out of the window
    assert [second for second, _ in history.buckets] == [103, 106]


def test_device_reports_the_tokens_generated_in_each_second(live_server):
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    start = _next_second()  # the in-thread server's clock is this one
    body = {"prompt": "hello", "max_tokens": 7, "ignore_eos": True}
    httpx.post(live_server.url + "/v1/completions", json=body, headers=headers).raise_for_status()
    end = _next_second()
    history = httpx.get(live_server.url + "/device", headers=headers).json()[
        "tokens_per_second_history"
    ]
    now = int(time.monotonic())
    assert len(history) == TOKEN_RATE_HISTORY_S
    assert sum(history[len(history) - (now - start) : len(history) - (now - end)]) == 7


def _next_second() -> int:
    """Wait for the next whole second of the monotonic clock; return it."""
    now = time.monotonic()
    time.sleep(int(now) + 1 - now)
    return int(time.monotonic())


def test_disable_web_ui_leaves_no_page_at_root(tiny_glm4):
    model_dir, _ = tiny_glm4
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(model_dir), dtype="float32", num_kv_pages=8, device="cpu"
        )
    )
    client = TestClient(build_app(engine, web_ui=False))  # no lifespan: the engine never starts
    assert client.get("/").status_code == 404
    assert client.get("/console/console.js").status_code == 404


# ---- in a real browser --------------------------------------------------------------------------
BROWSER_MISSING = (
    "no headless browser: install Debian's `apt-get install -y chromium chromium-driver` and "
    "`pip install -e '.[test]'` (selenium)"
)
CHAT_MESSAGE = "What does a list comprehension do?"
MAP_GROWTH_PAGES = 3  # pages the long request must add while the monitor watches
NUM_KV_PAGES = 64
DESKTOP = (1100, 1000)


def _browser_binaries() -> tuple[str, str] | None:
    chromium = which("chromium") or which("chromium-browser")
    driver = which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser() -> Iterator:
    webdriver = require_module("selenium.webdriver", BROWSER_MISSING)
    binaries = _browser_binaries()
    if binaries is None:
        missing_tool(BROWSER_MISSING)
    options = webdriver.ChromeOptions()
    options.binary_location = binaries[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={DESKTOP[0]},{DESKTOP[1]}")
    # the system chromedriver, named explicitly: Selenium Manager never looks for a download
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(binaries[1]))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def console_server() -> Iterator[str]:
    """The demo model behind an API key, in a thread; a small pool so the map shows its pages."""
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(demo_model_dir()),
            num_kv_pages=NUM_KV_PAGES,
            max_model_len=1024,
            device="kunlun-emu",
        )
    )
    with serve_app(build_app(engine, "demo", api_key=API_KEY)) as url:
        yield url


def _wait(condition, timeout: float = 60, what: str = "the page", driver=None):
    """``condition()`` once it is true; a failure after ``timeout`` s. Given the ``driver``, the
    failure says what the page showed: the status line and each transcript entry."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    shown = f"; the page showed {_page_state(driver)}" if driver is not None else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what}{shown}")


def _page_state(driver) -> dict:
    return driver.execute_script(
        """return {
             status: document.getElementById('answer-status').textContent,
             placeholder: document.getElementById('prompt').placeholder,
             entries: [...document.querySelectorAll('#transcript > li')].map(li => ({
               role: li.className, done: li.dataset.done,
               text: li.querySelector('.text')?.textContent.slice(0, 120),
               calls: li.querySelector('.calls')?.textContent.slice(0, 120)})),
           };"""
    )


def _screenshot(driver, name: str) -> None:
    folder = os.environ.get("PAGEDSERVE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        body = driver.find_element("tag name", "body")  # the content only, not the empty window
        body.screenshot(str(Path(folder) / name))


# Records every text the answer shows, with whether the stream had ended (data-done).
RECORD_ANSWER = """
window.__seen = [];
new MutationObserver(() => {
  const answer = document.querySelector('#transcript li.assistant:last-child');
  if (answer) window.__seen.push([answer.querySelector('.text').textContent, answer.dataset.done]);
}).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
"""


@pytest.mark.browser
def test_chat_answer_streams_in_and_the_page_map_fills_and_empties(browser, console_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = browser
    _open_with_key(driver, console_server)
    assert _unlabelled_controls(driver) == []

    # chat: a fixed sampling state so the answer is the same on every run
    driver.find_element(By.ID, "seed").send_keys("1")
    driver.find_element(By.ID, "max_tokens").clear()
    driver.find_element(By.ID, "max_tokens").send_keys("24")
    driver.execute_script(RECORD_ANSWER)
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(CHAT_MESSAGE, Keys.ENTER)
    answer = _wait(
        lambda: driver.find_elements(By.CSS_SELECTOR, "#transcript li.assistant[data-done=true]"),
        what="the chat answer to finish",
        driver=driver,
    )[-1]
    text = answer.find_element(By.CLASS_NAME, "text").text
    assert answer.is_displayed() and text.strip() and "error" not in answer.get_attribute("class")
    partial = {t for t, done in driver.execute_script("return window.__seen") if done == "false"}
    assert len(partial - {""}) >= 2, "the answer appeared at once, not token by token"
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert "tokens" in stats and "TTFT" in stats and "tokens/s" in stats
    user = driver.find_element(By.CSS_SELECTOR, "#transcript li.user .text").text
    assert user == CHAT_MESSAGE
    _screenshot(driver, "console-playground.png")

    # monitor: a long request fills pages as it decodes; its end (the client leaves) empties them
    driver.find_element(By.ID, "tab-monitor").click()
    driver.execute_script("const r = document.getElementById('refresh'); r.value = '250';")
    driver.execute_script("document.getElementById('refresh').dispatchEvent(new Event('change'))")
    page_map = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".page-map[data-in-use]"))[0]
    in_use = lambda: int(page_map.get_attribute("data-in-use"))  # noqa: E731
    assert page_map.is_displayed() and in_use() == 0
    leave = threading.Event()
    long_request = threading.Thread(target=_long_request, args=(console_server, leave), daemon=True)
    long_request.start()
    try:
        first = _wait(in_use, what="pages in use")
        _wait(lambda: in_use() >= first + MAP_GROWTH_PAGES, timeout=180, what="the map to fill")
        assert "pages in use" in page_map.get_attribute("aria-label")
        if os.environ.get("PAGEDSERVE_SCREENSHOTS"):  # a fuller map and a few seconds of chart
            _wait(lambda: in_use() >= NUM_KV_PAGES // 2, timeout=180, what="half the pool in use")
            _screenshot(driver, "console-monitor.png")
    finally:
        leave.set()
        long_request.join(60)
    _wait(lambda: in_use() == 0, what="the pages to be freed")
    assert driver.find_element(By.CSS_SELECTOR, "[data-fig=running]").text == "0"


@pytest.mark.browser
def test_completion_mode_answers_with_one_of_the_choices_given(browser, console_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.select import Select

    driver = browser
    _open_with_key(driver, console_server)
    driver.find_element(By.CSS_SELECTOR, "input[name=mode][value=completion]").click()
    assert not driver.find_element(By.ID, "system").is_displayed()  # chat only
    Select(driver.find_element(By.ID, "structured")).select_by_value("choice")
    driver.find_element(By.ID, "constraint").send_keys("mutable", Keys.ENTER, "immutable")
    driver.find_element(By.ID, "prompt").send_keys("A Python list is", Keys.ENTER)
    answer = _wait(
        lambda: driver.find_elements(By.CSS_SELECTOR, "#transcript li.completion[data-done=true]"),
        what="the completion",
        driver=driver,
    )[-1]
    assert answer.find_element(By.CLASS_NAME, "text").text in ("mutable", "immutable")


# Holds every /v1/models request sent without a key for arguments[0] ms before it goes out, so
# that its answer (a 401) comes back after the answer to a key typed meanwhile.
SLOW_KEYLESS_MODELS = """
const delay = arguments[0], fetchNow = window.fetch;
window.fetch = async (path, options = {}) => {
  if (String(path).endsWith('v1/models') && !(options.headers || {}).Authorization)
    await new Promise((resolve) => setTimeout(resolve, delay));
  return fetchNow(path, options);
};
"""


@pytest.mark.browser
def test_the_answer_to_a_key_typed_is_not_undone_by_a_late_answer_to_an_older_one(
    browser, console_server
):
    from selenium.webdriver.common.by import By

    driver = browser
    _open_with_key(driver, console_server)
    driver.execute_script(SLOW_KEYLESS_MODELS, 1000)
    driver.execute_script(
        """const key = document.getElementById('api-key');
           document.getElementById('model-name').textContent = '';
           key.value = ''; key.dispatchEvent(new Event('change'));  // out late: a 401
           key.value = arguments[0]; key.dispatchEvent(new Event('change'));""",
        API_KEY,
    )
    name = lambda: driver.find_element(By.ID, "model-name").text  # noqa: E731
    _wait(lambda: name() == "demo", what="the model name")
    time.sleep(2)  # the keyless request has gone out and had its answer
    assert name() == "demo"
    assert not driver.find_element(By.ID, "notice").is_displayed()


WEATHER_TOOLS = (
    '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]'
)


@pytest.mark.browser
def test_chat_with_tools_shows_the_call_and_sends_its_result_back(browser, console_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.select import Select

    driver = browser
    _open_with_key(driver, console_server)
    driver.find_element(By.ID, "clear").click()
    tools = driver.find_element(By.ID, "tools")
    tools.send_keys("[not json")
    driver.find_element(By.ID, "prompt").send_keys("Weather in Paris?", Keys.ENTER)
    assert "do not parse" in driver.find_element(By.ID, "answer-status").text
    assert tools.get_attribute("aria-invalid") == "true"
    assert not driver.find_elements(By.CSS_SELECTOR, "#transcript > li")  # nothing was sent

    tools.clear()
    tools.send_keys(WEATHER_TOOLS)
    Select(driver.find_element(By.ID, "tool-choice")).select_by_value("required")
    driver.find_element(By.ID, "seed").send_keys("3")  # the same answers on every run here
    driver.find_element(By.ID, "prompt").send_keys(Keys.ENTER)  # the message is still there
    answer = _wait(
        lambda: driver.find_elements(By.CSS_SELECTOR, "#transcript li.assistant[data-done=true]"),
        what="the call",
        driver=driver,
    )[-1]
    # one call or several (parallel_tool_calls is on): each is get_weather(city=...)
    calls = [call.text for call in answer.find_elements(By.CSS_SELECTOR, ".calls .tool-call")]
    assert calls
    for call in calls:
        name, _, arguments = call.partition("(")
        assert name == "get_weather" and set(json.loads(arguments.removesuffix(")"))) == {"city"}

    # each call's result is the next message; the model answers once all of them are in
    Select(driver.find_element(By.ID, "tool-choice")).select_by_value("none")
    prompt = driver.find_element(By.ID, "prompt")
    for _ in calls:
        assert "get_weather" in prompt.get_attribute("placeholder")
        prompt.send_keys('{"temperature": 21}', Keys.ENTER)
    _wait(
        lambda: (
            len(driver.find_elements(By.CSS_SELECTOR, "#transcript li.assistant[data-done=true]"))
            == 2
        ),
        what="the answer after the result",
        driver=driver,
    )
    roles = [
        li.get_attribute("class")
        for li in driver.find_elements(By.CSS_SELECTOR, "#transcript > li")
    ]
    assert roles == ["user", "assistant", *["tool"] * len(calls), "assistant"]
    last = driver.find_elements(By.CSS_SELECTOR, "#transcript li.assistant")[-1]
    assert last.find_element(By.CLASS_NAME, "text").text.strip()
    assert not last.find_element(By.CLASS_NAME, "calls").is_displayed()
    assert _unlabelled_controls(driver) == []
    driver.find_element(By.ID, "tools").clear()
    driver.find_element(By.ID, "clear").click()


def _open_with_key(driver, url: str) -> None:
    """Load the console and type the API key; the page then names the served model."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(url + "/")
    key = driver.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(API_KEY, Keys.TAB)  # "change" event: the page reads /v1/models with it
    _wait(lambda: driver.find_element(By.ID, "model-name").text == "demo", what="the model name")


def _long_request(url: str, leave: threading.Event, **fields) -> None:
    """A streamed completion far longer than the test waits; it leaves when ``leave`` is set,
    and the server aborts the request."""
    body = {"prompt": "def", "max_tokens": 1000, "ignore_eos": True, "stream": True, **fields}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
        for _ in response.iter_lines():
            if leave.is_set():
                return


def _unlabelled_controls(driver) -> list[str]:
    """Form controls a screen reader would announce without a name."""
    return driver.execute_script(
        """return [...document.querySelectorAll('input, select, textarea')]
             .filter(e => !e.labels.length && !e.getAttribute('aria-label'))
             .map(e => e.id || e.outerHTML);"""
    )


@pytest.mark.browser
def test_console_fits_a_phone_screen(browser, console_server):
    browser.set_window_size(390, 844)
    try:
        for tab in ("tab-playground", "tab-monitor"):
            browser.get(console_server + "/")
            browser.find_element("id", tab).click()
            overflow = browser.execute_script(
                "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 0, f"{tab}: the page scrolls sideways by {overflow}px at 390px"
    finally:
        browser.set_window_size(*DESKTOP)


@pytest.mark.browser
def test_views_switch_from_the_keyboard(browser, console_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(console_server + "/")
    browser.find_element(By.ID, "tab-playground").send_keys(Keys.ARROW_RIGHT)
    monitor_tab = browser.find_element(By.ID, "tab-monitor")
    assert monitor_tab.get_attribute("aria-selected") == "true"
    assert browser.switch_to.active_element == monitor_tab  # focus follows the selection
    assert browser.find_element(By.ID, "monitor").is_displayed()
    assert not browser.find_element(By.ID, "playground").is_displayed()


@pytest.mark.browser
def test_without_the_key_the_page_asks_for_it(browser, console_server):
    from selenium.webdriver.common.by import By

    browser.get(console_server + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    notice = _wait(lambda: browser.find_element(By.ID, "notice").text, what="the notice")
    assert "API key" in notice
    key = browser.find_element(By.ID, "api-key")
    assert key.is_displayed() and browser.switch_to.active_element == key


# a pool where the two siblings of an n = 2 request outgrow it halfway: the second is swapped out
TIERS_KV_PAGES = 32
TIERS_MAX_TOKENS = TIERS_KV_PAGES * 16 - 8  # each sibling fits the pool alone


@pytest.fixture(scope="module")
def tiers_console_server() -> Iterator[str]:
    """The demo model with a host tier (swap space and a host prefix cache)."""
    host_gib = host_tier_gib(demo_model_dir(), 2 * TIERS_KV_PAGES, 16)
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(demo_model_dir()),
            num_kv_pages=TIERS_KV_PAGES,
            max_model_len=1024,
            device="kunlun-emu",
            preemption_mode="swap",
            swap_space=host_gib,
            host_prefix_cache=host_gib,
        )
    )
    # a step of at least 5 ms: the swapped sibling waits out the other's last ~250 tokens, which
    # the demo model decodes in about 0.3 s, too short for a monitor refreshing every 250 ms to
    # be sure to see (the test timed out on loaded machines); now it sees it for over a second
    execute_step = engine.execute_step

    def slow_step():
        time.sleep(0.005)
        return execute_step()

    engine.execute_step = slow_step
    with serve_app(build_app(engine, "demo", api_key=API_KEY)) as url:
        yield url


@pytest.mark.browser
def test_the_host_tier_is_a_map_of_its_own_that_shows_swapped_out_pages(
    browser, tiers_console_server
):
    from selenium.webdriver.common.by import By

    driver, url = browser, tiers_console_server
    _open_with_key(driver, url)
    driver.find_element(By.ID, "tab-monitor").click()
    driver.execute_script("const r = document.getElementById('refresh'); r.value = '250';")
    driver.execute_script("document.getElementById('refresh').dispatchEvent(new Event('change'))")
    host_map = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".host-map[data-swapped]"))[0]
    swapped = lambda: int(host_map.get_attribute("data-swapped"))  # noqa: E731
    figure = lambda name: driver.find_element(By.CSS_SELECTOR, f"[data-fig={name}]")  # noqa: E731
    assert host_map.is_displayed() and swapped() == 0
    assert figure("swapped").is_displayed() and figure("host-hit").is_displayed()
    leave = threading.Event()
    fields = {"n": 2, "max_tokens": TIERS_MAX_TOKENS}
    siblings = threading.Thread(target=_long_request, args=(url, leave), kwargs=fields, daemon=True)
    siblings.start()
    try:
        _wait(swapped, timeout=240, what="a sibling's pages swapped out to the host tier")
        assert "hold swapped-out pages" in host_map.get_attribute("aria-label")
        legend = driver.find_element(By.CSS_SELECTOR, "[data-host-count=swapped]")
        _wait(lambda: legend.text == str(swapped()), what="the legend to count them")
        _wait(lambda: figure("swapped").text == "1", what="the swapped request's figure")
    finally:
        leave.set()
        siblings.join(60)
    _wait(lambda: swapped() == 0, what="the swapped pages to be freed")
