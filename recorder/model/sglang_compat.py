"""Reach SGLang's parser and request-contract modules without its package `__init__`.

`import sglang` runs `sglang/__init__.py`, which imports torch.distributed,
triton, PIL and zmq: a GPU serving stack the recorder never uses. The parser
modules (`sglang.srt.function_call`, `sglang.srt.parser`) and the `/generate`
contract (`sglang.srt.entrypoints.api_contract`) need only their own pure-Python
closure (tools/requirements-sglang-cpu.txt), so the `sglang` package is
registered here as a bare package over its directory and the submodules are
imported from it. What those modules import only for names a parser never
uses at runtime loads lazily too (`_LAZY_PACKAGES`, `_DEFERRED_MODULES`):
`xgrammar`, imported for type names (`StructuralTag`), whose `__init__` imports
its torch kernels (torch costs a server ~230 MB of RSS and seconds of
startup); the openai SDK's packages, whose `__init__`s import its client and
every type where the protocol models need ~20 Responses types; `sglang.utils`
(requests, IPython, tqdm) for one function a validator may call. A lazy
package imports each name's own submodule on first use (the names read from
its real `__init__.py`), or runs its real `__init__` on first use when that
does more than re-export; a deferred module runs on its first call. The
parsers stay SGLang's, xgrammar's and openai's own code, and the modules load
the moment something truly uses them. Everything SGLang raises while importing (a broken or partial
install, not only ImportError) becomes `SglangUnavailable`, whose message says
how to install it. Callers: recorder.model.parsers (the `sglang` backend, name lists)
and tools/test_engine (the request contract).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import sys
import threading
import types
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "install SGLang's CPU parser stack: pip install --no-deps sglang==0.5.23 "
    "-r tools/requirements-sglang-cpu.txt (tools/setup.sh does it)"
)


class SglangUnavailable(ImportError):
    """SGLang is not installed here, or its install is broken; the message says how to fix it."""


def _register_bare_package() -> None:
    """Put `sglang` in sys.modules as a package whose `__init__` never runs."""
    current = sys.modules.get("sglang")
    if current is not None:
        return
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError) as exc:
        raise SglangUnavailable(f"sglang cannot be found ({exc}); {INSTALL_HINT}") from exc
    if spec is None or not spec.submodule_search_locations:
        raise SglangUnavailable(f"sglang is not installed; {INSTALL_HINT}")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    package.__package__ = "sglang"
    sys.modules["sglang"] = package


def _source(name: str) -> tuple[importlib.machinery.ModuleSpec, ast.Module] | None:
    """The spec and parsed source of module `name`; None when absent or unreadable.

    None leaves the module to the real import, which reports what is wrong.
    """
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or spec.loader is None:
        return None
    try:
        return spec, ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None


def _reexports(tree: ast.Module) -> tuple[dict[str, str | None], bool]:
    """A package `__init__`'s `from .sub import name` names -> `sub` (None: `from . import sub`),
    and whether re-exporting is all it does (besides a docstring and dunder assignments)."""
    origins: dict[str, str | None] = {}
    only_reexports = True
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                origins[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            pass
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            pass  # the docstring
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("__") for t in node.targets
        ):
            pass  # __all__, __version__
        else:
            only_reexports = False
    return origins, only_reexports


# Held while a lazy module's own code runs, so two threads never both run it.
_RUNNING = threading.RLock()


def _run_real_code(module: types.ModuleType, name: str) -> types.ModuleType:
    """Run module `name`'s own code in `module` once: it becomes the real module."""
    with _RUNNING:
        if "__getattr__" in module.__dict__:
            del module.__getattr__
            spec = module.__spec__
            assert spec is not None and spec.loader is not None
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)  # as a failed import leaves it: absent
                raise
    return module


def _register_lazy_package(name: str) -> None:
    """Put package `name` in sys.modules with its `__init__` not run; names load on first use.

    A package `__init__` that only re-exports (`from .sub import name` lines,
    read from its real source so a newer version's names keep working) answers
    `package.name` by importing `package.sub` only then (PEP 562); its
    submodules import without it. One that does more (the openai SDK's sets up
    logging and its client) runs whole on the first name that is not a
    submodule, so a later user of the whole package gets the real package.
    Nothing happens when it is imported already or is not installed.
    """
    if name in sys.modules:
        return
    found = _source(name)
    if found is None or not found[0].submodule_search_locations:
        return
    spec, tree = found
    origins, only_reexports = _reexports(tree)
    package = importlib.util.module_from_spec(spec)
    if only_reexports:
        package.__all__ = list(origins)  # type: ignore[attr-defined]

    def attribute(attr: str) -> Any:
        if only_reexports and attr in origins:
            sub = origins[attr]
            if sub is None:
                value = importlib.import_module(f"{name}.{attr}")
            else:
                holder = importlib.import_module(f"{name}.{sub}")
                value = getattr(holder, attr, None)
                if value is None:  # `from .contrib import hf`: a submodule of a subpackage
                    value = importlib.import_module(f"{name}.{sub}.{attr}")
            setattr(package, attr, value)
            return value
        if not attr.startswith("__") and importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")  # `from . import sub`
        if only_reexports:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        return getattr(_run_real_code(package, name), attr)

    package.__getattr__ = attribute  # type: ignore[method-assign]
    _install(name, package)


