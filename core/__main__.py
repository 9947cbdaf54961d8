"""`python -m core …`: the command line (core/tools/cli.py)."""
import sys

from core.tools.cli import main

sys.exit(main())
