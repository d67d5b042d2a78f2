"""A program for the fork server's tests: `python -m tests.support.forked_program MODE [CODE]`.

Prints what a launched program must see as its own (arguments, working directory, environment),
then, by MODE: `exit` ends with status CODE, `serve` waits for SIGTERM (and says so), `raise`
raises an uncaught error.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

IMPORTED_BY = os.environ.get("FORKED_PROGRAM_MARK", "")


def main() -> None:
    mode = sys.argv[1]
    print(f"argv={sys.argv[1:]} cwd={os.getcwd()} mark={os.environ.get('FORKED_PROGRAM_MARK')}")
    print(f"imported-with-mark={IMPORTED_BY} name={__name__}", flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise RuntimeError("boom")
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    print("serving", flush=True)
    while not stopped:
        time.sleep(0.01)
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
