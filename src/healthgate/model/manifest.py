"""YAML manifests: a stream of documents, one resource per document.

The loader keeps each document's index and line so that every error can say
where it is. It is bounded, because a manifest is input from outside:

* a manifest larger than ``max_bytes`` or with more than ``max_documents``
  documents is refused before it is parsed further;
* each document is *composed* (YAML's node graph, where an alias is the same
  node again, not a copy) and measured before anything is built from it:
  nesting deeper than ``max_depth`` or more than ``max_nodes`` nodes *as
  expanded* is refused, and so are more than ``max_total_nodes`` in all the
  documents together (many documents of aliases, each just under the
  bound, once cost minutes of CPU a request). An alias bomb (nine anchors of nine aliases each: a
  few hundred bytes that expand to 387 million nodes) is measured in
  microseconds from the graph - each node's expanded size computed once -
  and never expanded;
* the C loader (libyaml) is used when present: several times faster, and it
  refuses nesting beyond 1,000 levels itself, where the pure-Python composer
  would recurse.

Loading is all or nothing: :func:`parse_manifest` either returns every
document or raises :class:`InvalidResources` with every problem found.
Callers in a server run it off the event loop (it is CPU work: seconds for
megabytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from healthgate.gcpause import gc_paused
from healthgate.model.rules import validate_documents
from healthgate.model.validation import (
    Document,
    InvalidResources,
    Issue,
    parse_resource,
)

_Base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Loader(_Base):  # type: ignore[valid-type,misc]
    """The C loader (when there), refusing a key given twice in one mapping:
    YAML's default keeps the last silently, and a manifest's second
    ``checkIntervalSec`` is far more likely a mistake than an override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = key_node.value
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key[:80]!r}",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class ManifestLimits:
    max_bytes: int = 16 * 1024 * 1024
    max_documents: int = 20_000
    max_depth: int = 32  # the deepest resource is 4 levels; 32 leaves room for mistakes
    max_nodes: int = 1_000_000  # per document, aliases expanded (a NEG: ~5 per endpoint)
    # every document together, aliases expanded: many documents each just under
    # max_nodes (aliases of one another) once cost minutes of CPU a request;
    # a 16 MiB manifest without aliases has fewer than ~6 million
    max_total_nodes: int = 8_000_000


def measure(node: yaml.Node, limits: ManifestLimits, budget: int | None = None) -> str | None:
    """What is wrong with a composed document's size, or None.

    Walks the node graph iteratively (no recursion however deep) and gives
    every node its expanded size once, so shared (aliased) nodes cost their
    size at each use without being expanded. ``budget``: what the manifest
    has left of ``max_total_nodes`` (the size is :func:`expanded_size`'s)."""
    problem, _ = expanded_size(node, limits, budget)
    return problem


def expanded_size(
    node: yaml.Node, limits: ManifestLimits, budget: int | None = None
) -> tuple[str | None, int]:
    """(what is wrong, or None; the document's size, aliases expanded)."""
    cap = limits.max_nodes if budget is None else min(limits.max_nodes, budget)
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(node, 1, False)]
    while stack:
        current, depth, children_done = stack.pop()
        key = id(current)
        if key in sizes:
            continue
        if depth > limits.max_depth:
            return f"nested more than {limits.max_depth} levels deep", 0
        if isinstance(current, yaml.ScalarNode):
            sizes[key] = 1
            continue
        children = _children(current)
        if not children_done:
            stack.append((current, depth, True))
            stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)
            continue
        total = 1 + sum(sizes.get(id(c), 0) for c in children)
        if total > cap:
            if cap < limits.max_nodes:
                return (
                    f"the manifest's documents expand to more than {limits.max_total_nodes:,} "
                    "YAML nodes together (anchors and aliases counted at each use)",
                    total,
                )
            return (
                f"expands to more than {limits.max_nodes:,} YAML nodes "
                "(anchors and aliases counted at each use)",
                total,
            )
        sizes[key] = total
    return None, sizes.get(id(node), 1)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


# what the server adds to a resource it shows (GET): ignored in a manifest, so
# that `get -o yaml` can be applied back (kubectl-style)
OUTPUT_ONLY = ("fingerprint", "selfLink", "creationTimestamp", "updateTimestamp", "status")


def without_output_fields(data: object) -> object:
    if isinstance(data, dict) and any(k in data for k in OUTPUT_ONLY):
        return {k: v for k, v in data.items() if k not in OUTPUT_ONLY}
    return data


def _resources_in(data: object, node: yaml.Node, line: int) -> list[tuple[object, int]]:
    """A document is one resource, or a list of them as `get -o yaml` prints
    it (``items: [...]`` with no kind), each with its own line."""
    if not (isinstance(data, dict) and "kind" not in data and isinstance(data.get("items"), list)):
        return [(data, line)]
    items_node = next(
        (v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == "items"), None
    )
    lines = (
        [n.start_mark.line + 1 for n in items_node.value]
        if isinstance(items_node, yaml.SequenceNode)
        else []
    )
    return [(item, lines[i] if i < len(lines) else line) for i, item in enumerate(data["items"])]


