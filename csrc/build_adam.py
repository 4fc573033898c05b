"""cffi build script of the CPU Adam kernel (out-of-line API mode) -> `infinity.optim._adam_cffi`.

`setup.py` runs it through `cffi_modules`; for development, build in place from the repository
root with

    python csrc/build_adam.py

which leaves `infinity/optim/_adam_cffi.*.so` (and the generated `.c`, git-ignored) next to
`infinity/optim/_native.py`, the only module that imports it.

The flags are portable on purpose (no -march=native): the SIMD loops carry their instruction set
in per-function target attributes and are picked at run time. -ffp-contract=off keeps the
compiler from fusing multiplies and adds on its own, which would break the bit-identity of the
paths (see [Note: one formula] in csrc/adam/adam_kernel.h) and of the compressed-state kernel
with its plain-torch reference (csrc/adam/adam_state_kernel.h).
"""

import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ADAM_DIR = os.path.join(HERE, "adam")
COMMON_DIR = os.path.join(HERE, "common")
SOURCES = ["adam.c", "adam_state.c", "adam_scalar.c", "adam_avx2.c", "adam_avx512.c",
           "sum_squares.c"]
HEADERS = ["inf_adam.h", "adam_kernel.h", "adam_simd_body.h", "adam_state_kernel.h",
           "adam_state_simd_body.h"]
ROOT = os.path.dirname(HERE)


def _cdef_text(header_path: str) -> str:
    """The header without preprocessor lines, which cffi's cdef cannot parse."""
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    return re.sub(r"^\s*#.*$", "", text, flags=re.MULTILINE)


def _rel(path: str) -> str:
    """Paths relative to the repository root: setuptools builds from there and wants relative
    source paths, and build_in_place changes into it first."""
    return os.path.relpath(path, ROOT)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text(os.path.join(ADAM_DIR, "inf_adam.h")))
ffibuilder.set_source(
    "infinity.optim._adam_cffi",
    '#include "inf_adam.h"\n',
    sources=[_rel(os.path.join(ADAM_DIR, name)) for name in SOURCES]
    + [_rel(os.path.join(COMMON_DIR, "inf_pool.c"))],
    include_dirs=[_rel(ADAM_DIR), _rel(COMMON_DIR)],
    depends=[_rel(os.path.join(ADAM_DIR, h)) for h in HEADERS]
    + [_rel(os.path.join(COMMON_DIR, "inf_pool.h"))],
    extra_compile_args=["-O3", "-std=c11", "-pthread", "-ffp-contract=off", "-fno-math-errno",
                        "-Wall", "-Wextra"],
    extra_link_args=["-pthread"],
    libraries=["m"],
)


def build_in_place() -> str:
    """Compile next to the Python package (development build); returns the library's path."""
    os.chdir(ROOT)
    return ffibuilder.compile(tmpdir=".", verbose=False)


if __name__ == "__main__":
    sys.stdout.write(build_in_place() + "\n")
