"""Reach SGLang's parser and request-contract modules without its package `__init__`.

`import sglang` runs `sglang/__init__.py`, which imports torch.distributed,
triton, PIL and zmq: a GPU serving stack the recorder never uses. The parser
modules (`sglang.srt.function_call`, `sglang.srt.parser`) and the `/generate`
contract (`sglang.srt.entrypoints.api_contract`) need only their own pure-Python
closure (tools/requirements-sglang-cpu.txt), so the `sglang` package is
registered here as a bare package over its directory and the submodules are
imported from it. `xgrammar`, which the tool-call parser modules import for
type names (`StructuralTag`), gets the same treatment: its `__init__` imports
its torch kernels (`xgrammar.matcher`, `xgrammar.testing`) and torch costs a
server ~230 MB of RSS and seconds of startup for nothing a parser calls, so it
is registered as a lazy package that imports each name's own submodule on
first use (the names and submodules read from its real `__init__.py`). The
parsers stay SGLang's and xgrammar's own code; torch loads only if something
truly touches a module that needs it. Everything SGLang raises while importing (a broken or partial
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


def _register_lazy_xgrammar() -> None:
    """Put `xgrammar` in sys.modules as a package importing each name on first use.

    Its real `__init__` is a list of `from .sub import name` lines; the lazy
    package reads them (so a newer xgrammar's names keep working) and answers
    `xgrammar.name` by importing `xgrammar.sub` only then (PEP 562). Nothing
    happens when xgrammar is already imported or is not installed.
    """
    if "xgrammar" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("xgrammar")
    except (ImportError, ValueError):
        return
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return
    try:
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return  # left to the real import, which reports what is wrong
    origins: dict[str, str | None] = {}  # name -> submodule holding it (None: a submodule)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                origins[alias.asname or alias.name] = node.module
    package = types.ModuleType("xgrammar")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    package.__package__ = "xgrammar"
    package.__all__ = list(origins)  # type: ignore[attr-defined]

    def attribute(name: str) -> Any:
        if name not in origins:
            raise AttributeError(f"module 'xgrammar' has no attribute {name!r}")
        sub = origins[name]
        if sub is None:
            value = importlib.import_module(f"xgrammar.{name}")
        else:
            holder = importlib.import_module(f"xgrammar.{sub}")
            value = getattr(holder, name, None)
            if value is None:  # `from .contrib import hf`: a submodule of a subpackage
                value = importlib.import_module(f"xgrammar.{sub}.{name}")
        setattr(package, name, value)
        return value

    package.__getattr__ = attribute  # type: ignore[method-assign]
    sys.modules["xgrammar"] = package


def load(module: str) -> Any:
    """`sglang.<module>`, imported without running `sglang/__init__.py` (nor xgrammar's)."""
    _register_bare_package()
    _register_lazy_xgrammar()
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
