"""Benchmark task files in the layouts people download, read into one item type per kind.

A task is a list of items of one kind:

- `MCItem` (multiple choice): a question, its choices and the index of the
  right one, scored by the log-likelihood of each choice (`scoring.py`);
- `GenItem` (generative): a question and its reference answer, scored by
  generating an answer and comparing it (exact or numeric match).

Readers, picked by file suffix and, for JSONL, by the fields of the first row:

- CSV: C-Eval (`id,question,A,B,C,D,answer[,explanation]`), CMMLU
  (`,Question,A,B,C,D,Answer`, a header naming the columns, case-insensitive)
  and MMLU (no header: `question,A,B,C,D,answer`); answer a letter A-D.
- JSONL: ARC and OpenBookQA as published by AI2 (`{"question": {"stem",
  "choices": [{"text", "label"}]}, "answerKey"}`) and as on the HF hub
  (`{"question" | "question_stem", "choices": {"text": [...], "label": [...]},
  "answerKey"}`); PIQA (`{"goal", "sol1", "sol2", "label"}`, or the label in
  the published `<name>-labels.lst` beside `<name>.jsonl`); HellaSwag
  (`{"activity_label", "ctx_a", "ctx_b", "endings", "label"}`); SIQA
  (`{"context", "question", "answerA", "answerB", "answerC", "label"}` with
  labels 1-3, or in `<name>-labels.lst`); GSM8K (`{"question", "answer"}`, the
  answer's last line `#### n`).
- The plain nanolm layout (JSONL): `{"question", "choices": [...], "answer"}`
  (answer: the index of the right choice, its letter, or its text) for
  multiple choice, `{"question", "answer": "..."}` for generative.

A malformed row raises `UserError("file:line: what is wrong; fix")`. `as_letters` turns a
multiple-choice item into its lettered form (choices listed, letters scored). Every
item carries the plain-text prompt its choices or answer follow (`prompt`, the
question in the layout's usual cloze form: "Question: ...\\nAnswer:" for
English, "...\\n答案：" for Chinese) and the bare question for a chat template
(`question`).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from nanolm.data import jsonl
from nanolm.errors import UserError

LETTERS = "ABCDEFGHIJ"
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


@dataclass(frozen=True)
class MCItem:
    """A multiple-choice question. prompt + delimiter + choices[i] is choice i's plain-text continuation."""

    question: str  # what a user would ask (the chat template's user turn)
    choices: tuple[str, ...]
    answer: int  # index into choices
    prompt: str  # the plain-text context the choices follow
    delimiter: str = " "  # between prompt and choice ("" for Chinese)
    where: str = ""  # file:line


@dataclass(frozen=True)
class GenItem:
    """A question with a reference answer: the target compared with the extracted reply."""

    question: str
    answer: str  # the reference, as a number or text to compare against (GSM8K: the value after ####)
    prompt: str
    solution: str = ""  # a worked answer, for few-shot examples (GSM8K: the whole answer field)
    where: str = ""


@dataclass
class Task:
    """A named list of items of one kind, read from `path`."""

    name: str
    kind: str  # "mc" or "gen"
    items: list = field(default_factory=list)
    path: str = ""
    layout: str = ""
    metric: str = "acc"  # the score the report card shows: acc, or acc_norm / acc_mutual_info of a "mc" task


def cloze(question: str) -> tuple[str, str]:
    """(prompt, delimiter) of a question in cloze form: Chinese text gets a Chinese frame and no space."""
    if _CJK.search(question):
        return f"{question}\n答案：", ""
    return f"Question: {question}\nAnswer:", " "


def as_letters(item: MCItem) -> MCItem:
    """The item as C-Eval, CMMLU and MMLU are usually scored (lm-eval's ceval-valid, MiniMind's C-Eval): the
    choices listed under the question as "A. ...", and the letters scored instead of the texts."""
    listed = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(item.choices))
    question = f"{item.question}\n{listed}"
    prompt, delimiter = cloze(question)
    return MCItem(question, tuple(LETTERS[:len(item.choices)]), item.answer, prompt, delimiter or " ", item.where)


def _mc(question: str, choices: list[str], answer: int, where: str, prompt: str | None = None,
        delimiter: str | None = None) -> MCItem:
    p, d = cloze(question)
    return MCItem(question, tuple(choices), answer, p if prompt is None else prompt,
                  d if delimiter is None else delimiter, where)


