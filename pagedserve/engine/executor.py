"""Executors: how rank 0's steps reach the other tensor-parallel ranks (vLLM's executor classes).

``Executor`` (tp 1) runs each step on the one card. ``MultiprocExecutor`` (tp > 1) starts the
ranks of this machine with torch.multiprocessing (spawn, or a forkserver: ``rank_context``),
joins torch.distributed's rendezvous (gloo on CPU and kunlun-emu, nccl on CUDA;
``--dist-init-addr`` across machines) and, each step, broadcasts the scheduler's decisions as one
compact ``ModelInput`` (token ids, positions, slot mapping, block tables, logits rows, page
copies) before rank 0 runs its own shard. Every rank's model all-reduces after its row-parallel
layers and all-gathers the logits.

A rank that dies makes the executor unhealthy (``check_health`` raises): the engine core then
reports itself dead, so ``/health`` answers 503 and the requests in flight fail. A rank that dies
while starting fails the start at once, and no engine blocks its process's exit
(``MultiprocExecutor``).
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing

from pagedserve.config import EngineConfig, ParallelConfig, UsageContext
from pagedserve.engine.model_runner import ModelInput, ModelRunner, ModelRunnerOutput
from pagedserve.engine.start_checks import refuse_parallel_config
from pagedserve.engine.worker import Worker
from pagedserve.hal import distributed_backend
from pagedserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

STEP, DEVICE_STATS, STOP, LORA = 1, 2, 3, 4  # what rank 0 tells the others, once per message
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
GROUP_TIMEOUT = timedelta(days=30)  # an idle worker waits this long for rank 0's next step
JOIN_TIMEOUT_S = 10.0
JOIN_POLL_S = 0.05  # how often rank 0 looks at the rendezvous and its ranks while they join
JOINED_KEY = "pagedserve/joined"  # in the TCP store: how many ranks other than 0 have arrived
# How the ranks of this machine start (PAGEDSERVE_WORKER_MULTIPROC_METHOD, as vLLM's
# VLLM_WORKER_MULTIPROC_METHOD): "spawn", a fresh interpreter per rank, or "forkserver", a fork of
# one server process that imported torch and this module once. A rank's imports take 4-5 s of a
# core on a 2-core Zen 3, so a process that starts engine after engine (a notebook, a test suite)
# pays them once with the forkserver. Either way a rank re-imports the main module (SPAWN_HINT)
# and runs in the environment that its engine started in.
START_METHOD_ENV = "PAGEDSERVE_WORKER_MULTIPROC_METHOD"
START_METHODS = ("spawn", "forkserver")

SPAWN_HINT = (
    "Tensor-parallel ranks are processes started with multiprocessing's spawn, which re-imports "
    "the program's main module first: run the program from a script file (not from standard "
    'input), and put the code that builds LLM(...) under `if __name__ == "__main__":`'
)


class Executor:
    """One rank on one card."""

    world_size = 1
    failed: str | None = None  # why a rank is gone, once one is: the engine then stops

    def __init__(self, config: EngineConfig, usage_context: UsageContext):
        self.config = config
        self.usage_context = usage_context
        self.worker: Worker | None = None

    def load(self) -> Worker:
        """The card, its weights and its KV pages."""
        self.worker = Worker(self.config, 0, 1, self.usage_context)
        self.worker.init_kv_cache()
        return self.worker

    @property
    def runner(self) -> ModelRunner:
        return self.worker.runner

    def execute_model(self, sched, forks) -> ModelRunnerOutput:
        return self.runner.execute_model(sched, forks)

    def add_lora(self, request: LoRARequest) -> None:
        """Every rank reads the adapter (its own cut) into host memory; rank 0 first, whose
        ``LoRAAdapterError`` says why it does not fit (then no other rank is told)."""
        self.worker.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.worker.lora.remove(lora_int_id)

    def check_health(self) -> None:
        """Raise ``RuntimeError`` saying which rank is gone."""

    def device_stats(self) -> list[dict]:
        return [self.worker.device_stats()]

    @property
    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig, usage_context: UsageContext) -> Executor:
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return Executor(config, usage_context)
    return MultiprocExecutor(config, usage_context)


class MultiprocExecutor(Executor):
    """Rank 0 here; the other ranks of this node in processes of their own (``run_worker``).

    Its lifetime is bounded at both ends. Start-up watches every local rank: one that dies before
    it has joined the rendezvous or loaded its shard fails the start at once, with its reason (a
    rank that never ran: the main module's re-import, ``check_main_module``); one still in that
    re-import after ``dist_timeout`` seconds fails it then, with the same fix; and a failed start
    stops what it began. ``shutdown`` stops the ranks (STOP while they can hear it, a bounded join,
    then a kill) and leaves the process group, so that another engine can start in this process;
    it runs when called, when the engine that owns the executor is garbage-collected, and at
    interpreter exit. The ranks are daemons that exit by themselves when this process is gone.
    """

    def __init__(self, config: EngineConfig, usage_context: UsageContext, log_level: str = "info"):
        super().__init__(config, usage_context)
        parallel = config.parallel
        check_parallel_config(config, usage_context)
        check_main_module()
        check_no_process_group()
        self.world_size = parallel.tensor_parallel_size
        self.address = parallel.dist_init_addr or f"127.0.0.1:{_free_port()}"
        self.failed: str | None = None
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        self.reports: dict[int, list[tuple]] = {}  # what each local rank said while starting
        self.joined = False  # this process is in the group that this executor made
        self.loaded = False  # every rank has its shard and its KV pages: it runs steps
        self.closed = False
        # after multiprocessing's own exit hook (registered when multiprocessing.connection was
        # imported), so before it at exit: that hook would wait forever for a rank that ignores
        # SIGTERM
        atexit.register(self.shutdown)
        try:
            self._start_ranks(log_level)
            self._join()
        except BaseException:
            self.shutdown()
            raise

    def _start_ranks(self, log_level: str) -> None:
        ctx, environ = rank_context()
        for rank in range(1, self.config.parallel.ranks_per_node):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(self.config, rank, self.address, child, log_level, environ),
                name=f"pagedserve-tp-rank-{rank}",
                daemon=True,
            )
            self.procs[rank], self.conns[rank], self.reports[rank] = proc, parent, []
            proc.start()
            child.close()  # the rank's end: EOF here once the rank is gone

    def _join(self) -> None:
        backend = distributed_backend(self.config.device.device)
        try:
            init_distributed(self.config.parallel, 0, backend, self.address, self._check_starting)
        except RendezvousTimeoutError as e:
            raise self._never_ran_error() or e from None
        self.joined = True

    def load(self) -> Worker:
        try:
            self.worker = Worker(self.config, 0, self.world_size, self.usage_context)
            self._wait_loaded()
            self.worker.init_kv_cache()
        except BaseException:
            self.shutdown()
            raise
        self.runner.broadcast_step = self._broadcast_step
        self.loaded = True
        return self.worker

    # ---- start-up -----------------------------------------------------------------------------
    def _wait_loaded(self) -> None:
        """Until every local rank has its weights; a rank that cannot load says why here."""
        for rank, conn in self.conns.items():
            while not self._reported(rank, "ready"):
                ready = multiprocessing.connection.wait([conn, self.procs[rank].sentinel])
                if conn not in ready or not self._read_reports(rank):
                    raise self._start_error(rank)
                if self._reported(rank, "error"):
                    raise self._start_error(rank)

    def _check_starting(self) -> None:
        """Raise why a local rank is gone, while rank 0 waits for the ranks to join."""
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                raise self._start_error(rank)

    def _read_reports(self, rank: int) -> bool:
        """Take what ``rank`` has sent; False when its end is closed (the rank is gone)."""
        conn = self.conns[rank]
        try:
            while conn.poll():
                self.reports[rank].append(conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _reported(self, rank: int, status: str) -> tuple | None:
        return next((r for r in self.reports[rank] if r[0] == status), None)

    def _start_error(self, rank: int) -> Exception:
        """Why ``rank`` failed to start: its own error when it could send one; else how it
        ended, and for a rank that never ran, the usual cause and its fix."""
        proc = self.procs[rank]
        self._read_reports(rank)
        error = self._reported(rank, "error")
        if error is not None:
            _, text, user_error = error
            if user_error:
                return ValueError(text)
            return RuntimeError(f"tensor-parallel rank {rank} failed while starting:\n{text}")
        proc.join(JOIN_TIMEOUT_S)
        ended = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        output = "its traceback is above" if proc.exitcode == 1 else "see its output above"
        if self._reported(rank, "started") is None:
            return RuntimeError(f"{ended} before it ran ({output}). {SPAWN_HINT}")
        return RuntimeError(f"{ended} while starting ({output})")

    def _never_ran_error(self) -> Exception | None:
        """Why the rendezvous timed out when a local rank is alive but never ran: its process is
        still in spawn's re-import of the main module, which waits (an ``input()``, a server
        started at import) or is slow (a busy machine). None when every local rank ran."""
        late = [r for r in self.procs if self._read_reports(r) and not self._reported(r, "started")]
        if not late:
            return None
        ranks = ", ".join(f"{rank} (pid {self.procs[rank].pid})" for rank in late)
        flag = self.usage_context.name_of("dist_timeout")
        timeout = f"{self.config.parallel.dist_timeout:g} s ({flag})"
        return RuntimeError(
            f"tensor-parallel rank {ranks} never ran within {timeout}: its process is "
            "still re-importing the program's main module, as multiprocessing's spawn does first. "
            "Importing the main module must only define things: put what the program does (not "
            'only the LLM(...)) under `if __name__ == "__main__":`; on a machine that is merely '
            f"busy, raise {flag}"
        )

    # ---- steps --------------------------------------------------------------------------------
    def execute_model(self, sched, forks) -> ModelRunnerOutput:
        self.check_health()
        try:
            return self.runner.execute_model(sched, forks)
        except RuntimeError as e:  # a collective failed: a rank is gone or broken
            self.failed = f"a tensor-parallel rank failed during a step: {e}"
            raise RuntimeError(self.failed) from e

    def add_lora(self, request: LoRARequest) -> None:
        super().add_lora(request)
        self._send_lora(["add", request.lora_name, request.lora_int_id, request.lora_path])

    def remove_lora(self, lora_int_id: int) -> None:
        super().remove_lora(lora_int_id)
        self._send_lora(["remove", "", lora_int_id, ""])

    def _send_lora(self, message: list) -> None:
        self.check_health()
        data = list(json.dumps(message).encode())
        self._send(
            LORA, torch.tensor(data, dtype=torch.long, device=self.worker.device.torch_device)
        )

    def _broadcast_step(self, inp: ModelInput) -> None:
        self._send(STEP, inp.to_tensor().to(self.worker.device.torch_device))

    def _send(self, kind: int, payload: torch.Tensor | None = None) -> None:
        device = self.worker.device
        size = 0 if payload is None else payload.numel()
        header = torch.tensor([kind, size], dtype=torch.long, device=device.torch_device)
        device.broadcast(header, src=0)
        if payload is not None:
            device.broadcast(payload, src=0)

    def device_stats(self) -> list[dict]:
        """Every card's figures, gathered from the ranks between two steps."""
        self.check_health()
        self._send(DEVICE_STATS)
        stats: list[dict] = [None] * self.world_size
        dist.gather_object(self.worker.device_stats(), stats, dst=0)
        return stats

    # ---- health and shutdown ------------------------------------------------------------------
    def check_health(self) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel ranks were shut down")
        if self.failed is not None:
            raise RuntimeError(self.failed)
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                self.failed = (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode}"
                )
                raise RuntimeError(self.failed)

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self.procs.values()]

    def shutdown(self) -> None:
        """Stop the ranks and leave the process group; idempotent, and at most about
        ``JOIN_TIMEOUT_S`` per rank: a rank that does not stop when told is killed."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        stopped = self._tell_ranks_to_stop()
        for proc in self.procs.values():
            proc.join(JOIN_TIMEOUT_S if stopped else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        for conn in self.conns.values():
            conn.close()
        self.procs.clear()
        self.conns.clear()
        if self.joined:  # gloo leaves a group at once, a lost rank or not
            self.joined = False
            dist.destroy_process_group()

    def _tell_ranks_to_stop(self) -> bool:
        """STOP to every rank, when each is alive and waiting for rank 0's next message."""
        if not self.loaded or self.failed is not None:
            return False
        if not all(proc.is_alive() for proc in self.procs.values()):
            return False
        try:
            self._send(STOP)
        except RuntimeError:
            return False
        return True


