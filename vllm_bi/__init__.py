"""vllm_bi: batch-invariant vLLM serving for Gated DeltaNet hybrids, with bitwise trainer parity.

Importing this package is cheap on purpose: ``vllm_bi_startup.pth`` imports
``vllm_bi._startup`` in every Python process of the environment.
"""

try:
    from vllm_bi._version import version as __version__
except ImportError:  # running from a source tree that was never built
    __version__ = "0.0.0"

__all__ = ["__version__"]
