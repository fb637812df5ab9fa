# One image for every TokenFleet process (docker-compose.yml runs each part from it):
# the emulator, collector, table worker, controllers and gateways differ only in their
# `tokenfleet` command line.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY streams streams
COPY control control
COPY gateway gateway
COPY sim sim
COPY tokenfleet tokenfleet
RUN pip install --no-cache-dir .
COPY examples examples
ENTRYPOINT ["tokenfleet"]
