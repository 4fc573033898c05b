"""cffi build script of the batched compaction move (out-of-line API mode) ->
`infinity.memory._move_cffi`.

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
COMMON_DIR = os.path.relpath(os.path.join(HERE, "common"), ROOT)
HEADERS = [os.path.join(COMMON_DIR, "inf_pool.h"), os.path.join(MEMORY_DIR, "inf_move.h")]


def _declarations(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as header:
        return re.sub(r"^\s*#.*$", "", header.read(), flags=re.MULTILINE)  # cdef has no cpp


ffibuilder = FFI()
ffibuilder.cdef("".join(_declarations(h) for h in HEADERS))
ffibuilder.set_source(
    "infinity.memory._move_cffi",
    '#include "inf_pool.h"\n#include "inf_move.h"\n',
    sources=[os.path.join(MEMORY_DIR, "inf_move.c"), os.path.join(COMMON_DIR, "inf_pool.c")],
    include_dirs=[MEMORY_DIR, COMMON_DIR],
    depends=HEADERS,
    extra_compile_args=["-O2", "-std=c11", "-pthread", "-Wall", "-Wextra"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    sys.stdout.write(ffibuilder.compile(tmpdir=".", verbose=False) + "\n")
