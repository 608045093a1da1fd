"""Every code block of the two design articles (../shared/seeds/), as we run it.

Each `Block` holds the text we run and the few substitutions the issue allows from the article's own text: `vllm`
to `minivllm` in Python imports, a model's name to the default model, a host's address to loopback. Undoing them
gives the article's text back: tests/seeds/test_blocks.py checks that against the article files when they are
beside the repository (they are not in a clean clone, where the check skips), so a block here cannot drift from
what the article says. The test modules of this folder run each block and check that it does what the article
says; a block that is not ours to run (a third-party tool's command) says why in `not_ours`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import REPO

SEEDS = REPO.parent / "shared" / "seeds"
VLLM_ARTICLE = "003_f8886d081ae9c3df.txt"  # vLLM 0.16.0: async scheduling, hybrid parallelism
SCHEDULER_ARTICLE = "000_737679cd81a3aaf1.txt"  # the scheduler's design and tuning

IMPORTS = (("from vllm", "from minivllm"), ("import vllm", "import minivllm"))
DEFAULT_MODEL = "default"  # what every command and LLM(...) read as SmolLM2-135M-Instruct


@dataclass(frozen=True)
class Block:
    name: str
    article: str
    section: str
    language: str
    text: str  # what we run
    substitutions: tuple[tuple[str, str], ...] = ()  # (the article's, ours) beyond the imports
    not_ours: str = ""  # why this block is not ours to run (another product's tool), if it is not
    table: bool = False  # the article gives these lines as a table's rows (key, value, its own note between them)

    def in_article(self, article: str) -> list[str]:
        """The parts of this block the article does not hold, once our substitutions are undone; compared without
        whitespace (article 000 is one line: its blocks lost their line breaks and indentation)."""
        page = squeezed(article)
        parts = [line.replace(":", "", 1) for line in self.text.splitlines()] if self.table else [self.text]
        return [part for part in parts if self._undone(squeezed(part)) not in page]

    def _undone(self, text: str) -> str:
        for article, ours in (*IMPORTS, *self.substitutions):
            text = text.replace(squeezed(ours), squeezed(article))
        return text


def squeezed(text: str) -> str:
    """Text without whitespace: article 000 is one line, its blocks' line breaks and indentation lost."""
    return re.sub(r"\s+", "", text)


def article_text(name: str) -> str | None:
    path = SEEDS / name
    return path.read_text() if path.is_file() else None


def block(name: str) -> Block:
    return next(b for b in BLOCKS if b.name == name)


def _lines(*lines: str) -> str:
    return "\n".join(lines)