def parse_manifest(text: str, limits: ManifestLimits | None = None) -> list[Document]:
    """Parse and field-validate every document; no cross-resource checks."""
    with gc_paused():  # (a large manifest: healthgate/gcpause.py)
        return _parse_manifest(text, limits)


def _parse_manifest(text: str, limits: ManifestLimits | None) -> list[Document]:
    limits = limits or ManifestLimits()
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise InvalidResources(
            [Issue("", f"manifest is {size} bytes; the limit is {limits.max_bytes}")]
        )
    documents: list[Document] = []
    issues: list[Issue] = []
    index = 0
    expanded = 0  # nodes of the documents so far, aliases expanded
    loader: yaml.SafeLoader | None = None
    try:
        loader = Loader(text)  # reads (and may reject) the stream at once
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
            problem, nodes = expanded_size(node, limits, limits.max_total_nodes - expanded)
            if problem is not None:
                issues.append(Issue("", f"document too large: {problem}", index, line))
                if expanded + nodes > limits.max_total_nodes:
                    break  # (the manifest's budget is spent: nothing more is read)
                continue
            expanded += nodes
            data = loader.construct_document(node)
            if data is None:
                continue  # an empty document (a stray '---')
            for item, item_line in _resources_in(data, node, line):
                resource, problems = parse_resource(without_output_fields(item), index, item_line)
                issues.extend(problems)
                if resource is not None:
                    documents.append(Document(resource, index, item_line))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidResources([Issue("", f"not valid YAML{at}: {problem}")]) from None
    except RecursionError:  # (the pure-Python composer, without libyaml)
        raise InvalidResources([Issue("", "not valid YAML: nested too deeply")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    if issues:
        raise InvalidResources(with_field_lines(text, issues))
    if not documents:
        raise InvalidResources([Issue("", "the manifest holds no resources")])
    return documents


def field_lines(node: yaml.Node, depth: int = 4) -> dict[str, int]:
    """Field path (``backends[0].group``) -> line, for one resource's node
    (resources are shallow: four levels cover every field)."""
    out: dict[str, int] = {}
    stack: list[tuple[yaml.Node, str, int]] = [(node, "", depth)]
    while stack:
        current, at, left = stack.pop()
        if left <= 0:
            continue
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode):
                    path = f"{at}.{key.value}" if at else str(key.value)
                    out[path] = key.start_mark.line + 1
                    stack.append((value, path, left - 1))
        elif isinstance(current, yaml.SequenceNode):
            for i, item in enumerate(current.value):
                path = f"{at}[{i}]"
                out[path] = item.start_mark.line + 1
                stack.append((item, path, left - 1))
    return out


def _line_of(lines: dict[str, int], field: str) -> int | None:
    """The line of a field, or of the nearest field that holds it."""
    at = field
    while at:
        if at in lines:
            return lines[at]
        cut = max(at.rfind("."), at.rfind("["))
        at = at[:cut] if cut > 0 else ""
    return None


def with_field_lines(text: str, issues: Sequence[Issue]) -> list[Issue]:
    """The issues, each with the line of its field rather than of its
    document. Only on the error path: the manifest is composed again up to the
    last document with an issue (it was parsed within limits already)."""
    wanted = {i.document for i in issues if i.document is not None and i.field}
    if not wanted:
        return list(issues)
    maps: dict[tuple[int, int], dict[str, int]] = {}  # (document, resource's line) -> lines
    loader = Loader(text)
    try:
        index = 0
        while index < max(wanted) and loader.check_node():
            node = loader.get_node()
            index += 1
            if index not in wanted or node is None:
                continue
            items = (
                next(
                    (
                        v
                        for k, v in getattr(node, "value", ())
                        if getattr(k, "value", None) == "items"
                    ),
                    None,
                )
                if isinstance(node, yaml.MappingNode)
                else None
            )
            resources = items.value if isinstance(items, yaml.SequenceNode) else [node]
            for res in resources:
                maps[(index, res.start_mark.line + 1)] = field_lines(res)
    except yaml.YAMLError:
        return list(issues)
    finally:
        loader.dispose()
    out = []
    for issue in issues:
        lines = maps.get((issue.document or 0, issue.line or 0))
        line = _line_of(lines, issue.field) if lines else None
        out.append(replace(issue, line=line) if line is not None else issue)
    return out


def load_manifest(text: str, limits: ManifestLimits | None = None) -> list[Document]:
    """Parse a manifest and check every rule, fields and references."""
    documents = parse_manifest(text, limits)
    issues = [i for i in validate_documents(documents) if not i.warning]
    if issues:
        raise InvalidResources(with_field_lines(text, issues))
    return documents


def check_manifest_offline(
    text: str, limits: ManifestLimits | None = None
) -> tuple[list[Document], list[Issue]]:
    """What ``healthgate validate`` does: every rule, with references to
    other projects' resources as warnings (returned) instead of errors."""
    documents = parse_manifest(text, limits)
    issues = validate_documents(documents, offline=True)
    issues = with_field_lines(text, issues)
    errors = [i for i in issues if not i.warning]
    if errors:
        raise InvalidResources(errors)
    return documents, [i for i in issues if i.warning]


def load_manifest_file(path: str | Path, limits: ManifestLimits | None = None) -> list[Document]:
    return load_manifest(Path(path).read_text(encoding="utf-8"), limits)
