"""Executors: how rank 0's steps reach the other tensor-parallel ranks (vLLM's executor classes).

``Executor`` (tp 1) runs each step on the one card. ``MultiprocExecutor`` (tp > 1) starts the
ranks of this machine with torch.multiprocessing (spawn), joins torch.distributed's rendezvous
(gloo on CPU and kunlun-emu, nccl on CUDA; ``--dist-init-addr`` across machines) and, each step,
broadcasts the scheduler's decisions as one compact ``ModelInput`` (token ids, positions, slot
mapping, block tables, logits rows, page copies) before rank 0 runs its own shard. Every rank's
model all-reduces after its row-parallel layers and all-gathers the logits.

A rank that dies makes the executor unhealthy (``check_health`` raises): the engine core then
reports itself dead, so ``/health`` answers 503 and the requests in flight fail.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing

from pagedserve.config import EngineConfig, ParallelConfig, UsageContext
from pagedserve.engine.model_runner import ModelInput, ModelRunner, ModelRunnerOutput
from pagedserve.engine.worker import Worker
from pagedserve.hal import distributed_backend, load_device_preset

logger = logging.getLogger(__name__)

STEP, DEVICE_STATS, STOP = 1, 2, 3  # what rank 0 tells the others, once per message
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
GROUP_TIMEOUT = timedelta(days=30)  # an idle worker waits this long for rank 0's next step
JOIN_TIMEOUT_S = 10.0


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
    """Rank 0 here; the other ranks of this node in processes of their own (``run_worker``)."""

    def __init__(self, config: EngineConfig, usage_context: UsageContext, log_level: str = "info"):
        super().__init__(config, usage_context)
        parallel = config.parallel
        check_parallel_config(config, usage_context)
        self.world_size = parallel.tensor_parallel_size
        self.address = parallel.dist_init_addr or f"127.0.0.1:{_free_port()}"
        self.failed: str | None = None
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self.conns: dict[int, multiprocessing.connection.Connection] = {}
        for rank in range(1, parallel.ranks_per_node):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(config, rank, self.address, child, log_level),
                name=f"pagedserve-tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs[rank], self.conns[rank] = proc, parent
        try:
            init_distributed(parallel, 0, distributed_backend(config.device.device), self.address)
        except BaseException:
            self.shutdown()
            raise

    def load(self) -> Worker:
        try:
            self.worker = Worker(self.config, 0, self.world_size, self.usage_context)
            self._wait_loaded()
            self.worker.init_kv_cache()
        except BaseException:
            self.shutdown()
            raise
        self.runner.broadcast_step = self._broadcast_step
        return self.worker

    def _wait_loaded(self) -> None:
        """Until every local rank has its weights; a rank that cannot load says why here."""
        for rank, conn in self.conns.items():
            ready = multiprocessing.connection.wait([conn, self.procs[rank].sentinel])
            if conn not in ready:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited with code {self.procs[rank].exitcode} "
                    "while loading; see the log above"
                )
            status, *detail = conn.recv()
            if status == "error":
                text, user_error = detail
                raise ValueError(text) if user_error else RuntimeError(text)

    # ---- steps --------------------------------------------------------------------------------
    def execute_model(self, sched, forks) -> ModelRunnerOutput:
        self.check_health()
        try:
            return self.runner.execute_model(sched, forks)
        except RuntimeError as e:  # a collective failed: a rank is gone or broken
            self.failed = f"a tensor-parallel rank failed during a step: {e}"
            raise RuntimeError(self.failed) from e

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
        """Tell the ranks to stop when they can still hear it; else end their processes."""
        stopped = False
        if self.failed is None and self.worker is not None and dist.is_initialized():
            try:
                self._send(STOP)
                stopped = True
            except RuntimeError:
                pass
        for proc in self.procs.values():
            proc.join(JOIN_TIMEOUT_S if stopped else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        self.procs.clear()
        if stopped:  # a group with a lost rank is left to the process's exit
            dist.destroy_process_group()


# ---- start-up ---------------------------------------------------------------------------------
def check_parallel_config(config: EngineConfig, usage_context: UsageContext) -> None:
    """Refuse, before anything starts, sizes the node or the flags cannot give."""
    parallel, name = config.parallel, usage_context.name_of
    tp = parallel.tensor_parallel_size
    if tp % parallel.nnodes:
        raise ValueError(
            f"{usage_context.assignment('tensor_parallel_size', tp)} cannot be spread evenly over "
            f"{usage_context.assignment('nnodes', parallel.nnodes)}; use a multiple of "
            f"{parallel.nnodes}"
        )
    if parallel.node_rank >= parallel.nnodes:
        raise ValueError(
            f"{usage_context.assignment('node_rank', parallel.node_rank)} must be less than "
            f"{name('nnodes')} {parallel.nnodes}"
        )
    if parallel.nnodes > 1 and not parallel.dist_init_addr:
        raise ValueError(
            f"{name('nnodes')} {parallel.nnodes} needs {name('dist_init_addr')} HOST:PORT, the "
            "address of node 0 that every node can reach"
        )
    preset = load_device_preset(config.device.device)
    unused = preset.check_tensor_parallel_size(
        parallel.ranks_per_node, name("tensor_parallel_size")
    )
    if unused:
        logger.warning(
            "%s ranks use %d of the %d cards of %s per node; cards %s stay unused",
            tp,
            parallel.ranks_per_node,
            preset.cards,
            preset.name,
            ", ".join(map(str, unused)),
        )


def init_distributed(parallel: ParallelConfig, rank: int, backend: str, address: str) -> None:
    """Join the process group through a TCP store at ``address`` (rank 0 hosts it); wait at most
    ``dist_timeout`` seconds for every rank to arrive."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process; shut the other one down first"
        )
    host, _, port = address.rpartition(":")
    world_size = parallel.tensor_parallel_size
    try:
        store = dist.TCPStore(
            host,
            int(port),
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=parallel.dist_timeout),
            wait_for_workers=True,
        )
    except (RuntimeError, ValueError, OSError) as e:
        role = "host the rendezvous at" if rank == 0 else "reach the rendezvous at"
        raise ValueError(
            f"tensor-parallel rank {rank} could not {role} {address} within "
            f"{parallel.dist_timeout:g} s ({e}); check --dist-init-addr, that node 0 is started "
            f"and that every node of --nnodes {parallel.nnodes} joins"
        ) from None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the other ranks --------------------------------------------------------------------------
