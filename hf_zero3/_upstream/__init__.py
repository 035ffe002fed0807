"""Every read of a private DeepSpeed / transformers / accelerate / TRL / torch attribute, and every
patch of one, lives in this package: one accessor each, named after what it reads.

Each module lists the releases its accessors were checked against (``CHECKED``), and
``tests/cpu/test_upstream_contracts.py`` holds one contract test per accessor, so an upgrade that
moves an attribute fails there, by name, instead of deep inside a run. Patches are installed
through :mod:`.patches` only when the feature that needs them is switched on, and
:func:`hf_zero3.unpatch` removes every one of them.
"""

from __future__ import annotations

from .versions import MINIMUM as MINIMUM
from .versions import TESTED as TESTED
from .versions import check_versions as check_versions
from .versions import require as require
