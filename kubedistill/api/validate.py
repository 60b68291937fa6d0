"""Validate DistillationJob manifests into one clear line per problem (never a traceback)."""

from __future__ import annotations

import difflib
import json
import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from kubedistill.api import kubeyaml
from kubedistill.api.job import API_VERSION, KIND, DistillationJob
from kubedistill.api.spec import DistillationJobSpec, SamplingSpec


@dataclass(frozen=True)
class Problem:
    where: str
    """File (and document number when a file holds several)."""
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.message}" if self.field else f"{self.where}: {self.message}"


def _path(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that validates the object at `loc` (aliases), if any."""
    model: type[BaseModel] | None = DistillationJob
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        model = _first_model(field.annotation)
    return model


def _first_model(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or value is None


# Keys users bring from other tools, by the model they are written in: the field they mean here.
FAMILIAR_KEYS: dict[tuple[type[BaseModel], str], tuple[str, str]] = {
    (SamplingSpec, "n"): ("samplesPerPrompt", "verl's rollout.n"),
}
BOOLEAN_KEYS: dict[str, tuple[str, ...]] = {
    "false": ("n", "N", "no", "off", "false"),
    "true": ("y", "Y", "yes", "on", "true"),
}
"""How a key that reached us as a boolean may have been written (YAML 1.1, as kubectl reads)."""


def _unknown_field(parent: type[BaseModel] | None, key: str) -> str:
    allowed = sorted((f.alias or n) for n, f in parent.model_fields.items()) if parent else []
    spellings = BOOLEAN_KEYS.get(key, ())
    meant = None
    if parent is not None:
        meant = next((FAMILIAR_KEYS[(parent, k)] for k in (key, *spellings) if (parent, k) in FAMILIAR_KEYS), None)
    if spellings:
        hint = (
            f": kubectl and the API server read YAML 1.1, where a bare key {', '.join(spellings[:-1])} or"
            f" {spellings[-1]} is the boolean {key}"
        )
    else:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close and not meant else ":" if meant else ""
    if meant:
        field, elsewhere = meant
        hint += f"{';' if spellings else ''} did you mean {field} ({elsewhere})?"
    return f"unknown field{hint}; allowed: {', '.join(allowed)}"


def _message(err: ErrorDetails) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_field(_model_at(tuple(err["loc"][:-1])), str(err["loc"][-1]))
    if kind == "missing":
        return "required field is missing"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if _scalar(err.get("input")) and kind not in ("value_error",):
        msg += f" (got {err['input']!r})"
    return msg


def _non_finite(value: Any, loc: tuple[Any, ...] = ()) -> str | None:
    """The path of the first infinite or NaN number (YAML's .inf, .nan): kubectl cannot encode it
    as JSON, so the API server never receives the object."""
    if isinstance(value, float) and not math.isfinite(value):
        return _path(loc)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, (*loc, key))
        if found is not None:
            return found
    return None


def problems_of(doc: Any, where: str) -> list[Problem]:
    """Problems of one parsed YAML document; empty when it is a valid DistillationJob."""
    if not isinstance(doc, dict):
        return [Problem(where, "", f"expected a {KIND} mapping, got {type(doc).__name__}")]
    if doc.get("apiVersion") != API_VERSION:
        return [Problem(where, "apiVersion", f"must be {API_VERSION} (got {doc.get('apiVersion')!r})")]
    if doc.get("kind") != KIND:
        return [Problem(where, "kind", f"must be {KIND} (got {doc.get('kind')!r})")]
    infinite = _non_finite(doc)
    if infinite is not None:
        return [Problem(where, infinite, "must be a finite number (kubectl cannot send infinity or NaN in JSON)")]
    try:
        # Strict JSON, as the API server types the object: "100" is no integer, 1 no boolean, "0.2"
        # no number (pydantic's lax Python mode would convert each; the server refuses them).
        DistillationJob.model_validate_json(json.dumps(doc), strict=True)
    except ValidationError as exc:
        out: list[Problem] = []
        for err in exc.errors():
            if err["type"] == "cross_field":
                base = _path(err["loc"])
                for path, message in err["ctx"]["violations"]:
                    full = path if path.startswith(base) else f"{base}.{path}"
                    out.append(Problem(where, full, message))
            else:
                out.append(Problem(where, _path(err["loc"]), _message(err)))
        return out
    return []


def load_documents(path: Path) -> tuple[list[Any], list[Problem]]:
    """The YAML documents of a file as the API server would read them, or the problem that kept
    it from loading (unreadable, too large, not UTF-8, not YAML, too deep, too many aliases)."""
    where = str(path)
    try:
        with path.open("rb") as f:
            data = f.read(kubeyaml.MAX_BYTES + 1)
    except OSError as exc:
        return [], [Problem(where, "", f"cannot read file: {exc.strerror or exc}")]
    try:
        docs = kubeyaml.load_all(kubeyaml.decode(data))
    except kubeyaml.ManifestError as exc:
        return [], [Problem(where, "", str(exc))]
    if not docs:
        return [], [Problem(where, "", "no YAML document found")]
    return docs, []


def _route_values(path: Path, key: str) -> list[tuple[int, str]] | None:
    """(row number from 1, routing-key value) of each row of a .jsonl or .parquet data file that
    has the key; None when the file is not here or cannot be read (the driver reports a bad file
    when the job starts)."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".json"):
            out = []
            with path.open() as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        row = json.loads(line)
                        if isinstance(row, dict) and row.get(key) is not None:
                            out.append((n, str(row[key])))
            return out
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # the runtime's; without it parquet rows go unchecked here

            column = pq.read_table(path, columns=[key]).column(key).to_pylist()
            return [(n, str(v)) for n, v in enumerate(column, 1) if v is not None]
    except (OSError, ValueError, KeyError, ImportError):
        return None
    return None


def row_problems(spec: DistillationJobSpec, where: str, base: Path) -> list[Problem]:
    """Problems of the job's data rows that the spec alone cannot show, for the data files that
    are on this machine (relative paths against `base`, as `kubedistill run` reads them): a row
    whose routing-key value no environment serves, and an environment no row of spec.data.train
    routes to. Empty without spec.environments."""
    if not spec.environments:
        return []
    key = spec.routing.key
    out: list[Problem] = []
    served: set[str] = set()
    complete = True
    for section, files in (("train", spec.data.train), ("val", spec.data.val)):
        for i, name in enumerate(files):
            file = Path(name) if Path(name).is_absolute() else base / name
            values = _route_values(file, key) if file.is_file() else None
            if values is None:
                complete = complete and section != "train"
                continue
            unrouted: dict[str, int] = {}
            for n, value in values:
                try:
                    environment = spec.environment_for(value).name
                except LookupError:
                    unrouted.setdefault(value, n)
                    continue
                if section == "train":
                    served.add(environment)
            for value, n in unrouted.items():
                out.append(
                    Problem(
                        where,
                        f"spec.data.{section}[{i}]",
                        f"row {n}: {key} {value!r} routes to no environment (no spec.environments[].match.dataSource"
                        " holds it, and every environment has a match)",
                    )
                )
    if complete:
        for j, e in enumerate(spec.environments):
            if e.name not in served:
                which = f"match.dataSource {e.match.data_source}" if e.match else "no match: every other row"
                out.append(
                    Problem(
                        where,
                        f"spec.environments[{j}]",
                        f"no row of spec.data.train routes to environment {e.name!r} ({which})",
                    )
                )
    return out


def validate_file(path: Path, data_base: Path | None = None) -> list[Problem]:
    """Problems of every document of a manifest file; for a valid job with environments also its
    data rows' (row_problems, data paths relative to `data_base`, default the working directory)."""
    docs, problems = load_documents(path)
    for i, doc in enumerate(docs):
        where = str(path) if len(docs) == 1 else f"{path} (document {i + 1})"
        found = problems_of(doc, where)
        if not found and doc["spec"].get("environments"):
            spec = DistillationJobSpec.model_validate(doc["spec"])
            found = row_problems(spec, where, data_base or Path.cwd())
        problems.extend(found)
    return problems


def load_job(path: Path) -> DistillationJob:
    """Parse a single-document job file; raises ValueError with the problem lines."""
    docs, problems = load_documents(path)
    if not problems and len(docs) != 1:
        problems = [Problem(str(path), "", f"expected one {KIND} document, found {len(docs)}")]
    if not problems:
        problems = problems_of(docs[0], str(path))
    if problems:
        raise ValueError("\n".join(str(p) for p in problems))
    return DistillationJob.model_validate(docs[0])
