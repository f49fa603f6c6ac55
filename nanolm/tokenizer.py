"""Train, save and load tokenizers: nanolm's byte-level BPE, or any HuggingFace tokenizer directory.

The tokenizer nanolm trains is a HuggingFace `tokenizers` byte-level BPE (as in
GPT-2 and MiniMind): no normalizer, the ByteLevel pre-tokenizer (GPT-2 split
regex, no prefix space) and decoder, and all 256 bytes in the initial alphabet,
so `decode(encode(text)) == text` for any Unicode string and no token is unknown.
Before the ByteLevel step, every digit (any Unicode number character: ASCII,
Arabic-Indic, full-width, ...) is split off on its own, as Qwen2/3 and StarCoder
do, so "2024" is four tokens and no merge is spent on numbers; arithmetic sees
the same digit tokens in every number. `train_tokenizer(..., split_digits=False)`
trains the plain GPT-2 scheme, which tokenizers trained before had. A
tokenizer.json stores its own pre-tokenizer, so a loaded tokenizer encodes as it
was trained, whichever it is (`Tokenizer.splits_digits` says which).

Its first tokens are the control tokens: `<|endoftext|>` = 0 (ends every
pretraining document; also padding), `<|im_start|>` = 1 and `<|im_end|>` = 2
(ChatML turn markers), special tokens; then the tags of tool calls and
reasoning, `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>`, `</think>` = 3 ... 8, added tokens that are not
special (decoding keeps them, llama.cpp prints them), as MiniMind-3 and Qwen3
have them. `encode` maps all of these strings to their ids wherever they occur
in the text, so a chat rendered by nanolm/chat/ encodes to the right
control ids; the flip side is that user text containing them becomes control
tokens too (chat data holding them is refused).

A tokenizer is a directory holding `tokenizer.json` (what `tokenizers` reads)
and `tokenizer_config.json` (what `transformers.AutoTokenizer` also needs: the
class, the special-token roles and the chat template). A directory saved by
transformers 5 keeps its chat template in `chat_template.jinja` instead; as in
transformers (`PreTrainedTokenizerBase._from_pretrained`), that file wins over
the config's `chat_template` when both exist. `Tokenizer.load` folds it into
`config`, so `save` (and every copy made from a saved tokenizer: an imported
or trained checkpoint) carries the template in tokenizer_config.json. The roles follow
Qwen2/3-Instruct and MiniMind: eos is `<|im_end|>`, because a chat model ends
its turn with it and `generate` should stop there; pad is `<|endoftext|>`;
there is no bos (nothing is prepended in training) and no unk.

Any other HuggingFace tokenizer directory loads too (`Tokenizer.load`), such as
MiniMind's own: nanolm finds its control tokens by name, at whatever ids they
have, and refuses one that lacks any of them, naming it. Its chat template
says which chat layout it renders (`chat.format_of`), and `save` writes its
files back as they were, so a tokenizer or checkpoint keeps the template it
was made with.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from nanolm.chat import CHAT_TEMPLATE, ChatFormat, TemplateFormat, format_of
from nanolm.errors import UserError
from nanolm.io import write_text_atomic
from nanolm.progress import fmt_count, fmt_duration
from nanolm.special_tokens import EOT_ID, IM_END_ID, IM_START_ID, SPECIAL_TOKENS, TAG_TOKENS  # noqa: F401

# Written into tokenizer_config.json. The tokenizer does not know the model's
# context length; this is MiniMind's value, and an export may overwrite it with
# the model's own.
MODEL_MAX_LENGTH = 32768

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's chat template

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS) + 1  # every byte, the added tokens and one merge
MAX_VOCAB_SIZE = 2**32  # ids are 32-bit in `tokenizers` and in nanolm's shards


def _byte_alphabet() -> dict[str, int]:
    """The 256 printable characters GPT-2's byte-level scheme uses for the 256 bytes, each with its byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]  # the other bytes, in order, shown as 256, 257, ...
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def _pre_tokenizer(split_digits: bool) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a tokenizer nanolm trains: GPT-2's ByteLevel split, after each digit is isolated
    when `split_digits` (StarCoder's layout, which llama.cpp knows as the "starcoder" pre-tokenizer)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if not split_digits:
        return byte_level
    # Digits only splits (each \p{N} character becomes a piece of its own), so decoding is unchanged.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def pre_tokenizer_json(split_digits: bool) -> dict[str, Any]:
    """The tokenizer.json `pre_tokenizer` entry of a tokenizer nanolm trains (`_pre_tokenizer`)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(split_digits)
    return json.loads(tok.to_str())["pre_tokenizer"]


def _splits_digits(pre_tokenizer: Any) -> bool:
    """Whether a tokenizer.json `pre_tokenizer` entry isolates every digit (a Digits step with
    individual_digits, alone or in a Sequence)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    steps = pre_tokenizer.get("pretokenizers") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    return any(isinstance(p, dict) and p.get("type") == "Digits" and p.get("individual_digits") is True
               for p in steps or [])


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=True, separators=(",", ":"))


