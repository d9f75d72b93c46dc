"""The command line's error: bad options or an unusable model / output path (exit code 2). Its own module so the
app modules below the CLI (model loading, resume) raise it without importing the CLI."""


class UsageError(Exception):
    """Bad options or an unusable model/output path: reported on stderr, exit code 2."""
