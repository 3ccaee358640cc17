"""`python -m minisgl.serve`: the OpenAI-compatible server (or, with --shell, a terminal chat)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
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
