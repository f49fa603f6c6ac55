"""Readers for .txt and .jsonl sources: what counts as a document, and every rejection message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanolm.corpora import expand_sources
from nanolm.data.formats import iter_documents, iter_pieces
from nanolm.data.jsonl import BadRecord, ReadStats, read_jsonl
from nanolm.errors import UserError

HINT = "; fix the line or pass --skip-bad to skip such lines"


def write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def test_jsonl_one_document_per_line_other_keys_ignored(tmp_path):
    p = write(tmp_path / "a.jsonl", "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in [
        {"text": "hello world"}, {"text": "二 lines\nhere", "id": 7}, {"meta": 1, "text": "tab\tend "}]))
    assert list(iter_documents(p)) == ["hello world", "二 lines\nhere", "tab\tend "]


def test_jsonl_bom_crlf_blank_lines_and_missing_final_newline(tmp_path):
    p = write(tmp_path / "a.jsonl", b'\xef\xbb\xbf{"text": "a"}\r\n\r\n   \n{"text": "b\\r\\nc"}\r\n\n{"text": "d"}')
    assert list(iter_documents(p)) == ["a", "b\r\nc", "d"]


def test_jsonl_empty_text_is_skipped_and_counted(tmp_path):
    p = write(tmp_path / "a.jsonl", '{"text": ""}\n{"text": "x"}\n{"text": ""}\n')
    stats = ReadStats()
    assert list(iter_documents(p, stats=stats)) == ["x"]
    assert (stats.empty_docs, stats.bad_lines) == (2, 0)


@pytest.mark.parametrize("line, problem", [
    (b'{"text": "a"', "invalid JSON (Expecting ',' delimiter at column 13)"),
    (b'{"text": "a"} x', "invalid JSON (Extra data at column 15)"),
    (b'["a"]', 'expected a JSON object like {"text": "..."}, got an array'),
    (b'"just a string"', 'expected a JSON object like {"text": "..."}, got a string'),
    (b'{"content": "a", "id": 1}', 'no "text" field (keys: content, id)'),
    (b'{"text": 3}', '"text" must be a string, got a number'),
    (b'{"text": null}', '"text" must be a string, got null'),
    (b'{"text": ["a"]}', '"text" must be a string, got an array'),
    (b'{"text": "a\xffb"}', "invalid UTF-8 (byte 0xff at column 12)"),
    (b'{"text": "\\ud83d"}', '"text" holds an unpaired surrogate escape \\ud83d, which is not valid Unicode'),
])
def test_jsonl_malformed_line_names_file_line_and_fix(tmp_path, line, problem):
    # Blank line 2 still counts, so the bad line is line 4.
    p = write(tmp_path / "bad.jsonl", b'{"text": "ok"}\n\n{"text": "ok2"}\n' + line + b'\n{"text": "after"}\n')
    with pytest.raises(UserError) as e:
        list(iter_documents(p))
    assert str(e.value) == f"{p}:4: {problem}{HINT}"


def test_skip_bad_skips_counts_and_keeps_first_locations(tmp_path):
    lines = ['{"text": "d0"}'] + ["not json"] * 7 + ['{"text": "d1"}', '{"x": 1}', '{"text": "d2"}']
    p = write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    stats = ReadStats()
    assert list(iter_documents(p, skip_bad=True, stats=stats)) == ["d0", "d1", "d2"]
    assert stats.bad_lines == 8
    assert stats.examples == [f"{p}:{i}: invalid JSON (Expecting value at column 1)" for i in range(2, 7)]


def test_jsonl_pieces_report_bytes_read(tmp_path):
    p = write(tmp_path / "a.jsonl", "".join(json.dumps({"text": "x" * 50_000}) + "\n" for _ in range(4)))
    pieces = list(iter_pieces(p))
    assert [pc.last for pc in pieces] == [True] * 4
    assert sum(pc.nbytes for pc in pieces) == p.stat().st_size


def test_txt_whole_file_is_one_document_bom_and_crlf_normalised(tmp_path):
    p = write(tmp_path / "a.txt", b"\xef\xbb\xbfFirst line\r\nsecond\r\n\r\nlast\rold-mac\n")
    assert list(iter_documents(p)) == ["First line\nsecond\n\nlast\nold-mac\n"]


def test_txt_empty_file_is_no_document(tmp_path):
    p = write(tmp_path / "a.txt", b"")
    stats = ReadStats()
    assert list(iter_documents(p, stats=stats)) == []
    assert stats.empty_docs == 1


def test_txt_invalid_utf8_names_line_and_can_be_skipped(tmp_path):
    p = write(tmp_path / "a.txt", b"good\nalso good\nbad \xc3\x28 here\nend\n")
    with pytest.raises(UserError) as e:
        list(iter_documents(p))
    assert str(e.value) == f"{p}:3: invalid UTF-8 (byte 0xc3 at column 5){HINT}"
    stats = ReadStats()
    assert list(iter_documents(p, skip_bad=True, stats=stats)) == ["good\nalso good\nend\n"]
    assert stats.examples == [f"{p}:3: invalid UTF-8 (byte 0xc3 at column 5)"]


def test_txt_large_file_comes_in_pieces_cut_before_a_newline_after_a_letter(tmp_path):
    lines = ["  indented line 1", "(punct) ...", "", "word", "数字 123", "mixed, end.", "x"] * 40
    text = "\n".join(lines) + "\n"
    p = write(tmp_path / "a.txt", text)
    pieces = list(iter_pieces(p, txt_piece_chars=64))
    assert len(pieces) > 10
    assert "".join(pc.text for pc in pieces) == text
    assert [pc.last for pc in pieces] == [False] * (len(pieces) - 1) + [True]
    for before, after in zip(pieces, pieces[1:]):
        assert before.text[-1].isalnum() and after.text[0] == "\n"
    assert sum(pc.nbytes for pc in pieces) == p.stat().st_size


def test_txt_without_safe_cut_is_still_bounded(tmp_path):
    p = write(tmp_path / "a.txt", "." * 1000)  # no newline, no letter: cut inside the line
    pieces = list(iter_pieces(p, txt_piece_chars=64))
    assert max(len(pc.text) for pc in pieces) <= 4 * 64
    assert "".join(pc.text for pc in pieces) == "." * 1000


def test_unsupported_suffix(tmp_path):
    p = write(tmp_path / "a.csv", "text\n")
    with pytest.raises(UserError, match=r"a\.csv: unsupported file type '\.csv'; use \.txt"):
        iter_pieces(p)
    with pytest.raises(UserError, match=r"a\.csv: unsupported file type"):
        expand_sources([p])


def test_expand_sources_files_and_directories(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    for name in ["b.jsonl", "a.txt", "sub/c.TXT", "notes.md", ".hidden/x.txt"]:
        write(d / name, "x")
    single = write(tmp_path / "z.jsonl", "")
    assert expand_sources([single, d]) == [single, d / "a.txt", d / "b.jsonl", d / "sub" / "c.TXT"]
    with pytest.raises(UserError, match="missing.txt: no such file or directory"):
        expand_sources([tmp_path / "missing.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty: directory holds no .txt or .jsonl files"):
        expand_sources([tmp_path / "empty"])


def test_prompt_records_in_the_shapes_people_have(tmp_path):
    from nanolm.data.formats import iter_prompt_records
    lines = [
        {"prompt": "2 + 2?", "answer": "4"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3 + 3?"}], "gt": 6},
        # MiniMind rlaif: the trailing empty assistant turn is a placeholder the policy fills
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "weather?"}], "solution": "#### sunny",
         "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}]},
    ]
    p = write(tmp_path / "p.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    got = [rec for rec, _ in iter_prompt_records(p)]
    assert [[(m.role, m.content) for m in conv.messages] for conv, _ in got] == [
        [("user", "2 + 2?")], [("system", "be brief"), ("user", "3 + 3?")], [("user", "hi")], [("user", "weather?")]]
    assert [r for _, r in got] == lines  # the record kept whole, reference fields included
    assert len(got[3][0].tools) == 1


@pytest.mark.parametrize("line, problem", [
    ('{"question": "2+2"}', 'no "prompt", "messages" or "conversations" field (keys: question)'),
    ('{"prompt": []}', '"prompt" is empty'),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "has no user turn"),
    ('{"prompt": [{"role": "user", "content": ""}]}', '"prompt"[0].content is empty'),
    ('[1]', "expected a JSON object"),
])
def test_prompt_record_errors_name_file_and_line(tmp_path, line, problem):
    from nanolm.data.formats import iter_prompt_records
    p = write(tmp_path / "p.jsonl", '{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(UserError) as e:
        list(iter_prompt_records(p))
    assert str(e.value).startswith(f"{p}:2: ") and problem in str(e.value)
    stats = ReadStats()
    assert len(list(iter_prompt_records(p, skip_bad=True, stats=stats))) == 1 and stats.bad_lines == 1


def test_a_bad_line_reads_alike_with_or_without_its_line_break(tmp_path):
    """A line is parsed without its line break: `"` is the same unterminated string at the file's end and before
    a newline (found by test_hostile's property test)."""
    from nanolm.data.formats import iter_preference_records
    errors = []
    for data in (b'"', b'"\n', b'"\r\n'):
        path = tmp_path / "pairs.jsonl"
        path.write_bytes(data)
        with pytest.raises(UserError) as e:
            list(iter_preference_records(path))
        errors.append(str(e.value))
    assert errors == [f"{tmp_path / 'pairs.jsonl'}:1: invalid JSON (Unterminated string starting at column 1); "
                      "fix the line or pass --skip-bad to skip such lines"] * 3


def test_the_one_jsonl_reader_names_file_and_line_and_its_fix(tmp_path):
    """BOM dropped, blank lines and CRLF accepted, line numbers as in the file, the bytes read; a bad line is
    `file:line: what is wrong; the fix` or, skipped, counted."""
    p = write(tmp_path / "items.jsonl", b'\xef\xbb\xbf{"a": 1}\n\n{"a": 2}\r\n{oops\n[1]\n')
    stats = ReadStats()
    lines = list(read_jsonl(p, skip_bad=True, stats=stats))
    assert [(r.value, r.line) for r in lines] == [({"a": 1}, 1), ({"a": 2}, 3), ([1], 5)]
    assert sum(r.nbytes for r in lines) == p.stat().st_size  # as the file is read (by buffers), for progress
    bad = f"{p}:4: invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    assert (stats.bad_lines, stats.examples) == (1, [bad])
    with pytest.raises(UserError) as e:
        list(read_jsonl(p, fix="write one item per line"))
    assert str(e.value) == bad + "; write one item per line"
    with pytest.raises(UserError) as e:
        list(read_jsonl(p, fix="", invalid="not valid JSON"))
    assert str(e.value) == f"{p}:4: not valid JSON (Expecting property name enclosed in double quotes at column 2)"

    def objects(value):
        if not isinstance(value, dict):
            raise BadRecord("expected an object")
        return value["a"]
    with pytest.raises(UserError) as e:
        list(read_jsonl(write(tmp_path / "b.jsonl", '{"a": 1}\n[1]\n'), objects))
    assert str(e.value) == f"{tmp_path / 'b.jsonl'}:2: expected an object{HINT}"
    with pytest.raises(UserError, match=r"b\.jsonl:1: invalid UTF-8 \(byte 0xff at column 8\)"):
        list(read_jsonl(write(tmp_path / "b.jsonl", b'{"a": "\xff"}\n')))
