"""transformers.Trainer integration: the :class:`Zero3Safe` callback and :func:`eval_forward`."""

from ..gathering import eval_forward
from .callback import Zero3Safe

__all__ = ["Zero3Safe", "eval_forward"]
