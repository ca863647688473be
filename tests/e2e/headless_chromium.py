"""A real headless Chromium driven over the DevTools protocol (aiohttp's websocket client; no
playwright): load a page, wait for a condition in it, collect every console error, uncaught
exception and failed load, evaluate expressions, take a screenshot.

    with Chromium(tmp_path) as browser:
        page = browser.open(url, until="document.body.dataset.polls >= 2", timeout=60)
        page.errors        # ["console error: ...", "exception: ...", "log error: ..."]
        page.evaluate("1 + 1")
        page.screenshot()  # PNG bytes of the 1280x900 viewport
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Page:
    def __init__(self, loop: asyncio.AbstractEventLoop, ws: aiohttp.ClientWebSocketResponse):
        self._loop = loop
        self._ws = ws
        self._seq = 0
        self._pending: dict[int, asyncio.Future] = {}
        self.errors: list[str] = []
        self._reader = loop.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            doc = json.loads(msg.data)
            if "id" in doc:
                fut = self._pending.pop(doc["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(doc)
                continue
            method, params = doc.get("method"), doc.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                text = (details.get("exception") or {}).get("description") or details.get("text")
                self.errors.append(f"exception: {text}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                self.errors.append(f"console {params['type']}: {args}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                self.errors.append(f"log error: {entry.get('text')} {entry.get('url', '')}".strip())

    async def _call(self, method: str, **params: Any) -> dict:
        self._seq += 1
        fut = self._loop.create_future()
        self._pending[self._seq] = fut
        await self._ws.send_str(json.dumps({"id": self._seq, "method": method, "params": params}))
        doc = await asyncio.wait_for(fut, 30)
        if "error" in doc:
            raise RuntimeError(f"{method}: {doc['error']}")
        return doc["result"]

    def call(self, method: str, **params: Any) -> dict:
        return self._loop.run_until_complete(self._call(method, **params))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.evaluate(f"Boolean({expression})"):
                    return True
            except RuntimeError:  # not yet: e.g. the document is still loading and has no body
                pass
            self._loop.run_until_complete(asyncio.sleep(0.25))
        return False

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])


class Chromium:
    def __init__(self, workdir: str | os.PathLike, binary: str | None = None, width: int = 1280, height: int = 900):
        self.workdir = Path(workdir)
        self.binary = binary or chromium_binary()
        self.size = (width, height)
        self.proc: subprocess.Popen | None = None
        self._loop = asyncio.new_event_loop()
        self._http: aiohttp.ClientSession | None = None
        self.pages: list[Page] = []

    def start(self) -> "Chromium":
        profile = self.workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--remote-debugging-port=0",
                f"--user-data-dir={profile}", f"--window-size={self.size[0]},{self.size[1]}", "about:blank"]
        if os.geteuid() == 0:  # Chromium refuses to run as root with its sandbox
            args.insert(1, "--no-sandbox")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.workdir / "chromium.log", "wb"))
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {(self.workdir / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        return self

    def open(self, url: str, until: str | None = None, timeout: float = 60.0) -> Page:
        targets = httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=10).json()
        target = next(t for t in targets if t["type"] == "page")

        async def connect() -> aiohttp.ClientWebSocketResponse:
            self._http = self._http or aiohttp.ClientSession()
            return await self._http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 << 20)

        page = Page(self._loop, self._loop.run_until_complete(connect()))
        self.pages.append(page)
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            page.call(domain)
        page.call("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                  deviceScaleFactor=1, mobile=False)
        page.call("Page.navigate", url=url)
        if until is not None and not page.wait(until, timeout):
            raise AssertionError(f"{until!r} did not hold within {timeout} s; errors: {page.errors}")
        return page

    def stop(self) -> None:
        async def close() -> None:
            for page in self.pages:
                page._reader.cancel()
                await page._ws.close()
            if self._http is not None:
                await self._http.close()

        try:
            self._loop.run_until_complete(close())
        finally:
            self._loop.close()
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()

    def __enter__(self) -> "Chromium":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
