"""cffi build script for the aio engines (out-of-line API mode).

`pip install` runs it through setup.py's cffi_modules; `python csrc/build_aio.py` builds the
extension in place for development.
"""

import pathlib
import re

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ["handle.c", "faults.c", "environment.c", "backend_kaio.c", "backend_uring.c",
           "backend_threads.c", "crc32c.c"]
HEADERS = ["inf_aio.h", "inf_crc32c.h"]  # the public declarations, read by cdef too


def _declarations(header: pathlib.Path) -> str:
    """The header without preprocessor lines and comments: cdef cannot #include or #ifdef."""
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    keep = []
    for line in text.splitlines():
        define = re.match(r"#define\s+(INF_(?:AIO|CRC32C)_\w+)\s+(-?\d+)\s*$", line)
        if define:
            keep.append(f"#define {define.group(1)} {define.group(2)}")
        elif not line.lstrip().startswith("#"):
            keep.append(line)
    return "\n".join(keep)


ffibuilder = FFI()
ffibuilder.cdef("\n".join(_declarations(HERE / "aio" / name) for name in HEADERS))
ffibuilder.set_source(
    "aio._aio_cffi",
    "\n".join(f'#include "{name}"' for name in HEADERS),
    sources=[str((HERE / "aio" / name).relative_to(HERE.parent)) for name in SOURCES],
    include_dirs=[str((HERE / "aio").relative_to(HERE.parent))],
    depends=[str((HERE / "aio" / h).relative_to(HERE.parent))
             for h in (*HEADERS, "backend.h", "faults.h")],
    extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-Wall", "-Wextra",
                        "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    import os

    os.chdir(HERE.parent)
    ffibuilder.compile(tmpdir=".", verbose=False)
