"""``agentspec`` command line: ``demo`` (the LangGraph demo) and ``train`` (distil a drafter)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any


def _flag_type(default: Any) -> Any:
    if isinstance(default, bool):
        return lambda v: v.strip().lower() in ("1", "true", "yes", "on")
    return type(default)


def _add_fields(parser: argparse.ArgumentParser, cls: type, defaults: bool = True) -> None:
    """One flag per config dataclass field: the dataclass is the single source of defaults."""
    for f in dataclasses.fields(cls):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=_flag_type(f.default),
                            default=f.default if defaults else None)


def build_parser() -> argparse.ArgumentParser:
    from agentspec.demo import DemoConfig
    from agentspec.training.config import TrainConfig

    parser = argparse.ArgumentParser(prog="agentspec", description="Lossless speculative decoding for agent loops.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plain vs speculative tool-call generation on the offline default model")
    _add_fields(demo, DemoConfig)
    train = sub.add_parser("train", help="distil a tool-call drafter for a target (resumable: rerun to continue)")
    train.add_argument("--config", default=None, help="a JSON file of TrainConfig fields (flags override it)")
    _add_fields(train, TrainConfig, defaults=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    if args.command == "demo":
        from agentspec.demo import DemoConfig, run_demo

        return run_demo(DemoConfig(**values))
    if args.command == "train":
        from agentspec.training.config import TrainConfig
        from agentspec.training.run import run_training

        given = {k: v for k, v in values.items() if v is not None}
        try:
            cfg = TrainConfig.from_file(args.config, **given) if args.config else TrainConfig(**given)
        except (ValueError, OSError) as e:
            raise SystemExit(f"agentspec train: {e}") from None
        report = run_training(cfg)
        return 0 if report.get("finished") else 3
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
