"""Rank 0's view of the adapters: which exist (by id and by name), and which device slot holds
which. Every rank's ``LoRASlots`` does what this decides: each step names the moves, so the
slots are the same on every rank."""

from __future__ import annotations

from pagedserve.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.requests: dict[int, LoRARequest] = {}
        self.slot_ids: list[int | None] = [None] * max_loras
        self.last_used: list[int] = [0] * max_loras  # the step each slot last served
        self.num_steps = 0
        self.num_swap_ins = 0  # adapters copied into a slot
        self.last_id = 0  # the largest id seen

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self.requests

    def by_name(self, name: str) -> LoRARequest | None:
        return next((r for r in self.requests.values() if r.lora_name == name), None)

    def add(self, request: LoRARequest) -> None:
        self.requests[request.lora_int_id] = request
        self.last_id = max(self.last_id, request.lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        self.requests.pop(lora_int_id, None)
        self.slot_ids = [None if i == lora_int_id else i for i in self.slot_ids]

    def forget_slots(self, slots: list[int]) -> None:
        """These slots' contents are not trusted (a step failed while moving adapters in): they
        count as empty, so the next step that needs their adapters copies them in again."""
        for slot in slots:
            self.slot_ids[slot] = None

    def next_id(self) -> int:
        """An id this engine has never used (for adapters a server loads at run time, so that
        no prefix-cache block of a removed adapter is ever taken for a new one's)."""
        self.last_id += 1
        return self.last_id

    def assign(self, lora_ids: set[int]) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """Slots for the adapters of one step (at most ``max_loras``, as the scheduler admits):
        those already in a slot stay; the others take an empty slot, else the least recently
        used one that this step does not need. Returns the moves (slot, adapter id) to do before
        the step, and each adapter's slot."""
        assert len(lora_ids) <= self.max_loras, f"{len(lora_ids)} adapters in one step"
        self.num_steps += 1
        slot_of = {i: s for s, i in enumerate(self.slot_ids) if i in lora_ids}
        moves = []
        for lora_id in sorted(lora_ids - set(slot_of)):
            free = [s for s, i in enumerate(self.slot_ids) if i is None]
            busy = set(slot_of.values())
            slot = (
                free[0]
                if free
                else min(
                    (s for s in range(self.max_loras) if s not in busy),
                    key=self.last_used.__getitem__,
                )
            )
            self.slot_ids[slot] = lora_id
            slot_of[lora_id] = slot
            moves.append((slot, lora_id))
        for slot in slot_of.values():
            self.last_used[slot] = self.num_steps
        self.num_swap_ins += len(moves)
        return moves, slot_of
