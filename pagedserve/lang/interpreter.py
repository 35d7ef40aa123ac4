"""Running programs: ``@function``, the program state ``s``, forks, batches and streaming."""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from pagedserve.lang.backend import Runtime
from pagedserve.lang.ir import Gen, RoleBlock, Select, ToolCall, ToolsBlock

_default_backend: Runtime | None = None
_END = object()


def set_default_backend(backend: Runtime) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Runtime:
    if _default_backend is None:
        raise RuntimeError(
            "no backend: call set_default_backend(Runtime('http://host:port')) or pass backend="
        )
    return _default_backend


class ProgramState:
    """``s`` in a program: its text, its named results (``s[name]``) and ``s.state``."""

    def __init__(
        self,
        backend: Runtime,
        state: dict,
        text: str = "",
        stream: bool = False,
        lora_path: str | None = None,
    ):
        self.backend = backend
        self.state = state
        # SGLang's: the LoRA adapter every request of the program runs with (None: the base)
        self.extra = {"lora_path": lora_path} if lora_path else {}
        self._text = text
        self.variables: dict[str, Any] = {}
        self.error: BaseException | None = None
        self._stream: queue.Queue | None = queue.Queue() if stream else None
        self.stream_gen = stream  # generate through streamed requests (forks inherit it)
        self._role: str | None = None
        self._done = threading.Event()
        if text:
            self._emit(text)

    # ---- reading ------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return self._text

    def __getitem__(self, name: str) -> Any:
        return self.variables[name]

    def get_var(self, name: str) -> Any:
        return self.variables[name]

    def text_iter(self) -> Iterator[str]:
        """The program's text as it is produced (``stream=True``)."""
        if self._stream is None:
            yield self._text
            return
        while (piece := self._stream.get()) is not _END:
            yield piece
        if self.error is not None:
            raise self.error

    def wait(self) -> ProgramState:
        self._done.wait()
        return self

    # ---- writing ------------------------------------------------------------------------------
    def __iadd__(self, item: Any) -> ProgramState:
        self._append(item)
        return self

    def _append(self, item: Any) -> None:
        if isinstance(item, str):
            self._add_text(item)
        elif isinstance(item, Gen):
            self._gen(item)
        elif isinstance(item, Select):
            self._select(item)
        elif isinstance(item, RoleBlock):
            self._role_block(item)
        elif isinstance(item, ToolsBlock):
            self._tools_block(item)
        elif isinstance(item, (list, tuple)):
            for part in item:
                self._append(part)
        else:
            raise TypeError(f"cannot add {type(item).__name__} to a program; add str, gen, select")

    def _add_text(self, text: str) -> None:
        self._text += text
        self._emit(text)

    def _emit(self, text: str) -> None:
        if self._stream is not None and text:
            self._stream.put(text)

    def _gen(self, g: Gen) -> None:
        params, tools = g.sampling_params(), g.tool_fields()
        meta: dict = {}
        if not self.stream_gen:
            result = self.backend.generate(self._text, params, **tools, **self.extra)
            out, meta = result["text"], result["meta_info"]
            self._add_text(out)
        else:
            out = ""
            pieces = self.backend.generate_stream(self._text, params, **tools, **self.extra)
            for piece, piece_meta in pieces:
                out += piece
                self._add_text(piece)
                meta = piece_meta  # the last one carries the calls
        if g.name:
            self.variables[g.name] = _tool_result(g, meta) if tools else out

    def _select(self, s: Select) -> None:
        scores = self.backend.score(self._text, s.choices, **self.extra)
        best = s.choices[max(range(len(scores)), key=scores.__getitem__)]
        self._add_text(best)
        if s.name:
            self.variables[s.name] = best

    # ---- role blocks (the model's chat template) -----------------------------------------------
    def _role_pieces(self, role: str) -> tuple[str, str]:
        roles = self.backend.model_info().get("chat_template_roles")
        if not roles:
            return f"{role}: ", "\n"
        begin = roles["begin"] if not self._text.startswith(roles["begin"]) else ""
        if role not in roles["roles"]:
            raise ValueError(f"the model's chat template has no {role} turn")
        prefix, suffix = roles["roles"][role]
        return begin + prefix, suffix

    def _role_block(self, block: RoleBlock) -> None:
        prefix, suffix = self._role_pieces(block.role)
        self._add_text(prefix)
        if block.content is not None:
            self._append(block.content)
        self._add_text(suffix)

    def _tools_block(self, block: ToolsBlock) -> None:
        """The chat template's text for the tools and no messages, after what it puts first."""
        begin = self.backend.chat_text([])
        text = self.backend.chat_text([], block.tools)
        if not text.startswith(begin):
            raise ValueError("the chat template does not put the tools before the conversation")
        self._add_text(text if not self._text.startswith(begin) else text[len(begin) :])

    @contextmanager
    def _role_scope(self, role: str):
        prefix, suffix = self._role_pieces(role)
        self._add_text(prefix)
        yield self
        self._add_text(suffix)

    def system(self, content: Any = None):
        return (
            self._role_scope("system")
            if content is None
            else self._append(RoleBlock("system", content))
        )

    def user(self, content: Any = None):
        return (
            self._role_scope("user")
            if content is None
            else self._append(RoleBlock("user", content))
        )

    def assistant(self, content: Any = None):
        return (
            self._role_scope("assistant")
            if content is None
            else self._append(RoleBlock("assistant", content))
        )

    def tool(self, content: Any = None):
        return (
            self._role_scope("tool")
            if content is None
            else self._append(RoleBlock("tool", content))
        )

    # ---- forks --------------------------------------------------------------------------------
    def fork(self, n: int = 1) -> ForkGroup:
        """``n`` branches that continue from this text; the server prefills it once and every
        branch's requests reuse its pages (prefix caching)."""
        self.backend.cache_prefix(self._text, **self.extra)
        branches = []
        for _ in range(n):
            branch = ProgramState(self.backend, self.state)
            branch.extra = self.extra
            branch._text = self._text
            branch.stream_gen = self.stream_gen
            branch.variables = dict(self.variables)
            branches.append(branch)
        return ForkGroup(branches)

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        if self._stream is not None:
            self._stream.put(_END)
        self._done.set()

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text!r}, variables={self.variables!r})"