def _tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast."""
    added = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": tok in SPECIAL_TOKENS}
        for i, tok in enumerate([*SPECIAL_TOKENS, *TAG_TOKENS])
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [SPECIAL_TOKENS[IM_START_ID], SPECIAL_TOKENS[IM_END_ID]],
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[EOT_ID],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # True would let transformers delete spaces before punctuation on decode.
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def _read_json_file(file: Path, fix: str) -> tuple[Any, str]:
    """(parsed JSON, text) of a file, or a one-line UserError naming it and `fix`."""
    try:
        text = file.read_text(encoding="utf-8")
        return json.loads(text), text
    except UnicodeDecodeError as e:
        raise UserError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file}:{e.lineno}: not valid JSON ({e.msg}); the file is damaged, {fix}") from None
    except RecursionError:
        raise UserError(f"{file}: not valid JSON (nested too deeply); the file is damaged, {fix}") from None


def _template_of(config: dict[str, Any], file: Path | None = None) -> str | None:
    """The chat template of a tokenizer config: its string, or the "default" of a list of named templates
    (as transformers allows); None when it has none. UserError (naming `file`) when it is not one of those."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise UserError(f"{file}: chat_template must be a string (a Jinja template), got {type(template).__name__}; "
                        "fix it or delete the key to use nanolm's template")
    return template


def _template_variables(config: dict[str, Any]) -> dict[str, str]:
    """The special tokens of tokenizer_config.json that transformers hands a chat template (bos_token, ...)."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


# Where a tokenizer lacks nanolm's control tokens, the tokens that play their parts in other families, in order
# ("eos_token" / "bos_token": the one the tokenizer config names): Llama 3 ends a text with <|end_of_text|> and a
# turn with <|eot_id|> and opens a turn's header with <|start_header_id|>; SentencePiece families (Llama 2,
# Mistral) have <s> and </s>.
ROLE_ALIASES: dict[str, tuple[str, ...]] = {
    SPECIAL_TOKENS[EOT_ID]: ("<|end_of_text|>", "</s>", "eos_token"),
    SPECIAL_TOKENS[IM_START_ID]: ("<|start_header_id|>", "<s>", "bos_token"),
    SPECIAL_TOKENS[IM_END_ID]: ("<|eot_id|>", "eos_token", "</s>"),
}


def _role_candidates(variables: dict[str, str]) -> dict[str, list[str]]:
    """Each control token's name, then the names of the tokens that may play its part, without repeats."""
    out = {}
    for name, aliases in ROLE_ALIASES.items():
        names = (variables.get(a) if a in ("eos_token", "bos_token") else a for a in (name, *aliases))
        out[name] = list(dict.fromkeys(n for n in names if n))
    return out