BLOCKS: tuple[Block, ...] = (
    Block(
        "async_engine",
        VLLM_ARTICLE,
        "1.1",
        "python",
        _lines(
            "from minivllm import AsyncEngineArgs, AsyncLLMEngine",
            "",
            "engine_args = AsyncEngineArgs(",
            f'    model="{DEFAULT_MODEL}",',
            "    scheduler_delay=0.05,  # 调度器轮询间隔(秒)",
            "    max_batch_size=32,     # 动态批处理上限",
            "    enable_preemption=True # 支持高优先级请求抢占",
            ")",
            "engine = AsyncLLMEngine.from_engine_args(engine_args)",
        ),
        (('model="Qwen-7B"', f'model="{DEFAULT_MODEL}"'),),
    ),
    Block(
        "hybrid_parallel_serving",
        VLLM_ARTICLE,
        "1.2",
        "bash",
        _lines(
            f"vllm-serving --model {DEFAULT_MODEL} \\",
            "    --tensor-parallel-size 2 \\",
            "    --pipeline-parallel-size 4 \\",
            "    --block-size 16",
        ),
        (("--model qwen-72b", f"--model {DEFAULT_MODEL}"),),
    ),
    Block(
        "memory_monitor",
        VLLM_ARTICLE,
        "1.3",
        "python",
        _lines(
            "from minivllm import MemoryMonitor", "", "monitor = MemoryMonitor(engine)", "print(monitor.get_stats())"
        ),
    ),
    Block(
        "config_yaml",
        VLLM_ARTICLE,
        "3.1",
        "yaml",
        _lines(
            "# config.yaml",
            f'model: "{DEFAULT_MODEL}"',
            "tensor_parallel_size: 2",
            "pipeline_parallel_size: 1",
            "block_size: 16",
            "enable_prefix_caching: true",
            "max_num_seqs: 128",
        ),
        (('model: "qwen-7b"', f'model: "{DEFAULT_MODEL}"'),),
    ),
    Block("serve_config", VLLM_ARTICLE, "3.1", "bash", "vllm-serving --config config.yaml --port 8000"),
    Block(
        "multi_node",
        VLLM_ARTICLE,
        "3.2",
        "bash",
        _lines(
            "# 节点0（调度器）",
            "vllm-scheduler --host 127.0.0.1 --port 50051",
            "",
            "# 节点1-3（工作节点）",
            f"vllm-worker --model {DEFAULT_MODEL} \\",
            "    --scheduler-address 127.0.0.1:50051 \\",
            "    --tensor-parallel-size 2 \\",
            "    --pipeline-parallel-size 2",
        ),
        (("192.168.1.10", "127.0.0.1"), ("--model qwen-72b", f"--model {DEFAULT_MODEL}")),
    ),
    Block(
        "helm_values",
        VLLM_ARTICLE,
        "3.3",
        "yaml",
        _lines(
            "engine:",
            "  replicaCount: 3",
            "  resources:",
            "    limits:",
            "      nvidia.com/gpu: 2",
            "  args:",
            f'    - "--model={DEFAULT_MODEL}"',
            '    - "--tensor-parallel-size=2"',
            '    - "--max-lora-rank=64"',
            "",
            "ingress:",
            "  enabled: true",
            "  annotations:",
            '    nginx.ingress.kubernetes.io/backend-protocol: "GRPC"',
        ),
        (('"--model=qwen-7b"', f'"--model={DEFAULT_MODEL}"'),),
    ),
    Block("monitor_memory", VLLM_ARTICLE, "4.2", "bash", "vllm-monitor --metric memory_usage --interval 1"),
    Block(
        "nccl_test",
        VLLM_ARTICLE,
        "4.2",
        "bash",
        "nccl-test --bus-bandwidth  # 应≥50GB/s（NVLink）或≥10GB/s（RDMA）",
        not_ours="NVIDIA's nccl-tests, a network check of the GPUs' links, not a minivllm command",
    ),
    Block(
        "paged_attention_supports",
        VLLM_ARTICLE,
        "4.3",
        "python",
        _lines(
            "from minivllm.model_executor.layers.attention import PagedAttention",
            "print(PagedAttention.supports(model_config))",
        ),
    ),
    Block(
        "convert_gguf",
        VLLM_ARTICLE,
        "4.3",
        "bash",
        "vllm-convert --input qwen.gguf --output qwen-vllm --quantization awq",
    ),
    Block(
        "extra_modules",
        VLLM_ARTICLE,
        "4.3",
        "yaml",
        _lines("model_loader:", "  extra_modules:", "    - vision_encoder", "    - cross_attention"),
    ),
    Block(
        "dify_config",
        VLLM_ARTICLE,
        "5.1",
        "yaml",
        _lines("inference:", '  vllm_endpoint: "http://127.0.0.1:8000"', "  timeout: 300"),
        (("http://vllm-server:8000", "http://127.0.0.1:8000"),),
        not_ours="Dify's own config.yml: it points Dify at our OpenAI door, which the serve_config block serves",
    ),
    Block(
        "dify_server",
        VLLM_ARTICLE,
        "5.1",
        "bash",
        "dify-server --enable-vllm-batching --max-batch-delay 50",
        not_ours="Dify's server and its flags; our side of it is --scheduler-delay (the async_engine block)",
    ),
    Block(
        "lm_cache",
        VLLM_ARTICLE,
        "5.2",
        "python",
        _lines(
            "from minivllm import LMCache",
            "",
            "cache = LMCache(",
            '    capacity="20GB",',
            '    policy="arc",  # 自适应替换缓存',
            '    offload_to="disk"  # 内存不足时自动转存',
            ")",
            "",
            "engine = AsyncLLMEngine(..., cache=cache)",
        ),
    ),
    Block("monitor_hit_rate", VLLM_ARTICLE, "5.2", "bash", "vllm-monitor --metric cache_hit_rate"),
    Block(
        "model_router",
        VLLM_ARTICLE,
        "5.3",
        "python",
        _lines(
            "from minivllm.controller import ModelRouter",
            "",
            "router = ModelRouter()",
            'router.add_model("qwen-7b", "path/to/qwen")',
            'router.add_model("llama3-70b", "path/to/llama3")',
            "",
            "# 智能路由示例",
            '@router.route(strategy="latency")',
            "async def handle_request(request):",
            "    if request.len < 100:",
            '        return "qwen-7b"',
            '    return "llama3-70b"',
        ),
    ),
    Block(
        "mixed_precision",
        VLLM_ARTICLE,
        "6.1",
        "yaml",
        _lines("engine:", "  mixed_precision:", "    matmul: fp8", "    kv_cache: fp16", "    embedding: bf16"),
    ),
    Block(
        "custom_kernel_source",
        VLLM_ARTICLE,
        "6.2",
        "cpp",
        _lines("__global__ void my_attention_kernel(...) {", "    // 自定义实现", "}"),
        not_ours="the user's own CUDA kernel, a stub in the article (its parameters and body are `...`): the complete"
        " one is deploy/custom_attention_kernel.c against our C ABI (kernels/csrc/custom_attention_abi.h), which the"
        " register_kernel block's test compiles, registers and serves with",
    ),
    Block(
        "register_kernel",
        VLLM_ARTICLE,
        "6.2",
        "python",
        _lines(
            "from minivllm import _custom_ops",
            "_custom_ops.register_kernel(",
            '    "my_attention", ',
            '    "path/to/custom_attention.so"',
            ")",
        ),
    ),
    Block(
        "attention_config",
        VLLM_ARTICLE,
        "6.2",
        "json",
        _lines("{", '    "attention": {', '        "type": "my_attention",', '        "params": {...}', "    }", "}"),
    ),
    Block(
        "priority_scheduler",
        VLLM_ARTICLE,
        "6.3",
        "python",
        _lines(
            "from minivllm import PriorityScheduler",
            "",
            "scheduler = PriorityScheduler(",
            "    default_priority=50,",
            "    priority_ranges={",
            '        "realtime": (80, 100),',
            '        "batch": (20, 40)',
            "    }",
            ")",
        ),
    ),
    Block("priority_header", VLLM_ARTICLE, "6.3", "bash", "curl -X POST -H \"X-Priority: 90\" -d '...'"),
    Block(
        "data_structures",
        SCHEDULER_ARTICLE,
        "2.2",
        "python",
        _lines(
            "class SchedulingRequest:",
            "    prompt: str",
            "    max_tokens: int",
            "    sampling_params: dict",
            "    arrival_time: float",
            "",
            "class BlockAllocationTable:",
            "    block_size: int",
            "    allocated_blocks: Dict[int, List[int]]",
            "    free_blocks: List[int]",
        ),
    ),
    Block(
        "compute_batch_size",
        SCHEDULER_ARTICLE,
        "4.1",
        "python",
        _lines(
            "def compute_batch_size(available_mem, model_size):",
            "    safety_margin = 0.1",
            "    max_batch = (available_mem * (1 - safety_margin)) // model_size",
            "    return min(max_batch, 64)  # 硬件限制",
        ),
        # The article's page lost its operators ("safety_margin 0.1", "max_batch (available_mem"): the only
        # reading that is Python puts `=` back.
        (("safety_margin0.1", "safety_margin=0.1"), ("max_batch(available_mem", "max_batch=(available_mem")),
    ),
    Block(
        "recommended_settings",
        SCHEDULER_ARTICLE,
        "5.1",
        "yaml",
        _lines("max_num_seqs: 128", "block_size: 16KB", "scheduler_interval: 50ms", "preemption_mode: elastic"),
        table=True,  # 参数 推荐值 说明: each row's key and value, as a config file's line
    ),
    Block(
        "gpu_topology",
        SCHEDULER_ARTICLE,
        "6.2",
        "yaml",
        _lines(
            "gpu_topology:",
            "  - device_ids: [0,1,2,3]",
            "    interconnect: nvlink",
            "  - device_ids: [4,5,6,7]",
            "    interconnect: pcie",
            "scheduling_policy:",
            "  cross_device: round_robin",
            "  memory_sharing: enabled",
        ),
    ),
    Block(
        "custom_scheduler",
        SCHEDULER_ARTICLE,
        "6.3",
        "python",
        _lines(
            "class CustomScheduler(Scheduler):",
            "    def schedule(self):",
            "        # 实现自定义逻辑",
            "        if self.load > 0.8:",
            "            return self.priority_schedule()",
            "        else:",
            "            return self.fifo_schedule()",
        ),
        # The page lost the comparison: "if self.load 0.8".
        (("self.load0.8", "self.load>0.8"),),
    ),
)


