"""jmirror's benchmark suite: every claim a ratio measured side by side in one run."""
