"""python -m loco_jax: the `loco-jax` command."""

import sys

from loco_jax.apps.cli import main

sys.exit(main())
