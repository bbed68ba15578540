"""pearing singleflight: exactly one responder does the contested step.

Importing the package is cheap on purpose: ``pearing-run`` and ``pearing-guard
verify`` are on hot paths, so submodules are imported only where used.
"""

from __future__ import annotations

__version__ = "0.1.0"
