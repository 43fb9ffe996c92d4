"""Only here to ship `megacache_autoload.pth` into site-packages (pyproject.toml has the rest).

The .pth file is what lets `torchrun` workers use the cache with no code change: at
interpreter start it enables the client when MEGACACHE_URL is set, and costs one
environment lookup otherwise.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "megacache_autoload.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
