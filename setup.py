"""The optional C helper of the group commit; everything else is declared in pyproject.toml.

`optional=True`: where no C compiler is at hand the build goes on without it, and the group commit
uses Python threads (storage/group_commit.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("storage._fsync_many", ["storage/_fsync_many.c"], optional=True)])
