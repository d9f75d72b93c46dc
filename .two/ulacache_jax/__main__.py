"""`python -m ulacache_jax ...` is the `ulacache` command."""
import sys

from .cli import main

sys.exit(main())