def file_of(b: Block, folder: Path) -> Path:
    """The block written to `folder` under a name its language's tools accept."""
    suffix = {"python": ".py", "bash": ".sh", "yaml": ".yaml", "json": ".json", "cpp": ".cu"}[b.language]
    path = folder / f"{b.name}{suffix}"
    path.write_text(b.text + "\n")
    return path


# Where each block runs: the test that runs its text (it reads it with `block(name)`) and checks what the article
# says it does. tests/seeds/test_blocks.py checks that each one exists and reads its block.
RUNS: dict[str, str] = {
    "extra_modules": "tests/settings/test_multimodal.py::test_extra_modules_from_the_flag_and_from_the_articles_yaml",
    "async_engine": "tests/seeds/test_python_lines.py::test_the_async_engine_monitor_and_cache_lines",
    "memory_monitor": "tests/seeds/test_python_lines.py::test_the_async_engine_monitor_and_cache_lines",
    "lm_cache": "tests/seeds/test_python_lines.py::test_the_async_engine_monitor_and_cache_lines",
    "hybrid_parallel_serving": "tests/seeds/test_serving_lines.py::test_hybrid_parallel_serving_line",
    "config_yaml": "tests/settings/test_article_spellings.py::test_article_003s_config_and_port_serve_http_on_8000",
    "serve_config": "tests/seeds/test_serving_lines.py::test_config_file_serves_http_on_its_port",
    "multi_node": "tests/seeds/test_serving_lines.py::test_multi_node_lines",
    "helm_values": "tests/deploy/test_helm.py::test_the_article_values_give_three_worlds_of_two_gpus",
    "monitor_memory": "tests/clients/test_monitor.py::test_the_articles_lines_run_as_written",
    "monitor_hit_rate": "tests/clients/test_monitor.py::test_the_articles_lines_run_as_written",
    "paged_attention_supports": "tests/minivllm/test_custom_ops.py::test_the_article_lines_as_written",
    "register_kernel": "tests/minivllm/test_custom_ops.py::test_the_article_lines_as_written",
    "attention_config": "tests/minivllm/test_custom_ops.py::test_the_article_lines_as_written",
    "convert_gguf": "tests/seeds/test_command_lines.py::test_convert_line",
    "model_router": "tests/minivllm/test_controller.py::test_the_articles_lines_as_written",
    "mixed_precision": "tests/settings/test_mixed_precision.py::test_the_articles_block_runs_on_a_gpu_and_on_a_cpu",
    "priority_scheduler": "tests/minivllm/test_priority_scheduler.py::"
    "test_the_articles_scheduler_orders_by_priority_and_names_its_ranges",
    "priority_header": "tests/e2e/test_priority_header.py::test_the_articles_curl_line",
    "data_structures": "tests/seeds/test_scheduler_article.py::test_the_data_structures_are_the_schedulers",
    "compute_batch_size": "tests/seeds/test_scheduler_article.py::test_the_batch_size_heuristic_runs",
    "recommended_settings": "tests/settings/test_article_spellings.py::test_article_000s_table_as_a_config_file",
    "gpu_topology": "tests/settings/test_topology.py::"
    "test_the_articles_template_sets_the_topology_and_the_replicas_policy",
    "custom_scheduler": "tests/minivllm/test_custom_scheduler.py::"
    "test_the_articles_class_loads_by_dotted_path_as_the_servers_name_it",
}