def _save_files(data: dict[str, Any], config: dict[str, Any], out_dir: Path) -> Path:
    """Write tokenizer.json (`data`) and tokenizer_config.json (`config`) into out_dir; return tokenizer.json's
    path."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    write_text_atomic(out_dir / TOKENIZER_FILE, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return out_dir / TOKENIZER_FILE


class Tokenizer:
    """A loaded tokenizer: encode/decode, the control ids, the chat layout.

    Build one with `Tokenizer.load` or `train_tokenizer`. `path` is the
    tokenizer.json file it was loaded from; `config` the tokenizer_config.json
    beside it (as read; nanolm's own when there is none), with the template of
    a chat_template.jinja beside it as its `chat_template`, which picks
    `chat_format`.
    """

    def __init__(self, tok: HFTokenizer, data: dict[str, Any], path: Path, config: dict[str, Any],
                 ids: dict[str, int], chat_format: ChatFormat) -> None:
        self._tok = tok
        self._data = data  # the parsed tokenizer.json, so `save` writes back exactly what was loaded
        self.config = config
        self.path = path
        self.fingerprint: str = hashlib.sha256(_canonical_json(data).encode("ascii")).hexdigest()
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.eot_id, self.im_start_id, self.im_end_id = (ids[t] for t in SPECIAL_TOKENS)
        self.tag_ids: dict[str, int] = {t: ids[t] for t in TAG_TOKENS if t in ids}
        self.chat_template: str | None = _template_of(config)
        self.chat_format = chat_format
        # As the file says, not as nanolm trains now: a tokenizer from before digit splitting keeps its numbers.
        # Only tokenizers' Digits step counts: a Split regex that isolates \p{N} (Qwen's own) reads False.
        self.splits_digits: bool = _splits_digits(data.get("pre_tokenizer"))
        self._byte_lengths: np.ndarray | None = None
        self._token_bytes: list[bytes] | None = None

    @classmethod
    def load(cls, path: Path | str) -> "Tokenizer":
        """Load from a directory holding tokenizer.json (and tokenizer_config.json), or from the file itself."""
        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise UserError(f"{file}: no tokenizer file here; run `nanolm tokenizer train` first, "
                            "or pass the directory that holds tokenizer.json")
        data, text = _read_json_file(file, "retrain it with `nanolm tokenizer train`")
        try:
            tok = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception with a serde message
            detail = repr(str(e))[1:-1][:200]  # it quotes values of the file, newlines and all
            raise UserError(f"{file}: not a tokenizer.json that `tokenizers` can read ({detail}); "
                            "retrain it with `nanolm tokenizer train`") from None
        config_file = file.parent / CONFIG_FILE
        if config_file.is_file():
            config = _read_json_file(config_file, f"retrain the tokenizer or delete {CONFIG_FILE}")[0]
            if not isinstance(config, dict):
                raise UserError(f"{config_file}: expected a JSON object, got {type(config).__name__}; retrain the "
                                f"tokenizer or delete {CONFIG_FILE}")
        else:
            config = _tokenizer_config()
        jinja = file.parent / CHAT_TEMPLATE_FILE
        if jinja.is_file():  # transformers reads it before the config's chat_template, and so does nanolm
            try:
                config = {**config, "chat_template": jinja.read_text(encoding="utf-8")}
            except UnicodeDecodeError as e:
                raise UserError(f"{jinja}: not UTF-8 text ({e.reason} at byte {e.start}); save the chat template "
                                f"as UTF-8 or delete {CHAT_TEMPLATE_FILE}") from None
        variables = _template_variables(config)
        # A template of neither nanolm layout renders as itself, with the special tokens it may read.
        fmt = format_of(_template_of(config, config_file), str(file.parent), variables)

        def added(name: str) -> int | None:
            # In the vocabulary is not enough: unless it is an added token, text holding it is split into
            # pieces, and rendered chats lose their turn markers.
            got = tok.token_to_id(name)
            return got if got is not None and tok.encode(name, add_special_tokens=False).ids == [got] else None
        ids = {name: got for name in TAG_TOKENS if (got := added(name)) is not None}
        # nanolm's own layouts write its control tokens; a tokenizer's own template writes its own
        roles = _role_candidates(variables) if isinstance(fmt, TemplateFormat) else {n: [n] for n in SPECIAL_TOKENS}
        for name in SPECIAL_TOKENS:
            found = next((got for c in roles[name] if (got := added(c)) is not None), None)
            if found is None:
                got = tok.token_to_id(name)
                where = "is not in its vocabulary" if got is None else \
                    f"is in its vocabulary (id {got}) but not an added token, so text holding it is split"
                also = f" (nor {', '.join(roles[name][1:])}, which play its part with the tokenizer's own chat " \
                    "template)" if len(roles[name]) > 1 else ""
                raise UserError(f"{file}: {name} {where}{also}; nanolm needs {', '.join(SPECIAL_TOKENS)} as special "
                                "tokens (document end, chat turns). Add them to the tokenizer (tokenizers' "
                                "add_special_tokens, then resize the model's embeddings), or train one with "
                                "`nanolm tokenizer train`")
            ids[name] = found
        return cls(tok, data, file.resolve(), config, ids, fmt)

    def save(self, out_dir: Path | str) -> Path:
        """Write tokenizer.json and tokenizer_config.json into out_dir as loaded, each atomically (the chat
        template in the config, wherever it was read from)."""
        return _save_files(self._data, self.config, Path(out_dir))

    def missing_tags(self) -> list[str]:
        """The tags of tool calls and reasoning the tokenizer lacks as added tokens (each is then spelled in
        several tokens: it works, with longer sequences and a model that must learn to spell it)."""
        return [t for t in TAG_TOKENS if t not in self.tag_ids]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added, but special-token strings in it map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` for many texts at once, in parallel on tokenizers' thread pool."""
        # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we never use.
        fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens are kept as their strings."""
        ids = [int(i) for i in ids]  # accepts numpy/torch integers too
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> list[bytes]:
        """The UTF-8 bytes each id stands for in `decode`, indexed by id (read-only use; built once).

        `decode(ids)` is the lossy UTF-8 decoding of these bytes joined, as `tokenizers`' ByteLevel decoder
        does it: a token spelled in the byte alphabet stands for those bytes, any other token (a special one,
        or one added by hand) for its own text. An id the vocabulary lacks stands for no bytes.
        """
        if self._token_bytes is None:
            alphabet = _byte_alphabet()
            table = []
            for i in range(self.vocab_size):
                token = self._tok.id_to_token(i)
                if token is None:
                    table.append(b"")
                elif all(c in alphabet for c in token):
                    table.append(bytes(alphabet[c] for c in token))  # one alphabet character per byte
                else:
                    table.append(token.encode("utf-8"))
            self._token_bytes = table
        return self._token_bytes

    def spelled_lengths(self) -> np.ndarray:
        """int64 [vocab_size]: the UTF-8 bytes each id stands for in `decode`, control tokens included (their
        text): the byte offsets of a rendered chat's tokens are its cumulative sum (`chat.encode_chat`)."""
        return np.array([len(b) for b in self.token_bytes()], dtype=np.int64)

    def token_byte_lengths(self) -> np.ndarray:
        """int32 [vocab_size]: how many UTF-8 bytes each token stands for; 0 for special tokens.

        Summing it over a text's tokens gives the text's byte count, which turns a
        loss in nats per token into bits per byte, comparable across tokenizers.
        """
        if self._byte_lengths is None:
            special = set(self._tok.get_added_tokens_decoder())
            lengths = np.array([0 if i in special else len(b) for i, b in enumerate(self.token_bytes())],
                               dtype=np.int32)
            lengths.setflags(write=False)
            self._byte_lengths = lengths
        return self._byte_lengths

    def compression(self, texts: Iterable[str]) -> float:
        """Characters per token over `texts` (higher means fewer tokens for the same text)."""
        texts = list(texts)
        n_chars = sum(len(t) for t in texts)
        n_tokens = sum(len(ids) for ids in self.encode_batch(texts))
        if n_tokens == 0:
            raise ValueError("compression needs at least one non-empty text")
        return n_chars / n_tokens

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, path={str(self.path)!r}, fingerprint={self.fingerprint[:12]})"


