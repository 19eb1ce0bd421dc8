"""`python -m diffexp.compare ...`, the same as `diffexp compare ...`."""

import sys

from diffexp.compare.cli import main

sys.exit(main())
