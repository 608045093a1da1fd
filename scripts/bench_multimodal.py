"""Images through a LLaVA model on CPU: what the encoder-output cache and image-aware prefix caching save, and how
many images per second the vision encoder takes.

Rows: the time to the first token of a request whose image is new, of the same request again (its prompt blocks,
image tokens included, come from the prefix cache), of the same image under another question (the prefix cache
misses after the image's blocks; the encoder cache has the image), and of the first request with prefix caching
off (the encoder cache alone). Then the encoder alone: images per second, one at a time and in batches.

The model: `--model` a LLaVA folder, or (default) a random one built here with a 224-pixel CLIP tower (256 image
tokens per image) over the tiny Llama decoder of the tests (minivllm/tiny_models.py).

    .venv/bin/python scripts/bench_multimodal.py [--model DIR] [--threads N] [--json out.json]
    .venv/bin/python scripts/bench_multimodal.py --smoke    # what CI runs: the tests' tiny model, one repeat
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.tiny_models import IMAGE_TOKEN, TINY_IMAGE_SIZE, build_tiny_llava  # noqa: E402
from scheduler_node.engine.model_path import DEFAULT, resolve_model  # noqa: E402
from scheduler_node.text.images import ImagePrompts  # noqa: E402
from worker_node.models.vision import load_vision_encoder  # noqa: E402

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def picture(seed: int, side: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side + 7, 3), dtype=np.uint8))


def ttft(llm: LLM, image: Image.Image, question: str) -> float:
    """Seconds to the first token of one request (alone in the engine)."""
    prompt = {"prompt": f"USER: {IMAGE_TOKEN}\n{question} ASSISTANT:", "multi_modal_data": {"image": image}}
    start = time.perf_counter()
    llm.generate(prompt, FIRST, use_tqdm=False)  # type: ignore[arg-type]
    return time.perf_counter() - start


def ttft_rows(model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: dict[str, list[float]] = {"new image": [], "seen image, same prompt": [], "seen image, new question": []}
    rows["seen image, no prefix caching"] = []
    question = "Describe everything in this picture in as much detail as you can, please. " * args.text_repeat
    for caching in (True, False):
        with LLM(
            str(model), dtype="float32", threads=args.threads, extra_modules=["vision_encoder"],
            enable_prefix_caching=caching, kv_cache_memory=args.kv_cache_memory,
        ) as llm:  # fmt: skip
            ttft(llm, picture(10**6, args.side), "warm-up")
            for r in range(args.repeats):
                image = picture(r, args.side)
                if caching:
                    rows["new image"].append(ttft(llm, image, question))
                    rows["seen image, same prompt"].append(ttft(llm, image, question))
                    rows["seen image, new question"].append(ttft(llm, image, f"{r}: {question}"))
                else:
                    ttft(llm, image, question)
                    rows["seen image, no prefix caching"].append(ttft(llm, image, question))
    new = statistics.median(rows["new image"])
    return [
        {
            "request": name,
            "TTFT ms": round(1e3 * statistics.median(t), 2),
            "vs new image": round(statistics.median(t) / new, 3),
        }
        for name, t in rows.items()
    ]


def encoder_rows(model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    config = json.loads((model / "config.json").read_text())
    encoder = load_vision_encoder(model, config, torch.float32, torch.device("cpu"))
    prompts = ImagePrompts.build(model, ("vision_encoder",), 1, 10**9)
    assert prompts is not None
    pixels = torch.from_numpy(np.stack([prompts.processor(picture(i, args.side)) for i in range(max(args.batches))]))
    rows = []
    for batch in args.batches:
        encoder(pixels[:batch])  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            encoder(pixels[:batch])
            best = min(best, time.perf_counter() - start)
        rows.append({"images per call": batch, "images/s": round(batch / best, 1), "ms per call": round(1e3 * best, 2)})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a LLaVA HF folder (default: a random one built here)")
    p.add_argument("--image-size", type=int, default=224, help="the built model's tower input side, in pixels")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--smoke", action="store_true", help="the tests' tiny model, one repeat (CI)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    args.batches, args.text_repeat = [1, 4, 16], 4
    if args.smoke:
        args.image_size, args.repeats, args.batches, args.text_repeat = TINY_IMAGE_SIZE, 1, [1, 2], 1
        args.threads = 1  # CI's two cores are shared: a second OpenMP thread only waits for a core
    args.side = args.image_size + 17  # resized and cropped like any photo
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else Path(scratch) / "llava"
        if not args.model:
            model.mkdir()
            big = {} if args.smoke else {"patch_size": 14, "vision_hidden": 128, "vision_layers": 4}
            build_tiny_llava(model, resolve_model(DEFAULT), image_size=args.image_size, **big)
        report = {
            "model": model.name,
            "threads": args.threads,
            "encoder": encoder_rows(model, args),  # first: an engine's closed worker threads may linger
            "ttft": ttft_rows(model, args),
            "load": f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after",
        }
    print(f"## images through {report['model']}, {args.threads} threads, float32; load {report['load']}")
    for name in ("ttft", "encoder"):  # printed in this order
        rows = report[name]
        print("| " + " | ".join(rows[0]) + " |")
        print("| " + " | ".join("---" for _ in rows[0]) + " |")
        for row in rows:
            print("| " + " | ".join(str(v) for v in row.values()) + " |")
        print()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