def run_worker(
    config: EngineConfig,
    rank: int,
    address: str,
    conn: multiprocessing.connection.Connection | None = None,
    log_level: str = "info",
) -> None:
    """A rank's process (or a node's first rank, in ``serve --node-rank N``): join, load its
    shard, report to ``conn`` (rank 0's end, on the same machine), then run steps until STOP."""
    if conn is not None:  # the engine core owns this process's lifetime
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    torch.set_num_threads(max(torch.get_num_threads() // config.parallel.ranks_per_node, 1))
    try:
        backend = distributed_backend(config.device.device)
        init_distributed(config.parallel, rank, backend, address)
        worker = Worker(config, rank, config.parallel.tensor_parallel_size)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which says it
        user_error = isinstance(e, (ValueError, TypeError, FileNotFoundError))
        if conn is None:
            raise
        conn.send(("error", str(e) if user_error else repr(e), user_error))
        sys.exit(1)
    if conn is not None:
        conn.send(("ready",))
    worker.init_kv_cache()
    logger.info("tensor-parallel rank %d ready on %s", rank, worker.device.describe())
    worker_loop(worker)
    dist.destroy_process_group()


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
        worker.runner.run_step(ModelInput.from_tensor(payload))


def serve_node(config: EngineConfig, log_level: str = "info") -> int:
    """``serve --node-rank N`` (N > 0): this machine's ranks, no HTTP server; node 0 serves."""
    parallel = config.parallel
    check_parallel_config(config, UsageContext.OPENAI_API_SERVER)
    first = parallel.node_rank * parallel.ranks_per_node
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=run_worker,
            args=(config, rank, parallel.dist_init_addr, None, log_level),
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
