"""Headless Chromium (Debian's `chromium`) driving `q8rules serve`'s chat page over its
DevTools protocol, with a minimal websocket client (no browser-automation package needed):
type a message, wait for the streamed reply. Loopback only, every wait bounded.

`python -m tests._chromium URL OUT.png` saves a screenshot of the page at URL after one
message (docs/serve_chat.png).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
  """One page's DevTools websocket: `call(method, **params)` -> its result."""

  def __init__(self, ws_url: str, timeout: float = 30.0):
    rest = ws_url.removeprefix("ws://")
    hostport, path = rest.split("/", 1)
    host, port = hostport.split(":")
    self.sock = socket.create_connection((host, int(port)), timeout=timeout)
    key = base64.b64encode(os.urandom(16)).decode()
    self.sock.sendall(
      f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
      head += self.sock.recv(1)
    assert b" 101 " in head.split(b"\r\n")[0], head
    self.next_id = 0

  def _send(self, text: str) -> None:
    data = text.encode()
    mask = os.urandom(4)
    n = len(data)
    header = bytes([0x81]) + (
      bytes([0x80 | n])
      if n < 126
      else bytes([0x80 | 126]) + n.to_bytes(2, "big")
      if n < 65536
      else bytes([0x80 | 127]) + n.to_bytes(8, "big")
    )
    self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

  def _exact(self, n: int) -> bytes:
    out = b""
    while len(out) < n:
      piece = self.sock.recv(n - len(out))
      if not piece:
        raise ConnectionError("DevTools closed the socket")
      out += piece
    return out

  def _receive(self) -> str:
    message = b""
    while True:
      b0, b1 = self._exact(2)
      n = b1 & 0x7F
      if n == 126:
        n = int.from_bytes(self._exact(2), "big")
      elif n == 127:
        n = int.from_bytes(self._exact(8), "big")
      message += self._exact(n)
      if b0 & 0x80:
        return message.decode()

  def call(self, method: str, **params: Any) -> dict[str, Any]:
    self.next_id += 1
    self._send(json.dumps({"id": self.next_id, "method": method, "params": params}))
    while True:
      reply = json.loads(self._receive())
      if reply.get("id") == self.next_id:
        if "error" in reply:
          raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

  def evaluate(self, expression: str) -> Any:
    out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
    return out["result"].get("value")


def chat_once(
  url: str, text: str, screenshot: str | None = None, key: str = "", timeout: float = 60
) -> dict:
  """Open the page at `url` in headless Chromium (the API key `key` in its field), type `text`
  and press Enter; wait (at most `timeout` s) for the reply to finish. Returns {'user', 'reply', 'stats', 'partial'} (partial:
  the reply's lengths seen while it streamed)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  profile = tempfile.mkdtemp(prefix="q8rules-chromium-")
  proc = subprocess.Popen(
    [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
     f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
     f"--user-data-dir={profile}", "--window-size=900,560", "about:blank"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
  )  # fmt: skip
  try:
    deadline = time.monotonic() + timeout
    while True:
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
          pages = [t for t in json.load(r) if t["type"] == "page"]
        if pages:
          break
      except OSError:
        pass
      assert time.monotonic() < deadline, "Chromium did not start"
      time.sleep(0.2)
    page = DevTools(pages[0]["webSocketDebuggerUrl"])
    page.call("Page.enable")
    page.call("Page.navigate", url=url)
    while page.evaluate("document.readyState") != "complete" or not page.evaluate(
      "!!document.getElementById('input')"
    ):
      assert time.monotonic() < deadline, "the page did not load"
      time.sleep(0.1)
    page.evaluate(f"document.getElementById('key').value = {json.dumps(key)}")
    page.evaluate("document.getElementById('input').focus()")
    page.call("Input.insertText", text=text)
    for kind in ("keyDown", "keyUp"):
      page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                windowsVirtualKeyCode=13)  # fmt: skip
    partial = []
    while not page.evaluate("!!document.querySelector('.stats')"):
      assert time.monotonic() < deadline, "the reply did not finish"
      n = page.evaluate(
        "(document.querySelector('.assistant') || {textContent: ''}).textContent.length"
      )
      if not partial or partial[-1] != n:
        partial.append(n)
      time.sleep(0.02)
    out = {
      "user": page.evaluate("document.querySelector('.user').textContent"),
      "reply": page.evaluate("document.querySelector('.assistant').textContent"),
      "stats": page.evaluate("document.querySelector('.stats').textContent"),
      "partial": partial,
    }
    if screenshot:
      shot = page.call("Page.captureScreenshot", format="png")
      with open(screenshot, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    return out
  finally:
    proc.terminate()
    try:
      proc.wait(10)
    except subprocess.TimeoutExpired:
      proc.kill()
    shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
  print(chat_once(sys.argv[1], "Hello there", screenshot=sys.argv[2]))
