"""The `kubedistill` command. Subcommands import their modules lazily: `crd` and `validate`
must stay fast and must not import torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kubedistill", description=__doc__.splitlines()[0])
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
    return parser


def _plugins() -> list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]]:
    """Subcommands owned by the operator and runtime packages (each adds its own parsers)."""
    import importlib

    return [getattr(importlib.import_module(module), attr) for module, attr in COMMAND_MODULES]


# (module, function) pairs; each function adds subcommands to the parser. The modules must be
# cheap to import and need no optional extra (heavy imports go inside the command functions).
COMMAND_MODULES: list[tuple[str, str]] = [
    ("kubedistill.runtime.entrypoints.local", "add_commands"),
    ("kubedistill.runtime.entrypoints.roles", "add_commands"),
    ("kubedistill.runtime.entrypoints.quickstart", "add_commands"),
    ("kubedistill.runtime.entrypoints.vl_prepare", "add_commands"),
    ("kubedistill.operator.main", "add_commands"),
]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