# ---- start-up ---------------------------------------------------------------------------------
def check_parallel_config(config: EngineConfig, usage_context: UsageContext) -> None:
    """Refuse, before anything starts, sizes the node or the flags cannot give
    (``start_checks.refuse_parallel_config``); warn of the cards the ranks leave unused."""
    preset, unused = refuse_parallel_config(config, usage_context)
    if unused:
        logger.warning(
            "%s ranks use %d of the %d cards of %s per node; cards %s stay unused",
            config.parallel.tensor_parallel_size,
            config.parallel.ranks_per_node,
            preset.cards,
            preset.name,
            ", ".join(map(str, unused)),
        )


def init_distributed(
    parallel: ParallelConfig,
    rank: int,
    backend: str,
    address: str,
    check_ranks: Callable[[], None] | None = None,
) -> None:
    """Join the process group through a TCP store at ``address`` (rank 0 hosts it): rank 0 waits
    at most ``dist_timeout`` seconds for every other rank to arrive, calling ``check_ranks`` (which
    raises when a local rank is gone) while it waits."""
    check_no_process_group()
    store = _join_store(parallel, rank, address)
    if rank == 0:
        _wait_for_ranks(store, parallel, address, check_ranks)
    else:
        store.add(JOINED_KEY, 1)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=parallel.tensor_parallel_size,
        timeout=GROUP_TIMEOUT,
    )


