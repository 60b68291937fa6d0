"""The `kubedistill` command."""

# Subcommands import their modules lazily: `crd` and `validate` must stay fast and must not
# import torch.

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol


class Subcommands(Protocol):
    """What `ArgumentParser.add_subparsers()` returns, as far as the subcommand modules use it
    (its class is private to argparse)."""

    def add_parser(self, name: str, *, help: str | None = ..., **kwargs: Any) -> argparse.ArgumentParser: ...


def _crd(args: argparse.Namespace) -> int:
    from kubedistill.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _api_docs(args: argparse.Namespace) -> int:
    from kubedistill.api.reference import api_reference

    sys.stdout.write(api_reference())
    return 0


def _validate(args: argparse.Namespace) -> int:
    from kubedistill.api.validate import validate_file

    bad = 0
    for name in args.files:
        problems = validate_file(Path(name))
        for p in problems:
            print(p)
        if problems:
            bad += 1
        elif not args.quiet:
            print(f"{name}: valid")
    return 1 if bad else 0


DESCRIPTION = """\
Distill a student LLM from teacher LLMs on-policy: the student generates, the teachers score
its tokens, the trainer learns from their log-probabilities. A DistillationJob manifest
describes the job; run it on Kubernetes (the operator) or on this machine (`kubedistill run`)."""
EPILOG = """first steps:
  kubedistill quickstart            a CPU demo: make a teacher and a student, distill, show the gain
  kubedistill validate JOB.yaml     check a manifest, one line per problem
  kubedistill run JOB.yaml          run a job here, as local processes
  kubectl apply -f JOB.yaml         run it on a cluster with the operator installed
  kubedistill COMMAND --help        a command's own options

docs: README.md and docs/ (docs/fields.md: every spec field)"""


def build_parser() -> argparse.ArgumentParser:
    from kubedistill import __version__

    parser = argparse.ArgumentParser(
        prog="kubedistill",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("crd", help="print the DistillationJob CRD generated from the API models")
    p.set_defaults(func=_crd)

    p = sub.add_parser("api-docs", help="print the API reference (docs/api.md) generated from the models")
    p.set_defaults(func=_api_docs)

    p = sub.add_parser("validate", help="check DistillationJob manifests; one line per problem")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    p.set_defaults(func=_validate)

    for register in _plugins():
        register(sub)
    for name, (_, help_text) in DEMO_COMMANDS.items():
        sub.add_parser(name, help=help_text)  # listed here; main() hands its arguments to the module
    return parser


def _plugins() -> list[Callable[[Subcommands], None]]:
    """Subcommands owned by the operator and runtime packages (each adds its own parsers)."""
    import importlib

    return [getattr(importlib.import_module(module), attr) for module, attr in COMMAND_MODULES]


# (module, function) pairs; each function adds subcommands to the parser. The modules must be
# cheap to import and need no optional extra (heavy imports go inside the command functions).
COMMAND_MODULES: list[tuple[str, str]] = [
    ("kubedistill.runtime.entrypoints.run_cli", "add_commands"),
    ("kubedistill.runtime.entrypoints.roles", "add_commands"),
    ("kubedistill.operator.main", "add_commands"),
]

DEMO_COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": (
        "kubedistill.demo.quickstart",
        "CPU demo: make a teacher and a student, distill on-policy, show the gain",
    ),
    "prepare-vl": ("kubedistill.demo.vl_prepare", "make the models and data of examples/multi-teacher-vl-cpu.yaml"),
}
"""Commands of the demo package, which is imported only when one of them runs: the runtime image's
commands never load it (tests/test_product_boundary.py)."""


def _run_demo(name: str, argv: Sequence[str]) -> int:
    import importlib

    module, help_text = DEMO_COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"kubedistill {name}", description=help_text)
    importlib.import_module(module).add_arguments(parser)
    parsed = parser.parse_args(argv)
    return int(parsed.func(parsed) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in DEMO_COMMANDS:
            return _run_demo(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
