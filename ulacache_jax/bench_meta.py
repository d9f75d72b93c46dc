"""Metadata every benchmark records: the commit it measured (shared by scripts/bench_*.py)."""
from __future__ import annotations

import os
import subprocess


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(root: str | None = None) -> str:
    """HEAD's hash (+ '-dirty' with uncommitted changes to tracked files); read from .git directly where git cannot
    run (the GPU machine gets a copied tree whose git may refuse it); 'unknown' when neither works."""
    root = root or repo_root()
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=root)
        commit = out.stdout.strip()
        if out.returncode == 0 and len(commit) == 40:
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=20, cwd=root)
            return commit + ("-dirty" if st.returncode == 0 and st.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - no git binary, a timeout: fall back to reading the files
        pass
    try:
        head = open(os.path.join(root, ".git", "HEAD")).read().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        path = os.path.join(root, ".git", ref)
        if os.path.exists(path):
            return open(path).read().strip()
        for line in open(os.path.join(root, ".git", "packed-refs")):
            if line.strip().endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return "unknown"
