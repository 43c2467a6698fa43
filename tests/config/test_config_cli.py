"""The ``rlhf-megatron`` dispatcher and its subcommand registry."""

from __future__ import annotations

import sys
import types

import pytest

from rlhf_megatron import cli


def test_usage_lists_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "plan" in out


def test_no_subcommand_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: rlhf-megatron" in capsys.readouterr().out


def test_unknown_subcommand_suggests_the_nearest(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown subcommand 'trian'; did you mean 'train'?" in capsys.readouterr().err


def test_registered_subcommand_is_imported_lazily_and_gets_its_args(monkeypatch):
    calls = []
    module = types.ModuleType("fake_export_module")
    module.main = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "fake_export_module", module)
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))
    cli.register_subcommand("export", "fake_export_module:main", "export checkpoints")
    assert cli.main(["export", "--to", "hf"]) == 7
    assert calls == [["--to", "hf"]]


def test_registering_a_taken_name_elsewhere_is_an_error(monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))
    with pytest.raises(ValueError, match="already registered to rlhf_megatron.train:main"):
        cli.register_subcommand("train", "somewhere:else", "x")


def test_every_builtin_subcommand_target_resolves():
    for name, command in cli.SUBCOMMANDS.items():
        assert callable(command.load()), name
