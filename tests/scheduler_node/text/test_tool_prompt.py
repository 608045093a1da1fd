"""A chat template without tools (SmolLM2's) gets the tools, earlier calls and tool results in the Hermes form the
default parser reads back; a template that reads `tools` gets them as HF passes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scheduler_node.text.tokenizer import ModelTokenizer
from scheduler_node.text.tool_prompt import DEFAULT_SYSTEM, hermes_messages
from tests.support.stand_in import tokenizer

pytestmark = pytest.mark.unit

WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION: Any = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_a_template_without_tools_gets_them_in_the_hermes_form() -> None:
    tok = tokenizer()
    assert not tok.supports_tools  # SmolLM2's template knows no tools
    text = tok.decode(tok.apply_chat_template(CONVERSATION, [WEATHER]))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "user\n<tool_response>\nsunny\n</tool_response>" in text


def test_the_tools_join_a_system_message_or_come_with_their_own() -> None:
    own = hermes_messages([{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]], [WEATHER])
    assert own[0]["content"].startswith("Be brief.\n\n# Tools") and len(own) == 2
    added = hermes_messages(CONVERSATION[:1], [WEATHER])
    assert added[0]["role"] == "system" and added[0]["content"].startswith(DEFAULT_SYSTEM) and len(added) == 2
    assert hermes_messages(CONVERSATION[:1], None) == CONVERSATION[:1]  # no tools: nothing added


def test_a_template_that_reads_tools_renders_them_itself(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    source = Path(tokenizer().path)
    (folder / "tokenizer.json").write_bytes(source.read_bytes())
    template = (
        "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
        "\n{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = ModelTokenizer(folder)
    assert tok.supports_tools
    text = tok.decode(tok.apply_chat_template(CONVERSATION, [WEATHER]))
    assert text.startswith("TOOLS=" + json.dumps([WEATHER]))  # HF's tojson: no HTML escaping
    assert 'CALL get_weather {"city": "Paris"}' in text and "tool: sunny" in text