# What in minivllm runs each block, for docs/guide.md's "From the articles" table.
WHAT: dict[str, str] = {
    "async_engine": "`minivllm.AsyncEngineArgs` / `AsyncLLMEngine` (minivllm/async_engine.py)",
    "hybrid_parallel_serving": "`vllm-serving` (= `vllm-serve`): 8 worker processes, TP 2 x PP 4",
    "memory_monitor": "`minivllm.MemoryMonitor` (minivllm/memory_monitor.py)",
    "config_yaml": "`--config` keys (settings/config_file.py)",
    "serve_config": "`vllm-serving --port` is the HTTP port (`--grpc-port` for gRPC)",
    "multi_node": "`vllm-scheduler` without a model; workers join at its gRPC address (worker_node/join_address.py)",
    "helm_values": "the Helm chart deploy/helm/minivllm/",
    "monitor_memory": "`vllm-monitor --metric` short names (clients/monitor.py)",
    "nccl_test": "not ours",
    "paged_attention_supports": "`PagedAttention.supports` (minivllm/model_executor/layers/attention.py)",
    "convert_gguf": "`vllm-convert` (worker_node/convert.py)",
    "extra_modules": "`model_loader.extra_modules`: the modules to load, checked against the checkpoint (LLaVA)",
    "dify_config": "not ours: Dify reaches the OpenAI door",
    "dify_server": "not ours: Dify's server",
    "lm_cache": "`minivllm.LMCache`: the KV offload tiers (minivllm/lm_cache.py)",
    "monitor_hit_rate": "`vllm-monitor --metric cache_hit_rate`",
    "model_router": "`minivllm.controller.ModelRouter` over vllm-router's strategies",
    "mixed_precision": "`engine.mixed_precision` (settings/mixed_precision.py)",
    "custom_kernel_source": "not ours: your kernel (deploy/custom_attention_kernel.c is one)",
    "register_kernel": "`minivllm._custom_ops.register_kernel` (kernels/custom_kernels.py)",
    "attention_config": "a model config's `attention.type` (proto/attention_setting.py)",
    "priority_scheduler": "`minivllm.PriorityScheduler` (minivllm/scheduling.py)",
    "priority_header": "the `X-Priority` header, a number or a range's name",
    "data_structures": "scheduler_node/core/request.py, scheduler_node/core/kv/block_table.py",
    "compute_batch_size": "plain Python (the engine sizes its batch from `--max-num-seqs` and the KV cache)",
    "recommended_settings": "`--config` keys with units (settings/units.py)",
    "gpu_topology": "`gpu_topology` / `scheduling_policy` (settings/topology.py)",
    "custom_scheduler": "`minivllm.Scheduler`, subclassed (minivllm/scheduling.py)",
}


def guide_table() -> str:
    """docs/guide.md's "From the articles" table: each block's first line, what runs it, the test that runs it."""
    rows = ["| article | line | what runs it | its test |", "| --- | --- | --- | --- |"]
    for b in BLOCKS:
        first = next(line for line in b.text.splitlines() if line.strip() and not line.startswith("#")).strip()
        shown = (first if len(first) <= 72 else first[:69] + "...").replace("|", "/")
        shown = f'"{shown}"' if b.not_ours else f"`{shown}`"  # another product's flags are not ours to check
        article = "vLLM" if b.article == VLLM_ARTICLE else "scheduler"
        test = RUNS.get(b.name, "").replace("::", " ") or "-"
        rows.append(f"| {article} {b.section} | {shown} | {WHAT[b.name]} | {test} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(guide_table())
