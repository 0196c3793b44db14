"""`python -m experiments.cli`: the `sinkstudy` command without its installed script."""

import sys

from experiments.cli import main

sys.exit(main())
