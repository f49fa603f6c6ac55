"""Packed batches: coverage without gaps or repeats, determinism, rank sharding, resume, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolm.data.kinds import text as text_kind
from nanolm.data import shards as shards_module
from nanolm.data.loader import Loader, iter_eval_batches
from nanolm.data.prepare import prepare
from nanolm.data.shards import FORMAT_VERSION, PackedData
from nanolm.errors import UserError

FP = "ab" * 32


def make_data(root: Path, shard_lens: dict[str, list[int]], fingerprint: str = FP) -> Path:
    """A prepared-data directory whose token at global position p of a split is p itself
    (uint32), so every window says where it came from. One document per shard."""
    root.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, lens in shard_lens.items():
        shards, pos = [], 0
        for i, n in enumerate(lens):
            stem = f"{split}-{i:05d}"
            np.arange(pos, pos + n, dtype=np.uint32).tofile(root / f"{stem}.bin")
            np.array([0, n], dtype=np.uint64).tofile(root / f"{stem}.idx")
            shards.append({"bin": f"{stem}.bin", "idx": f"{stem}.idx", "n_tokens": n, "n_docs": 1})
            pos += n
        splits[split] = {"shards": shards, "n_tokens": pos, "n_docs": len(lens)}
    manifest = {"format": "nanolm-tokens", "version": FORMAT_VERSION, "dtype": "uint32", "splits": splits,
                "tokenizer": {"path": "/somewhere/tokenizer.json", "fingerprint": fingerprint,
                              # token p is p itself, so the ids run to the longest split's length
                              "vocab_size": max(70000, *(e["n_tokens"] for e in splits.values())), "eot_id": 0}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


# Shards of 41, 33 and 26 tokens with seq_len 8: 5 + 4 + 3 = 12 windows.
SHARDS = [41, 33, 26]
T = 8


@pytest.fixture
def data(tmp_path) -> PackedData:
    return PackedData(make_data(tmp_path / "d", {"train": SHARDS, "val": [30]}))


def starts(x: torch.Tensor) -> list[int]:
    """The global position of each row's first input token."""
    return x[:, 0].tolist()


def take(loader: Loader, steps: int) -> list[int]:
    return [p for _ in range(steps) for p in starts(loader.next_batch().x)]


def test_packed_data_maps_shards_read_only(data):
    assert (data.n_tokens, data.vocab_size, data.dtype) == (100, 70000, np.dtype(np.uint32))
    assert [len(s) for s in data.shards] == SHARDS
    assert not data.shards[0].flags.writeable
    assert data.n_windows(T).tolist() == [5, 4, 3]


def test_batches_are_shifted_windows(data):
    batch = Loader(data, batch_size=3, seq_len=T).next_batch()
    x, y = batch.x, batch.y
    assert batch.pos is None and batch.seg is None  # text: one causal sequence per row
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, T)
    assert x.is_contiguous() and y.is_contiguous()
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert row_x == list(range(row_x[0], row_x[0] + T))
        assert row_y == [p + 1 for p in row_x]


def test_one_epoch_covers_every_position_once_except_shard_tails(data):
    loader = Loader(data, batch_size=3, seq_len=T, seed=5)
    assert (loader.epoch_windows, loader.tokens_per_epoch) == (12, 96)
    seen = []
    for _ in range(4):
        seen += loader.next_batch().x.flatten().tolist()
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["cursor"] == 0
    # Inputs tile each shard from its start; the tail is the last (n - 1) % T tokens plus the final token.
    expected = list(range(0, 40)) + list(range(41, 41 + 32)) + list(range(74, 74 + 24))
    assert sorted(seen) == expected


def test_order_is_the_seeded_permutation_and_changes_per_epoch_and_seed(data):
    loader = Loader(data, batch_size=4, seq_len=T, seed=3)
    window_start = np.array([0, 8, 16, 24, 32, 41, 49, 57, 65, 74, 82, 90])
    epoch0 = take(loader, 3)
    epoch1 = take(loader, 3)
    assert epoch0 == window_start[np.random.default_rng([3, 0]).permutation(12)].tolist()
    assert epoch1 == window_start[np.random.default_rng([3, 1]).permutation(12)].tolist()
    assert epoch0 != epoch1
    assert take(Loader(data, batch_size=4, seq_len=T, seed=3), 6) == epoch0 + epoch1
    assert take(Loader(data, batch_size=4, seq_len=T, seed=4), 3) != epoch0


