"""The blocks this folder runs are the articles' own: each one, its substitutions undone, is in its article."""

from __future__ import annotations

import ast

import pytest

from tests.seeds.blocks import BLOCKS, RUNS, SCHEDULER_ARTICLE, VLLM_ARTICLE, Block, article_text, guide_table
from tests.support.paths import REPO

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_each_block_is_the_articles_text(block: Block) -> None:
    article = article_text(block.article)
    if article is None:
        pytest.skip(f"../shared/seeds/{block.article} is not beside this clone")
    assert block.in_article(article) == []


def test_a_changed_block_is_caught() -> None:
    article = article_text(VLLM_ARTICLE)
    if article is None:
        pytest.skip("the articles are not beside this clone")
    wrong = Block("x", VLLM_ARTICLE, "1.1", "python", "from minivllm import AsyncEngineArgz, AsyncLLMEngine")
    right = Block("x", VLLM_ARTICLE, "1.1", "python", "from minivllm import AsyncEngineArgs, AsyncLLMEngine")
    assert right.in_article(article) == [] and wrong.in_article(article) == [wrong.text]


def test_every_block_of_both_articles_is_here() -> None:
    """Counted by hand from the articles: 23 code blocks in the vLLM article, 5 in the scheduler one (its data
    structures, its batch-size heuristic, its settings table, its GPU topology template, its custom scheduler)."""
    by_article = {name: [b for b in BLOCKS if b.article == name] for name in (VLLM_ARTICLE, SCHEDULER_ARTICLE)}
    assert (len(by_article[VLLM_ARTICLE]), len(by_article[SCHEDULER_ARTICLE])) == (23, 5)
    assert len({b.name for b in BLOCKS}) == len(BLOCKS)


def test_every_block_runs_in_a_test_that_reads_it() -> None:
    """Each block is ours to run (not another product's tool) and names the test that runs it; that test exists
    and reads the block's own text from tests/seeds/blocks.py, so the article's line is what runs."""
    missing = [b.name for b in BLOCKS if not b.not_ours and b.name not in RUNS]
    assert missing == [], "a block with no test that runs it"
    for name, where in RUNS.items():
        path, _, test = where.partition("::")
        source = (REPO / path).read_text()
        tree = ast.parse(source)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert test in defined, f"{name}: {where} is not a test there"
        assert f'block("{name}")' in source, f"{name}: {path} does not read the block's text"


def test_the_guide_shows_what_runs_each_block() -> None:
    """docs/guide.md's "From the articles" table is `python -m tests.seeds.blocks`'s output."""
    assert guide_table() in (REPO / "docs" / "guide.md").read_text()
