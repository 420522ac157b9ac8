"""`python -m devharness ...`: the same as the `devharness` command."""
import sys

from devharness.cli import main

sys.exit(main())
