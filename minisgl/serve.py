"""`python -m minisgl.serve`: the OpenAI-compatible server (or, with --shell, a terminal chat)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from minisgl.logging_setup import log_phase, process_start_time, since_launch

    # The launch's clock, inherited by every child: their startup lines count from here.
    os.environ.setdefault("MINISGL_LAUNCH_T0", str(process_start_time()))
    from minisgl import env

    env.LAUNCH_T0 = float(os.environ["MINISGL_LAUNCH_T0"])
    log_phase("launcher: interpreter and imports", since_launch())
    from minisgl.launch.cli import parse_args

    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from minisgl.launch.launcher import launch

    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
