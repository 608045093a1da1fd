"""The offline API (`from minivllm import LLM, SamplingParams`): HF's greedy tokens in-process and over worker
processes (the same assertions for both transports), TP 2, n > 1, stop strings, logprobs, errors, clean close."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from minivllm.cluster import REPO
from scheduler_node.engine.builder import kv_bytes_per_token_per_layer
from tests.support.models import assert_teacher_forced, load_hf
from tests.support.ops import alive, child_pids

pytestmark = pytest.mark.e2e

VOCAB = 49152


def mixed_prompts(seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 15, 16, 17, 33, 48, 70]  # inside, at and across block boundaries
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths], [40, 7, 19, 33, 1, 25, 12, 30]


@pytest.mark.parametrize("backend", ["inprocess", "processes"])
def test_greedy_matches_hf_on_either_transport(tiny_llama_dir: Path, backend: str) -> None:
    prompts, max_tokens = mixed_prompts(7)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",  # compared with HF at 1e-3: `auto` is bf16 on CPUs with AVX-512 BF16
        worker_backend=backend,
        num_kv_blocks=14,  # the batch needs ~20 blocks at its peak: preemption
        max_num_batched_tokens=24,  # chunked prefill
        threads=1,
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.engine.scheduler
        assert scheduler.num_preemptions > 0, "the test lost its point: no preemption happened"
        assert scheduler.blocks.num_free == 14
    hf = load_hf(tiny_llama_dir)
    for out, prompt, m in zip(outputs, prompts, max_tokens):
        assert out.prompt_token_ids == prompt
        (c,) = out.outputs
        assert len(c.token_ids) == m and c.finish_reason == "length"
        assert_teacher_forced(hf, prompt, c.token_ids)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_tp2_worker_processes_match_hf(kind: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts, max_tokens = mixed_prompts(3)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    with LLM(str(folder), tensor_parallel_size=2, kv_cache_memory="16MiB", threads=1, dtype="float32") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(folder)
    for out, prompt in zip(outputs, prompts):
        assert_teacher_forced(hf, prompt, out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    with LLM(str(smollm2_dir), kv_cache_memory="256MiB", threads=2, dtype="float32") as llm:
        yield llm


def test_smollm2_text_prompts_n_logprobs_and_stop(smollm2: LLM, smollm2_dir: Path) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=12, n=2, logprobs=3)
    outputs = smollm2.generate(prompts, greedy, use_tqdm=False)
    hf = load_hf(smollm2_dir)
    for out in outputs:
        assert len(out.outputs) == 2
        first, second = out.outputs
        assert first.token_ids == second.token_ids, "greedy siblings agree"
        assert first.text == smollm2.tokenizer.decode(first.token_ids)
        assert_teacher_forced(hf, out.prompt_token_ids, first.token_ids)
        assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
        with torch.inference_mode():
            ids = torch.tensor([out.prompt_token_ids + first.token_ids])
            logp = hf(ids).logits[0, len(out.prompt_token_ids) - 1 : -1].float().log_softmax(-1)
        for i, (token, lp) in enumerate(zip(first.token_ids, first.logprobs)):
            assert abs(lp.logprob - float(logp[i, token])) < 1e-3
            assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the best is the one taken
    # Without logprobs or stop strings a sequence's tokens are detokenized once, when it ends: the same text.
    (plain,) = smollm2.generate(prompts[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert plain.outputs[0].text == smollm2.tokenizer.decode(plain.outputs[0].token_ids)
    text = outputs[0].outputs[0].text
    stop = text.split()[1]  # a word the greedy text contains: generation ends right before it
    (stopped,) = smollm2.generate(prompts[0], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and stop not in c.text and text.startswith(c.text)


def test_embed_is_smollm2s_pooled_hidden_states(smollm2: LLM, smollm2_dir: Path) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    hf = load_hf(smollm2_dir)
    for pooling in ("last", "mean"):
        batched = smollm2.embed(prompts, pooling=pooling)
        (alone,) = smollm2.embed(prompts[1], pooling=pooling)
        for out in [*batched, alone]:
            with torch.inference_mode():
                hidden = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
            want = torch.nn.functional.normalize(hidden.mean(0) if pooling == "mean" else hidden[-1], dim=0)
            cosine = torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), want, dim=0)
            assert float(cosine) >= 0.9999, (pooling, float(cosine))
    with pytest.raises(ValueError, match="pooling"):
        smollm2.embed("hi", pooling="max")


def test_chat_uses_the_template(smollm2: LLM) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    (out,) = smollm2.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.prompt_token_ids == smollm2.tokenizer.apply_chat_template(messages)
    assert out.outputs[0].token_ids


def test_vllm_dict_prompts_give_what_their_plain_forms_give(smollm2: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    ids = smollm2.tokenizer.encode("The capital of France is")
    plain_prompts: list[str | list[int]] = ["The capital of France is", ids]
    plain = smollm2.generate(plain_prompts, params, use_tqdm=False)
    prompts: list[TextPrompt | TokensPrompt] = [{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}]
    as_dicts = smollm2.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in as_dicts] == [o.outputs[0].token_ids for o in plain]
    assert as_dicts[0].prompt == "The capital of France is" and as_dicts[1].prompt_token_ids == ids
    (single,) = smollm2.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert single.outputs[0].token_ids == plain[1].outputs[0].token_ids


def test_seeded_sampling_is_reproducible(smollm2: LLM) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, n=2)
    a = smollm2.generate(["Once upon a time"], params, use_tqdm=False)[0]
    b = smollm2.generate(["Once upon a time", "Hello"], params, use_tqdm=False)[0]  # another batch around it
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids, "siblings draw with their own seeds"


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        ([""], SamplingParams(), "prompts[0]"),
        ([[10**9]], SamplingParams(), "prompts[0]"),
        (["hi"], SamplingParams(top_p=1.5), "top_p"),
        (["hi"], SamplingParams(temperature=-1), "temperature"),
        (["hi"], SamplingParams(n=0), "n"),
        (["hi"], SamplingParams(max_tokens=10**6), "max_tokens"),
        (["hi", "there"], [SamplingParams()], "sampling_params"),
        ([{"prompt_token_ids": [10**9]}], SamplingParams(), "prompts[0].prompt_token_ids"),
        ([{"prompt": 7}], SamplingParams(), "prompts[0].prompt"),
        ([{"text": "hi"}], SamplingParams(), "prompts[0]"),
        (["ok", 42], SamplingParams(), "prompts[1]"),
        (["ok", ["a", 1]], SamplingParams(), "prompts[1]"),
    ],
)
def test_bad_input_names_the_field(smollm2: LLM, prompts: list, params: object, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError) as error:
        smollm2.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    assert str(error.value).startswith(f"{field}:"), error.value


def test_close_leaves_no_process_behind(tiny_llama_dir: Path) -> None:
    before = set(child_pids(os.getpid()))  # a shared world of other tests may run beside this one
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, kv_cache_memory="16MiB", threads=1)
    workers = [pid for pid in child_pids(os.getpid()) if pid not in before]
    assert len(workers) >= 2
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    llm.close()
    llm.close()  # idempotent
    assert not [pid for pid in workers if alive(pid)], "a worker process outlived close()"
    with pytest.raises(RuntimeError):
        llm.generate(["after close"], use_tqdm=False)


def test_the_readme_example_runs_as_written(smollm2_dir: Path) -> None:
    """The README's "Offline inference" block, run as a user would paste it (default model, default flags)."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Offline inference") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("'The capital of France is' -> '") and lines[0].endswith(("length", "stop"))
    assert lines[1].startswith("'def fibonacci(n):' -> '")
    assert len(lines) >= 3 and lines[2].strip(), "the chat answer"


def test_a_block_in_bytes_is_made_tokens_for_the_model(tiny_llama_dir: Path) -> None:
    """Article 000's `block_size: 16KB`, as `LLM(kv_block_bytes=...)`: the largest block of tokens that fits."""
    per_token = kv_bytes_per_token_per_layer(tiny_llama_dir, "float32")
    with LLM(model=str(tiny_llama_dir), dtype="float32", kv_block_bytes=f"{32 * per_token + 1}B") as llm:
        assert llm.config.scheduler.block_size == 32
        (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
