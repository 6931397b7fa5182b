"""``agentspec`` command line: ``demo`` (the LangGraph demo), ``train`` (distil a drafter) and ``export``
(a model as a checkpoint directory other engines such as vLLM load)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import logging

from agentspec import __version__


def version() -> str:
    """The installed distribution's version (``agentspec.__version__`` when it is not installed)."""
    try:
        return importlib.metadata.version("agentspec")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def parse_bool(text: str) -> bool:
    """A strict boolean flag value: true/false, 1/0 or yes/no (any case); anything else is an error."""
    if text.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true/false, 1/0 or yes/no, got {text!r}")
    return text.strip().lower() in ("true", "1", "yes")


def _add_fields(parser: argparse.ArgumentParser, cls: type, defaults: bool = True) -> None:
    """One flag per config dataclass field, its help from the field's metadata: the dataclass is the single
    source of defaults (``required`` metadata: a flag the command line must give)."""
    for f in dataclasses.fields(cls):
        required = f.metadata.get("required", False)
        shown = "required" if required else f"default: {f.default!r}"
        names = (f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ()))
        parser.add_argument(*names, default=f.default if defaults else None,
                            type=parse_bool if isinstance(f.default, bool) else type(f.default),
                            required=required, help=f"{f.metadata['help']} ({shown})")


def build_parser() -> argparse.ArgumentParser:
    """``agentspec``'s parser: ``demo`` and ``train`` (flags generated from their configs), and ``export``."""
    from agentspec.demo import DemoConfig
    from agentspec.training.config import TrainConfig

    parser = argparse.ArgumentParser("agentspec", description="Lossless speculative decoding for agent loops")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="plain vs speculative tool calls on the offline default model")
    _add_fields(demo, DemoConfig)
    train = sub.add_parser("train", help="distil a tool-call drafter for a target (rerun to resume)")
    train.add_argument("--config", default=None, help="a JSON file of TrainConfig fields (flags override it)")
    _add_fields(train, TrainConfig, defaults=False)
    export = sub.add_parser("export", help="write a model (offline alias or .gguf) as a checkpoint directory "
                                           "vLLM and other engines load")
    export.add_argument("source", help="an offline alias (e.g. qwen2.5-coder-0.5b-instruct) or a .gguf file")
    export.add_argument("out", help="the directory to write (must be empty unless --overwrite)")
    export.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the weights' dtype (default: float32)")
    export.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``agentspec``; returns the exit code (a model that cannot be loaded: its error, exit status 1)."""
    logging.basicConfig(level=logging.WARNING)
    args = build_parser().parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    from agentspec.models import ModelLoadError

    try:
        if args.command == "export":
            from agentspec.models.export import export_checkpoint

            try:
                out = export_checkpoint(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite)
            except ValueError as e:
                raise SystemExit(f"agentspec export: {e}") from None
            print(out)
            return 0
        if args.command == "demo":
            from agentspec.demo import DemoConfig, run_demo

            return run_demo(DemoConfig(**values))
        from agentspec.training.config import TrainConfig
        from agentspec.training.run import run_training

        given = {k: v for k, v in values.items() if v is not None}
        try:
            cfg = TrainConfig.from_file(args.config, **given) if args.config else TrainConfig(**given)
        except (ValueError, OSError) as e:
            raise SystemExit(f"agentspec train: {e}") from None
        return 0 if run_training(cfg).get("finished") else 3
    except ModelLoadError as e:  # one paragraph that says what to pass or install, not a traceback
        raise SystemExit(f"agentspec {args.command}: {e}") from None


if __name__ == "__main__":
    raise SystemExit(main())
