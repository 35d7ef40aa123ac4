"""Structured output in the engine core, as vLLM v1's ``structured_output/``: the manager that
compiles grammars (``manager.py``), one constrained sequence's matcher (``request.py``) and the
llguidance grammars and checks (``backend_guidance.py``)."""
