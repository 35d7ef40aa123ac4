"""What the engine does about the faults its device reports (the HAL detects them; here they are
recovered), so that no fault costs more than a recompute:

- a KV page the device reports corrupted leaves the prefix cache, and every running request that
  holds it is preempted: it recomputes its KV on good pages (never swapped: its pages are bad);
- a host-tier frame the device reports corrupted leaves the host prefix cache, and the swapped-out
  request that holds it recomputes instead of coming back by copy;
- a weight page whose checksum fails (the patrol scrub between a step's forward pass and its
  sampling, or a scrub on demand) is restored from the checkpoint on disk, and the step computed
  again;
- a forward pass that raises ends the requests it computed, and only those: a device's kernel
  error (``DeviceKernelError``) as a fault it recovers from, any other exception as a bug, with
  its traceback logged once (the server answers those requests 500, ``LLM.generate`` raises).

The device counts what its checks detected; here a fault counts as recovered once the check that
recovery worked passes (no cache or running request holds a bad page any more, a restored weight
page matches its checksum, the step after a failed one ran). Faults are injected on purpose
(``kunlun-emu``, ``--enable-fault-injection``) to test all this; ``PAGEDSERVE_FAULT_RECOVERY=off``
(tests only: every fault test's negative control) detects and counts as usual but recovers
nothing, so that each fault's damage shows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from pagedserve.config import DeviceConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput
from pagedserve.hal import Device
from pagedserve.hal.faults import DeviceKernelError, UnrecoverableFaultError
from pagedserve.models.glm4 import GlmForCausalLM
from pagedserve.models.loader import layer_of

logger = logging.getLogger(__name__)


def is_device_fault(error: BaseException) -> bool:
    """Whether a failed forward pass is the device's (a kernel error it reports), not a bug."""
    return isinstance(error, DeviceKernelError)


