"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by selenium
with no browser download) against a real server on the default model: the page loads without console
errors, shows the radix tree after three programs that share a system prompt (one node hit 3 times),
draws a forked program's call graph with each call's cached tokens, streams a playground answer
with its cached tokens, shows a prompt's "<script>" as text, and refuses to show anything without
the API key.

With RADIXLM_DASHBOARD_SCREENSHOTS=<dir> set, each view's screenshot is written there; the README's
come from `RADIXLM_DASHBOARD_SCREENSHOTS=docs/dashboard pytest <this file>`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from server_harness import API_KEY, HEADERS, Server, launch_server

import radixlm as sgl

pytestmark = pytest.mark.slow

INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium (or: bash scripts/install.sh)"
SYSTEM = "You are Ada, a terse librarian. Answer every question in at most five words, then stop.\n"
QUESTIONS = ["Where are atlases kept?", "Who shelves returned novels?", "When does the reading room open?"]
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> tell me a story'
WAIT_S = 60.0


def _browser_paths() -> tuple[str, str]:
    """Chromium and chromedriver, or a failure in CI (a skip elsewhere) naming the install command."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if chromium and driver:
        return chromium, driver
    reason = f"the dashboard's browser tests need Chromium, chromedriver and selenium: {INSTALL}"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def dash_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch_server(tmp_path_factory.mktemp("dashboard"))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    chromium, chromedriver = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,1000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    yield drv
    drv.quit()


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except Exception:  # the element is not there yet, or was redrawn under us
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def console_errors(drv: Any) -> list[dict[str, Any]]:
    return [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(drv: Any, name: str) -> None:
    folder = os.environ.get("RADIXLM_DASHBOARD_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        drv.save_screenshot(str(Path(folder) / f"{name}.png"))


def js(drv: Any, script: str, *args: Any) -> Any:
    return drv.execute_script(script, *args)


def open_dashboard(drv: Any, server: Server, key: str | None) -> None:
    """Loads the page in a fresh tab state and logs in with key (None: stays at the login)."""
    drv.get(f"{server.url}/dashboard")
    js(drv, "sessionStorage.clear()")
    # The page left behind may poll a feed without its key between the clear and the reload: leave
    # it for a blank page and drop its log, so a test's console holds only its own page's errors.
    drv.get("about:blank")
    drv.get_log("browser")
    drv.get(f"{server.url}/dashboard")
    wait_for(lambda: js(drv, "return !document.getElementById('login').hidden"), "the login form")
    if key is not None:
        drv.find_element("id", "api-key").send_keys(key)
        drv.find_element("id", "login-form").submit()
        wait_for(
            lambda: js(drv, "return !document.getElementById('app').hidden"), "the dashboard after login"
        )


def rows(drv: Any, selector: str) -> list[Any]:
    return drv.find_elements("css selector", selector)


def show(drv: Any, view: str) -> None:
    drv.find_element("css selector", f"#tabs button[data-view={view}]").click()


def test_page_refuses_without_the_key(dash_server: Server, driver: Any) -> None:
    open_dashboard(driver, dash_server, None)
    time.sleep(0.5)
    assert js(driver, "return document.getElementById('app').hidden") is True
    assert js(driver, "return document.querySelectorAll('.node-row, #live-table tr').length") == 0
    # Every feed refuses a browser that has no key, whatever the page does.
    status = js(driver, "return fetch('/dashboard/api/tree').then(r => r.status)")
    assert status == 401
    assert requests.get(f"{dash_server.url}/dashboard/api/requests", timeout=10).status_code == 401
    driver.find_element("id", "api-key").send_keys("wrong-key")
    driver.find_element("id", "login-form").submit()
    wait_for(lambda: driver.find_element("id", "login-error").text, "the refused-key message")
    assert js(driver, "return document.getElementById('app').hidden") is True
    screenshot(driver, "login")
    # The only console errors are the refused feed requests themselves.
    assert all("401" in e["message"] for e in console_errors(driver)), console_errors(driver)


def test_three_programs_share_one_node_hit_three_times(dash_server: Server, driver: Any) -> None:
    @sgl.function
    def librarian(s, question):  # type: ignore[no-untyped-def]
        s += sgl.system(SYSTEM)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))

    backend = sgl.RuntimeEndpoint(dash_server.url, api_key=API_KEY)
    try:
        states = librarian.run_batch([{"question": q} for q in QUESTIONS], backend=backend)
    finally:
        backend.shutdown()
    assert all(st["answer"] for st in states)

    open_dashboard(driver, dash_server, API_KEY)
    # The shared prefix (system prompt) is one node from the root that all three programs hit.
    shared = wait_for(
        lambda: [r for r in rows(driver, ".node-row[data-hits='3']") if "terse librarian" in r.text],
        "a node with the system prompt and 3 hits",
    )
    assert len(shared) == 1
    screenshot(driver, "cache")

    # Clicking it lists the requests that used it: the three programs' calls (and the warm-up).
    shared[0].click()
    wait_for(lambda: len(rows(driver, "#node-detail tr.clickable")) >= 3, "node users")

    show(driver, "programs")
    wait_for(lambda: len(rows(driver, "#programs .program")) >= 3, "program runs")
    runs = [r for r in rows(driver, "#programs .program") if "librarian" in r.text]
    assert len(runs) >= 3

    show(driver, "requests")
    wait_for(
        lambda: len(rows(driver, "#recent-table tr.clickable")) >= 4,
        "recent requests",
    )
    rows(driver, "#recent-table tr.clickable")[0].click()
    wait_for(lambda: driver.find_element("id", "request-prompt").text, "a request's prompt")
    assert rows(driver, "#request-prompt .cached")
    screenshot(driver, "requests")
    assert console_errors(driver) == []


def test_programs_view_draws_the_call_graph(dash_server: Server, driver: Any) -> None:
    """A program that forks: its first call is a root of the graph, the two branches hang under it,
    each line shows its cached tokens (the branches find the shared prefix in the cache)."""

    @sgl.function
    def branches(s, topic):  # type: ignore[no-untyped-def]
        s += sgl.system(SYSTEM)
        s += sgl.user(f"Name one fact about {topic}.")
        s += sgl.assistant(sgl.gen("fact", max_tokens=6, temperature=0))
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += sgl.user(f"Give detail {i + 1}.")
            f += sgl.assistant(sgl.gen("detail", max_tokens=6, temperature=0))
        forks.join()  # waits for both branches: the run ends after them

    backend = sgl.RuntimeEndpoint(dash_server.url, api_key=API_KEY)
    try:
        branches.run(topic="maps", backend=backend).sync()
    finally:
        backend.shutdown()

    open_dashboard(driver, dash_server, API_KEY)
    show(driver, "programs")

    def graph_lines() -> list[Any]:
        runs = [r for r in rows(driver, "#programs .program") if r.text.startswith("branches")]
        return runs[0].find_elements("css selector", ".call-graph .call") if runs else []

    lines = wait_for(lambda: (ls := graph_lines()) and len(ls) >= 3 and ls, "the forked program's call graph")
    indent = [float(line.value_of_css_property("padding-left").removesuffix("px")) for line in lines]
    cached = [int(line.text.split(" / ")[0].split()[-1]) for line in lines]
    assert indent[0] == 0.0
    assert sum(1 for x in indent[1:] if x > 0.0) >= 2, indent  # both branches under the first call
    assert all(c > 0 for c, x in zip(cached, indent) if x > 0.0), (cached, indent)
    screenshot(driver, "programs")
    assert console_errors(driver) == []


def test_playground_streams_and_shows_cached_tokens(dash_server: Server, driver: Any) -> None:
    open_dashboard(driver, dash_server, API_KEY)
    show(driver, "playground")
    prompt = driver.find_element("id", "pg-prompt")
    prompt.send_keys("Name three colours of the rainbow.")
    driver.find_element("id", "pg-max").clear()
    driver.find_element("id", "pg-max").send_keys("24")
    cached = []
    for _ in range(2):  # the second time, the whole prompt but its last token comes from the cache
        js(
            driver,
            "window.__updates = 0; new MutationObserver(() => window.__updates++).observe("
            "document.getElementById('pg-output'), {childList: true, characterData: true, subtree: true});"
            "document.getElementById('pg-cached').removeAttribute('data-cached');",
        )
        driver.find_element("id", "pg-send").click()
        value = wait_for(lambda: driver.find_element("id", "pg-cached").get_attribute("data-cached"), "usage")
        cached.append(int(value))
        assert driver.find_element("id", "pg-output").text.strip()
        assert js(driver, "return window.__updates") > 1  # streamed: the answer grew piece by piece
    assert cached[1] > 0 and cached[1] >= cached[0], cached
    assert f"{cached[1]} from the cache" in driver.find_element("id", "pg-cached").text
    screenshot(driver, "playground")

    show(driver, "metrics")
    wait_for(lambda: len(rows(driver, "#charts .uplot")) == 4, "four charts")
    time.sleep(2.5)  # a couple more samples
    screenshot(driver, "metrics")
    assert console_errors(driver) == []


def test_a_prompt_with_script_shows_as_text(dash_server: Server, driver: Any) -> None:
    r = requests.post(
        f"{dash_server.url}/generate",
        json={"text": XSS, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        headers=HEADERS,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    rid = r.json()["meta_info"]["id"]
    open_dashboard(driver, dash_server, API_KEY)
    wait_for(
        lambda: [n for n in rows(driver, ".node-row") if "<script>" in n.text],
        "tree text",
    )
    show(driver, "requests")
    row = wait_for(
        lambda: driver.find_element("css selector", f"#recent-table tr[data-rid='{rid}']"), "the request"
    )
    row.click()
    wait_for(lambda: "<script>" in driver.find_element("id", "request-prompt").text, "the prompt as text")
    assert js(driver, "return window.__pwned") is None
    assert js(driver, "return document.querySelectorAll('#app script, #app img').length") == 0
    assert console_errors(driver) == []


def test_abort_from_the_requests_view(dash_server: Server, driver: Any) -> None:
    body = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    body["rid"] = "dashboard-abort-me"
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            requests.post, f"{dash_server.url}/generate", json=body, headers=HEADERS, timeout=600
        )
        open_dashboard(driver, dash_server, API_KEY)
        show(driver, "requests")
        button = wait_for(
            lambda: driver.find_element(
                "css selector", "#live-table tr[data-rid='dashboard-abort-me'] button"
            ),
            "the running request's abort button",
        )
        button.click()
        finish = answer.result().json()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort", finish
    assert console_errors(driver) == []


SYNTHETIC_TREE = """
const node = (id, parent, depth, tokens, text, hits, children) => ({id, parent, depth, tokens,
  prefix_tokens: 0, text, hits, age_s: 1, lock_ref: 0, locked_by: [], other_locks: 0,
  evictable: parent !== null, children, omitted_children: 0});
