"""PEP 517 backend: setuptools, with build_tools/ importable for the cmdclass."""

from setuptools.build_meta import *  # noqa: F401,F403
