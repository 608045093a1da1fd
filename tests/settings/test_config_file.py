"""`--config FILE.yaml` (settings/config_file.py) on a small parser: keys are the long flags (dashes or underscores),
flags win, a repeatable flag adds to the file's list, a required flag may come from the file, null keeps the
default, values are converted and checked like flags, and a bad file is an error naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from settings.config_file import add_config_flag, config_keys, parse_args

pytestmark = pytest.mark.unit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool")
    add_config_flag(p)
    p.add_argument("--model", required=True)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    return p


def config(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def test_the_file_fills_in_and_flags_win(tmp_path: Path) -> None:
    args = parse_args(parser(), config(tmp_path, "model: m\nmax-num-seqs: 8\nstop: [a, b]\npolicy: null\n"))
    assert (args.model, args.max_num_seqs, args.stop, args.policy) == ("m", 8, ["a", "b"], "fcfs")
    argv = config(tmp_path, "model: m\nmax_num_seqs: '8'\nstop: a\n") + ["--max-num-seqs", "4", "--stop", "c"]
    args = parse_args(parser(), argv)
    assert (args.max_num_seqs, args.stop) == (4, ["a", "c"]), "the flag wins; a repeatable flag adds"
    assert set(config_keys(parser())) == {"model", "max_num_seqs", "stop", "policy"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: m\nmax-num-sqes: 8\n", "unknown key 'max-num-sqes'"),
        ("model: m\nmax-num-seqs: many\n", "max-num-seqs in"),
        ("model: m\npolicy: lifo\n", "'lifo' is not one of ['fcfs', 'priority']"),
        ("- a list\n", "must be a mapping of flag names to values"),
        ("model: [unclosed\n", "cannot read config"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    with pytest.raises(SystemExit):
        parse_args(parser(), config(tmp_path, text))
    assert message in capsys.readouterr().err


def test_a_required_flag_is_still_required_without_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(parser(), [])
    assert "--model" in capsys.readouterr().err
