"""The trainer's exceptions. :class:`TrainerError` ends a run with a message the user can act on (what went
wrong and how to resume) and an exit status of :mod:`vllm_bi.errors` (default 3: the server or the environment);
:class:`NaNLoss` reports a non-finite loss or gradient norm, raised before the update is applied (the gradients
are dropped, the weights are unchanged). This module imports nothing of the trainer, so every other module can
import them.
"""

from __future__ import annotations

from vllm_bi.errors import ENVIRONMENT, UserError

__all__ = ["TrainerError", "NaNLoss"]


class TrainerError(UserError, RuntimeError):
    """A run ended on an error the user can act on; the message says what and how to resume, ``exit_code`` its
    meaning (:mod:`vllm_bi.errors`)."""

    exit_code = ENVIRONMENT


class NaNLoss(FloatingPointError):
    pass