def _tool_result(g: Gen, meta: dict) -> ToolCall | list[ToolCall] | None:
    calls = [ToolCall.from_openai(c) for c in meta.get("tool_calls") or []]
    if g.parallel_tool_calls:
        return calls
    return calls[0] if calls else None


class ForkGroup(list):
    """The branches of ``s.fork(n)``; ``join()`` waits for them (they run in this thread)."""

    def join(self) -> ForkGroup:
        return self


class SglFunction:
    """A program: ``fn(*args, session_id=None, backend=None, stream=False, **kwargs)`` runs it and
    returns its ``ProgramState``. A string argument that no parameter takes starts the text, as in
    ``echo_agent("Hello, world!")``. ``state`` lasts across calls; with ``session_id`` it is kept
    by the server, so another client process sees it."""

    def __init__(self, func: Callable):
        self.func = func
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(f"{func.__name__}: a program's first parameter must be 's'")
        self.arg_names = params[1:]
        self.state: dict = {}
        self._lock = threading.Lock()

    def __call__(
        self,
        *args: Any,
        session_id: str | None = None,
        backend: Runtime | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> ProgramState:
        return self.run(*args, session_id=session_id, backend=backend, stream=stream, **kwargs)

    def run(
        self, *args, session_id=None, backend=None, stream=False, lora_path=None, **kwargs
    ) -> ProgramState:
        """``lora_path``: the LoRA adapter (its name on the server) every request of this run
        uses, as SGLang's ``lora_path``."""
        backend = backend or get_default_backend()
        text = ""
        if len(args) > len(self.arg_names) and isinstance(args[len(self.arg_names)], str):
            text, args = args[len(self.arg_names)], args[: len(self.arg_names)]
        state = backend.load_state(session_id) if session_id else self.state
        s = ProgramState(backend, state, text, stream, lora_path)
        if stream:
            threading.Thread(
                target=self._execute, args=(s, args, kwargs, session_id), daemon=True
            ).start()
        else:
            self._execute(s, args, kwargs, session_id)
        return s

    def _execute(self, s: ProgramState, args, kwargs, session_id: str | None) -> None:
        error = None
        try:
            self.func(s, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - kept on the state, as SGLang's state.error()
            error = e
        if session_id and error is None:
            try:
                s.backend.save_state(session_id, s.state)
            except Exception as e:  # noqa: BLE001
                error = e
        s._finish(error)

    def run_batch(self, batch_kwargs: list[dict], num_threads: int = 16, **common) -> list:
        """Run the program once per dict of arguments, concurrently; states in order."""
        with ThreadPoolExecutor(max(1, min(num_threads, len(batch_kwargs)))) as pool:
            return list(pool.map(lambda kw: self.run(**common, **kw), batch_kwargs))


def function(func: Callable) -> SglFunction:
    return SglFunction(func)


def run_batch(program: SglFunction, batch_kwargs: list[dict], num_threads: int = 16, **common):
    return program.run_batch(batch_kwargs, num_threads, **common)
