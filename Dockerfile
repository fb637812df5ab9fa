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
# Not root: the parts need no privilege. The worker's data folder is made the user's here,
# so that a named volume mounted on it (docker-compose.yml) starts out as the user's too.
RUN useradd --system --create-home --uid 10001 tokenfleet \
    && mkdir -p /var/lib/tokenfleet/worker && chown -R tokenfleet /var/lib/tokenfleet
USER tokenfleet
ENTRYPOINT ["tokenfleet"]
