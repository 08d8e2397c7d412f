"""MkDocs hooks for the zerompi site (registered in ``mkdocs.yml`` under ``hooks:``).

* **One reference page per module, generated.** Every module of the package (every
  ``.py`` under ``zerompi/``; the C extension ``zerompi._kernels`` has none) gets a
  virtual page ``reference/<dotted.name>.md`` holding ``::: <dotted.name>``, and the
  nav's "API reference" section gets a "Modules" entry listing them by package: a new
  module appears by itself, a removed one disappears. A page renders the public names
  its module defines; a name it only imports and re-exports (``zerompi.Deferred``) is
  rendered on its own module's page and on the public API page, so that every object
  has one primary anchor for cross-references.
* **Objects still to come.** A ``::: path`` line of a page whose object does not exist
  (yet) fails the build, unless the path is in ``PENDING``: then the line is left out
  of the page and the build says so at info level. ``PENDING`` lists the names of the
  API being introduced (``ZeroConfig`` and its policies); once they exist the lines
  render by themselves and the set can be emptied.
* **Links that leave docs/.** The pages link to files of the repository outside
  ``docs/`` (``../slurm/README.md``, ``../scripts/results/bench-w2.png``), which is
  right when reading them on GitHub. On the site an image is copied in
  (``_repo/<path>``) and its link rewritten; another link becomes a link into the
  repository when ``repo_url`` is set (``<repo_url>/blob/main/<path>``), else its text
  alone. A link to a repository file that does not exist is a warning (so
  ``--strict`` fails on it), as mkdocs does for links inside docs/.
* **The unresolved roles.** After the build, a summary of the reST roles that
  ``docs/griffe_roles.py`` could not resolve (each was already a warning).
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

logger = logging.getLogger("mkdocs.plugins.zerompi.hooks")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "zerompi"
SKIP = {"zerompi._kernels"}
REFERENCE = "reference"
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"(?ms)^```.*?^```[ \t]*$")

_images: dict[str, str] = {}  # repository path -> site path of its copy


def modules() -> list[str]:
    """Every module of the package, as dotted names, packages before their modules."""
    found = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if name not in SKIP and "__pycache__" not in parts:
            found.append(name)
    return sorted(found, key=lambda name: name.split("."))


def page_of(module: str) -> str:
    return f"{REFERENCE}/{module}.md"


def _nav_modules(names: list[str]) -> list[Any]:
    """Nested nav entries: a package's page first, then its modules and subpackages."""
    def entries(prefix: str) -> list[Any]:
        depth = prefix.count(".") + 1
        children = [n for n in names if n.startswith(prefix + ".") and n.count(".") == depth]
        out: list[Any] = []
        for child in children:
            if any(n.startswith(child + ".") for n in names):
                out.append({child: [{child: page_of(child)}, *entries(child)]})
            else:
                out.append({child: page_of(child)})
        return out

    return [{PACKAGE: page_of(PACKAGE)}, *entries(PACKAGE)]


def _find_reference_section(nav: list[Any]) -> list[Any] | None:
    for item in nav:
        if isinstance(item, dict):
            for value in item.values():
                if isinstance(value, list):
                    if f"{REFERENCE}/index.md" in value or any(
                        isinstance(v, dict) and f"{REFERENCE}/index.md" in v.values() for v in value
                    ):
                        return value
                    inner = _find_reference_section(value)
                    if inner is not None:
                        return inner
    return None


def on_config(config: Any, **kwargs: Any) -> Any:
    sys.path.insert(0, str(Path(__file__).parent))  # docs/griffe_roles.py for the summary
    section = _find_reference_section(config.nav or [])
    if section is None:
        logger.warning("zerompi hooks: no nav section holds reference/index.md")
    else:
        section.append({"Modules": _nav_modules(modules())})
    return config


