"""llama.cpp as a peer for scripts/bench_cpu_peer.py: `llama-server` built once from the llama-cpp-python source
distribution's vendored llama.cpp, a model folder converted to GGUF by its own converter, and the server driven
over HTTP (its /completion endpoint takes token ids and reports its decode timings).

Everything lives under ~/.cache/minivllm/llama.cpp (`CACHE`): the sdist, its tree, `build/bin/llama-server`
(cmake + ninja, native CPU flags, ~25 min on 2 cores, at nice 19) and `gguf/<model>-<type>.gguf`. The converter
needs `sentencepiece` and imports the vendored `gguf-py` (not a registry's gguf, which may lag the converter).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

CACHE = Path.home() / ".cache" / "minivllm" / "llama.cpp"
PACKAGE = "llama-cpp-python"


def cpu_model() -> str:
    """The `model name` of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def source_tree(cache: Path) -> Path:
    """The vendored llama.cpp of the sdist in `cache` (downloaded and unpacked first where it is not)."""
    trees = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if trees:
        return trees[-1]
    cache.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-binary", ":all:", "--no-deps", "-d", str(cache)]
    subprocess.run(pip, check=True)
    sdist = sorted(cache.glob("llama_cpp_python-*.tar.gz"))[-1]
    subprocess.run(["tar", "xzf", str(sdist), "-C", str(cache)], check=True)
    return sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def ensure_server(cache: Path = CACHE) -> Path:
    """`llama-server`, built first where it is not in the cache (its logs beside the build)."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    tree, build = source_tree(cache), cache / "build"
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    options += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
    nice = ["nice", "-n", "19"]
    with (cache / "cmake.log").open("w") as log:
        subprocess.run([*nice, "cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", *options], check=True,
                       stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    with (cache / "ninja.log").open("w") as log:
        subprocess.run([*nice, "ninja", "-C", str(build), "llama-server"], check=True, stdout=log,
                       stderr=subprocess.STDOUT)  # fmt: skip
    return binary


def convert(model: Path, kind: str, cache: Path = CACHE) -> Path:
    """`model` (an HF folder) as a GGUF of `kind` (bf16, q8_0, f32, ...), converted once by the vendored
    convert_hf_to_gguf.py."""
    target = cache / "gguf" / f"{model.name}-{kind}.gguf"
    if target.is_file():
        return target
    tree = source_tree(cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    command = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model), "--outtype", kind]
    env = {"PYTHONPATH": str(tree / "gguf-py"), "PATH": "/usr/bin:/bin"}
    subprocess.run([*command, "--outfile", str(partial)], check=True, env=env, capture_output=True)
    partial.rename(target)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`llama-server` on one GGUF with `slots` parallel sequences, for the time of a `with` block."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, context: int) -> None:
        self.port = free_port()
        self.command = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                        "-c", str(context), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}): {' '.join(self.command)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("llama-server did not become healthy in 120 s")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def complete(self, ids: list[int], tokens: int) -> dict[str, Any]:
        """One greedy completion of `tokens` tokens after the prompt `ids`, EOS ignored, no prompt cache."""
        body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
        if answer.get("tokens_predicted") != tokens:
            raise RuntimeError(f"llama-server made {answer.get('tokens_predicted')} tokens, not {tokens}")
        return answer

    def single_stream(self, ids: list[int], tokens: int) -> float:
        """Its own decode rate for one sequence (tokens per second, prefill excluded)."""
        return float(self.complete(ids, tokens)["timings"]["predicted_per_second"])

    def batch_rate(self, batch: list[list[int]], tokens: int) -> float:
        """Output tokens per wall second with every prompt of `batch` sent at once."""
        start = time.perf_counter()
        with ThreadPoolExecutor(len(batch)) as pool:
            list(pool.map(lambda ids: self.complete(ids, tokens), batch))
        return len(batch) * tokens / (time.perf_counter() - start)