const nodes = [node(0, null, 0, 0, "", 0, 100)];
let id = 1;
for (let a = 0; a < 100; a++) {
  const top = id++;
  nodes.push(node(top, 0, 1, 40, `shared prefix ${a}`, 99, 99));
  for (let b = 0; b < 99; b++) nodes.push(node(id++, top, 2, 60, `branch ${a}.${b}`, 0, 0));
}
const body = JSON.stringify({enabled: true, nodes, truncated: false, total_tokens: 10,
  evictable_tokens: 10, protected_tokens: 0, max_total_tokens: 20000, taken_at: Date.now() / 1000});
const realFetch = window.fetch;
const json = {headers: {"Content-Type": "application/json"}};
window.fetch = (url, opts) => String(url).includes("/dashboard/api/tree")
  ? Promise.resolve(new Response(body, json)) : realFetch(url, opts);
document.getElementById("refresh").value = "0";
window.__t0 = performance.now();
const select = document.getElementById("tree-max");
select.value = "20000";
select.dispatchEvent(new Event("change"));
"""


def test_tree_of_ten_thousand_nodes_stays_responsive(dash_server: Server, driver: Any) -> None:
    """The cache view draws a 10^4-node snapshot (served to the page in place of the feed's) and
    folds a branch in well under a second each."""
    open_dashboard(driver, dash_server, API_KEY)
    js(driver, SYNTHETIC_TREE)
    wait_for(lambda: len(rows(driver, ".node-row")) > 1000, "the large tree drawn")
    drawn_ms = js(driver, "return performance.now() - window.__t0")
    assert "10001 nodes" in driver.find_element("id", "tree-summary").text
    fold_ms = js(
        driver,
        "const t0 = performance.now();"
        "document.querySelector('.node-row[data-node-id=\"1\"] .toggle').click();"
        "return performance.now() - t0;",
    )
    assert drawn_ms < 3000 and fold_ms < 1500, (drawn_ms, fold_ms)
    assert console_errors(driver) == []