def _repo_path(page_src: str, target: str, docs_dir: Path) -> Path | None:
    """The repository file a relative link of a docs page names, if it is outside
    docs/ (``None`` for links mkdocs handles itself)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    resolved = (docs_dir / posixpath.dirname(page_src) / path).resolve()
    try:
        resolved.relative_to(docs_dir)
        return None
    except ValueError:
        pass
    try:
        resolved.relative_to(ROOT)
    except ValueError:
        return None
    return resolved


def _prose(markdown: str) -> str:
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)


def _own_members(module: str) -> list[str] | None:
    """The public names ``module`` defines itself, in source order (``None``: griffe
    does not know the module). Names it imports and re-exports (``zerompi.Deferred``)
    are left to the page of the module defining them, and the public API page: one
    object, one primary anchor."""
    pkg = _package()
    try:
        obj = pkg if module == PACKAGE else pkg[module.removeprefix(PACKAGE + ".")]
    except KeyError:
        return None
    own = [
        member for name, member in obj.members.items()
        if not member.is_alias and not member.is_module
        and not (name.startswith("_") and not (name.startswith("__") and name.endswith("__")))
        and not (name.startswith("__") and name != "__version__")  # __all__, __getattr__
    ]
    return [m.name for m in sorted(own, key=lambda m: m.lineno or 0)]


def _page_content(module: str) -> str:
    members = _own_members(module)
    if members is None:
        return f"::: {module}\n"
    listed = "[" + ", ".join(members) + "]" if members else "false"
    return f"::: {module}\n    options:\n      members: {listed}\n"


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    for name in modules():
        files.append(File.generated(config, page_of(name), content=_page_content(name)))
    docs_dir = Path(config.docs_dir).resolve()
    for file in list(files.documentation_pages()):
        if file.abs_src_path is None or file.generated_by:
            continue
        for match in LINK.finditer(_prose(Path(file.abs_src_path).read_text())):
            path = _repo_path(file.src_uri, match["target"], docs_dir)
            if match["bang"] and path is not None and path.is_file():
                rel = path.relative_to(ROOT).as_posix()
                if rel not in _images:
                    _images[rel] = f"_repo/{rel}"
                    files.append(File.generated(config, _images[rel], abs_src_path=str(path)))
    return files



def _package() -> Any:
    """The package as griffe sees it, loaded once, without rewriting (or warning about)
    its roles: mkdocstrings' own load does that."""
    if not hasattr(_package, "pkg"):
        import griffe
        from griffe_roles import ReSTRoles

        pkg = griffe.load(PACKAGE, search_paths=[str(ROOT)], allow_inspection=False)
        ReSTRoles()._lazy_exports(pkg)
        _package.pkg = pkg  # type: ignore[attr-defined]
    return _package.pkg  # type: ignore[attr-defined]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files, **kwargs: Any) -> str:
    if page.file.generated_by:
        return markdown
    docs_dir = Path(config.docs_dir).resolve()
    repo_url = (config.repo_url or "").rstrip("/")

    def link(match: re.Match[str]) -> str:
        path = _repo_path(page.file.src_uri, match["target"], docs_dir)
        if path is None:
            return match.group(0)
        rel = path.relative_to(ROOT).as_posix() if path.exists() else None
        if rel is None:
            logger.warning("zerompi hooks: %s links to %r, which is not in the repository",
                           page.file.src_uri, match["target"])
            return match["text"]
        if match["bang"] and rel in _images:
            site = posixpath.relpath(_images[rel], posixpath.dirname(page.file.src_uri) or ".")
            return f"![{match['text']}]({site})"
        if repo_url:
            fragment = match["target"].partition("#")[2]
            url = f"{repo_url}/blob/main/{rel}" + (f"#{fragment}" if fragment else "")
            return f"{match['bang']}[{match['text']}]({url})"
        return match["text"]

    parts = re.split(r"(?ms)(^```.*?^```[ \t]*$)", markdown)
    return "".join(p if i % 2 else LINK.sub(link, p) for i, p in enumerate(parts))


def on_post_build(config: Any, **kwargs: Any) -> None:
    try:
        from griffe_roles import EXTERNAL, RESOLVED, UNRESOLVED
    except ImportError:
        return
    logger.info("zerompi roles: %d resolved, %d outside the package, %d unresolved",
                RESOLVED[0], len(EXTERNAL), len(UNRESOLVED))
