"""The offline API, as vLLM's ``LLM``: ``generate`` over a batch of prompts, ``chat``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.llm_engine import LLMEngine, RequestRejectedError
from pagedserve.engine.output_processor import EngineStepError
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # serve's


class _TqdmHandler(logging.Handler):
    """pagedserve's records, with their level and logger, for a script that set up no logging of
    its own (Python would print the bare message). Written with ``tqdm.write``, so a progress bar
    is redrawn whole below the line instead of being cut by it."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.root.handlers:  # the application's own logging has it (no line twice)
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _route_logging() -> None:
    package = logging.getLogger("pagedserve")
    if not any(isinstance(h, _TqdmHandler) for h in package.handlers):
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        package.addHandler(handler)


@contextmanager
def _logging_above_the_bar() -> Iterator[None]:
    """The application's console handlers write above the bar while it runs."""
    if not logging.root.handlers:
        yield  # _TqdmHandler does
        return
    with logging_redirect_tqdm(tqdm_class=tqdm):
        yield


class LLM:
    """An engine in this process. At ``tensor_parallel_size`` > 1 it has worker processes and a
    process group: ``shutdown()`` (or the end of a ``with LLM(...) as llm:`` block) stops them,
    and so do the garbage collector once the ``LLM`` is gone and interpreter exit; then another
    tensor-parallel ``LLM`` can start in this process. The workers re-import the main module
    (multiprocessing's spawn): build the ``LLM`` in a script file, under
    ``if __name__ == "__main__":``."""

    def __init__(self, model: str = "demo", **kwargs: Any):
        _route_logging()
        context = UsageContext.LLM_CLASS
        config = EngineConfig.from_kwargs(context, model=model, **kwargs)
        self.llm_engine = LLMEngine(config, context)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the engine: its tensor-parallel workers and their process group; idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; a prompt is a string or ``{"prompt_token_ids": [...]}``.

        ``lora_request`` (as vLLM's): the LoRA adapter every prompt runs with, or one per prompt
        (None: the base model); an ``LLM(enable_lora=True)`` reads each adapter on first use.

        A prompt that can never run (longer than ``max_model_len``, larger than the whole KV
        cache, empty, or with ids outside the vocabulary) does not stop the others: its output has
        ``finish_reason == "rejected"`` in every choice and the reason in ``error``, and a warning
        is logged. A forward pass that fails on the device (a fault the engine recovers from)
        ends the requests it computed with ``finish_reason == "error"`` and the reason in
        ``error``; one that raises for any other cause is a bug: ``EngineStepError`` names the
        requests and the cause, once the call's other requests are aborted."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(sampling_params)} sampling_params"
            )
        loras = _per_prompt(lora_request, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        request_ids, rejected = [], {}
        for index, (prompt, ids, sp) in enumerate(zip(prompts, encoded, sampling_params)):
            request_id = str(self._counter)
            self._counter += 1
            request_ids.append(request_id)
            text = prompt if isinstance(prompt, str) else None
            try:
                self.llm_engine.add_request(
                    request_id, ids, sp, prompt=text, lora_request=loras[index]
                )
            except RequestRejectedError as e:
                logger.warning("prompt %d rejected: %s", index, e)
                rejected[request_id] = _rejected_output(request_id, text, ids, sp, str(e))
        return self._run_engine(request_ids, rejected, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat
        template; ``tools`` (OpenAI's shape) go to the template, as vLLM's ``LLM.chat`` sends
        them (the calls in the text are read by the server, not here)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self._tokenizer()
        prompts = [
            {
                "prompt_token_ids": tok.encode(
                    tok.apply_chat_template(
                        c, add_generation_prompt=add_generation_prompt, tools=tools
                    ),
                    add_special_tokens=False,
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _tokenizer(self):
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError(
                "this model directory has no tokenizer.json: pass prompts as "
                '{"prompt_token_ids": [...]} or add a tokenizer'
            )
        return tok

    def _encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError('a dict prompt needs "prompt_token_ids": [int, ...]')
            return list(prompt["prompt_token_ids"])
        return self._tokenizer().encode(prompt)

    def _run_engine(
        self, request_ids: list[str], rejected: dict[str, RequestOutput], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        finished = dict(rejected)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        with _logging_above_the_bar(), bar:
            bar.update(len(rejected))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                for rid, why in engine.take_rejected():  # a constraint that failed to compile
                    finished[rid] = _rejected_output(rid, None, [], SamplingParams(), why)
                    bar.update(1)
                failed = engine.take_failed()  # a step failed under them
                error = engine.take_step_error()
                if error is not None:  # a bug, not the device: no output can be trusted
                    self._abort_unfinished(request_ids, finished)
                    ids = ", ".join(rid for rid, _ in failed)
                    raise EngineStepError(
                        f"the engine failed computing request(s) {ids}: {error!r} (a bug in "
                        "pagedserve: its traceback is logged above); the other requests of this "
                        "call were aborted"
                    ) from error
                for rid, why in failed:  # a device fault: the engine recovered
                    finished[rid] = _rejected_output(rid, None, [], SamplingParams(), why, "error")
                    bar.update(1)
        return [finished[rid] for rid in request_ids]

    def _abort_unfinished(self, request_ids: list[str], finished: dict) -> None:
        self.llm_engine.abort_request([rid for rid in request_ids if rid not in finished])


def _per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(loras)} lora_request entries")
    return loras


def _rejected_output(
    request_id: str,
    prompt: str | None,
    ids: list[int],
    params: SamplingParams,
    error: str,
    finish_reason: str = "rejected",
) -> RequestOutput:
    """A request that produced nothing: rejected, or ended by a failed step ("error")."""
    choices = [
        CompletionOutput(index=i, text="", token_ids=[], finish_reason=finish_reason)
        for i in range(params.n)
    ]
    return RequestOutput(request_id, prompt, ids, choices, finished=True, error=error)
