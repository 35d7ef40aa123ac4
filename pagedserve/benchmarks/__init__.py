"""The serving benchmark behind ``pagedserve bench`` (vLLM's ``vllm/benchmarks/``): datasets,
one streamed request, the run, its metrics and plots. The repository's top-level ``benchmarks/``
holds the scripts that measure this project's own figures."""
