"""A griffe extension: the docstrings' reST roles become mkdocstrings cross-references.

zerompi's docstrings are written for Sphinx: ``:class:`Comm```, ``:func:`shard_range```,
``:mod:`.watchdog```, ``:meth:``, ``:data:``, ``:attr:``, ``:exc:``, ``:obj:``. Once the
package is loaded (griffe's ``on_package`` event: the whole tree, imports included),
every role in every docstring is rewritten into an autorefs cross-reference
``[`Name`][full.path]`` to the object's canonical path (where it is defined, which is
where its module's reference page renders it). Targets resolve the way Sphinx would:

* a dotted absolute path (``zerompi.mpi.collectives.Comm``) as it is;
* a leading-dot path (``.watchdog``, ``.nodes.nodes_of``) relative to the owner's
  package, one level up per further dot (Python's relative imports);
* a bare or dotted name (``Comm``, ``Comm.agree``, ``step``) against the owner's
  class members (inherited ones too, innermost class first), then its module's
  members and imports (griffe keeps them, ``if TYPE_CHECKING:`` ones included);
* ``~path`` shows only the last component, ``title <path>`` shows the title, ``!path``
  is not linked.

A target that cannot be resolved, or that resolves to a private object the reference
does not render (``_helper``), is logged as a warning (``mkdocs build --strict`` fails
on it) and shown as code without a link; in the docstring of a private object, which
the reference does not render either, only at info level (Sphinx would not see it).
A target outside the package (``numpy``, ``torch``: nothing of theirs is loaded) is
shown as code without a link, logged at info level.

Three more things griffe's static view needs: a paragraph ending in ``::`` before an
indented block ends in ``:`` (reST's literal block; the block is Markdown code); a
name in a module's ``__all__`` that only a module-level ``__getattr__`` provides
(``zerompi.ZeroOptimizer``, imported on first use) becomes an alias of its
definition, so that ``::: zerompi.ZeroOptimizer`` and roles naming it resolve; and a
name in a class's ``__slots__`` is an instance attribute even where its assignment is
one griffe does not read (``self.a, self.b = ...``).

Registered in ``mkdocs.yml`` under the python handler's ``options: extensions:``.
``UNRESOLVED`` collects what was warned about (``docs/hooks.py`` prints a summary).
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

import griffe

# Under "mkdocs.": mkdocs counts these warnings (and --strict fails on them).
logger = logging.getLogger("mkdocs.plugins.zerompi.roles")

ROLE = re.compile(
    r":(?:py:)?(?P<kind>class|func|mod|meth|data|attr|exc|obj|const|type):"
    r"`(?P<body>[^`]+)`"
)
TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.S)
LITERAL = re.compile(r"(?m)^(?P<text>.*\S)?[ \t]*::[ \t]*$")

# Outside the package whether installed here or not (the docs build needs neither).
EXTERNAL_MODULES = {"numpy", "np", "mpi4py", "MPI", "torch", "ml_dtypes", "matplotlib",
                    "pytest", "hypothesis", "griffe", "mkdocs"}

UNRESOLVED: list[tuple[str, str, str]] = []  # (owner path, role as written, why)
EXTERNAL: list[tuple[str, str]] = []  # (owner path, role as written)
RESOLVED: list[int] = [0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined under it (aliases, i.e. imports, left out)."""
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:
            yield from _objects(member)  # type: ignore[arg-type]


def _module_of(obj: griffe.Object) -> griffe.Module:
    while not obj.is_module:
        obj = obj.parent  # type: ignore[assignment]
    return obj  # type: ignore[return-value]


def _package_of(module: griffe.Module) -> griffe.Module:
    """The package a module's relative imports start from (a package is its own)."""
    if module.is_package or module.parent is None:
        return module
    return module.parent  # type: ignore[return-value]


class _Resolver:
    def __init__(self, collection: Any) -> None:
        self.collection = collection

    def walk(self, start: Any, parts: list[str]) -> Any:
        """Follow ``parts`` down from ``start`` through members (inherited ones too),
        through aliases to their targets; ``None`` if a part is missing; raise
        ``LookupError`` when an alias points outside what is loaded."""
        obj = start
        for part in parts:
            if obj.is_alias:
                obj = self.target(obj)
            members = obj.members
            if obj.is_class:
                try:
                    members = {**obj.inherited_members, **obj.members}
                except Exception:  # bases not resolvable: own members only
                    members = obj.members
            if part not in members:
                return None
            obj = members[part]
        return obj

    def target(self, alias: Any) -> Any:
        try:
            return alias.final_target
        except Exception as exc:  # AliasResolutionError, CyclicAliasError
            raise LookupError(alias.target_path) from exc

    def absolute(self, path: str) -> Any:
        """``path`` from the top; ``LookupError`` if it starts outside what is loaded
        (an importable module: ``numpy``, ``sys``, ``torch``), ``None`` if it names
        nothing at all."""
        head, *rest = path.split(".")
        if head in self.collection.members:
            return self.walk(self.collection.members[head], rest)
        if head in EXTERNAL_MODULES or head in sys.stdlib_module_names:
            raise LookupError(path)
        try:
            if importlib.util.find_spec(head) is not None:
                raise LookupError(path)
        except (ImportError, ValueError):
            pass
        return None

    def scopes(self, owner: griffe.Object) -> Iterator[Any]:
        """Where a bare name is looked up: the enclosing classes (innermost first), then
        the module (its members include what it imports)."""
        obj: Any = owner
        while obj is not None and not obj.is_module:
            if obj.is_class:
                yield obj
            obj = obj.parent
        yield obj

    def resolve(self, owner: griffe.Object, target: str) -> Any:
        module = _module_of(owner)
        if target.startswith("."):
            dots = len(target) - len(target.lstrip("."))
            base: Any = _package_of(module)
            for _ in range(dots - 1):
                base = base.parent if base.parent is not None else base
            rest = target[dots:].split(".") if target[dots:] else []
            found = self.walk(base, rest)
            if found is not None:
                return found
            target = target[dots:]  # Sphinx: then as if it had no dot
        head, *rest = target.split(".")
        for scope in self.scopes(owner):
            found = self.walk(scope, [head, *rest])
            if found is not None:
                return found
        if head in module.imports:  # ``import x.y`` leaves no member for the dotted name
            return self.absolute(".".join([module.imports[head], *rest]))
        return self.absolute(target)  # a dotted absolute path


