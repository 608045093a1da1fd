"""The attention setting (proto/attention_setting.py): each form parses to the choice it names and a choice writes
back the shortest form that carries it; the model config's `attention` section is refused by key when wrong; and a
command's `--config` file takes the section (the design article's JSON block, as YAML) as --attention-backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proto.attention_setting import AttentionChoice, from_mapping, parse_setting
from settings.config_file import parse_args

pytestmark = pytest.mark.unit

KERNEL = AttentionChoice("my_attention", "/k/lib.so", {"trace": "/t"})


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ("auto", AttentionChoice("auto")),
        (
            "deploy.custom_attention:PaddedDecodeAttention",
            AttentionChoice("deploy.custom_attention:PaddedDecodeAttention"),
        ),
        ("my_attention", AttentionChoice("my_attention")),
        ("my_attention=/k/lib.so", AttentionChoice("my_attention", "/k/lib.so")),
        ('{"library":"/k/lib.so","params":{"trace":"/t"},"type":"my_attention"}', KERNEL),
        ('{"type": "torch"}', AttentionChoice("torch")),
    ],
)
def test_each_form_parses_and_writes_back(text: str, choice: AttentionChoice) -> None:
    assert parse_setting(text) == choice
    assert parse_setting(choice.setting()) == choice


def test_only_other_names_are_compiled_kernels() -> None:
    assert [parse_setting(t).compiled for t in ("native", "a.b:C", "mine", "mine=/x.so")] == [False, False, True, True]
    assert KERNEL.setting().startswith("{"), "params travel only in the JSON form"
    assert AttentionChoice("mine", "/x.so").setting() == "mine=/x.so"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("my_attention", "attention: expected a mapping with a 'type' key"),
        ({"params": {}}, "attention.type: missing"),
        ({"type": "my_attention", "param": {}}, "attention.param: unknown key; attention takes type, library, params"),
        ({"type": "my_attention", "params": [1]}, "attention.params: expected a mapping"),
        ({"type": "my_attention", "library": 3}, "attention.library: expected the path of a shared library"),
        (
            {"type": "torch", "params": {"a": 1}},
            "attention.params: 'torch' is not a compiled kernel, so it takes no params",
        ),
        ({"type": "my attention"}, "attention.type: a kernel name is a word"),
        ({"type": "mine", "params": {"a": {1, 2}}}, "attention.params: not expressible as JSON"),
    ],
)
def test_a_bad_section_is_refused_naming_the_key(section: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        from_mapping(section)


def test_malformed_strings_are_refused() -> None:
    for text, message in [("=x.so", "a kernel name is a word"), ("a:1b", "expected package.module:Class")]:
        with pytest.raises(ValueError, match=message):
            parse_setting(text)


def worker_config(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def test_a_config_files_attention_section_is_the_workers_setting(tmp_path: Path) -> None:
    from worker_node.worker import build_parser

    section = "attention:\n  type: my_attention\n  library: /k/lib.so\n  params: {trace: /t}\n"
    args = parse_args(build_parser(), worker_config(tmp_path, section))
    assert parse_setting(args.attention_backend) == KERNEL
    args = parse_args(build_parser(), worker_config(tmp_path, "attention: {type: torch}\n"))
    assert args.attention_backend == "torch"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "attention: {type: my_attention}\n",
            "attention.library: give the path of the shared library of kernel 'my_attention'",
        ),
        ("attention: {type: torch}\nattention-backend: native\n", "attention and attention_backend both choose"),
        ("attention: {kind: torch}\n", "attention.kind: unknown key"),
    ],
)
def test_a_bad_config_section_is_refused_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    from worker_node.worker import build_parser

    with pytest.raises(SystemExit):
        parse_args(build_parser(), worker_config(tmp_path, text))
    assert message in capsys.readouterr().err
