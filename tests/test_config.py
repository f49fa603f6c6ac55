"""Config layering (preset -> file -> overrides) and validation messages."""

import json

import pytest

from nanolm.config import Config, ModelConfig, preset

from nanolm.config.load import override_fields
from nanolm.train.configure import load_config
from nanolm.errors import UserError


def test_presets_are_complete_and_valid():
    cfg = preset("minimind-26m")
    assert (cfg.model.d_model, cfg.model.n_layer, cfg.model.n_head, cfg.model.n_kv_head) == (512, 8, 8, 2)
    assert cfg.model.vocab_size == 6400 and cfg.model.n_hidden == 1408
    assert preset("minimind-104m").model.d_model == 768 and preset("minimind-104m").model.n_layer == 16
    with pytest.raises(UserError, match="unknown preset 'nope'; choose one of: tiny"):
        preset("nope")


def test_layering_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layer = 3\nd_model = 64\n[train]\nmax_steps = 7\n')
    cfg = load_config("tiny", f, {"model.n_layer": "5", "optim.lr": "1e-3", "train.compile": "true"})
    assert cfg.model.n_layer == 5 and cfg.model.d_model == 64
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 1e-3 and cfg.train.compile is True
    assert cfg.model.n_head == preset("tiny").model.n_head


def test_json_config_and_round_trip(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"train": {"batch_size": 3}}))
    cfg = load_config(None, f)
    assert cfg.train.batch_size == 3
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("overrides, message", [
    ({"model.n_head": "5"}, "model.d_model (128) must be divisible by model.n_head (5)"),
    ({"model.n_kv_head": "3"}, "must be a multiple of model.n_kv_head (3)"),
    ({"model.n_layer": "four"}, "model.n_layer: expected an integer, got 'four'"),
    ({"optim.schedule": "linear"}, "optim.schedule must be 'cosine' or 'constant'"),
    ({"optim.min_lr": "1"}, "optim.min_lr must be in [0, optim.lr="),
    ({"train.seq_len": "1024"}, "train.seq_len (1024) must not exceed model.max_seq_len (256)"),
    ({"train.dtype": "fp8"}, "train.dtype must be one of auto, float32, bfloat16, float16"),
    ({"model.nlayers": "2"}, "unknown option --model.nlayers"),
])
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(UserError) as e:
        load_config("tiny", overrides=overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(UserError, match="bad.toml: invalid TOML"):
        load_config("tiny", bad)
    unknown = tmp_path / "u.json"
    unknown.write_text('{"model": {"layers": 2}}')
    with pytest.raises(UserError, match="u.json: unknown field model.layers; known fields: model.vocab_size"):
        load_config("tiny", unknown)
    with pytest.raises(UserError, match="missing.toml: config file not found"):
        load_config("tiny", tmp_path / "missing.toml")


def test_override_names_come_from_the_dataclasses():
    names = override_fields()
    assert {"model.n_layer", "optim.lr", "train.max_steps", "data.path"} <= set(names)
    assert names["model.n_layer"] is int and names["train.compile"] is bool


def test_auto_hidden_size():
    assert ModelConfig(d_model=512).n_hidden == 1408
    assert ModelConfig(d_model=768).n_hidden == 2048


def test_stage_defaults_come_before_file_and_overrides(tmp_path):
    pre = preset("minimind-26m").optim.lr
    sft = load_config("minimind-26m", overrides={"train.stage": "sft"})
    assert sft.optim.lr == pytest.approx(pre / 10) and sft.optim.min_lr == pytest.approx(pre / 100)
    lora = load_config("minimind-26m", overrides={"train.stage": "lora", "optim.lr": "1e-3"})
    assert lora.optim.lr == 1e-3 and lora.optim.min_lr == pytest.approx(pre / 20)
    f = tmp_path / "s.toml"
    f.write_text('[train]\nstage = "sft"\n')
    assert load_config("minimind-26m", f).optim.lr == pytest.approx(pre / 10)


def test_lora_targets_from_command_line_and_file(tmp_path):
    cfg = load_config("tiny", overrides={"lora.targets": "q_proj, v_proj", "lora.rank": "4"})
    assert cfg.lora.targets == ("q_proj", "v_proj") and cfg.lora.rank == 4
    f = tmp_path / "l.toml"
    f.write_text('[lora]\ntargets = ["o_proj"]\nalpha = 8\n')
    cfg = load_config("tiny", f)
    assert cfg.lora.targets == ("o_proj",) and cfg.lora.alpha == 8.0
    assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(UserError, match="lora.targets: expected a list of names"):
        load_config("tiny", overrides={"lora.targets": ","})
    with pytest.raises(UserError, match="lora.rank must be a positive integer"):
        load_config("tiny", overrides={"lora.rank": "0"})


def test_summary_lists_every_field():
    lines = load_config("tiny", overrides={"train.stage": "lora"}).summary()
    assert lines[0].startswith("model: vocab_size=6400 d_model=128 n_layer=4")
    assert any(line.startswith("lora: enabled=False rank=8 alpha=16.0 dropout=0.05 targets=q_proj,k_proj")
               for line in lines)
    assert not any(line.startswith(("dpo:", "distill:")) for line in lines)
    assert not any(line.startswith("lora:") for line in load_config("tiny").summary())


# ----------------------------------------------------------------------------- data sets: curricula and mixtures

def test_data_sets_from_toml_json_and_round_trip(tmp_path):
    from nanolm.config import DataSetConfig
    f = tmp_path / "c.toml"
    f.write_text('[data]\nmode = "mixture"\n[[data.sets]]\npath = "/d/wiki"\nweight = 3\n'
                 '[[data.sets]]\npath = "/e/wiki"\n[[data.sets]]\npath = "/d/sft"\nname = "chat"\n')
    cfg = load_config("tiny", f)
    assert cfg.data.mode == "mixture" and cfg.data.path == ""
    assert cfg.data.sets == (DataSetConfig("/d/wiki", weight=3.0, name="wiki"),
                             DataSetConfig("/e/wiki", name="wiki-2"), DataSetConfig("/d/sft", name="chat"))
    saved = json.loads(json.dumps(cfg.to_dict()))  # as config.json holds it
    assert saved["data"]["sets"][1] == {"path": "/e/wiki", "epochs": 0.0, "tokens": 0, "weight": 1.0,
                                        "name": "wiki-2"}
    assert Config.from_dict(saved) == cfg
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"data": {"sets": [{"path": "/d/a", "epochs": 1.5}, {"path": "/d/b", "tokens": 5000}]}}))
    cfg = load_config("tiny", j)
    assert [(s.name, s.epochs, s.tokens) for s in cfg.data.sets] == [("a", 1.5, 0), ("b", 0.0, 5000)]
    assert "data: path='' sets=/d/a:epochs=1.5,name=a /d/b:tokens=5000,name=b mode=curriculum" in cfg.summary()
    # one data set is data.path, as before
    assert load_config("tiny", overrides={"data.path": "/d/a"}).data.sets == ()


