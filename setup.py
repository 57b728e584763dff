"""Builds torch_kvcanary; the whole build is in build_tools/build_ext.py."""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tools.build_ext import LIMITED_API, cmdclass, extensions  # noqa: E402

setup(ext_modules=extensions(), cmdclass=cmdclass(), options={"bdist_wheel": {"py_limited_api": LIMITED_API}})
