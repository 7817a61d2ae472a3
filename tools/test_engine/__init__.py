"""Test engines speaking SGLang's `/generate` subset: scripted and a tiny real model.

In-process (pytest):
    engine = ScriptedEngine(tokenizer, replies=["Hi!"]); url = await engine.start()
Command line:
    python -m tools.test_engine --backend scripted|tiny --port N [--script FILE]
        [--context-length N] [--tokenizer PATH]
"""

from .core import EngineCore, EngineServer, Fault, GenRequest, build_app
from .launch import ThreadedEngine, free_port, start_subprocess
from .scripted import Reply, Script, ScriptedBackend, ScriptedEngine, hashed_logprob, load_script

__all__ = [
    "EngineCore",
    "EngineServer",
    "Fault",
    "GenRequest",
    "Reply",
    "Script",
    "ScriptedBackend",
    "ScriptedEngine",
    "ThreadedEngine",
    "build_app",
    "free_port",
    "hashed_logprob",
    "load_script",
    "start_subprocess",
]
