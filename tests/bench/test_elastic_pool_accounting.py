"""The elastic bench pays for what a warm pool holds: a pooled process (`<prefix>-pool-<n>` on its
command line, waiting or claimed) counts among an arm's alive site processes, once."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.elastic.timeline import alive

SLEEP = "import time; time.sleep(60)"


def test_a_pooled_process_is_counted_like_a_site_and_only_once() -> None:
    # Command lines as a named site's and a pooled process's (the words after -c are argv).
    site = [sys.executable, "-c", SLEEP, "site_engine", "--site-name", "fed-elastic-0"]
    pooled = [sys.executable, "-c", SLEEP, "site_engine", "--site-name", "fed-elastic-pool-3"]
    other = [sys.executable, "-c", SLEEP, "site_engine", "--site-name", "other-pool-0"]
    processes = [subprocess.Popen(c) for c in (site, pooled, other)]
    try:
        deadline = time.monotonic() + 30
        while (found := alive(("fed-site-1", "fed-elastic-0"))) != {
            "fed-elastic-0",
            f"pool:{processes[1].pid}",
        }:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert alive(("fed-site-1", "fed-elastic-0")) == set()
