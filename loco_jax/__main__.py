"""python -m loco_jax: the `loco-jax` command."""

import sys

from loco_jax.cli import main

sys.exit(main())
