"""A stage and a data kind are registry entries: a new one is a class registered from outside nanolm/, and the
loop trains with it; the trainer and prepare name none of the built-in ones. A stage's own settings are a
dataclass it declares: the configuration builds, checks, saves, prints and offers them on the command line under
the stage's name, with no edit to any module of nanolm/."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanolm
from nanolm.train.configure import load_config
from nanolm.config import registry
from nanolm.errors import UserError
from nanolm.train import stages
from nanolm.train.objectives import Loss, Objective
from nanolm.train.trainer import Trainer

ROOT = Path(nanolm.__file__).parent


class LastTokenObjective(Objective):
    """A toy objective: the cross-entropy of each row's last `targets` targets only, summed; its unit is a row."""

    def __init__(self, model: torch.nn.Module, targets: int = 1) -> None:
        self.model = model
        self.targets = targets

    @staticmethod
    def units(batch) -> int:
        return int(batch.x.shape[0])

    def __call__(self, model, batch) -> Loss:
        k = self.targets
        logits = model(batch.x)[:, -k:]
        ce = F.cross_entropy(logits.float().flatten(0, 1), batch.y[:, -k:].flatten(), reduction="sum") / k
        return Loss(ce, {"loss": ce.detach()})

    def evaluate(self, model, batches, autocast, token_bytes) -> dict[str, float]:
        total, rows = 0.0, 0
        with torch.no_grad(), autocast():
            for b in batches:
                total += float(self(model, b).total)
                rows += b.x.shape[0]
        return {"val_loss": total / rows} if rows else {}


@dataclass
class LastTokenConfig:
    """The toy stage's own settings (`--toy-last-token.targets 2`)."""

    targets: int = 1  # each row's last targets trained on

    def __post_init__(self) -> None:
        if self.targets < 1:
            raise UserError(f"toy-last-token.targets must be >= 1, got {self.targets}")


class LastToken(stages.Stage):
    name = "toy-last-token"
    kinds = ("text",)
    section = LastTokenConfig

    def defaults(self, base):
        return {"optim": {"lr": 1e-3, "min_lr": 1e-4}}

    def objective(self, trainer):
        return LastTokenObjective(trainer.model, getattr(trainer.cfg, self.name).targets)


@pytest.fixture
def toy_stage(monkeypatch):
    monkeypatch.setattr(registry, "_STAGES", dict(registry._STAGES))  # registered for this test only
    stages.register(LastToken)
    return LastToken


def toy_cfg(data_dir: Path, out: Path, **over):
    base = {"data.path": str(data_dir), "train.out_dir": str(out), "train.stage": LastToken.name,
            "model.vocab_size": 400, "model.d_model": 32, "model.n_layer": 2, "model.n_head": 4,
            "model.n_kv_head": 2, "model.max_seq_len": 32, "train.seq_len": 32, "train.batch_size": 4,
            "train.max_steps": 3, "train.eval_interval": 0, "train.eval_batches": 2, "train.dtype": "float32",
            "optim.warmup_steps": 0, "model.dropout": 0.0}
    base.update(over)
    return load_config("tiny", overrides=base)


def test_a_registered_stage_trains_one_step_with_its_own_objective_and_defaults(toy_stage, data_dir, tmp_path):
    cfg = toy_cfg(data_dir, tmp_path / "run")
    assert (cfg.optim.lr, cfg.optim.min_lr) == (1e-3, 1e-4)  # the stage's defaults, before the overrides
    t = Trainer(cfg, quiet=True)
    assert isinstance(t.objective, LastTokenObjective)
    batch = t.data.next_batch()
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with torch.no_grad():  # the step's loss, by hand: each row's last target, averaged over the rows
        expected = F.cross_entropy(t.model(batch.x)[:, -1], batch.y[:, -1]).item()
    res = t.train_step([batch])
    assert res.units == batch.x.shape[0]
    assert res.logged(t.info)["loss"] == pytest.approx(expected, rel=1e-6)
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    # the whole loop, with its validation and checkpoint, under the new stage's name
    result = t.run()
    assert result.step == 3 and result.best_metric == "val_loss" and result.best_value is not None
    assert (tmp_path / "run" / "checkpoints" / "best.json").is_file()


