"""`python -m diffexp.compare ...`, the same as `diffexp compare ...` (user errors: one paragraph, exit 2)."""

import sys

from diffexp.compare.cli import main
from diffexp.errors import guarded

sys.exit(guarded(main))
