"""cffi build script of the batched compaction move (out-of-line API mode) -> `infinity.memory._move_cffi`.

`setup.py` runs it through `cffi_modules`; for development, build in place from the repository
root with

    python csrc/build_memory.py

which leaves `infinity/memory/_move_cffi.*.so` (and the generated `.c`, git-ignored) next to
`infinity/memory/_move.py`, the only module that imports it.
"""

import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MEMORY_DIR = os.path.relpath(os.path.join(HERE, "memory"), ROOT)  # setuptools wants relative paths

with open(os.path.join(HERE, "memory", "inf_move.h"), encoding="utf-8") as header:
    DECLARATIONS = re.sub(r"^\s*#.*$", "", header.read(), flags=re.MULTILINE)  # cdef has no cpp

ffibuilder = FFI()
ffibuilder.cdef(DECLARATIONS)
ffibuilder.set_source(
    "infinity.memory._move_cffi",
    '#include "inf_move.h"\n',
    sources=[os.path.join(MEMORY_DIR, "inf_move.c")],
    include_dirs=[MEMORY_DIR],
    depends=[os.path.join(MEMORY_DIR, "inf_move.h")],
    extra_compile_args=["-O2", "-std=c11", "-pthread", "-Wall", "-Wextra"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    sys.stdout.write(ffibuilder.compile(tmpdir=".", verbose=False) + "\n")
