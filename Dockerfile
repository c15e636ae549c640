# Image for the production-like compose deployment (api, control, agent).
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .
ENV GPUFLEET_STATE_DIR=/var/lib/gpufleet
CMD ["gpufleet", "--help"]
