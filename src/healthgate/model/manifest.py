"""YAML manifests: a stream of documents, one resource per document.

The loader keeps each document's index and line so that every error can say
where it is. It is bounded: a manifest larger than ``max_bytes`` or with more
than ``max_documents`` documents is refused before it is parsed further.
Loading is all or nothing: :func:`load_manifest` either returns every document
or raises :class:`InvalidResources` with every problem found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from healthgate.model.validation import (
    Document,
    InvalidResources,
    Issue,
    parse_resource,
    validate_documents,
)


@dataclass(frozen=True, slots=True)
class ManifestLimits:
    max_bytes: int = 16 * 1024 * 1024
    max_documents: int = 20_000


def parse_manifest(text: str, limits: ManifestLimits | None = None) -> list[Document]:
    """Parse and field-validate every document; no cross-resource checks."""
    limits = limits or ManifestLimits()
    size = len(text.encode())
    if size > limits.max_bytes:
        raise InvalidResources(
            [Issue("", f"manifest is {size} bytes; the limit is {limits.max_bytes}")]
        )
    documents: list[Document] = []
    issues: list[Issue] = []
    index = 0
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # reads (and may reject) the stream at once
        while loader.check_node():
            node = loader.get_node()
            index += 1
            if index > limits.max_documents:
                raise InvalidResources(
                    [Issue("", f"more than {limits.max_documents} documents in one manifest")]
                )
            if node is None:
                continue
            line = node.start_mark.line + 1
            data = loader.construct_document(node)
            if data is None:
                continue  # an empty document (a stray '---')
            resource, problems = parse_resource(data, index, line)
            issues.extend(problems)
            if resource is not None:
                documents.append(Document(resource, index, line))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidResources([Issue("", f"not valid YAML{at}: {problem}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if issues:
        raise InvalidResources(issues)
    return documents


def load_manifest(text: str, limits: ManifestLimits | None = None) -> list[Document]:
    """Parse a manifest and check every rule, fields and references."""
    documents = parse_manifest(text, limits)
    issues = validate_documents(documents)
    if issues:
        raise InvalidResources(issues)
    return documents


def load_manifest_file(path: str | Path, limits: ManifestLimits | None = None) -> list[Document]:
    return load_manifest(Path(path).read_text(encoding="utf-8"), limits)