def _validate_train_args(vocab_size: int, min_frequency: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise UserError(f"vocab_size={vocab_size!r}: must be an integer from {MIN_VOCAB_SIZE} to {MAX_VOCAB_SIZE} "
                        f"(256 byte tokens + {len(SPECIAL_TOKENS)} special tokens + at least one merge); "
                        "6400 is MiniMind's choice")
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise UserError(f"min_frequency={min_frequency!r}: must be an integer >= 1 "
                        "(a pair is merged only if it occurs at least this often)")


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 6400, *,
                    min_frequency: int = 2, split_digits: bool = True, quiet: bool = False) -> Tokenizer:
    """Train a byte-level BPE on `texts`, save it into out_dir and return it loaded from there.

    split_digits: encode every digit as a token of its own (Qwen2/3's choice);
    False keeps GPT-2's split, where "2024" or " 12" can be one token.

    The vocabulary can come out smaller than vocab_size when the text has too
    few distinct pairs occurring min_frequency times; `Tokenizer.vocab_size`
    tells the real size.
    """
    _validate_train_args(vocab_size, min_frequency)
    if not isinstance(split_digits, bool):
        raise UserError(f"split_digits={split_digits!r}: must be True (one token per digit) or False")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory; choose another output directory")

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(split_digits)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *TAG_TOKENS],  # added first, so they get ids 0 ... 8
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # tokenizers' bars draw only on a terminal, yet print blank lines to stdout
        # even when hidden; ask for them only where they show.
        show_progress=not quiet and sys.stderr.isatty(),
    )

    stats = {"texts": 0, "chars": 0}
    special = re.compile("|".join(re.escape(s) for s in (*SPECIAL_TOKENS, *TAG_TOKENS)))

    def pieces() -> Iterator[str]:
        for t in texts:
            stats["texts"] += 1
            stats["chars"] += len(t)
            # The trainer does not split on special tokens as encode does; without
            # this, "<|im_end|>" or "<think>" in chat text would spend merges on "<|", "im", ...
            yield from special.split(t) if "<" in t else (t,)

    start = time.perf_counter()
    tok.train_from_iterator(pieces(), trainer=trainer)
    elapsed = time.perf_counter() - start
    if stats["chars"] == 0:
        raise UserError(f"tokenizer training got no text ({stats['texts']} texts, all empty); "
                        "check that the input files hold text")

    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:  # the tags are added tokens, not special: decoding keeps them
        added["special"] = added["content"] in SPECIAL_TOKENS
    file = _save_files(data, _tokenizer_config(), out_dir)
    loaded = Tokenizer.load(file)
    if not quiet:
        short = "" if loaded.vocab_size == vocab_size else f" (asked for {vocab_size}: the text has too few frequent pairs)"
        print(f"trained tokenizer: vocab {loaded.vocab_size}{short} on {fmt_count(stats['texts'])} texts, "
              f"{fmt_count(stats['chars'])} chars in {fmt_duration(elapsed)} -> {file}", file=sys.stdout)
    return loaded


def split_by_script(texts: Iterable[str], limit: int = 200_000) -> tuple[list[str], list[str]]:
    """Up to `limit` characters each of mainly-Chinese and of CJK-free (English) texts, for the compression report."""
    zh: list[str] = []
    en: list[str] = []
    nzh = nen = 0
    for text in texts:
        head = text[:2000]
        cjk = sum(1 for c in head if "\u4e00" <= c <= "\u9fff")
        if cjk > 0.3 * len(head) and nzh < limit:
            zh.append(text[: limit - nzh])
            nzh += len(zh[-1])
        elif cjk == 0 and nen < limit:
            en.append(text[: limit - nen])
            nen += len(en[-1])
        if nzh >= limit and nen >= limit:
            break
    return zh, en


def compression_report(tok: Tokenizer, zh_texts: Iterable[str], en_texts: Iterable[str]) -> str:
    """One line: characters per token on Chinese and English samples (a language with no text is left out)."""
    parts = []
    for lang, texts in (("zh", list(zh_texts)), ("en", list(en_texts))):
        if any(texts):
            parts.append(f"{lang} {tok.compression(texts):.2f} chars/token")
    return "compression: " + (", ".join(parts) if parts else "no sample text")
