"""Compile the batchpilot pipeline for a config: `python pipelines/compile.py [--config FILE] [--output FILE]`.

The output is deterministic (same config, same bytes); the compiled YAML of the example configs is
checked in under pipelines/compiled/ and a test fails when it drifts from the source.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: components/ and pipelines/ live here
    sys.path.insert(0, str(REPO))

EXAMPLES = ("demo.yaml", "nemo_gpt3_5b.yaml", "maxtext_per_device.yaml")


def compile_config(config_path: Path, output: Path, *, image: str | None = None) -> int:
    """Compiles the pipeline for `config_path` into `output`; returns the number of stages."""
    from kfp import compiler

    from batchpilot.config import load_config
    from pipelines.batchpilot_pipeline import DEFAULT_IMAGE, build_pipeline, num_stages

    config = load_config(config_path)
    pipeline = build_pipeline(config, image=image or DEFAULT_IMAGE)
    output.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(output))
    return num_stages(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: every example config in configs/)")
    parser.add_argument("--output", help="output YAML (default: pipelines/compiled/<config name>.yaml)")
    parser.add_argument(
        "--image", help="the batchpilot image all components run (default: batchpilot:<version>)"
    )
    args = parser.parse_args(argv)
    from batchpilot.errors import BatchpilotError

    configs = [Path(args.config)] if args.config else [REPO / "configs" / name for name in EXAMPLES]
    if args.output and len(configs) != 1:
        parser.error("--output needs --config")
    try:
        for config in configs:
            output = Path(args.output) if args.output else REPO / "pipelines" / "compiled" / config.name
            count = compile_config(config, output, image=args.image)
            print(f"compiled {config} -> {output} ({count} stage(s))")
    except BatchpilotError as error:
        for line in str(error).splitlines():
            print(f"compile: error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
