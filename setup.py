# Shim for tools that still call setup.py directly; all metadata lives in pyproject.toml.
from setuptools import setup

setup()
