"""The documentation site builds with warnings as errors, and every page reads right in a real browser.

`mkdocs build --strict` (broken links and anchors, pages missing from the nav are errors), then each page
is served over HTTP and loaded in headless Chromium (`--dump-dom`: the DOM after the theme's scripts ran);
a page fails on an empty article, a link to a page or anchor that is not there, or an image that does not
load. Skipped, with the reason, where mkdocs or Chromium is absent (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.docs
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


class _Page(HTMLParser):
    """What one rendered page holds: its element ids, links, images, and the article's text."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.text: list[str] = []
        self._article = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        if tag == "img":
            self.images.append(a.get("src") or "")
        if tag == "article":
            self._article += 1

    def handle_endtag(self, tag):
        if tag == "article":
            self._article -= 1

    def handle_data(self, data):
        if self._article:
            self.text.append(data)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the stdlib's signature)
        pass


def _dom(url: str) -> _Page:
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",  # type: ignore[list-item]
            "--virtual-time-budget=1000",
            "--disable-extensions",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    page = _Page()
    page.feed(out.stdout)
    return page


def _status(url: str) -> tuple[int, str, int]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.headers.get_content_type(), len(r.read())
    except urllib.error.HTTPError as e:
        return e.code, "", 0


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    started = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    print(f"site built in {time.perf_counter() - started:.1f} s")
    return out


def test_the_site_builds_strict(site):
    assert (site / "index.html").is_file() and (site / "config" / "index.html").is_file()


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (Debian: apt-get install chromium)")
def test_every_page_reads_in_a_browser(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        pages = sorted(p.parent.relative_to(site).as_posix() for p in site.rglob("index.html"))
        urls = [base + (p + "/" if p != "." else "") for p in pages]
        assert len(urls) >= 15, pages
        with ThreadPoolExecutor(4) as pool:
            doms = dict(zip(urls, pool.map(_dom, urls), strict=True))
        problems = []
        for url, dom in doms.items():
            if len("".join(dom.text).split()) < 20:
                problems.append(f"{url}: empty page")
            for src in dom.images:
                status, kind, size = _status(urljoin(url, src))
                if status != 200 or not kind.startswith("image/") or size == 0:
                    problems.append(f"{url}: image {src} does not load ({status} {kind})")
            for href in dom.links:
                target = urljoin(url, href)
                if urlparse(target).netloc != urlparse(base).netloc:
                    continue  # another site: not ours to check offline
                page_url, anchor = urldefrag(target)
                if page_url in doms:
                    if anchor and anchor not in doms[page_url].ids:
                        problems.append(f"{url}: link {href}: no #{anchor} on {page_url}")
                elif _status(page_url)[0] != 200:
                    problems.append(f"{url}: broken link {href}")
        assert not problems, "\n".join(sorted(set(problems)))
    finally:
        server.shutdown()
