"""`outbox-relay console` in a real browser (headless Chromium from Debian, driven by
selenium), against a real relay database: dead letters made by a relay, runs and jobs
made by the jobs API, a replay request.  Also what a browser cannot show: cross-site
and forged requests are refused, read-only mode has no actions; a dead letter of many
megabytes is listed and shown cut, with its size.

Without chromium/chromedriver (apt-get install chromium chromium-driver) or selenium the
browser test skips with the reason, and fails under CI=true.  OUTBOX_CONSOLE_SCREENSHOTS=DIR
saves the screenshots of the main pages there (docs/console/ in the README).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest

from consumer_sdk.jobs import NewJob, accept, enqueue
from consumer_sdk.jobs import queue as jobq
from relay.replay_store import ReplayStore
from tests.fixtures.outbox import RelayThread, relay_cmd, relay_env
from tests.fixtures.procs import wait_until
from tests.integration.jobs._support import claim_next

TOKEN = "console-token-0123456789abcdef"
SECRET_PAYLOAD = "payload-secret-marker"


def _browser_or_skip() -> tuple[str, str]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if chromium and driver:
        return chromium, driver
    reason = ("headless Chromium test needs Debian's chromium and chromium-driver "
              "(apt-get install chromium chromium-driver) and selenium (pip install .[test])")
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def _dead_letters(dsn: str, bootstrap: str, topic: str) -> None:
    """Three rows the relay cannot publish (a header that is not a string): dead letters."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in range(3):
            conn.execute("INSERT INTO outbox (topic, key, payload, headers) VALUES (%s, %s, %s, %s)",
                         (topic, f"k{n}", f'{{"secret": "{SECRET_PAYLOAD}", "n": {n}}}', '{"n": 1}'))
    with RelayThread(dsn, bootstrap, max_attempts=1):
        wait_until(lambda: _count(dsn, "outbox_dead_letters") == 3, timeout_s=60)


def _jobs(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        runs = {name: accept(conn, owner_id="owner-a", request_key=name, kind="report", body={"n": name})
                for name in ("done", "failed", "queued")}
        enqueue(conn, [NewJob(owner_id="owner-b", queue="bulk", kind="export", payload={})])
        for job in claim_next(conn, "worker-1", now=None, max_concurrency=4):
            if job.run_id == runs["done"].run_id:
                assert jobq.complete(conn, job.lease, result={"pages": 1})
            elif job.run_id == runs["failed"].run_id:
                assert jobq.fail(conn, job.lease, reason="permanent_error",
                                 error="Boom: https://internal.example/secret-url", error_type="Boom")
    return {name: str(run.run_id) for name, run in runs.items()}


def _count(dsn: str, table: str, where: str = "true") -> int:
    """Rows of ``table`` matching ``where`` (test-owned constants only)."""
    from psycopg import sql

    query = sql.SQL("SELECT count(*) FROM {} WHERE {}").format(sql.Identifier(table), sql.SQL(where))  # type: ignore[arg-type]
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute(query).fetchone()[0])  # type: ignore[index]


def _console(spawn: Any, dsn: str, tmp_path: Path, *, actions: bool) -> tuple[Any, str]:
    token_file = tmp_path / "console-token"
    token_file.write_text(TOKEN + "\n")
    env = relay_env(dsn, "", console_port=0, console_actions=str(actions).lower(),
                    console_token_file=str(token_file))
    proc = spawn(relay_cmd("console"), env=env, name=f"console-{'rw' if actions else 'ro'}")
    line = proc.wait_for_log(re.compile(r"console listening on http://127\.0\.0\.1:\d+/"), timeout_s=30)
    return proc, line.split("on ", 1)[1].strip()


