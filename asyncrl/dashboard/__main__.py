"""``python -m asyncrl.dashboard RUN_DIR_OR_ENDPOINT``: the live dashboard of a run.

RUN_DIR_OR_ENDPOINT is a run directory (its events.jsonl is read and followed as it grows:
a running or a finished run), an events.jsonl file, or a run's subscribe endpoint
(``tcp://127.0.0.1:PORT``, in ``<run_dir>/metrics.endpoints.json``) to subscribe to the
live stream. The page is served on 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="run directory, events.jsonl, or tcp:// subscribe endpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: loopback)")
    p.add_argument("--port", type=int, default=8050, help="port to serve on (0: any free port)")
    args = p.parse_args(argv)

    from asyncrl.dashboard.server import DashboardServer, FileFeed, StreamFeed

    if args.source.startswith(("tcp://", "ipc://")):
        feed, title = StreamFeed(args.source), args.source
    else:
        path = Path(args.source)
        jsonl = path / "events.jsonl" if path.is_dir() else path
        if not jsonl.exists():
            p.error(f"{jsonl} does not exist: give a run directory with an events.jsonl, the file, "
                    f"or a tcp:// endpoint")
        feed, title = FileFeed(jsonl), (path if path.is_dir() else path.parent).name
    server = DashboardServer(feed, host=args.host, port=args.port, title=title)
    print(f"asyncrl dashboard for {feed.description} at {server.url} (Ctrl-C stops it)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
