"""A user's view of the Ray dashboard: headless Chromium logs in with the cluster's token the
way a person does (the dashboard's "Authentication Token Required" dialog), finds the sweep's
job in the job list and its trial actors, and saves screenshots as test artifacts.

Artifacts go to ``$ORCHESTRATOR_TEST_ARTIFACTS`` (default: the test's tmp dir); their paths are
printed. Needs Debian's chromium + chromium-driver (``scripts/install_browser.sh``) and
selenium (the dev extra); skips with the reason when either is missing.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from system_packages import left_out

from orchestrator.cli import build_parser
from orchestrator.config import load_spec
from orchestrator.launch.ray_job import build_job_request, connect
from orchestrator.run_request import RunRequest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,900"]
SWEEP = ["run", "configs/demo_cpu.yaml", "--set", "search_space.workload=cnn", "--set", "search_space.lr=0.01",
         "--set", "search_space.width={grid: [16, 32]}", "--set", "stop.epochs=2"]
WAIT_S = 60

pytestmark = pytest.mark.integration


@pytest.fixture
def artifacts(tmp_path) -> Path:
    folder = Path(os.environ.get("ORCHESTRATOR_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser(tmp_path):
    opted_out = left_out("chromium and chromium-driver")
    if opted_out:
        pytest.skip(opted_out)
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            pytest.skip(f"{path} not found: run scripts/install_browser.sh as root (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def shoot(driver, folder: Path, name: str) -> Path:
    path = folder / name
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def test_dashboard_shows_the_sweep_job_after_token_login(browser, ray_head, artifacts, monkeypatch):
    """Token login through the dashboard's own dialog, then the job in the job list, its trial actors
    and its finished page. (`browser` comes first: without Chromium it skips before Ray starts.)"""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    monkeypatch.chdir(ROOT)
    args = build_parser().parse_args(SWEEP)
    request = build_job_request(RunRequest.from_args(args), load_spec(args.config, args.overrides), ROOT)
    client = connect(ray_head.dashboard_url)
    submission_id = client.submit_job(entrypoint=request.entrypoint, runtime_env=request.runtime_env,
                                      metadata=request.metadata)
    wait = WebDriverWait(browser, WAIT_S)

    def text_shown(text: str):
        return wait.until(seen.visibility_of_element_located((By.XPATH, f"//*[contains(text(), '{text}')]")))

    # Token auth is on: the page asks for the token, refuses a wrong one, accepts the right one.
    browser.get(ray_head.dashboard_url)
    token_box = wait.until(seen.visibility_of_element_located(
        (By.CSS_SELECTOR, "input[placeholder='Enter your authentication token']")))
    shoot(browser, artifacts, "dashboard-token-dialog.png")
    token_box.send_keys("not-the-token", Keys.ENTER)
    text_shown("Invalid authentication token")
    token_box.send_keys(Keys.CONTROL, "a")
    token_box.send_keys(ray_head.token, Keys.ENTER)
    wait.until(seen.invisibility_of_element_located((By.CSS_SELECTOR, "input[placeholder='Enter your authentication token']")))
    cookie = browser.get_cookie("ray-authentication-token")
    assert cookie and cookie["httpOnly"], cookie

    browser.get(f"{ray_head.dashboard_url}/#/jobs")
    text_shown(submission_id)
    text_shown("orchestrator demo_cpu")  # the Name column, from the job's metadata
    shoot(browser, artifacts, "dashboard-jobs.png")

    # The trials run as Tune actors of the job (function trainables are `ImplicitFunc`). The page
    # lists finished actors too, so this holds however fast the trials were; it is reloaded
    # until they appear.
    deadline = time.monotonic() + 180
    browser.get(f"{ray_head.dashboard_url}/#/actors")
    while not browser.find_elements(By.XPATH, "//*[contains(text(), 'ImplicitFunc')]"):
        assert time.monotonic() < deadline, "no trial actor on the Actors page:\n" + client.get_job_logs(submission_id)[-3000:]
        time.sleep(2)
        browser.refresh()
    shoot(browser, artifacts, "dashboard-actors.png")

    deadline = time.monotonic() + 300
    while not (status := client.get_job_status(submission_id)).is_terminal():
        assert time.monotonic() < deadline, f"job still {status}"
        time.sleep(2)
    browser.get(f"{ray_head.dashboard_url}/#/jobs/{submission_id}")
    text_shown(status.value)
    shoot(browser, artifacts, "dashboard-job-finished.png")
    assert status == "SUCCEEDED", client.get_job_logs(submission_id)[-3000:]