def _post(url: str, fields: dict[str, str], **headers: str) -> int:
    from urllib.parse import urlencode

    request = urllib.request.Request(url, data=urlencode(fields).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - 127.0.0.1 only
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _driver(chromium: str, driver_path: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,860", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def test_console_in_a_browser(outbox_db, broker, topic, spawn, tmp_path):
    chromium, driver_path = _browser_or_skip()
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    _dead_letters(outbox_db, broker.bootstrap, topic)
    runs = _jobs(outbox_db)
    store = ReplayStore(outbox_db)
    from datetime import UTC, datetime, timedelta

    replay = store.create(since=datetime.now(UTC) - timedelta(hours=1), until=None, topics=[topic], keys=[],
                          rate=100.0, requested_by="tester")
    store.close()
    with psycopg.connect(outbox_db, autocommit=True) as conn:  # a replica waiting on a partition
        conn.execute("INSERT INTO outbox_relay_replicas (owner, seen_until, stalled) VALUES "
                     "('replica-a', now() + interval '1 hour', %s::jsonb)",
                     (f'{{"{topic}": {{"2": 17}}}}',))
    proc, url = _console(spawn, outbox_db, tmp_path, actions=True)
    shots = os.environ.get("OUTBOX_CONSOLE_SCREENSHOTS")
    browser = _driver(chromium, driver_path)
    try:
        def shot(name: str) -> None:
            browser.save_screenshot(str(tmp_path / f"{name}.png"))
            if shots:
                browser.save_screenshot(str(Path(shots) / f"{name}.png"))

        def submit(element: Any) -> None:
            """Click and wait for the next page (a form post navigates)."""
            old = browser.find_element(By.TAG_NAME, "html")
            element.click()
            # Chromium may answer "node does not belong to the document" mid-navigation: retry.
            WebDriverWait(browser, 15, ignored_exceptions=(WebDriverException,)).until(
                expected_conditions.staleness_of(old))

        def click(label: str, row_text: str) -> None:
            row = browser.find_element(By.XPATH, f"//tr[td[contains(., '{row_text}')]]")
            submit(row.find_element(By.XPATH, f".//button[normalize-space()='{label}']"))

        browser.get(url)
        assert "Relay status" in browser.title
        assert len(browser.find_elements(By.XPATH, "//h2[.='Shards and leases']/following-sibling::table[1]//tbody/tr")) == 16
        stalled = browser.find_element(By.XPATH, f"//tr[td[.='{topic}'] and td[.='2']]")
        assert "17" in stalled.text and "replica-a" in stalled.text  # what waits, and where
        shot("status")

        browser.get(url + "dead-letters")
        assert len(browser.find_elements(By.CSS_SELECTOR, "tbody tr")) == 3
        assert SECRET_PAYLOAD not in browser.page_source
        assert not browser.find_elements(By.TAG_NAME, "button")  # no session: no action
        shot("dead-letters")
        submit(browser.find_element(By.CSS_SELECTOR, "tbody tr a"))
        assert SECRET_PAYLOAD not in browser.page_source
        submit(browser.find_element(By.LINK_TEXT, "show them for this row"))
        assert SECRET_PAYLOAD in browser.page_source and "bad_headers" in browser.page_source

        browser.get(url + "login")
        browser.find_element(By.NAME, "who").send_keys("alice")
        browser.find_element(By.NAME, "token").send_keys("wrong-token-wrong-token")
        submit(browser.find_element(By.CSS_SELECTOR, "form button"))
        assert "wrong token" in browser.page_source
        browser.find_element(By.NAME, "who").send_keys("alice")
        browser.find_element(By.NAME, "token").send_keys(TOKEN)
        submit(browser.find_element(By.CSS_SELECTOR, "form button"))
        assert "signed in as alice" in browser.page_source
        cookie = browser.get_cookie("outbox_console")
        assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"

        browser.get(url + "dead-letters")
        first, second = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "tbody tr td:first-child a")][:2]
        click("requeue", first)
        assert "requeued 1" in browser.find_element(By.CLASS_NAME, "flash").text
        click("purge", second)
        assert "purged 1" in browser.find_element(By.CLASS_NAME, "flash").text
        assert _count(outbox_db, "outbox_dead_letters") == 1
        assert _count(outbox_db, "outbox", f"event_id = '{first}' AND published_at IS NULL") == 1

        browser.get(url + "replays")
        shot("replays")
        click("cancel", f"{topic}")
        assert "cancelled" in browser.find_element(By.CLASS_NAME, "flash").text
        assert _count(outbox_db, "outbox_relay_replays", f"id = {replay['id']} AND state = 'cancelled'") == 1

        browser.get(url + "jobs?status=failed")
        assert runs["failed"] in browser.page_source and runs["done"] not in browser.page_source.split("<h2>Runs")[1].split("<h2>")[0]
        browser.get(url + "jobs")
        shot("jobs")
        click("retry", "permanent_error")
        assert "queued again" in browser.find_element(By.CLASS_NAME, "flash").text
        assert _count(outbox_db, "job_dead_letters") == 0

        browser.get(url + f"runs/{runs['failed']}")
        assert "secret-url" not in browser.page_source
        shot("run")
        submit(browser.find_element(By.LINK_TEXT, "show it for this run"))
        assert "secret-url" in browser.page_source
        browser.get(url + f"runs/{runs['queued']}")
        submit(browser.find_element(By.XPATH, "//button[.='cancel run']"))
        assert "now cancelled" in browser.find_element(By.CLASS_NAME, "flash").text
    finally:
        browser.quit()

    log = proc.log_text()
    assert re.search(r'"who": ?"alice".*"action": ?"dead-letters/requeue"|"action": ?"dead-letters/requeue".*"who": ?"alice"', log)
    assert "console_sign_in_refused" in log
    assert TOKEN not in log


