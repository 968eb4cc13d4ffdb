"""The README screenshot of the playground (docs/playground.png): headless Chromium (Debian's chromium and
chromium-driver, selenium from the dev extra) against a running `verispec serve --enable-speculative`.

Usage: python recipes/playground_screenshot.py http://127.0.0.1:8000/ docs/playground.png
It sends the page's default prompt, then a follow-up with "Compare on / off", and captures the whole page."""

import base64
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait
url, out = sys.argv[1], sys.argv[2]
o = Options(); o.binary_location = "/usr/bin/chromium"
for f in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1440,1000", "--hide-scrollbars"):
    o.add_argument(f)
d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=o)
try:
    d.get(url)
    w = WebDriverWait(d, 300, 0.1)
    w.until(lambda d: "connected" in d.find_element("id", "status").text)
    d.find_element("id", "send").click()
    time.sleep(0.5)
    w.until(lambda d: d.find_element("id", "send").is_enabled())
    d.find_element("id", "prompt").send_keys("Now write it in JavaScript.")
    d.find_element("id", "compare").click()
    w.until(lambda d: d.find_element("id", "compare-verdict").get_attribute("class") in ("same", "differ"))
    print(d.find_element("id", "compare-verdict").text, d.find_element("id", "error").text)
    print(d.find_element("id", "figures").text)
    h = d.execute_script("return document.documentElement.scrollHeight")
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 1440, "height": h, "deviceScaleFactor": 1, "mobile": False})
    shot = d.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    open(out, "wb").write(base64.b64decode(shot["data"]))
finally:
    d.quit()