def _letter_index(value: Any, n: int, where: str, fix: str) -> int:
    """'B' (or 'b', ' B ') -> 1, checked against n choices."""
    s = str(value).strip().upper() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    if len(s) != 1 or s not in LETTERS[:n]:
        raise UserError(f"{where}: answer {value!r} is not one of {', '.join(LETTERS[:n])}; {fix}")
    return LETTERS.index(s)


def _text(row: dict, key: str, where: str, layout: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in row else f"{type(value).__name__} {str(value)[:40]!r}"
        raise UserError(f"{where}: field {key!r} must be a non-empty string for the {layout} layout, got {got}; "
                        f"fix the row or drop it")
    return value.strip()


# ----------------------------------------------------------------------------- CSV (C-Eval, CMMLU, MMLU)

def read_csv(path: Path) -> Task:
    """C-Eval / CMMLU (with a header) or MMLU (without one) multiple-choice CSV."""
    items: list[MCItem] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        header: dict[str, int] | None = None
        start = 1
        for row in reader:
            where = f"{path}:{start}"
            start = reader.line_num + 1
            if not row or all(not c.strip() for c in row):
                continue
            lowered = [c.strip().lower() for c in row]
            if header is None and not items and {"question", "a", "b", "c", "d", "answer"} <= set(lowered):
                header = {name: lowered.index(name) for name in ("question", "a", "b", "c", "d", "answer")}
                layout = "C-Eval/CMMLU"
                continue
            if header is None:
                layout = "MMLU"
                if len(row) != 6:
                    raise UserError(f"{where}: {len(row)} columns; an MMLU row is question,A,B,C,D,answer (or give "
                                    f"a header row naming question,A,B,C,D,answer as C-Eval and CMMLU do)")
                cols = {"question": 0, "a": 1, "b": 2, "c": 3, "d": 4, "answer": 5}
            else:
                cols = header
                if len(row) <= max(cols.values()):
                    raise UserError(f"{where}: {len(row)} columns, the header names {max(cols.values()) + 1}; fix "
                                    f"the row (a field holding a comma or newline must be quoted)")
            question = row[cols["question"]].strip()
            choices = [row[cols[k]].strip() for k in "abcd"]
            if not question:
                raise UserError(f"{where}: the question is empty; fix the row or drop it")
            for letter, choice in zip(LETTERS, choices):
                if not choice:
                    raise UserError(f"{where}: choice {letter} is empty; fix the row or drop it")
            if not row[cols["answer"]].strip():
                raise UserError(f"{where}: the answer is empty (C-Eval's and CMMLU's test splits keep their "
                                f"answers private); score the val/dev split, which has them")
            answer = _letter_index(row[cols["answer"]], 4, where, "the answer column holds the right letter")
            items.append(_mc(question, choices, answer, where))
    return Task(path.stem, "mc", items, str(path), layout if items else "csv")


# ----------------------------------------------------------------------------- JSONL layouts

def _labels_file(path: Path) -> list[str] | None:
    """The published PIQA / SIQA labels beside the data: `<name>-labels.lst`, one label a line."""
    lst = path.with_name(f"{path.stem}-labels.lst")
    if not lst.is_file():
        return None
    return [line.strip() for line in lst.read_text(encoding="utf-8").splitlines() if line.strip()]


def _label(row: dict, labels: list[str] | None, index: int, where: str, layout: str, path: Path) -> Any:
    if "label" in row:
        return row["label"]
    if labels is None:
        raise UserError(f"{where}: no 'label' field, and no {path.stem}-labels.lst beside {path.name}; {layout} "
                        f"publishes its labels in that file: put it there, or add 'label' to each row")
    if index >= len(labels):
        raise UserError(f"{where}: {path.stem}-labels.lst has {len(labels)} labels, fewer than the rows; use the "
                        f"labels file of this split")
    return labels[index]


def _int_label(value: Any, n: int, base: int, where: str, layout: str) -> int:
    try:
        i = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        i = None
    if i is None or not base <= i < n + base:
        raise UserError(f"{where}: label {value!r} is not an integer from {base} to {n + base - 1} ({layout}); "
                        "fix the row or its line in the labels file")
    return i - base


def _arc_like(row: dict, where: str, layout: str) -> MCItem:
    """AI2's layout (question.stem, question.choices[]) or the HF hub's (question | question_stem, choices{})."""
    q = row.get("question")
    if isinstance(q, dict):
        stem = _text(q, "stem", where + " (question)", layout)
        raw = q.get("choices")
        if not isinstance(raw, list) or not raw or not all(isinstance(c, dict) for c in raw):
            raise UserError(f"{where}: question.choices must be a list of {{'text', 'label'}} objects; fix the row")
        texts, labels = [c.get("text") for c in raw], [c.get("label") for c in raw]
    else:
        stem = _text(row, "question_stem" if "question_stem" in row else "question", where, layout)
        raw = row.get("choices")
        if not isinstance(raw, dict) or not isinstance(raw.get("text"), list) or not isinstance(raw.get("label"), list):
            raise UserError(f"{where}: choices must be {{'text': [...], 'label': [...]}} ({layout}); fix the row")
        texts, labels = raw["text"], raw["label"]
    if len(texts) != len(labels) or len(texts) < 2 or not all(isinstance(t, str) and t.strip() for t in texts):
        raise UserError(f"{where}: needs at least 2 choices, each a non-empty text with a label; fix the row")
    labels = [str(x).strip() for x in labels]
    key = str(row.get("answerKey", "")).strip()
    if key not in labels:
        raise UserError(f"{where}: answerKey {row.get('answerKey')!r} is not one of the labels "
                        f"{', '.join(labels)}; fix the row")
    return _mc(stem, [t.strip() for t in texts], labels.index(key), where)


def _hellaswag_text(text: str) -> str:
    """WikiHow contexts carry markup ("[title]", "[step]"): a tag becomes a sentence break, spaces collapse."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[[^\]]*\]", "", text)
    return re.sub(r" {2,}", " ", text).strip()


def _hellaswag(row: dict, where: str, layout: str) -> MCItem:
    ctx_a = row.get("ctx_a")
    if isinstance(ctx_a, str):
        ctx_b = row.get("ctx_b") if isinstance(row.get("ctx_b"), str) else ""
        ctx = f"{ctx_a} {ctx_b[:1].upper()}{ctx_b[1:]}".strip()
    else:
        ctx = _text(row, "ctx", where, layout)
    endings = row.get("endings")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) and e.strip() for e in endings):
        raise UserError(f"{where}: endings must be a list of at least 2 non-empty strings ({layout}); fix the row")
    activity = row.get("activity_label") if isinstance(row.get("activity_label"), str) else ""
    query = _hellaswag_text(f"{activity}: {ctx}" if activity else ctx)
    answer = _int_label(row.get("label"), len(endings), 0, where, layout)
    return MCItem(query, tuple(_hellaswag_text(e) for e in endings), answer, query, " ", where)


def _plain_mc(row: dict, where: str, layout: str) -> MCItem:
    question = _text(row, "question", where, layout)
    choices = row.get("choices")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c.strip() for c in choices):
        raise UserError(f"{where}: choices must be a list of at least 2 non-empty strings; fix the row")
    choices = [c.strip() for c in choices]
    answer = row.get("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < len(choices):
            raise UserError(f"{where}: answer {answer} is not an index of the {len(choices)} choices (0 to "
                            f"{len(choices) - 1}); fix the row")
        index = answer
    elif isinstance(answer, str) and answer.strip() in choices:
        index = choices.index(answer.strip())
    elif isinstance(answer, str) and len(answer.strip()) == 1:
        index = _letter_index(answer, len(choices), where, "give the index, letter or text of the right choice")
    else:
        raise UserError(f"{where}: answer {answer!r} is neither an index, a letter nor the text of one of the "
                        "choices; fix the row")
    return _mc(question, choices, index, where)


_GSM_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.S)


def _gsm8k(row: dict, where: str, layout: str) -> GenItem:
    question = _text(row, "question", where, layout)
    solution = _text(row, "answer", where, layout)
    m = _GSM_ANSWER.search(solution)
    if m is None:
        raise UserError(f"{where}: the answer has no final '#### <number>' line (GSM8K's layout); fix the row")
    prompt, _ = cloze(question)
    return GenItem(question, m.group(1).strip(), prompt, solution, where)


def _plain_gen(row: dict, where: str, layout: str) -> GenItem:
    question = _text(row, "question", where, layout)
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise UserError(f"{where}: answer must be a non-empty string or a number; fix the row")
    prompt, _ = cloze(question)
    return GenItem(question, answer.strip(), prompt, answer.strip(), where)


# layout name -> (does the first row look like it, row reader(row, where, layout, index) -> item, kind)
def _layout_of(row: dict) -> str | None:
    if "endings" in row:
        return "hellaswag"
    if "goal" in row and "sol1" in row:
        return "piqa"
    if "answerA" in row and "context" in row:
        return "siqa"
    if isinstance(row.get("question"), dict) or "question_stem" in row or (
            "answerKey" in row and isinstance(row.get("choices"), dict)):
        return "arc"
    if "question" in row and "choices" in row:
        return "nanolm-mc"
    if "question" in row and "answer" in row:
        return "gsm8k" if isinstance(row["answer"], str) and "####" in row["answer"] else "nanolm-gen"
    return None


_LAYOUT_NAMES = {"hellaswag": "HellaSwag", "piqa": "PIQA", "siqa": "SIQA", "arc": "ARC/OpenBookQA",
                 "nanolm-mc": "nanolm multiple-choice", "gsm8k": "GSM8K", "nanolm-gen": "nanolm generative"}


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    for row, n, _ in jsonl.read_jsonl(path, fix="fix the line", invalid="not valid JSON"):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}; fix the line")
        yield where, row


def read_jsonl(path: Path) -> Task:
    """Any of the JSONL layouts, picked by the first row's fields; every row must be of that layout."""
    labels = None
    items: list = []
    layout = None
    for index, (where, row) in enumerate(_rows(path)):
        if layout is None:
            layout = _layout_of(row)
            if layout is None:
                raise UserError(f"{where}: fields {', '.join(sorted(row)) or '(none)'} match no task layout; use "
                                f"{{\"question\", \"choices\", \"answer\"}} or {{\"question\", \"answer\"}}, or one "
                                f"of ARC, OpenBookQA, PIQA, HellaSwag, SIQA, GSM8K as published")
            if layout in ("piqa", "siqa"):
                labels = _labels_file(path)
        elif _layout_of(row) != layout:
            raise UserError(f"{where}: fields {', '.join(sorted(row))} do not fit the {_LAYOUT_NAMES[layout]} layout "
                            f"of the file's first row; one file holds one layout")
        name = _LAYOUT_NAMES[layout]
        if layout == "piqa":
            sols = [_text(row, "sol1", where, name), _text(row, "sol2", where, name)]
            answer = _int_label(_label(row, labels, index, where, name, path), 2, 0, where, name)
            items.append(_mc(_text(row, "goal", where, name), sols, answer, where))
        elif layout == "siqa":
            context, question = _text(row, "context", where, name), _text(row, "question", where, name)
            choices = [_text(row, k, where, name) for k in ("answerA", "answerB", "answerC")]
            answer = _int_label(_label(row, labels, index, where, name, path), 3, 1, where, name)
            items.append(_mc(f"{context} {question}", choices, answer, where))
        else:
            read: Callable[[dict, str, str], Any] = {"hellaswag": _hellaswag, "arc": _arc_like, "nanolm-mc": _plain_mc,
                                                     "gsm8k": _gsm8k, "nanolm-gen": _plain_gen}[layout]
            items.append(read(row, where, name))
    kind = "gen" if layout in ("gsm8k", "nanolm-gen") else "mc"
    return Task(path.stem, kind, items, str(path), _LAYOUT_NAMES.get(layout or "", ""))


def read_task_file(path: str | Path) -> Task:
    """The task in a .csv or .jsonl file; UserError for other files and for files without items."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such task file; pass a .csv (C-Eval, CMMLU, MMLU) or .jsonl task file, or a "
                        f"built-in task name")
    if path.suffix.lower() == ".csv":
        task = read_csv(path)
    elif path.suffix.lower() in (".jsonl", ".json"):
        task = read_jsonl(path)
    else:
        raise UserError(f"{path}: unknown task file type {path.suffix or '(no suffix)'!r}; use .csv or .jsonl")
    if not task.items:
        raise UserError(f"{path}: holds no items; pass a task file with at least one question")
    return task