def test_batch_straddles_epochs_without_repeats_inside_an_epoch(data):
    loader = Loader(data, batch_size=5, seq_len=T, seed=1)  # 12 windows: step 3 takes 2 + 3
    stream = take(loader, 6)  # 30 windows = 2.5 epochs
    assert sorted(stream[:12]) == sorted(stream[12:24]) and len(set(stream[:12])) == 12
    assert stream == take(Loader(data, batch_size=2, seq_len=T, seed=1), 15)  # batch size does not change the stream
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["cursor"] == 6


def test_two_ranks_split_the_same_global_stream(data):
    one = Loader(data, batch_size=4, seq_len=T, seed=9)
    ranks = [Loader(data, batch_size=2, seq_len=T, seed=9, rank=r, world_size=2) for r in range(2)]
    for _ in range(7):
        batch = one.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(batch.x, torch.cat([p.x for p in parts]))
        assert torch.equal(batch.y, torch.cat([p.y for p in parts]))
    assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()


def test_resume_continues_identically_with_any_world_size(data):
    ref = Loader(data, batch_size=2, seq_len=T, seed=7)
    take(ref, 5)
    state = json.loads(json.dumps(ref.state_dict()))
    assert state == {"epoch": 0, "cursor": 10, "seed": 7, "seq_len": T, "epoch_windows": 12}
    continuation = take(ref, 8)

    same = Loader(data, batch_size=2, seq_len=T, seed=0)
    same.load_state_dict(state)
    assert take(same, 8) == continuation

    ranks = [Loader(data, batch_size=1, seq_len=T, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    resumed = []
    for _ in range(8):
        resumed += [p for r in ranks for p in starts(r.next_batch().x)]
    assert resumed == continuation


def test_load_state_dict_rejects_other_data(data):
    loader = Loader(data, batch_size=2, seq_len=T)
    with pytest.raises(UserError, match=r"saved data position is for 12 windows of seq_len 4, but .* has 12 windows "
                                        r"of seq_len 8; resume with the same prepared data and seq_len"):
        loader.load_state_dict({"epoch": 0, "cursor": 0, "seed": 0, "seq_len": 4, "epoch_windows": 12})
    with pytest.raises(UserError, match="out of range"):
        loader.load_state_dict({"epoch": 0, "cursor": 12, "seed": 0, "seq_len": T, "epoch_windows": 12})


def test_too_few_windows_says_how_many_tokens_are_needed(data):
    with pytest.raises(UserError, match=r"100 tokens make 12 windows of seq_len\+1 = 9 tokens, but a step takes "
                                        r"batch_size x world_size = 14; it needs at least 113 tokens"):
        Loader(data, batch_size=7, seq_len=T, world_size=2)
    Loader(data, batch_size=6, seq_len=T, world_size=2)  # exactly enough


def test_eval_batches_are_sequential_and_repeatable(data):
    batches = list(iter_eval_batches(data, batch_size=5, seq_len=T, max_batches=None))
    assert [starts(b.x) for b in batches] == [[0, 8, 16, 24, 32], [41, 49, 57, 65, 74], [82, 90]]
    assert all(torch.equal(b.y, b.x + 1) and b.pos is None and b.seg is None for b in batches)
    again = list(iter_eval_batches(data, batch_size=5, seq_len=T, max_batches=2))
    assert len(again) == 2 and all(torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
                                   for a, b in zip(batches, again))
    val = PackedData(data.data_dir, "val")
    assert [starts(b.x) for b in iter_eval_batches(val, 4, T, None)] == [[0, 8, 16]]
    with pytest.raises(UserError, match="fewer than one window of seq_len\\+1 = 31"):
        next(iter_eval_batches(val, 4, 30, None))


def test_missing_data_errors(tmp_path):
    with pytest.raises(UserError, match=r"nope: no such data directory; run `nanolm prepare` to make it"):
        PackedData(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty/manifest.json: not found, .*run `nanolm prepare`"):
        PackedData(tmp_path / "empty")
    d = make_data(tmp_path / "d", {"train": [20], "val": []})
    with pytest.raises(UserError, match=r"no 'val' split \(the data has: train\)"):
        PackedData(d, "val")
    with open(d / "train-00000.bin", "r+b") as f:
        f.truncate(40)
    with pytest.raises(UserError, match=r"train-00000.bin: expected 80 bytes \(20 x uint32\), found 40; "
                                        r"the data is damaged, run `nanolm prepare` again"):
        PackedData(d)
    (d / "manifest.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(UserError, match="data format version 99, this nanolm reads version 1"):
        PackedData(d)


def test_tokenizer_fingerprint_mismatch_names_both(tmp_path):
    d = make_data(tmp_path / "d", {"train": [20]})
    PackedData(d, tokenizer_fingerprint=FP)
    with pytest.raises(UserError, match=f"tokenized with tokenizer {FP[:16]} \\(/somewhere/tokenizer.json\\) but "
                                        f"the tokenizer in use is {'cd' * 8}; use that tokenizer, or run "
                                        "`nanolm prepare` again with this one"):
        PackedData(d, tokenizer_fingerprint="cd" * 32)


def test_loader_reads_prepare_output(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    texts = [f"document {i}: the cat sat on the mat, number {i * i}." for i in range(60)]
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    m = prepare([tmp_path / "a.jsonl"], tmp_path / "tokenizer.json", tmp_path / "out", val_fraction=0.1,
                workers=0, quiet=True)
    data = PackedData(tmp_path / "out", tokenizer_fingerprint=m.tokenizer.fingerprint)
    assert data.dtype == np.uint16 and data.n_tokens == m.splits["train"]["n_tokens"]
    stream = np.fromfile(tmp_path / "out" / "train-00000.bin", dtype=np.uint16).astype(np.int64)
    batch = Loader(data, batch_size=4, seq_len=16, seed=0).next_batch()
    x, y = batch.x, batch.y
    assert data.kind == "text" and data.masks is None
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        hits = [s for s in range(0, len(stream) - 16, 16) if np.array_equal(stream[s:s + 16], row_x)]
        assert hits and np.array_equal(stream[hits[0] + 1:hits[0] + 17], row_y)
    assert (x == 0).any()  # documents are packed, separated by <|endoftext|>


# Shards of 2001, 1501 and 999 tokens with seq_len 8: 250 + 187 + 124 = 561 windows; with
# SHUFFLE_BLOCK = 64, epochs are shuffled in 9 blocks, the last of 49 windows.
BIG = [2001, 1501, 999]
BLOCK = 64


@pytest.fixture
def big(tmp_path, monkeypatch) -> PackedData:
    monkeypatch.setattr(text_kind, "SHUFFLE_BLOCK", BLOCK)
    return PackedData(make_data(tmp_path / "big", {"train": BIG}))


def window_ids(data: PackedData, loader: Loader, steps: int) -> list[int]:
    """Global window ids of the rows of the loader's next `steps` batches (tokens are positions)."""
    first = np.cumsum([0] + [len(s) for s in data.shards])  # global position of each shard's first token
    ids = np.cumsum([0] + data.n_windows(T).tolist())
    out = []
    for p in take(loader, steps):
        s = int(np.searchsorted(first, p, side="right")) - 1
        assert (p - first[s]) % T == 0
        out.append(int(ids[s] + (p - first[s]) // T))
    return out


def test_two_level_shuffle_takes_the_blocks_in_a_seeded_order_each_shuffled(big):
    loader = Loader(big, batch_size=7, seq_len=T, seed=3)  # 561 = 80 x 7 + 1: batches straddle the epochs
    assert loader.epoch_windows == 561
    stream = window_ids(big, loader, 161)
    for epoch, order in enumerate((stream[:561], stream[561:1122])):
        assert sorted(order) == list(range(561))  # every window once
        blocks = np.random.default_rng([3, epoch]).permutation(9)
        expected = [b * BLOCK + i for b in blocks.tolist()
                    for i in np.random.default_rng([3, epoch, b]).permutation(min(BLOCK, 561 - b * BLOCK)).tolist()]
        assert order == expected
    assert stream[:561] != stream[561:1122]
    assert window_ids(big, Loader(big, batch_size=11, seq_len=T, seed=3), 102) == stream[:1122]  # any batch size
    assert window_ids(big, Loader(big, batch_size=7, seq_len=T, seed=4), 80) != stream[:560]
    assert len(loader._orders[loader.epoch]._cache) <= 2  # a block's order at a time, not the epoch's


def test_two_level_shuffle_resumes_exactly_and_ranks_take_disjoint_windows(big):
    ref = Loader(big, batch_size=5, seq_len=T, seed=3)
    window_ids(big, ref, 30)  # 150 windows: inside the epoch's third block
    state = json.loads(json.dumps(ref.state_dict()))
    assert state == {"epoch": 0, "cursor": 150, "seed": 3, "seq_len": T, "epoch_windows": 561}
    continuation = window_ids(big, ref, 100)  # into epoch 1

    same = Loader(big, batch_size=5, seq_len=T)
    same.load_state_dict(state)
    assert window_ids(big, same, 100) == continuation
    ranks = [Loader(big, batch_size=1, seq_len=T, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    resumed = [w for _ in range(250) for r in ranks for w in window_ids(big, r, 1)]
    assert resumed == continuation

    ranks = [Loader(big, batch_size=4, seq_len=T, seed=8, rank=r, world_size=2) for r in range(2)]
    seen = [window_ids(big, r, 70) for r in ranks]  # 70 steps of 8 windows: all of epoch 0 but one window
    assert ranks[0].state_dict()["epoch"] == 0 and not set(seen[0]) & set(seen[1])
    assert len(set(seen[0]) | set(seen[1])) == 560


def test_up_to_shuffle_block_windows_the_epoch_is_one_permutation(data, monkeypatch):
    monkeypatch.setattr(text_kind, "SHUFFLE_BLOCK", 12)  # exactly the 12 windows of `data`
    whole = take(Loader(data, batch_size=4, seq_len=T, seed=3), 3)
    window_start = np.array([0, 8, 16, 24, 32, 41, 49, 57, 65, 74, 82, 90])
    assert whole == window_start[np.random.default_rng([3, 0]).permutation(12)].tolist()
    monkeypatch.setattr(text_kind, "SHUFFLE_BLOCK", 11)
    blocked = take(Loader(data, batch_size=4, seq_len=T, seed=3), 3)
    assert blocked != whole and sorted(blocked) == sorted(whole)


def _rss_file_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssFile from /proc (Linux)")
def test_gather_reads_windows_without_mapping_the_data_into_the_process(tmp_path, monkeypatch):
    n, seq = 1 << 22, 1024  # 16 MiB of uint32 tokens, 4095 windows
    data = PackedData(make_data(tmp_path / "d", {"train": [n]}))
    windows = np.random.default_rng(0).permutation(int(data.n_windows(seq).sum()))

    def read_all() -> int:
        """Gather every window in random order; the growth of the file-backed resident set, KiB."""
        data.gather(windows[:2], seq)
        before = _rss_file_kib()
        for b in range(0, len(windows), 64):
            rows = data.gather(windows[b:b + 64], seq)
            assert np.array_equal(rows, windows[b:b + 64, None] * seq + np.arange(seq + 1))
        return _rss_file_kib() - before

    assert read_all() < 2048  # pread: the pages stay in the page cache, out of the process
    monkeypatch.delattr(shards_module.os, "pread")  # the fallback: fancy indexing into the memory map
    assert read_all() > 8192


def test_shard_files_open_at_most_max_open_shards_and_a_shrunk_one_is_a_user_error(data, monkeypatch):
    monkeypatch.setattr(shards_module, "MAX_OPEN_SHARDS", 2)
    batches = list(iter_eval_batches(data, batch_size=5, seq_len=T))
    assert [starts(b.x) for b in batches] == [[0, 8, 16, 24, 32], [41, 49, 57, 65, 74], [82, 90]]
    assert all(torch.equal(b.y, b.x + 1) for b in batches)
    assert list(data._files._fds) == [1, 2]  # the least recently read shard was closed
    fresh = PackedData(data.data_dir)
    with open(data.data_dir / "train-00002.bin", "r+b") as f:
        f.truncate(60)  # 15 of its 26 tokens
    with pytest.raises(UserError, match=r"train-00002.bin: ends before byte 68; it changed after it was opened, "
                                        r"or the data is damaged: run `nanolm prepare` again"):
        fresh.gather(np.array([10]), T)  # its second window: bytes 32..68