def test_data_values_from_the_command_line():
    from nanolm.config import data_overrides
    assert data_overrides(["/d/wiki"]) == {"data.path": "/d/wiki", "data.sets": []}
    over = data_overrides(["/d/wiki:epochs=2", "/d/x:y/sft:tokens=5M,name=chat", "/d/z:weight=0.5"])
    assert over == {"data.path": "", "data.sets": [{"path": "/d/wiki", "epochs": 2.0},
                                                   {"path": "/d/x:y/sft", "tokens": 5_000_000, "name": "chat"},
                                                   {"path": "/d/z", "weight": 0.5}]}
    assert data_overrides(["a:tokens=2B", "b:tokens=1.5k", "c"])["data.sets"][:2] == [
        {"path": "a", "tokens": 2_000_000_000}, {"path": "b", "tokens": 1500}]
    assert data_overrides(["/d/a:b"]) == {"data.path": "/d/a:b", "data.sets": []}  # no key=value: all path
    cfg = load_config("tiny", overrides={**data_overrides(["/d/a:epochs=1", "/d/b"])})
    assert [s.name for s in cfg.data.sets] == ["a", "b"] and cfg.data.sets[0].epochs == 1.0
    with pytest.raises(UserError, match=r"--data a:foo=1: unknown key 'foo'; use epochs, tokens, weight, name"):
        data_overrides(["a:foo=1"])
    with pytest.raises(UserError, match=r"--data a:tokens=5X: tokens must be a whole number of tokens such as"):
        data_overrides(["a:tokens=5X", "b"])
    with pytest.raises(UserError, match=r"--data a:weight=heavy: weight must be a number, got 'heavy'"):
        data_overrides(["a:weight=heavy"])