def test_a_registered_stage_brings_its_own_settings_section(toy_stage, data_dir, tmp_path, capsys):
    """Declared by the stage only: built from the overrides, checked, saved in config.json, printed for its own
    runs, offered as a command-line option, and read by its objective."""
    from nanolm.cli import main
    cfg = toy_cfg(data_dir, tmp_path / "run", **{"toy-last-token.targets": "2"})
    assert getattr(cfg, LastToken.name) == LastTokenConfig(targets=2)
    assert cfg.to_dict()[LastToken.name] == {"targets": 2}
    assert "toy-last-token: targets=2" in cfg.summary()
    assert not any(line.startswith("toy-last-token") for line in toy_cfg(
        data_dir, tmp_path / "run", **{"train.stage": "pretrain"}).summary())  # another stage's run: not printed
    with pytest.raises(UserError, match=r"command line: toy-last-token\.targets must be >= 1, got 0"):
        toy_cfg(data_dir, tmp_path / "run", **{"toy-last-token.targets": "0"})
    with pytest.raises(UserError, match=r"unknown field toy-last-token\.nope; known fields: toy-last-token\.targets"):
        from nanolm.config import Config
        Config.from_dict({**cfg.to_dict(), LastToken.name: {"nope": 1}}, "x")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--toy-last-token.targets" in capsys.readouterr().out
    t = Trainer(cfg, quiet=True)  # its objective reads it: the cross-entropy of each row's last 2 targets
    batch = t.data.next_batch()
    with torch.no_grad():
        logits = t.model(batch.x)[:, -2:]
        expected = F.cross_entropy(logits.flatten(0, 1), batch.y[:, -2:].flatten()).item()
    assert t.train_step([batch]).logged(t.info)["loss"] == pytest.approx(expected, rel=1e-6)


def test_an_unknown_stage_names_the_registered_ones(data_dir, tmp_path):
    assert {"pretrain", "sft", "lora", "dpo", "distill", "grpo", "blocks"} <= set(stages.names())
    with pytest.raises(UserError, match=rf"train\.stage must be one of {', '.join(stages.names())}, got "
                                        r"'toy-last-token'"):
        toy_cfg(data_dir, tmp_path / "run")


def test_a_stage_refuses_data_of_another_kind_with_the_fix(toy_stage, data_dir, tmp_path):
    class OnlyBlocks(LastToken):
        name = "toy-blocks"
        kinds = ("blocks",)
        prepare_hint = "prepare blocks for it"
    stages.register(OnlyBlocks)
    with pytest.raises(UserError, match=r"train\.stage=toy-blocks cannot train on text data; prepare blocks for it"):
        Trainer(toy_cfg(data_dir, tmp_path / "run", **{"train.stage": "toy-blocks"}), quiet=True)


def test_the_trainer_names_no_stage_and_no_data_kind():
    names = set(stages.names()) | {"text", "chat", "pairs", "dpo", "prompts", "blocks"}
    for path in (ROOT / "train" / "trainer.py",):
        literals = set(re.findall(r"""["']([a-z]+)["']""", path.read_text(encoding="utf-8")))
        assert not literals & names, f"{path.name} names {sorted(literals & names)}"


def test_a_toy_data_kind_and_a_toy_stage_registered_from_outside_train_together(monkeypatch, tokenizer_dir,
                                                                                  tmp_path):
    """Both registries at once: a data kind (tests/test_kinds.py's upper-cased documents) prepared by `prepare`
    and a stage that trains only on that kind, registered here; one step and its checkpoint."""
    from test_kinds import UpperKind, write_docs

    from nanolm.data import kinds
    from nanolm.data.kinds import base as kinds_base
    from nanolm.data.prepare import prepare
    monkeypatch.setattr(kinds_base, "_KINDS", dict(kinds_base._KINDS))
    kinds.register(UpperKind)
    monkeypatch.setattr(registry, "_STAGES", dict(registry._STAGES))

    class UpperLastToken(LastToken):
        name = "toy-upper"
        kinds = ("upper",)
        prepare_hint = "prepare it with --format upper"
    stages.register(UpperLastToken)
    data = tmp_path / "data"
    prepare([write_docs(tmp_path / "docs.jsonl")], tokenizer_dir, data, format="upper", val_fraction=0.2,
            workers=0, quiet=True)
    cfg = toy_cfg(data, tmp_path / "run", **{"train.stage": "toy-upper", "train.max_steps": 1,
                                             "model.max_seq_len": 16, "train.seq_len": 16, "train.batch_size": 2})
    t = Trainer(cfg, quiet=True)
    assert t.data.kind == "upper" and isinstance(t.objective, LastTokenObjective)
    batch = t.data.next_batch()
    with torch.no_grad():
        expected = F.cross_entropy(t.model(batch.x)[:, -1], batch.y[:, -1]).item()
    res = t.train_step([batch])
    assert res.logged(t.info)["loss"] == pytest.approx(expected, rel=1e-6) and res.units == 2
    assert t.run().step == 1
    # the toy stage refuses another kind, naming its fix; a built-in stage refuses the toy kind
    with pytest.raises(UserError, match=r"x: train\.stage=toy-upper cannot train on text data; prepare it with "
                                        r"--format upper"):
        stages.check_data(UpperLastToken(), "text", "x")
    with pytest.raises(UserError, match=r"x: train\.stage=sft cannot train on upper data"):
        stages.check_data(stages.get("sft"), "upper", "x")