def test_console_refuses_forged_requests_and_is_read_only_by_default(outbox_db, spawn, tmp_path):
    rw, url = _console(spawn, outbox_db, tmp_path, actions=True)
    origin = url.rstrip("/")
    assert _post(url + "actions/dead-letters/purge", {"event_id": "x"}, Origin="http://evil.example") == 403
    assert _post(url + "actions/dead-letters/purge", {"event_id": "x"}) == 403  # no Origin, no Referer
    assert _post(url + "actions/dead-letters/purge", {"event_id": "x", "csrf": "guess"}, Origin=origin) == 403
    assert _post(url + "login", {"who": "mallory", "token": TOKEN, "csrf": "forged"}, Origin=origin) == 403
    request = urllib.request.Request(url, headers={"Host": "rebound.example:80"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)  # noqa: S310 - 127.0.0.1 only
    assert refused.value.code == 421
    with urllib.request.urlopen(url, timeout=10) as page:  # noqa: S310
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
        assert page.headers["X-Frame-Options"] == "DENY"
    rw.sigterm()
    assert rw.wait(10) == 0

    ro, ro_url = _console(spawn, outbox_db, tmp_path, actions=False)
    assert "read-only" in ro.log_text()
    assert _post(ro_url + "actions/dead-letters/purge", {"event_id": "x"}, Origin=ro_url.rstrip("/")) == 403
    with urllib.request.urlopen(ro_url + "dead-letters", timeout=10) as page:  # noqa: S310
        body = page.read()
    assert b"sign in" not in body and b"read-only" in body
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(ro_url + "login", timeout=10)  # noqa: S310 - no sign-in when read-only
    assert missing.value.code == 404
    # An address whose id is not a UUID is not found.  Both raised in the handler (the dead
    # letter's id went to PostgreSQL's uuid input, the run's to InvalidJob): a traceback,
    # and the connection closed without an answer.
    for path in ("dead-letters/" + "-" * 36, "runs/" + "-" * 36, "runs/urn:uuid:" + "0" * 32):
        with pytest.raises(urllib.error.HTTPError) as not_an_id:
            urllib.request.urlopen(ro_url + path, timeout=10)  # noqa: S310
        assert not_an_id.value.code == 404, path
    assert "Traceback" not in ro.log_text()


def test_a_dead_letter_of_many_megabytes_is_listed_and_shown_cut(outbox_db, spawn, tmp_path):
    """A row is dead-lettered for its size with its key and headers (fc8549f): a key of
    20 MB made `dead-letters list` print 20 MB (and read 20 MB a row, 200 rows a page in the
    console), the console's page of the row as much.  Now the list cuts keys to 200
    characters and gives their size; the console's page cuts key, headers and payload to
    10,000 characters and says so; `dead-letters show` still prints the whole row."""
    big = 20_000_000
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("""INSERT INTO outbox_dead_letters
                            (id, event_id, topic, key, payload, headers, created_at, reason, error, attempts)
                        VALUES (1, '018f0000-0000-7000-8000-000000000001', 'orders', repeat('k', %(n)s),
                                jsonb_build_object('pad', repeat('p', %(n)s)),
                                jsonb_build_object('h', repeat('h', %(n)s)),
                                now(), 'message_too_large', 'too large', 1)""", {"n": big})
    listed = subprocess.run(relay_cmd("dead-letters", "list", "--json", "--dsn", outbox_db),
                            capture_output=True, text=True, check=True, timeout=60)
    assert len(listed.stdout) < 10_000
    (row,) = json.loads(listed.stdout)
    assert row["key"] == "k" * 200 and row["key_bytes"] == big

    ro, url = _console(spawn, outbox_db, tmp_path, actions=False)
    for path in ("dead-letters", "dead-letters/018f0000-0000-7000-8000-000000000001",
                 "dead-letters/018f0000-0000-7000-8000-000000000001?reveal=1"):
        with urllib.request.urlopen(url + path, timeout=30) as page:  # noqa: S310 - 127.0.0.1 only
            body = page.read().decode()
        assert len(body) < 100_000, path
    assert "of 20,000,000 bytes" in body  # the key
    assert "of 20,000,009 bytes" in body  # the headers' text: {"h": "hhh..."}
    assert "of 20,000,011 bytes" in body  # the payload's: {"pad": "ppp..."}
    assert "k" * 10_000 in body and "k" * 10_001 not in body
    ro.sigterm()
    assert ro.wait(10) == 0

    shown = subprocess.run(relay_cmd("dead-letters", "show", "018f0000-0000-7000-8000-000000000001",
                                     "--dsn", outbox_db), capture_output=True, text=True, check=True,
                           timeout=60)
    whole = json.loads(shown.stdout)
    assert len(whole["key"]) == big and whole["payload_size"] == big + 11


def test_the_console_listens_on_an_ipv6_address(outbox_db, spawn):
    """`--console-host ::1` failed with "Address family for hostname not supported" (the
    console's server bound IPv4 only), where `--metrics-host ::1` works; and an IPv6 address's
    own Host header ([::1]:port) is the one its check must allow (an audit's finding)."""
    env = relay_env(outbox_db, "", console_port=0, console_host="::1")
    proc = spawn(relay_cmd("console"), env=env, name="console-v6")
    line = proc.wait_for_log(re.compile(r"console listening on http://\[::1\]:\d+/"), timeout_s=30)
    url = line.split("on ", 1)[1].split()[0]
    with urllib.request.urlopen(url, timeout=10) as page:  # noqa: S310 - ::1 only
        assert page.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, headers={"Host": "rebound.example:80"}),  # noqa: S310
                               timeout=10)
    assert refused.value.code == 421
    proc.sigterm()
    assert proc.wait(10) == 0


