"""``agentspec-verifier``: command line of the verification server.

The server itself is not built yet; this entry point exists so installs and docs can refer to it, and
it says so plainly instead of pretending to serve.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentspec-verifier",
        description="Serve a target model for speculative verification (not available yet in this version).",
    )
    parser.add_argument("model", nargs="?", help="hub id, local directory, .gguf file or offline alias")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        build_parser().print_help()
        return 0
    print("agentspec-verifier: the verification server is not implemented in this version yet.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
