# The gateway (and the `spindle` client commands): the core install, no torch.
#   docker build -f docker/gateway.Dockerfile -t spindle/gateway:0.1.0 .
# Expected size: about 0.2 GB (helm/spindle/README.md, "Images"; estimated, not built here).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN python -m venv /opt/spindle
WORKDIR /src
COPY pyproject.toml README.md ./
COPY spindle spindle
COPY gateway gateway
COPY model_service model_service
COPY adapter_service adapter_service
RUN /opt/spindle/bin/pip install --no-cache-dir ".[gateway]"

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent spindle
COPY --from=build /opt/spindle /opt/spindle
ENV PATH=/opt/spindle/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["spindle"]
CMD ["gateway"]
