"""Reach SGLang's parser and request-contract modules without its package `__init__`.

`import sglang` runs `sglang/__init__.py`, which imports torch.distributed,
triton, PIL and zmq: a GPU serving stack the recorder never uses. The parser
modules (`sglang.srt.function_call`, `sglang.srt.parser`) and the `/generate`
contract (`sglang.srt.entrypoints.api_contract`) need only their own pure-Python
closure (tools/requirements-sglang-cpu.txt), so the `sglang` package is
registered here as a bare package over its directory and the submodules are
imported from it. Everything SGLang raises while importing (a broken or partial
install, not only ImportError) becomes `SglangUnavailable`, whose message says
how to install it. Callers: recorder.model.parsers (the `sglang` backend, name lists)
and tools/test_engine (the request contract).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
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


def load(module: str) -> Any:
    """`sglang.<module>`, imported without running `sglang/__init__.py`."""
    _register_bare_package()
    try:
        return importlib.import_module(f"sglang.{module}")
    except Exception as exc:  # one seam: any import-time failure is an unusable install
        raise SglangUnavailable(
            f"sglang.{module} does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc


def available() -> bool:
    """Whether SGLang's parser modules import here."""
    try:
        load("srt.function_call.function_call_parser")
        load("srt.parser.reasoning_parser")
    except SglangUnavailable:
        return False
    return True


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