def _raw(url: str, request: bytes, *, timeout_s: float = 10) -> bytes:
    """Send ``request`` as is (its Host header filled in); the answer's bytes."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as sock:
        sock.sendall(request.replace(b"HOST", parts.netloc.encode()))
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_the_console_answers_what_an_audit_of_its_web_security_sent(outbox_db, spawn, tmp_path):
    """Each of these failed on the code before (an audit of the console's web security):
    a NUL in a /jobs filter got no answer and a traceback; a negative Content-Length read the
    body past the form limit until the client closed; one client trickling a request held
    every other one; redirects and the standard library's error pages had no CSP; any text
    in ?done= was shown as an action's result; the jobs' pages got no answer when the
    database connection was gone; a client gone mid-answer printed a traceback."""
    import socket
    import time
    from urllib.parse import urlsplit

    proc, url = _console(spawn, outbox_db, tmp_path, actions=True)
    with pytest.raises(urllib.error.HTTPError) as nul:
        urllib.request.urlopen(url + "jobs?owner=%00", timeout=10)  # noqa: S310 - 127.0.0.1 only
    assert nul.value.code == 400
    answer = _raw(url, b"POST /actions/x HTTP/1.1\r\nHost: HOST\r\nOrigin: http://HOST\r\n"
                       b"Content-Length: -1\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400"), answer[:80]
    for request in (b"PUT / HTTP/1.1\r\nHost: HOST\r\nConnection: close\r\n\r\n",
                    b"GET /logout HTTP/1.1\r\nHost: HOST\r\nConnection: close\r\n\r\n"):
        answer = _raw(url, request)
        assert b"Content-Security-Policy: default-src 'none'" in answer, answer[:300]
    two_hosts = _raw(url, b"GET / HTTP/1.1\r\nHost: HOST\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
    assert b" 421 " in two_hosts.split(b"\r\n", 1)[0], two_hosts[:80]  # only the first was checked
    with urllib.request.urlopen(url + "?done=session+expired%3A+sign+in+at+evil.example", timeout=10) as page:  # noqa: S310
        assert b"evil.example" not in page.read()
    # A client that sends a byte at a time does not hold the others.
    parts = urlsplit(url)
    slow = socket.create_connection((parts.hostname, parts.port), timeout=10)
    slow.sendall(b"GET / HTTP/1.1\r\n")
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=10) as page:  # noqa: S310
        assert page.status == 200
    assert time.monotonic() - started < 5
    slow.close()
    # The console's database connection cut: the jobs' pages say so.
    with psycopg.connect(outbox_db, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE application_name = 'outbox-relay-console'")
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(url + "runs/44444444-4444-4444-8444-444444444444", timeout=10)  # noqa: S310
    assert gone.value.code == 503
    with pytest.raises(urllib.error.HTTPError) as back:  # ... and once it is back, they work again
        urllib.request.urlopen(url + "runs/44444444-4444-4444-8444-444444444444", timeout=10)  # noqa: S310
    assert back.value.code == 404  # no such run
    # A client gone mid-answer is one log line, not a traceback.
    reset = socket.create_connection((parts.hostname, parts.port), timeout=10)
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    reset.sendall(f"GET /dead-letters HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
    reset.close()
    with urllib.request.urlopen(url, timeout=10) as page:  # noqa: S310 - still serving
        assert page.status == 200
    proc.sigterm()
    assert proc.wait(10) == 0
    assert "Traceback" not in proc.log_text(), proc.log_text()[-3000:]


def _login_form(url: str) -> str:
    with urllib.request.urlopen(url + "login", timeout=10) as page:  # noqa: S310 - 127.0.0.1 only
        found = re.search(r'name="csrf" value="([^"]+)"', page.read().decode())
    assert found is not None
    return found.group(1)


def test_the_console_limits_guesses_at_its_token_and_its_connections(outbox_db, spawn, tmp_path):
    """Each of these was open on the code before (found by an audit of the console's web
    security): any number of wrong tokens could be tried, each GET of /login kept a form for
    ten minutes however many were asked for, a request refused for its Host left no log line,
    and every connection got a thread of its own however many were open."""
    import socket
    from urllib.parse import urlsplit

    from relay.console import MAX_CONNECTIONS, MAX_LOGIN_FORMS, MAX_REFUSED_SIGN_INS

    proc, url = _console(spawn, outbox_db, tmp_path, actions=True)
    origin = url.rstrip("/")
    first = _login_form(url)
    for _ in range(MAX_LOGIN_FORMS):
        newest = _login_form(url)
    assert _post(url + "login", {"who": "alice", "token": TOKEN, "csrf": first}, Origin=origin) == 403  # forgotten
    assert _post(url + "login", {"who": "alice", "token": TOKEN, "csrf": newest}, Origin=origin) == 200  # signed in
    for _ in range(MAX_REFUSED_SIGN_INS - 1):
        assert _post(url + "login", {"who": "mallory", "token": "wrong-" * 4, "csrf": _login_form(url)},
                     Origin=origin) == 403
    # The right token too is refused now, for the rest of the minute: guesses are that slow.
    assert _post(url + "login", {"who": "alice", "token": TOKEN, "csrf": _login_form(url)}, Origin=origin) == 429
    assert "too_many_refused_sign_ins" in proc.log_text()
    request = urllib.request.Request(url, headers={"Host": "rebound.example:80"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)  # noqa: S310 - 127.0.0.1 only
    assert refused.value.code == 421
    proc.wait_for_log(re.compile(r"\"reason\": \"host\""), timeout_s=10)
    # Connections past the limit are closed unanswered, and served again once others end.
    parts = urlsplit(url)
    held = [socket.create_connection((parts.hostname, parts.port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    for sock in held:
        sock.sendall(b"GET / HTTP/1.1\r\n")  # a request never finished

    def extra_answered() -> bytes:
        # Until the server has taken in every held connection, an extra one may still be served.
        with socket.create_connection((parts.hostname, parts.port), timeout=3) as extra:
            extra.sendall(f"GET / HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode())
            return extra.recv(100)

    wait_until(lambda: extra_answered() == b"", timeout_s=20, ignore=(OSError,),
               message="a connection past the limit closed unanswered")
    proc.wait_for_log(re.compile(r"console_busy"), timeout_s=10)
    for sock in held:
        sock.close()
    wait_until(lambda: _served(url), timeout_s=15, message="the console serving again")
    proc.sigterm()
    assert proc.wait(10) == 0
    assert "Traceback" not in proc.log_text(), proc.log_text()[-3000:]


def _served(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as page:  # noqa: S310 - 127.0.0.1 only
            return page.status == 200
    except OSError:
        return False