def _canonical(obj: Any, resolver: _Resolver) -> Any:
    return resolver.target(obj) if obj.is_alias else obj


def _rendered(obj: Any) -> str | None:
    """Why the reference would not render ``obj`` (``None``: it does). Every module has
    a page; members are rendered unless private (mkdocstrings' default filter)."""
    names = []
    while obj is not None and not obj.is_module:
        names.append(obj.name)
        obj = obj.parent
    private = [name for name in names if _private(name)]
    return f"private member {private[-1]!r} is not rendered" if private else None


def _literal_blocks(text: str) -> str:
    """reST's ``text::`` + indented block -> ``text:`` + the block (Markdown code)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        match = LITERAL.match(line)
        if not match:
            continue
        after = [other for other in lines[i + 1 :] if other.strip()]
        indent = len(line) - len(line.lstrip())
        if not after or len(after[0]) - len(after[0].lstrip()) <= indent:
            continue
        text_part = match.group("text")
        lines[i] = f"{text_part}:" if text_part else ""
    return "\n".join(lines)


class ReSTRoles(griffe.Extension):
    """Rewrite reST roles into mkdocstrings cross-references (see the module)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        resolver = _Resolver(loader.modules_collection)
        self._lazy_exports(pkg)
        self._slots(pkg)
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = self._rewrite(obj, obj.docstring.value, resolver)

    # -- names that only a module-level __getattr__ provides --------------------------
    def _lazy_exports(self, pkg: griffe.Module) -> None:
        modules = [obj for obj in _objects(pkg) if obj.is_module]
        for module in modules:
            if "__getattr__" not in module.members or not module.exports:
                continue
            for name in [str(export) for export in module.exports]:
                if name in module.members:
                    continue
                found = [
                    other.members[name]
                    for other in modules
                    if other.path.startswith(module.path + ".")
                    and name in other.members
                    and not other.members[name].is_alias
                ]
                if len(found) == 1:
                    module.set_member(name, griffe.Alias(name, found[0], parent=module))

    # -- instance attributes named in __slots__ ---------------------------------------
    def _slots(self, pkg: griffe.Module) -> None:
        """A name in a class's ``__slots__`` is an instance attribute, also where
        griffe does not see its assignment (``self.a, self.b = ...``)."""
        for cls in _objects(pkg):
            slots = cls.members.get("__slots__") if cls.is_class else None
            if slots is None or slots.is_alias or getattr(slots, "value", None) is None:
                continue
            try:
                names = ast.literal_eval(str(slots.value))
            except (ValueError, SyntaxError):
                continue
            for name in [names] if isinstance(names, str) else names:
                if isinstance(name, str) and name not in cls.members:
                    attribute = griffe.Attribute(name, lineno=slots.lineno, parent=cls)
                    attribute.labels.add("instance-attribute")
                    cls.set_member(name, attribute)

    # -- roles -----------------------------------------------------------------------
    def _rewrite(self, owner: griffe.Object, text: str, resolver: _Resolver) -> str:
        def replace(match: re.Match[str]) -> str:
            role, body = match.group(0), match.group("body").strip()
            titled = TITLED.match(body)
            title, target = (titled["title"], titled["target"]) if titled else (None, body)
            target = target.strip()
            if target.startswith("!"):
                return f"`{title or target[1:]}`"
            short = target.startswith("~")
            target = target.lstrip("~")
            if target.endswith("()"):
                target = target[:-2]
            shown = title or (target.rsplit(".", 1)[-1] if short else target)
            try:
                found = resolver.resolve(owner, target)
            except LookupError:
                EXTERNAL.append((owner.path, role))
                logger.info("zerompi roles: %s: %s points outside the package", owner.path, role)
                return f"`{shown}`"
            if found is None:
                return self._unresolved(owner, role, shown, "no such object")
            try:
                found = _canonical(found, resolver)
            except LookupError:
                EXTERNAL.append((owner.path, role))
                return f"`{shown}`"
            why = _rendered(found)
            if why:
                return self._unresolved(owner, role, shown, f"{found.path}: {why}")
            RESOLVED[0] += 1
            return f"[`{shown}`][{found.path}]"

        return _literal_blocks(ROLE.sub(replace, text))

    @staticmethod
    def _unresolved(owner: griffe.Object, role: str, shown: str, why: str) -> str:
        where = f"{owner.relative_filepath}:{owner.lineno}" if owner.lineno else owner.path
        if _rendered(owner) is not None:  # a private object's docstring: not on the site
            logger.info("zerompi roles: unresolved %s in the docstring of %s, which is not "
                        "rendered (%s; %s)", role, owner.path, why, where)
            return f"`{shown}`"
        UNRESOLVED.append((owner.path, role, why))
        logger.warning("zerompi roles: unresolved %s in the docstring of %s (%s; %s)",
                       role, owner.path, why, where)
        return f"`{shown}`"
