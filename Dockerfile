# pagedserve on the CPU with the pinned torch (2.13.0, CPU wheel).
#   docker build -t pagedserve .
#   docker run -p 8000:8000 -v /path/to/glm-4-9b-chat:/models/glm-4-9b-chat:ro pagedserve \
#     serve --model /models/glm-4-9b-chat --host 0.0.0.0
# With Ray Serve, for deploy/k8s/rayservice.yaml (KubeRay's probes run wget):
#   docker build --build-arg EXTRAS=ray -t pagedserve:ray .
FROM python:3.11-slim
ARG EXTRAS=

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY deploy ./deploy
RUN if [ -n "$EXTRAS" ]; then apt-get update && apt-get install -y --no-install-recommends wget \
      && rm -rf /var/lib/apt/lists/*; fi \
    && pip install ".${EXTRAS:+[$EXTRAS]}" && useradd --create-home --uid 1000 pagedserve
USER pagedserve

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--config", "/app/deploy/serve.yaml"]