@pytest.mark.parametrize("data, message", [
    ({"path": "/d/a", "sets": [{"path": "/d/b"}]},
     "data.path and data.sets are both set; give one data set as data.path or several as data.sets"),
    ({"sets": [{"path": "/d/a", "epochs": 1, "tokens": 10}, {"path": "/d/b"}]},
     "data.sets[0] (a): give epochs or tokens, not both"),
    ({"mode": "mixture", "sets": [{"path": "/d/a", "weight": 0}, {"path": "/d/b"}]},
     "data.sets[0] (a): weight must be > 0, got 0"),
    ({"mode": "mixture", "sets": [{"path": "/d/a"}, {"path": "/d/b", "epochs": 2}]},
     "data.sets[1] (b): epochs and tokens are budgets of a curriculum; a mixture samples"),
    ({"sets": [{"path": "/d/a", "epochs": 1, "weight": 2}, {"path": "/d/b"}]},
     ("data.sets[0] (a): weight 2 applies only to a mixture; a curriculum uses its sets in turn (use data.mode "
      "mixture, or drop the weight)")),
    ({"sets": [{"path": "/d/a"}, {"path": "/d/b"}]},
     "data.sets[0] (a) needs epochs or tokens: in a curriculum every set but the last has a budget"),
    ({"sets": [{"path": "/d/a", "epochs": -1}]}, "data.sets[0] (a): epochs must be >= 0, got -1"),
    ({"sets": [{"path": ""}]}, "data.sets[0].path is empty"),
    ({"sets": [{"path": "/d/a", "epochs": 1, "name": "x"}, {"path": "/d/b", "name": "x"}]},
     "data.sets[0].name 'x' is used twice"),
    ({"sets": [{"path": "/d/a", "name": "a b"}]}, "data.sets[0].name 'a b' may hold only letters, digits"),
    ({"mode": "random", "sets": [{"path": "/d/a"}]}, "data.mode must be one of curriculum, mixture, got 'random'"),
    ({"sets": [{"path": "/d/a", "epochs": "two"}]}, "data.sets[0].epochs: expected a number, got 'two'"),
    ({"sets": [{"path": "/d/a", "steps": 2}]}, "unknown field data.sets[0].steps; known fields: data.sets[0].path"),
    ({"sets": {"path": "/d/a"}}, "data.sets must be a list of tables/objects ([[data.sets]] in TOML), got dict"),
])
def test_bad_data_sets_name_the_field(tmp_path, data, message):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"data": data}))
    with pytest.raises(UserError) as e:
        load_config("tiny", f)
    assert message in str(e.value) and str(e.value).startswith(f"{f}: ")
    assert "\n" not in str(e.value)


def test_overriding_a_presets_width_keeps_the_automatic_sizes_automatic():
    """tiny's n_hidden (384) and head_dim follow its d_model; `--model.d_model 64` makes them follow 64, as on
    the defaults, unless they are given."""
    cfg = load_config("tiny", overrides={"model.d_model": 64})
    assert (cfg.model.n_hidden, cfg.model.head_dim) == (192, 16)
    assert load_config("tiny").model.n_hidden == 384
    assert load_config("tiny", overrides={"model.d_model": 64, "model.n_hidden": 100}).model.n_hidden == 100
    moe = load_config("tiny", overrides={"model.use_moe": True, "model.d_model": 256})
    assert moe.model.n_hidden == moe.model.moe_n_hidden == 704
