"""The vLLM article's QoS line (section 6.3), `curl -X POST -H "X-Priority: 90" -d '...'`, run with curl against a
real server: the article elides the URL and the body (`'...'`), which this test fills in; the header is read (a
priority the server cannot read is refused naming `priority`), and the request is served."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import pytest

from tests.seeds.blocks import block
from tests.support.clusters import SHARED, MeteredCluster

pytestmark = pytest.mark.e2e


def curl(argv: list[str], url: str, body: dict) -> tuple[int, dict]:
    filled = [json.dumps(body) if arg == "..." else arg for arg in argv]  # the article's elided body
    auth = ["-H", f"Authorization: Bearer {SHARED.api_key}", "-H", "Content-Type: application/json"]
    done = subprocess.run(
        [*filled, *auth, "-s", "-w", "\n%{http_code}", url], capture_output=True, text=True, timeout=60
    )
    text, _, status = done.stdout.rpartition("\n")
    return int(status), json.loads(text)


def test_the_articles_curl_line(shared_cluster: MeteredCluster) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    argv = shlex.split(block("priority_header").text)
    assert argv[:5] == ["curl", "-X", "POST", "-H", "X-Priority: 90"]
    url = f"{shared_cluster.base_url}/completions"
    body = {"model": SHARED.served_model_name, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    status, answer = curl(argv, url, body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    unreadable = [arg.replace("X-Priority: 90", "X-Priority: urgent-ish") for arg in argv]
    status, answer = curl(unreadable, url, body)
    assert status == 400 and "priority" in json.dumps(answer), answer
