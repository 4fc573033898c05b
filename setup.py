"""Build hook only: cffi compiles the native code in csrc/ at install time (metadata lives in
pyproject.toml)."""
from setuptools import setup

setup(cffi_modules=["csrc/build_aio.py:ffibuilder", "csrc/build_adam.py:ffibuilder",
                     "csrc/build_memory.py:ffibuilder"])