def _register_deferred_module(name: str) -> None:
    """Put module `name` in sys.modules unexecuted; it runs on first real use.

    `from name import f` of a plain function `f` (read from its source) gets a
    forwarder that runs the real module on its first call, then calls the real
    `f`; any other attribute runs the real module at once. Nothing happens
    when it is imported already, absent, or a package.
    """
    if name in sys.modules:
        return
    found = _source(name)
    if found is None or found[0].submodule_search_locations is not None:
        return
    spec, tree = found
    functions = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.decorator_list
    }
    module = importlib.util.module_from_spec(spec)

    def attribute(attr: str) -> Any:
        if attr == "__path__":  # the import system asking whether it is a package: no
            raise AttributeError(f"module {name!r} has no attribute '__path__'")
        if attr not in functions:
            return getattr(_run_real_code(module, name), attr)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return getattr(_run_real_code(module, name), attr)(*args, **kwargs)

        forward.__name__ = forward.__qualname__ = attr
        forward.__module__ = name
        return forward

    module.__getattr__ = attribute  # type: ignore[method-assign]
    _install(name, module)


_registered: dict[str, types.ModuleType] = {}  # the lazy modules put in sys.modules here


def _install(name: str, module: types.ModuleType) -> None:
    """Register `module` as `name`, and as its parent package's attribute (as an import does)."""
    sys.modules[name] = module
    _registered[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def _under_lazy_parent(name: str) -> bool:
    """Whether `name` is top-level or its parent is one of ours, still lazy: a lazy child of a
    real, initialised package would miss the attribute its `__init__` sets."""
    parent = name.rpartition(".")[0]
    return not parent or (parent in _registered and sys.modules.get(parent) is _registered[parent])


# What SGLang's parser modules import for names a parser never uses at runtime,
# loaded lazily (each entry's cost is a server's RSS, measured by
# tools/bench_session_memory.py's import census). xgrammar's `__init__` imports
# its torch kernels (~230 MB); the OpenAI protocol models import the openai SDK
# for ~20 of its Responses types, and its packages' `__init__`s import ~500
# modules (the client, httpx's CLI, every type: ~7 MB); `sglang.utils`, from
# which the protocol models take `convert_json_schema_to_str` for a
# `response_format` validator, imports requests, IPython and tqdm (~9 MB).
_LAZY_PACKAGES = (
    "xgrammar",
    "openai",
    "openai.types",
    "openai.types.responses",
    "openai.types.shared",
)
_DEFERRED_MODULES = ("sglang.utils",)


def load(module: str) -> Any:
    """`sglang.<module>`, imported without running `sglang/__init__.py` (nor xgrammar's)."""
    _register_bare_package()
    for name in _LAZY_PACKAGES:
        if _under_lazy_parent(name):
            _register_lazy_package(name)
    for name in _DEFERRED_MODULES:
        _register_deferred_module(name)
    try:
        return importlib.import_module(f"sglang.{module}")
    except Exception as exc:  # one seam: any import-time failure is an unusable install
        raise SglangUnavailable(
            f"sglang.{module} does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc


def available() -> bool:
    """Whether SGLang's parser modules are here: the tool-call parsers import.

    The reasoning parsers' module is only located, not imported (it imports
    transformers, ~25 MB of RSS, which a server without a reasoning parser
    never needs); a broken one fails when a parser is built, saying how to fix it.
    """
    try:
        load("srt.function_call.function_call_parser")
        found = importlib.util.find_spec("sglang.srt.parser.reasoning_parser") is not None
    except (SglangUnavailable, ImportError, ValueError):
        return False
    return found


def version() -> str:
    """The installed SGLang's version ('' when it is not installed)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return ""


def tool_parser_names() -> tuple[str, ...]:
    """Every tool-call parser name the installed SGLang registers."""
    parser = load("srt.function_call.function_call_parser").FunctionCallParser
    return tuple(parser.ToolCallParserEnum)


def reasoning_parser_names() -> tuple[str, ...]:
    """Every reasoning parser name the installed SGLang registers."""
    return tuple(load("srt.parser.reasoning_parser").ReasoningParser.DetectorMap)


def generate_contract_error(body: Any) -> str | None:
    """What SGLang's HTTP server says about a `/generate` JSON body before accepting it.

    None when the body is admitted; else the contract's own error text (SGLang
    answers HTTP 400 with it).
    """
    return load("srt.entrypoints.api_contract").generate_contract_error(body)
