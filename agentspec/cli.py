"""``agentspec`` command line: ``demo`` now; ``train`` and ``bench`` arrive with their issues."""

from __future__ import annotations

import argparse
import dataclasses
import logging


def build_parser() -> argparse.ArgumentParser:
    from agentspec.demo import DemoConfig

    parser = argparse.ArgumentParser(prog="agentspec", description="Lossless speculative decoding for agent loops.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plain vs speculative tool-call generation on the offline default model")
    for f in dataclasses.fields(DemoConfig):  # one source of defaults: the config dataclass
        demo.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from agentspec.demo import DemoConfig, run_demo

        return run_demo(DemoConfig(**{k: v for k, v in vars(args).items() if k != "command"}))
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
