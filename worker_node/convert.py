"""vllm-convert: turn a GGUF file into an HF model folder that every minivllm command (and HF) can load."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from proto.cli_config import add_config_flag, parse_args
from worker_node.models.gguf import convert

logger = logging.getLogger("vllm-convert")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-convert",
        description="Convert a GGUF file to an HF folder: config.json, generation_config.json, the tokenizer and "
        "the tensors dequantised to model.safetensors (or, with --link, a link to the GGUF file).",
    )
    add_config_flag(p)
    p.add_argument("--input", required=True, help="the .gguf file")
    p.add_argument("--output", required=True, help="the folder to write (must not exist yet)")
    p.add_argument(
        "--link",
        action="store_true",
        help="keep the weights in the GGUF file (linked from the folder), dequantised at each load",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    source, output = Path(args.input).expanduser(), Path(args.output).expanduser()
    if source.suffix != ".gguf" or not source.is_file():
        logger.error("--input %s: not a .gguf file", source)
        return 2
    if output.exists():
        logger.error("--output %s already exists", output)
        return 2
    convert(source, output, link=args.link)
    logger.info("wrote %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
