"""LoRA adapters beside the base model (DESIGN.md, "LoRA adapters").

- ``request``: ``LoRARequest`` (vLLM's) and ``--lora-modules``' two forms; no torch;
- ``peft``: PEFT's adapter directories read, checked against the base and cut for a rank;
- ``ops``: the per-row ``scale * B (A x)`` for many adapters in one batch: the reference, and the
  grouped ops the model runs (rows sorted by adapter: matmuls, padded bmm or grouped GEMMs);
- ``slots``: one rank's adapters: device slots, the host-memory LRU cache, the step's batch;
- ``registry``: rank 0's view: which adapters exist, which device slot holds which;
- ``sizes``: the slots' shapes and bytes, without torch (``pagedserve tune`` plans by them).

This package's ``__init__`` imports nothing, so that ``pagedserve.LoRARequest`` stays light.
"""
