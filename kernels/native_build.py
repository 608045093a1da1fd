"""Building and loading the C kernels of kernels/csrc for this CPU (ctypes, no Python extension).

A library is built once per source (with the headers beside it), compiler, flags and CPU feature set into the
minivllm cache folder, so a worker starts in milliseconds after the first build (about a second with gcc). Where
no C compiler is found or the build fails, `load_library` returns None (logged) and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kernels.cpu_features import cpu_flags_line
from proto.model_cache import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -ffast-math lets gcc vectorize the reductions and expf (libmvec), but only when compiling: at link time it
# would add crtfastmath.o, which flushes subnormals to zero for the whole process the moment the library loads.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# GCC vectorizes in 256-bit registers on AVX-512 CPUs unless told otherwise. The attention kernel's rows run faster
# in whole 512-bit ones (a SmolLM2 decode step's attention 8.8 -> 8.1 ms at 64 sequences, docs/benchmarks.md). Not
# the glue: built so, its norms and silu gained 0.1 ms a step, and their other rounding (the sums' order, libmvec's
# 16-wide expf) moved a SmolLM2 bf16 greedy token 0.14 below HF's best in tests/fidelity (bar 0.05), though each
# op was as close to float64 as before. Only a preference: ignored without AVX-512.
VECTOR_WIDTH = "-mprefer-vector-width=512"
LDFLAGS = ("-shared", "-fopenmp", "-lmvec", "-lm")


def compiler() -> str | None:
    """$CC, else cc or gcc on the PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(source: Path, compiler: str, flags: tuple[str, ...]) -> Path:
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what a source may #include
    for part in (source.read_bytes(), *headers, compiler.encode(), " ".join(flags + LDFLAGS).encode()):
        key.update(part)
    key.update(cpu_flags_line().encode())
    return cache_dir() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _build(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: workers starting together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        obj = partial.with_suffix(".o")
        subprocess.run([compiler, *flags, "-c", str(source), "-o", str(obj)], check=True, capture_output=True)
        subprocess.run([compiler, str(obj), *LDFLAGS, "-o", str(partial)], check=True, capture_output=True)
        os.replace(partial, target)


def load_library(source: Path, flags: tuple[str, ...], what: str) -> ctypes.CDLL | None:
    """`source` compiled with `flags` (built first if needed) and loaded; None when it cannot be here, with a
    warning that `what` keeps its slower torch path."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found; %s uses the slower torch path", what)
        return None
    target = library_path(source, cc, flags)
    try:
        if not target.exists():
            _build(source, cc, flags, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("could not build %s (%s) %s", source.name, error, detail.decode(errors="replace"))
        return None