def check_no_process_group() -> None:
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process; shut the other one down first (LLM.shutdown())"
        )


def _join_store(parallel: ParallelConfig, rank: int, address: str) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    try:
        return dist.TCPStore(
            host,
            int(port),
            parallel.tensor_parallel_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=parallel.dist_timeout),
            wait_for_workers=False,  # rank 0 waits in _wait_for_ranks, watching its own ranks
        )
    except (RuntimeError, ValueError, OSError) as e:
        role = "host the rendezvous at" if rank == 0 else "reach the rendezvous at"
        raise ValueError(
            f"tensor-parallel rank {rank} could not {role} {address} within "
            f"{parallel.dist_timeout:g} s ({e}); {_rendezvous_advice(parallel)}"
        ) from None


def _wait_for_ranks(
    store: dist.TCPStore,
    parallel: ParallelConfig,
    address: str,
    check_ranks: Callable[[], None] | None,
) -> None:
    others = parallel.tensor_parallel_size - 1
    deadline = time.monotonic() + parallel.dist_timeout
    while (joined := store.add(JOINED_KEY, 0)) < others:
        if check_ranks is not None:
            check_ranks()
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"tensor-parallel rank 0 hosted the rendezvous at {address}, but only {joined} "
                f"of the {others} other ranks joined within {parallel.dist_timeout:g} s; "
                f"{_rendezvous_advice(parallel)}"
            )
        time.sleep(JOIN_POLL_S)