class FaultRecovery:
    """Device-fault recovery over one engine's device, model, pages and scheduler."""

    def __init__(
        self,
        device: Device,
        model: GlmForCausalLM,
        model_path: Path,
        block_manager: BlockManager,
        scheduler: Scheduler,
        device_config: DeviceConfig,
    ):
        self.device = device
        self.model = model
        self.model_path = model_path
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.device_config = device_config  # weight_scrub_pages: the patrol's pages per step
        self.enabled = os.environ.get("PAGEDSERVE_FAULT_RECOVERY", "on") != "off"
        self.failed_steps = 0  # failed steps the engine has not yet shown it survived

    def recover_kv_pages(self) -> list[Request]:
        """A page the device reports corrupted leaves the prefix cache, and every request that
        holds it is preempted: it recomputes its KV on good pages, and nothing is lost. The same
        for the host tier's frames. The running requests preempted."""
        self.recover_host_frames(self.device.take_faulted_host_frames())
        faulted = set(self.device.take_faulted_pages())
        if not faulted or not self.enabled:
            return []
        for page in faulted:
            self.block_manager.uncache_page(page)
        preempted = []
        for req in list(self.scheduler.running):
            if faulted & set(self.block_manager.get_block_table(req.request_id)):
                logger.warning("KV page fault under %s: recomputing it", req.request_id)
                self.scheduler.preempt(req)
                preempted.append(req)
        self.device.faults.recovered["kv_page"] += len(faulted - self._pages_in_use())
        return preempted

    def _pages_in_use(self) -> set[int]:
        """Pages a later step may read: cached or in a running request's block table."""
        bm = self.block_manager
        tables = (bm.get_block_table(r.request_id) for r in self.scheduler.running)
        return set(bm.page_to_cached_block).union(*tables)

    def recover_host_frames(self, frames: list[int], fault: bool = True) -> None:
        """Host frames whose contents are not trusted (``fault``: the device reported them; else
        a failed step may not have written them): their cached blocks are forgotten, and the
        swapped-out requests that hold them recompute."""
        if not frames or (fault and not self.enabled):
            return
        affected = set(self.block_manager.drop_host_frames(frames))
        why = "a host-tier KV fault" if fault else "a failed step's page moves"
        for req in self.scheduler.swapped:
            if req.request_id in affected:
                logger.warning("%s under %s: recomputing it", why, req.request_id)
                self.scheduler.recompute_swapped(req)
        if fault:
            host = self.block_manager.host
            held = set(host.frame_to_cached_block).union(*host.block_tables.values())
            self.device.faults.recovered["kv_page"] += len(set(frames) - held)

    def fail_step(
        self,
        sched: SchedulerOutput,
        error: Exception,
        abort_request: Callable[[list[str]], None],
    ) -> list[tuple[str, str]]:
        """A forward pass that raised ends the requests it computed, and only those, with an
        error that says so; the others (waiting, or not in this batch) go on. The KV this step
        wrote may be half written, so those pages leave the prefix cache. A device's kernel error
        is a fault (counted, and recovered once a step runs); any other exception is a bug, whose
        traceback is logged here, once. (request id, why) of each request ended."""
        device_fault = is_device_fault(error)
        if device_fault:
            logger.error("a device kernel failed mid-step: %r; ending the step's requests", error)
            self.device.faults.detected["step"] += 1
        else:
            logger.error(
                "a forward pass raised %r: a bug, not a device fault (the traceback follows); "
                "ending the step's requests and serving the others",
                error,
                exc_info=error,
            )
        if not self.enabled:
            raise error
        block_size = self.block_manager.block_size
        # the page moves before the forward pass may not have run: what they wrote is not trusted
        self.recover_host_frames([frame for _, frame in sched.swap_out], fault=False)
        for _, page in sched.swap_in:
            self.block_manager.uncache_page(page)
        request_ids: list[str] = []
        for s in sched.scheduled:
            for page in s.block_table[s.request.num_computed_tokens // block_size :]:
                self.block_manager.uncache_page(page)
            rid = s.request.request_id.partition("#")[0]
            if rid not in request_ids:
                request_ids.append(rid)
        why = (
            f"the engine step computing this request failed ({error!r}); the engine goes on "
            "serving: send the request again"
            if device_fault
            else f"the engine failed computing this request: {error!r} (a bug in pagedserve, not "
            "in the request: the server log has its traceback); the engine goes on serving"
        )
        failed = [(rid, why) for rid in request_ids]
        abort_request(request_ids)
        self.failed_steps += device_fault
        return failed

    def step_done(self) -> None:
        """A forward pass ran: the failed steps before it are recovered from."""
        self.device.faults.recovered["step"] += self.failed_steps
        self.failed_steps = 0

    # ---- weight pages -------------------------------------------------------------------------
    def patrol_scrub(self) -> bool:
        """Between a step's forward pass and its sampling: verify the patrol's next pages; True
        when a corrupted one was restored, so that the step is computed again."""
        return self.scrub_weights(self.device_config.weight_scrub_pages) > 0

    def scrub_weights(self, num_pages: int | None = None) -> int:
        """Verify ``num_pages`` weight pages (None: every one) and restore each corrupted page
        from the checkpoint on disk; the number restored."""
        dev = self.device
        bad = dev.scrub_weights(dev.num_weight_pages if num_pages is None else num_pages)
        if not self.enabled:
            return 0
        for layer in {layer_of(p.tag) for p in bad}:
            try:
                rebuilt = self.model.rebuild_weights(self.model_path, layer)
            except (OSError, ValueError, KeyError) as e:
                raise UnrecoverableFaultError(
                    f"weight pages {[(p.tag, p.index) for p in bad]} are corrupted and cannot "
                    f"be restored from {self.model_path}: {e!r}; restart the server"
                ) from e
            for p in (p for p in bad if layer_of(p.tag) == layer):
                logger.warning(
                    "weight page %d of %s failed its checksum: restored from %s",
                    p.index,
                    p.tag,
                    self.model_path,
                )
                dev.restore_weight_page(p, rebuilt[p.tag])
        return len(bad)

    # ---- injection (kunlun-emu) -------------------------------------------------------------
    def inject_fault(self, kind: str, tag: str | None = None, page: int | None = None) -> dict:
        """Provoke a device fault on purpose (``kunlun-emu`` only): ``kv_page`` flips a bit in
        KV page ``page`` (default: the first page of a running request), ``host_page`` in host
        frame ``page`` (a swapped-out or spilled page), ``weight_page`` in a
        weight page (``tag``, ``page``; default: a random one), ``step`` fails the next forward
        pass. What was injected, as plain data."""
        dev = self.device
        if not hasattr(dev, "inject_kernel_fault"):
            raise ValueError(f"fault injection needs --device kunlun-emu, not {dev.name}")
        if kind == "kv_page":
            if page is None:
                tables = [
                    self.block_manager.get_block_table(r.request_id) for r in self.scheduler.running
                ]
                page = next((t[0] for t in tables if t), 0)
            if not 0 <= page < self.block_manager.num_pages:
                raise ValueError(f"KV pages are 0..{self.block_manager.num_pages - 1}, not {page}")
            dev.inject_fault(page)
            return {"kind": kind, "page": page}
        if kind == "host_page":
            return {"kind": kind, "page": self._inject_host_fault(page)}
        if kind == "weight_page":
            injected = dev.inject_weight_fault(tag, page)
            return {"kind": kind, "tag": injected.tag, "page": injected.index}
        if kind == "step":
            dev.inject_kernel_fault()
            return {"kind": kind}
        raise ValueError(
            f"unknown fault kind {kind!r}; use kv_page, host_page, weight_page or step"
        )

    def _inject_host_fault(self, frame: int | None) -> int:
        """A flipped bit in host-tier frame ``frame`` (default: the first frame of a swapped-out
        request, else of a cached block)."""
        host = self.block_manager.host
        if host is None:
            raise ValueError("no host tier: start with --swap-space or --host-prefix-cache GiB")
        if frame is None:
            held = [t[0] for t in host.block_tables.values() if t] + list(
                host.frame_to_cached_block
            )
            frame = held[0] if held else 0
        if not 0 <= frame < host.num_frames:
            raise ValueError(f"host-tier frames are 0..{host.num_frames - 1}, not {frame}")
        self.device.inject_host_fault(frame)
        return frame
