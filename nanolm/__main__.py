"""`python -m nanolm ...` (and `torchrun -m nanolm ...`) run the CLI."""

import sys

from nanolm.cli import main

sys.exit(main())
