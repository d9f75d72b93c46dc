"""`python -m ulacache_jax ...` is the `ulacache` command."""
import sys

from ulacache_jax.app.cli import main

sys.exit(main())
