"""`python -m ulacache_jax ...` is the `ulacache` command."""
import sys

try:
    from ulacache_jax.app.cli import main
except KeyboardInterrupt:   # Ctrl-C before main installs its handlers: one line, as main would say, no traceback
    print("ulacache: interrupted by SIGINT (Ctrl-C) during start-up; no results were written", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