class RendezvousTimeoutError(ValueError):
    """Rank 0 waited ``dist_timeout`` seconds and some ranks never joined."""


def _rendezvous_advice(parallel: ParallelConfig) -> str:
    return (
        f"check --dist-init-addr, that node 0 is started and that every node of --nnodes "
        f"{parallel.nnodes} joins (or raise --dist-timeout)"
    )


def check_main_module() -> None:
    """Refuse to start ranks that cannot start. Each rank's process is started with
    multiprocessing's spawn, which first re-imports this program's main module: a main module
    read from standard input cannot be read again, and a main module that builds the engine when
    imported would build it again in every rank (which is where this raises, in the rank)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # spawn's bootstrap
        raise RuntimeError(
            "this is a tensor-parallel rank's process re-importing the program's main module, "
            f"and the main module starts a tensor-parallel engine when imported. {SPAWN_HINT}"
        )
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or path is None:
        return  # imported by name (python -m), or none to import (an interactive session)
    if not os.path.isfile(os.path.join(multiprocessing.process.ORIGINAL_DIR or "", path)):
        raise RuntimeError(
            f"tensor-parallel ranks cannot start: this program's main module is {path!r}, "
            f"which a rank's process cannot read again. {SPAWN_HINT}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the other ranks --------------------------------------------------------------------------
def rank_context() -> tuple[multiprocessing.context.BaseContext, dict[str, str] | None]:
    """The multiprocessing context that starts this machine's ranks (START_METHOD_ENV), and the
    environment a forked rank takes on: a forkserver keeps the one it started in."""
    method = os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in START_METHODS:
        raise ValueError(
            f"{START_METHOD_ENV}={method!r}: choose one of {', '.join(START_METHODS)} (or unset it)"
        )
    ctx = torch.multiprocessing.get_context(method)
    if method == "spawn":
        return ctx, None
    ctx.set_forkserver_preload([__name__])
    return ctx, dict(os.environ)


def run_worker(
    config: EngineConfig,
    rank: int,
    address: str,
    conn: multiprocessing.connection.Connection | None = None,
    log_level: str = "info",
    environ: dict[str, str] | None = None,
) -> None:
    """A rank's process (or a node's first rank, in ``serve --node-rank N``): join, load its
    shard, report to ``conn`` (rank 0's end, on the same machine), then run steps until STOP.
    ``environ``: the starting engine's environment, for a rank forked from a forkserver."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if conn is not None:  # the engine core owns this process's lifetime
        conn.send(("started",))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    _exit_with_parent()
    torch.set_num_threads(max(torch.get_num_threads() // config.parallel.ranks_per_node, 1))
    try:
        backend = distributed_backend(config.device.device)
        init_distributed(config.parallel, rank, backend, address)
        worker = Worker(config, rank, config.parallel.tensor_parallel_size)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which says it
        user_error = isinstance(e, (ValueError, TypeError, FileNotFoundError))
        if conn is None:
            raise
        conn.send(("error", str(e) if user_error else traceback.format_exc(), user_error))
        sys.exit(1)
    if conn is not None:
        conn.send(("ready",))
    worker.init_kv_cache()
    logger.info("tensor-parallel rank %d ready on %s", rank, worker.device.describe())
    worker_loop(worker)
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """End this process when the one that started it is gone (killed, with no time to stop its
    ranks): a rank waits for rank 0's next message without a deadline, and would outlive it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.warning("the process that started this rank (pid %s) is gone; exiting", parent.pid)
        os._exit(1)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


def worker_loop(worker: Worker) -> None:
    """Receive rank 0's messages and act on them until STOP."""
    device = worker.device
    where = device.torch_device  # nccl moves CUDA tensors only
    while True:
        header = device.broadcast(torch.zeros(2, dtype=torch.long, device=where), src=0)
        kind, size = header.tolist()
        if kind == STOP:
            return
        if kind == DEVICE_STATS:
            dist.gather_object(worker.device_stats(), None, dst=0)
            continue
        payload = device.broadcast(torch.empty(size, dtype=torch.long, device=where), src=0)
        if kind == LORA:
            _lora_message(worker, payload)
        else:
            worker.runner.run_step(ModelInput.from_tensor(payload))


def _lora_message(worker: Worker, payload: torch.Tensor) -> None:
    """An adapter added (rank 0 has read it already: this rank reads its own cut) or removed."""
    op, name, lora_int_id, path = json.loads(bytes(payload.tolist()).decode())
    if op == "remove":
        worker.lora.remove(lora_int_id)
    else:
        worker.lora.add(LoRARequest(name, lora_int_id, path))


def serve_node(config: EngineConfig, log_level: str = "info") -> int:
    """``serve --node-rank N`` (N > 0): this machine's ranks, no HTTP server; node 0 serves."""
    parallel = config.parallel
    check_parallel_config(config, UsageContext.OPENAI_API_SERVER)
    first = parallel.node_rank * parallel.ranks_per_node
    ctx, environ = rank_context()
    procs = [
        ctx.Process(
            target=run_worker,
            args=(config, rank, parallel.dist_init_addr, None, log_level, environ),
            daemon=True,
        )
        for rank in range(first + 1, first + parallel.ranks_per_node)
    ]
    for proc in procs:
        proc.start()
    run_worker(config, first, parallel.dist_init_addr)
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
    return 0
