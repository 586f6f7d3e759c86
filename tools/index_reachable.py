"""Whether a package index answers, asked once and briefly, before pip is pointed at it.

    python tools/index_reachable.py https://download.pytorch.org/whl/cpu --timeout 5

Exit status 0 when the index answered within `--timeout` seconds (any HTTP reply, an error
status included: the host is there), else 1 with one line on stderr saying what happened and
after how long. `make train` asks this about TORCH_INDEX: pip itself, given an index it cannot
reach, retries every request five times with growing pauses, for torch and again for each of
its dependencies (minutes, and a hundred warning lines), before it fails or goes on with what
it can reach. The time bound covers the name lookup too (a machine without DNS can wait in it
longer than any socket timeout), so the probe runs in a thread that is abandoned at the limit.
Proxies set in the environment (HTTPS_PROXY, ...) are used, as pip uses them.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.error
import urllib.request


def probe(url: str, timeout: float) -> str | None:
    """None when `url` answers within `timeout` seconds, else why not (one phrase)."""
    outcome: list[str | None] = []

    def ask() -> None:
        request = urllib.request.Request(url, method="HEAD")
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                pass
            outcome.append(None)
        except urllib.error.HTTPError:  # a reply: the index is there
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 (every failure to get a reply is the answer)
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):  # the socket's clock ran out before join's
                outcome.append(f"no answer in {timeout:g} s")
            else:
                outcome.append(f"{type(reason).__name__}: {reason}")

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(timeout)
    if not outcome:
        return f"no answer in {timeout:g} s"
    return outcome[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    a = parser.parse_args(argv)
    start = time.monotonic()
    why = probe(a.url, a.timeout)
    if why is None:
        return 0
    print(f"{a.url}: {why} (after {time.monotonic() - start:.1f} s)", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    os._exit(status)  # not waiting for a probe thread still stuck in a name lookup
