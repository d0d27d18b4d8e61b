# Precision Lab: one image for the API, the workers and Flower (docker-compose.yml picks the command).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.11.0"
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PLAB_HOME=/var/lib/plab PLAB_DATA_DIR=/data
WORKDIR /app
# PyPI's Linux torch wheel is the CUDA build; the NVIDIA container runtime provides the driver.
RUN pip install "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY plab plab
COPY backend backend
COPY workers workers
COPY training training
COPY frontend frontend
RUN pip install .
EXPOSE 8000 5555
CMD ["plab", "serve", "--host", "0.0.0.0", "--port", "8000"]
