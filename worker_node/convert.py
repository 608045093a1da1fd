"""vllm-convert: turn a GGUF file into an HF model folder that every minivllm command (and HF) can load, or (with
`--quantization awq`) a GGUF file or full-precision HF folder into an AutoAWQ 4-bit checkpoint."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from settings.commands import command_parser
from settings.config_file import parse_args
from worker_node.models.gguf import convert

logger = logging.getLogger("vllm-convert")


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "vllm-convert",
        "Convert a GGUF file to an HF folder: config.json, generation_config.json, the tokenizer and the tensors "
        "dequantised to model.safetensors (or, with --link, a link to the GGUF file); with --quantization awq, "
        "quantize a GGUF file or an HF folder to AutoAWQ's 4-bit layout.",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    source, output = Path(args.input).expanduser(), Path(args.output).expanduser()
    awq = args.quantization == "awq"
    folder_input = awq and (source / "config.json").is_file()
    if not folder_input and (source.suffix != ".gguf" or not source.is_file()):
        logger.error("--input %s: not a .gguf file%s", source, " or an HF folder" if awq else "")
        return 2
    if output.exists():
        logger.error("--output %s already exists", output)
        return 2
    if not awq:
        if args.group_size is not None or args.calib_file:
            logger.error("--group-size and --calib-file go with --quantization awq")
            return 2
        convert(source, output, link=args.link)
    else:
        return _convert_awq(source, output, folder_input, args)
    logger.info("wrote %s", output)
    return 0


def _convert_awq(source: Path, output: Path, folder_input: bool, args: argparse.Namespace) -> int:
    from worker_node.models.awq_convert import AwqConvertError, quantize_folder

    if args.link:
        logger.error("--link: an AWQ checkpoint holds its own 4-bit tensors")
        return 2
    calib = None
    if args.calib_file:
        try:
            calib = Path(args.calib_file).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as exc:
            logger.error("--calib-file %s: %s", args.calib_file, exc)
            return 2
    scratch = Path(tempfile.mkdtemp(prefix=".gguf-", dir=output.parent if output.parent.exists() else None))
    try:
        folder = source if folder_input else convert(source, scratch / "model")
        quantize_folder(folder, output, args.group_size, calib)
    except AwqConvertError as exc:
        logger.error("%s", exc)
        return 2
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("wrote %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
